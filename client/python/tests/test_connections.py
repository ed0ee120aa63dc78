"""Client(connections=N) and AsyncClient(connections=N): N channels that each open a TCP connection
of their own (a test-only gRPC server records the peer, i.e. the client end of the connection, of
every call), calls taken round robin, every member's results bitwise those of one connection on a
real server, unix targets defaulting to one connection, and counts out of range refused."""

import asyncio
import collections
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

import fusedlayer
import fusedlayer.aio
from helpers import bf16_random, seam_inputs


class PeerRecorder:
    """Answers every unary call of any method with an empty message (every field default: a valid
    response of each type) and counts the calls per peer ("ipv4:127.0.0.1:PORT")."""

    def __init__(self):
        self._lock = threading.Lock()
        self._peers = collections.Counter()
        recorder = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, handler_call_details):
                return grpc.unary_unary_rpc_method_handler(recorder._answer)

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[Handler()])
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.target = f"127.0.0.1:{port}"

    def _answer(self, request, context):
        with self._lock:
            self._peers[context.peer()] += 1
        return b""

    def take(self):
        """Calls per peer since the last take()."""
        with self._lock:
            peers, self._peers = dict(self._peers), collections.Counter()
        return peers

    def stop(self):
        self._server.stop(grace=None)


@pytest.fixture
def recorder():
    r = PeerRecorder()
    yield r
    r.stop()


def _expect_round_robin(peers, connections, calls):
    assert len(peers) == connections, peers
    assert all(p.startswith("ipv4:127.0.0.1:") for p in peers), peers
    assert sorted(peers.values()) == [calls // connections] * connections, peers


def test_a_pool_of_four_opens_four_connections_and_every_call_kind_uses_each(recorder):
    with fusedlayer.Client(recorder.target, connections=4) as c:
        assert c.connections == 4
        seen = set()
        for kind, call in (("health", lambda: c.health()), ("list", lambda: c.list_weight_sets()),
                           ("sessions", lambda: c.list_residual_sessions())):
            for _ in range(8):
                call()
            peers = recorder.take()
            _expect_round_robin(peers, 4, 8)
            seen.update(peers)
        assert len(seen) == 4  # the same four connections throughout


def test_one_connection_by_default_and_the_default_follows_the_concurrency(recorder):
    # connections=1 (the default with expected_concurrency=1): one channel with the usual options.
    # Two such clients share one connection (gRPC's global subchannel pool): what the pool gets around.
    with fusedlayer.Client(recorder.target) as a, fusedlayer.Client(recorder.target, connections=1) as b:
        assert a.connections == b.connections == 1
        for _ in range(4):
            a.health()
            b.health()
        assert list(recorder.take().values()) == [8]
    assert [fusedlayer.default_connections("10.0.0.1:50051", k) for k in (1, 4, 5, 16, 1024)] == [1, 1, 2, 4, 8]
    with fusedlayer.Client(recorder.target, expected_concurrency=16) as c:
        assert c.connections == 4
        for _ in range(8):
            c.list_weight_sets()
        _expect_round_robin(recorder.take(), 4, 8)


def test_unix_targets_default_to_one_connection():
    for target in ("unix:/tmp/fusedlayer-no-such.sock", "unix-abstract:fusedlayer-no-such"):
        assert fusedlayer.default_connections(target, 64) == 1
        with fusedlayer.Client(target, expected_concurrency=64) as c:
            assert c.connections == 1
        with fusedlayer.Client(target, connections=3) as c:  # an explicit count is honoured
            assert c.connections == 3


@pytest.mark.parametrize("bad", [-1, fusedlayer.MAX_CONNECTIONS + 1, 1000, True, 2.0, "4"])
def test_connection_counts_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match=r"connections = .* is outside 0\.\.64"):
        fusedlayer.Client("127.0.0.1:50051", connections=bad)

    async def make():
        fusedlayer.aio.AsyncClient("127.0.0.1:50051", connections=bad)

    with pytest.raises(ValueError, match=r"connections = .* is outside 0\.\.64"):
        asyncio.run(make())
    with pytest.raises(ValueError, match="expected_concurrency"):
        fusedlayer.Client("127.0.0.1:50051", expected_concurrency=0)


def _expect_mhc_equal(got, want):
    for f in ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f


def test_every_connection_gives_the_results_of_one(server, client, rng):
    T, n, C = 3, 4, 5120
    with fusedlayer.Client(server.target, connections=4) as pool:
        assert pool.health() == "SERVING"
        # Four calls of each kind in a row: every member serves each kind once.
        for inputs in [seam_inputs(rng, T, n, C) for _ in range(4)]:
            _expect_mhc_equal(pool.mhc_seam("v41-flash/demo", **inputs), client.mhc_seam("v41-flash/demo", **inputs))
        for qr_kv in [bf16_random(rng, (5, 1280 + 512)) for _ in range(4)]:
            got, want = pool.swa_norm_quant("v41-flash/demo", qr_kv), client.swa_norm_quant("v41-flash/demo", qr_kv)
            assert np.array_equal(got.kv, want.kv) and np.array_equal(got.q_fp8, want.q_fp8)
            assert np.array_equal(got.q_scale, want.q_scale)
        for _ in range(4):
            assert "v41-flash/demo" in [w.name for w in pool.list_weight_sets()]


def test_async_pool_opens_its_connections_and_matches_the_sync_client(server, client, recorder, rng):
    T, n, C = 2, 4, 5120
    calls = [seam_inputs(rng, T, n, C) for _ in range(8)]

    async def main():
        async with fusedlayer.aio.AsyncClient(recorder.target, connections=4) as c:
            assert c.connections == 4
            for _ in range(8):
                await c.health()
            peers = recorder.take()
        async with fusedlayer.aio.AsyncClient(server.target, connections=4) as c:
            results = await asyncio.gather(*(c.mhc_seam("v41-flash/demo", **x) for x in calls))
        return peers, results

    peers, results = asyncio.run(main())
    _expect_round_robin(peers, 4, 8)
    for inputs, got in zip(calls, results):
        _expect_mhc_equal(got, client.mhc_seam("v41-flash/demo", **inputs))
