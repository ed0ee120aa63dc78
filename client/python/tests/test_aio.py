"""fusedlayer.aio.AsyncClient against real servers: concurrent calls on one event loop, the same
results as the synchronous client, and every error class with its gRPC code."""

import asyncio
import hashlib
import os
import secrets
import socket

import grpc
import numpy as np
import pytest

import fusedlayer
import fusedlayer.aio
from conftest import SERVER_MAX_MESSAGE_BYTES, ServerProcess
from helpers import bf16_random, loaded_sets, mhc_manifest, mhc_weights, seam_inputs


def run(coro):
    return asyncio.run(coro)


def test_concurrent_calls_on_one_loop_match_the_sync_client(server, client, rng):
    T, n, C = 3, 4, 5120
    calls = [seam_inputs(rng, T, n, C) for _ in range(8)]
    qr_kv = bf16_random(rng, (5, 1280 + 512))
    order = []

    async def one(c, i, inputs):
        order.append(("start", i))
        r = await c.mhc_seam("v41-flash/demo", **inputs)
        order.append(("end", i))
        return r

    async def main():
        async with fusedlayer.aio.AsyncClient(server.target) as c:
            assert await c.health() == "SERVING"
            info = await c.server_info()
            results = await asyncio.gather(*(one(c, i, x) for i, x in enumerate(calls)),
                                           c.swa_norm_quant("v41-flash/demo", qr_kv))
            return info, results

    info, results = run(main())
    assert info.backend == "cpu"
    # Every call was started (its request sent) before the first one's response was taken.
    assert [kind for kind, _ in order[:len(calls)]] == ["start"] * len(calls)
    for inputs, got in zip(calls, results[:-1]):
        want = client.mhc_seam("v41-flash/demo", **inputs)
        for f in ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix"):
            assert np.array_equal(getattr(got, f), getattr(want, f)), f
        assert got.report.path == "fused" and got.report.round_trip_seconds > 0
    swa = client.swa_norm_quant("v41-flash/demo", qr_kv)
    assert np.array_equal(results[-1].kv, swa.kv) and np.array_equal(results[-1].q_fp8, swa.q_fp8)


def test_weights_sessions_and_regions(server, rng):
    n, C, T = 4, 64, 2
    w = mhc_weights(rng, n, C)

    async def main():
        async with fusedlayer.aio.AsyncClient(server.target) as c:
            [info] = await c.load_weights(w, name="py-aio/set", mhc=dict(hc_mult=n, hidden=C), replace=True)
            assert info.name == "py-aio/set" and "py-aio/set" in {s.name for s in await c.list_weight_sets()}
            assert await c.open_residual_session("py-aio", T, n, C) > 0
            first = await c.mhc_seam("py-aio/set", bf16_random(rng, (T, C)), stage="first", session="py-aio")
            assert first.new_residual is None and first.y.shape == (T, C)
            assert [s["name"] for s in await c.list_residual_sessions()] == ["py-aio"]
            assert await c.close_residual_session("py-aio") == 1
            with pytest.raises(fusedlayer.FailedPrecondition, match="allow_shared_memory"):
                await c.system_shared_memory_status()  # the session server has no --allow_shared_memory
            assert await c.unload_weight_set("py-aio/set") > 0

    run(main())



def test_manifest_loads_all_sets_or_none(server, client, rng, tmp_path, monkeypatch):
    """AsyncClient.load_weights of a manifest stages every set and publishes them in one step, as the
    synchronous client does: set 2 of 3 refused by the server leaves every set as it was."""
    names = ["py-aio-all/a", "py-aio-all/b", "py-aio-all/c"]
    v1 = mhc_manifest(tmp_path, rng, "v1", names)
    refused = mhc_manifest(tmp_path, rng, "refused", names, refused="py-aio-all/b")
    v2 = mhc_manifest(tmp_path, rng, "v2", names)
    stages = []

    async def main():
        async with fusedlayer.aio.AsyncClient(server.target) as c:
            assert [i.name for i in await c.load_weights(v1, replace=True)] == names
            before = loaded_sets(client)
            # A known stage id, to check that the failed load discarded its stage.
            monkeypatch.setattr(fusedlayer.aio, "_stage_id", lambda: stages.append("py-aio-test-stage") or stages[-1],
                                raising=False)
            with pytest.raises(fusedlayer.FusedLayerError) as e:
                await c.load_weights(refused, replace=True)
            assert type(e.value) is fusedlayer.InvalidArgument and e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert loaded_sets(client) == before
            assert 'loading "py-aio-all/b"' in e.value.message, e.value.message
            assert stages == ["py-aio-test-stage"]
            with pytest.raises(fusedlayer.NotFound):  # the stage was discarded
                await c.commit_weight_sets("py-aio-test-stage")
            monkeypatch.undo()
            infos = await c.load_weights(v2, replace=True)
            want = {p.header.name: p.header.sha256 for p in fusedlayer.pack_manifest(v2)}
            assert [(i.name, i.sha256) for i in infos] == [(n, want[n]) for n in names]
            after = loaded_sets(client)
            for n in names:
                assert after[n][0] == want[n] != before[n][0], n
                await c.unload_weight_set(n)

    run(main())


@pytest.fixture(scope="module")
def auth(tmp_path_factory):
    d = tmp_path_factory.mktemp("aio-tokens")
    compute = secrets.token_hex(32)
    (d / "tokens").write_text(f"{compute} compute\n")
    (d / "compute").write_text(compute)
    os.chmod(d / "compute", 0o600)
    s = ServerProcess(extra_args=[f"--auth_tokens_file={d / 'tokens'}"])
    yield s, str(d / "compute")
    s.stop()


async def stalled_upload(c, timeout=None):
    """A LoadWeights stream whose first chunk never comes: the call stays in flight until its deadline,
    its cancellation or the channel's close."""
    async def never():
        await asyncio.Event().wait()
        yield fusedlayer.aio.pb.WeightChunk()
    return await c._call(c._stub.LoadWeights, never(), timeout)


def test_every_error_class_from_the_async_client(server, auth, rng):
    auth_server, compute_token = auth
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    async def expect(cls, code, coro):
        with pytest.raises(cls) as e:
            await coro
        assert type(e.value) is cls and e.value.code == code, (cls, e.value)
        return e.value

    async def main():
        G = grpc.StatusCode
        async with fusedlayer.aio.AsyncClient(server.target) as c:
            inputs = seam_inputs(rng, 2, 4, 5120)
            await expect(fusedlayer.InvalidArgument, G.INVALID_ARGUMENT,
                         c.mhc_seam("v41-flash/demo", **{**inputs, "x": bf16_random(rng, (2, 5000))}))
            await expect(fusedlayer.NotFound, G.NOT_FOUND, c.mhc_seam("no/such/set", **inputs))
            w = mhc_weights(rng, 2, 128)
            await c.load_weights(w, name="py-aio/n2", mhc=dict(hc_mult=2, hidden=128), replace=True)
            await expect(fusedlayer.AlreadyExists, G.ALREADY_EXISTS,
                         c.load_weights(w, name="py-aio/n2", mhc=dict(hc_mult=2, hidden=128)))
            e = await expect(fusedlayer.FusedUnavailable, G.FAILED_PRECONDITION,
                             c.mhc_seam("py-aio/n2", **seam_inputs(rng, 2, 2, 128), path="require_fused"))
            assert e.reason == "hc_mult_unsupported" and isinstance(e, fusedlayer.FailedPrecondition)
            await expect(fusedlayer.FailedPrecondition, G.FAILED_PRECONDITION,  # a CPU server has no CUDA IPC
                         c.register_cuda_shared_memory("py-aio-cuda", b"\0" * 64, 0, 0, 1024))
            await c.unload_weight_set("py-aio/n2")
            T = SERVER_MAX_MESSAGE_BYTES // (4 * 7168 * 2) + 1
            await expect(fusedlayer.ResourceExhausted, G.RESOURCE_EXHAUSTED,
                         c.mhc_seam("v4-pro/demo", **seam_inputs(rng, T, 4, 7168)))
            await expect(fusedlayer.DeadlineExceeded, G.DEADLINE_EXCEEDED,
                         c.mhc_seam("v4-pro/demo", **seam_inputs(rng, 64, 4, 7168), timeout=1e-6))
            await expect(fusedlayer.DeadlineExceeded, G.DEADLINE_EXCEEDED, stalled_upload(c, timeout=0.5))
            packed = fusedlayer.pack_arrays("py-aio/sha", mhc_weights(rng, 4, 64), mhc=dict(hc_mult=4, hidden=64))
            packed.header.sha256 = hashlib.sha256(b"something else").hexdigest()
            await expect(fusedlayer.DataLoss, G.DATA_LOSS, c.upload(packed))

            # Cancelling the awaiting task cancels the RPC: asyncio.CancelledError, and the client goes on.
            task = asyncio.create_task(stalled_upload(c))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await c.server_info()).backend == "cpu"

        # The channel closed under a call in flight: Cancelled (CANCELLED).
        c = fusedlayer.aio.AsyncClient(server.target)
        task = asyncio.create_task(stalled_upload(c))
        await asyncio.sleep(0.2)
        await c.close()
        with pytest.raises(fusedlayer.Cancelled) as e:
            await task
        assert e.value.code == G.CANCELLED

        async with fusedlayer.aio.AsyncClient(f"127.0.0.1:{dead_port}", timeout=5) as c:
            await expect(fusedlayer.Unavailable, G.UNAVAILABLE, c.server_info())
        async with fusedlayer.aio.AsyncClient(server.target, max_message_bytes=64 << 10) as c:
            await expect(fusedlayer.ResourceExhausted, G.RESOURCE_EXHAUSTED,
                         c.mhc_seam("v41-flash/demo", **seam_inputs(rng, 4, 4, 5120)))
        async with fusedlayer.aio.AsyncClient(auth_server.target) as c:
            await expect(fusedlayer.Unauthenticated, G.UNAUTHENTICATED, c.list_weight_sets())
        async with fusedlayer.aio.AsyncClient(auth_server.target, token_file=compute_token) as c:
            await expect(fusedlayer.PermissionDenied, G.PERMISSION_DENIED, c.unload_weight_set("v41-flash/demo"))
        # Client-side checks raise before any call, as in the synchronous client.
        async with fusedlayer.aio.AsyncClient(server.target) as c:
            with pytest.raises(fusedlayer.NotFound):
                await c.load_weights(os.path.join(os.sep, "no", "such", "manifest.json"))
            with pytest.raises(TypeError):
                await c.mhc_seam("v41-flash/demo", np.zeros((2, 5120), np.float32), stage="first")
        with pytest.raises(ValueError, match="not available"):
            fusedlayer.aio.AsyncClient(server.target, transport="shm")

    run(main())


def test_every_code_of_an_aio_error_maps_to_its_class():
    """Including INTERNAL, which no request of a correct server causes: grpc.aio's error type goes
    through the same mapping as the synchronous client's."""
    from grpc.aio import AioRpcError, Metadata
    G = grpc.StatusCode
    expected = {G.INVALID_ARGUMENT: fusedlayer.InvalidArgument, G.NOT_FOUND: fusedlayer.NotFound,
                G.ALREADY_EXISTS: fusedlayer.AlreadyExists, G.FAILED_PRECONDITION: fusedlayer.FailedPrecondition,
                G.RESOURCE_EXHAUSTED: fusedlayer.ResourceExhausted, G.DEADLINE_EXCEEDED: fusedlayer.DeadlineExceeded,
                G.DATA_LOSS: fusedlayer.DataLoss, G.UNAVAILABLE: fusedlayer.Unavailable,
                G.UNAUTHENTICATED: fusedlayer.Unauthenticated, G.PERMISSION_DENIED: fusedlayer.PermissionDenied,
                G.INTERNAL: fusedlayer.Internal, G.CANCELLED: fusedlayer.Cancelled,
                G.UNKNOWN: fusedlayer.FusedLayerError}
    for code, cls in expected.items():
        err = fusedlayer.errors.from_rpc_error(AioRpcError(code, Metadata(), Metadata(), details="d"))
        assert type(err) is cls and err.code == code and err.message == "d"
