"""Call rings (fusedlayer.ring) against a real server with --allow_call_rings --allow_shared_memory:
ring calls bitwise equal to the same RPCs (fresh random inputs with outliers), raw descriptors over a
region of the caller's own, bad descriptors answered with the RPC's error classes while the ring
keeps serving, a server without the flag refusing, and the structures' layout against call_ring.h."""

import ctypes
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

import fusedlayer
from fusedlayer import ring as fring
from conftest import ServerProcess
from helpers import bf16_random, seam_inputs

MHC_OUTPUTS = ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix", "aux")
SWA_OUTPUTS = ("q_fp8", "q_scale", "kv", "q_proj")
DEMO_SETS = {"v41-flash/demo": 5120, "v4-pro/demo": 7168}


@pytest.fixture(scope="module")
def ring_server():
    s = ServerProcess(extra_args=["--allow_call_rings", "--allow_shared_memory"])
    yield s
    s.stop()


def _same_bits(a, b):
    return a is None and b is None or (a is not None and b is not None and a.shape == b.shape and
                                       a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def test_layout_matches_call_ring_h():
    # The literals call_ring.h static_asserts (kRingSlotBytes, kRingCallOffsetInSlot,
    # kRingCompletionOffsetInSlot, and the structures' sizes).
    assert fring.layout_mismatches() == []
    assert (fring.RING_SLOT_BYTES, fring.RING_CALL_OFFSET_IN_SLOT, fring.RING_COMPLETION_OFFSET_IN_SLOT) == (
        1536, 128, 896)
    assert ctypes.sizeof(fring.RingSlot) == 1536
    assert fring.RingSlot.call.offset == 128 and fring.RingSlot.completion.offset == 896
    assert ctypes.sizeof(fring.RingCallDescriptor) == 712 and ctypes.sizeof(fring.RingTensorRef) == 56
    assert ctypes.sizeof(fring.RingCompletion) == 616 and ctypes.sizeof(fring.RingHeader) == 128
    assert fring.RingSlotControl.complete_seq.offset == 64 and fring.RingSlotControl.client_waiting.offset == 68
    assert fring.RingHeader.poller_sleeping.offset == 64


@pytest.mark.parametrize("weight_set,stage,mode,capture_aux", [
    ("v41-flash/demo", "seam", "shifted", False), ("v41-flash/demo", "seam", "shifted", True),
    ("v41-flash/demo", "first", "shifted", False), ("v41-flash/demo", "head", "shifted", False),
    ("v4-pro/demo", "seam", "normal", False), ("v4-pro/demo", "seam", "normal", True),
    ("v4-pro/demo", "head", "shifted", False)])
def test_mhc_ring_calls_equal_rpcs_bitwise(ring_server, rng, weight_set, stage, mode, capture_aux):
    C = DEMO_SETS[weight_set]
    with fusedlayer.Client(ring_server.target) as c, c.open_call_ring(weight_sets=[weight_set], slots=2) as ring:
        for T in (1, 5):
            inputs = seam_inputs(rng, T, 4, C)
            if stage == "first":
                inputs = dict(x=inputs["x"])
            elif mode == "normal":
                inputs["pre_mix"] = None
            for path in ("auto", "force_unfused"):
                want = c.mhc_seam(weight_set, stage=stage, mode=mode, capture_aux=capture_aux, path=path, **inputs)
                got = ring.mhc_seam(weight_set, stage=stage, mode=mode, capture_aux=capture_aux, path=path, **inputs)
                for f in MHC_OUTPUTS:
                    assert _same_bits(getattr(got, f), getattr(want, f)), (T, path, f)
                assert (got.report.path, got.report.fallback_reason) == (want.report.path, want.report.fallback_reason)
                assert got.report.weight_set == weight_set and got.verification is None
                # the completion's stages, as the RPC's report has them: disjoint parts of server_seconds
                assert set(got.report.stages) == set(want.report.stages)
                assert got.report.stages["decode"] > 0 and got.report.stages["device"] > 0
                assert sum(got.report.stages.values()) + got.report.queue_seconds <= got.report.server_seconds * (1 + 1e-9)


def test_swa_ring_calls_equal_rpcs_bitwise(ring_server, rng):
    with fusedlayer.Client(ring_server.target) as c, c.open_call_ring(weight_sets=list(DEMO_SETS)) as ring:
        for name, width in (("v41-flash/demo", 1280 + 512), ("v4-pro/demo", 1536 + 512 + 7)):
            for M in (1, 9, 33):
                qr_kv = bf16_random(rng, (M, width))
                want, got = c.swa_norm_quant(name, qr_kv), ring.swa_norm_quant(name, qr_kv, slot=M % ring.slots)
                for f in SWA_OUTPUTS:
                    assert _same_bits(getattr(got, f), getattr(want, f)), (name, M, f)
                assert got.fp8_format == want.fp8_format
                assert got.report.path == want.report.path


def test_torch_cpu_tensors_through_a_ring(ring_server, rng):
    torch = pytest.importorskip("torch")
    inputs = seam_inputs(rng, 3, 4, 5120)
    tensors = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == np.uint16
               else torch.from_numpy(v) for k, v in inputs.items()}
    with fusedlayer.Client(ring_server.target) as c, c.open_call_ring(weight_sets=["v41-flash/demo"]) as ring:
        want = c.mhc_seam("v41-flash/demo", **inputs)
        got = ring.mhc_seam("v41-flash/demo", **tensors)
        assert isinstance(got.y, torch.Tensor) and got.y.dtype == torch.bfloat16
        assert np.array_equal(got.y.view(torch.int16).numpy().view(np.uint16), want.y)
        assert np.array_equal(got.new_comb_mix.numpy(), want.new_comb_mix)


class _OwnRegion:
    """A system shared-memory region of the test's own, registered under `name`, holding x at 0 and
    room for y after it: the raw descriptor API over a region bound at open."""

    def __init__(self, client, name, x, y_bytes):
        self.shm = shared_memory.SharedMemory(create=True, size=1 << 20)
        self.name, self.client = name, client
        client.register_system_shared_memory(name, "/" + self.shm.name.lstrip("/"), 0, self.shm.size)
        self.x_bytes = x.nbytes
        self.shm.buf[:x.nbytes] = x.tobytes()
        self.y_offset, self.y_bytes = (x.nbytes + 63) // 64 * 64, y_bytes

    def request(self, weight_set, T, C):
        from fusedlayer.v1 import fusedlayer_pb2 as pb
        req = pb.MhcSeamRequest(weight_set=weight_set, stage=pb.MHC_STAGE_FIRST, mode=pb.MHC_MODE_SHIFTED)
        req.x.dtype, req.x.shape[:] = pb.DATA_TYPE_BF16, [T, C]
        req.x.shared_memory.region, req.x.shared_memory.offset, req.x.shared_memory.byte_size = self.name, 0, \
            self.x_bytes
        req.output_placements.add(output="y", shared_memory=pb.SharedMemoryRef(
            region=self.name, offset=self.y_offset, byte_size=self.y_bytes))
        return req

    def y(self, T, C):
        return np.frombuffer(self.shm.buf[self.y_offset:self.y_offset + self.y_bytes], dtype="<u2").reshape(T, C).copy()

    def close(self):
        self.client.unregister_system_shared_memory(self.name)
        self.shm.close()
        self.shm.unlink()


def test_bad_descriptors_raise_the_rpc_error_classes_and_the_ring_keeps_serving(ring_server, rng):
    T, C = 3, 5120
    x = bf16_random(rng, (T, C))
    with fusedlayer.Client(ring_server.target) as c:
        want = c.mhc_seam("v41-flash/demo", x, stage="first").y
        own = _OwnRegion(c, "py-ring-test-own", x, T * C * 2)
        try:
            with c.open_call_ring(weight_sets=["v41-flash/demo"], regions=["py-ring-test-own"], slots=2) as ring:
                assert ring.region_index("py-ring-test-own") == 1 and ring.regions[0][0].startswith("py-ring-")
                valid = fusedlayer.ring_call_of(own.request("v41-flash/demo", T, C), ring.weight_sets, ring.regions)
                assert valid.tensors[0].region == 1 and valid.num_tensors == 2

                def serving():
                    r = ring.call(0, valid)
                    assert r.path == "fused" and r.fallback_reason == "none" and r.batch_requests >= 1
                    assert np.array_equal(own.y(T, C), want)

                serving()
                cases = [
                    ("op", lambda d: setattr(d, "op", 7), fusedlayer.InvalidArgument, "not an op"),
                    ("weight set index", lambda d: setattr(d, "weight_set", 1), fusedlayer.InvalidArgument,
                     "weight_set index 1"),
                    ("region index", lambda d: setattr(d.tensors[0], "region", 5), fusedlayer.InvalidArgument,
                     "region index 5"),
                    ("dtype", lambda d: setattr(d.tensors[0], "dtype", 99), fusedlayer.InvalidArgument,
                     "not a DataType"),
                    ("out of the region", lambda d: setattr(d.tensors[0], "offset", 1 << 40),
                     fusedlayer.InvalidArgument, ""),
                    ("deadline passed", lambda d: setattr(d, "deadline_ns", 1), fusedlayer.DeadlineExceeded,
                     "not launched"),
                ]
                for what, edit, error, message in cases:
                    bad = fring.RingCallDescriptor.from_buffer_copy(valid)
                    edit(bad)
                    with pytest.raises(error) as e:
                        ring.call(1, bad)
                    assert type(e.value) is error, what
                    assert message in e.value.message, (what, e.value.message)
                    serving()
                # The client's own checks, before anything is written.
                with pytest.raises(fusedlayer.InvalidArgument):
                    ring.call(2, valid)
                with pytest.raises(fusedlayer.NotFound, match="not bound to the ring"):
                    ring.mhc_seam("v4-pro/demo", x, stage="first")
                with pytest.raises(fusedlayer.NotFound, match="not bound to the ring"):
                    fusedlayer.ring_call_of(own.request("v41-flash/demo", T, C), ring.weight_sets, ring.regions[:1])
                # Submit and wait apart, in two slots at once.
                ring.submit(0, valid)
                ring.submit(1, valid)
                assert ring.wait(1).path == ring.wait(0).path == "fused"
                serving()
        finally:
            own.close()


def test_require_fused_failure_is_fused_unavailable_as_over_rpc(ring_server, rng):
    # hc_mult 2 has no fused kernel: the RPC and the ring raise the same class (FusedUnavailable).
    from helpers import load_mhc_set
    with fusedlayer.Client(ring_server.target) as c:
        load_mhc_set(c, rng, "py-ring/n2", n=2, C=256)
        inputs = seam_inputs(rng, 2, 2, 256)
        with pytest.raises(fusedlayer.FailedPrecondition) as rpc:
            c.mhc_seam("py-ring/n2", path="require_fused", **inputs)
        with c.open_call_ring(weight_sets=["py-ring/n2"], slots=1) as ring:
            with pytest.raises(fusedlayer.FailedPrecondition) as ringed:
                ring.mhc_seam("py-ring/n2", path="require_fused", **inputs)
            assert type(ringed.value) is type(rpc.value) is fusedlayer.FusedUnavailable
            assert ringed.value.message == rpc.value.message and ringed.value.reason == "hc_mult_unsupported"
            got = ring.mhc_seam("py-ring/n2", **inputs)
            want = c.mhc_seam("py-ring/n2", **inputs)
            for f in MHC_OUTPUTS:
                assert _same_bits(getattr(got, f), getattr(want, f)), f
            assert got.report.fallback_reason == want.report.fallback_reason == "hc_mult_unsupported"
            assert got.report.fallback_detail == want.report.fallback_detail


def test_calls_between_pauses_find_the_poller_awake_or_wake_it(ring_server, rng):
    """The server's poller sleeps after a short idle spin; calls after pauses of varying length meet it
    in every phase of going to sleep, including a call submitted the moment the previous one in its
    slot completed. Each must complete (a missed wake would end in DeadlineExceeded)."""
    import random
    import time
    qr_kv = bf16_random(rng, (1, 1280 + 512))
    with fusedlayer.Client(ring_server.target) as c, c.open_call_ring(weight_sets=["v41-flash/demo"], slots=1) as ring:
        want = c.swa_norm_quant("v41-flash/demo", qr_kv)
        for i in range(400):
            if i % 3 == 0:
                time.sleep(random.random() * 0.002)
            got = ring.swa_norm_quant("v41-flash/demo", qr_kv, timeout=20)
            assert _same_bits(got.kv, want.kv) and _same_bits(got.q_fp8, want.q_fp8)


def test_close_removes_the_rings_region(ring_server, rng):
    with fusedlayer.Client(ring_server.target) as c:
        before = {r["name"] for r in c.system_shared_memory_status()}
        with c.open_call_ring(weight_sets=["v41-flash/demo"], slots=1) as ring:
            ring.swa_norm_quant("v41-flash/demo", bf16_random(rng, (2, 1280 + 512)))
            own = ring.regions[0][0]
            assert own in {r["name"] for r in c.system_shared_memory_status()}
        assert ring.closed
        assert {r["name"] for r in c.system_shared_memory_status()} == before
        with pytest.raises(ValueError, match="closed"):
            ring.submit(0, fring.RingCallDescriptor())


def test_the_ring_grows_its_region_under_the_same_name(ring_server, rng):
    with fusedlayer.Client(ring_server.target) as c, \
            c.open_call_ring(weight_sets=["v41-flash/demo"], slots=1, region_bytes=1 << 16) as ring:
        # About 1.7 MB of tensors and outputs: more than the region's first object (1 MiB) holds.
        inputs = seam_inputs(rng, 16, 4, 5120)
        first = ring._arena.buffer.nbytes
        got, want = ring.mhc_seam("v41-flash/demo", **inputs), c.mhc_seam("v41-flash/demo", **inputs)
        for f in MHC_OUTPUTS:
            assert _same_bits(getattr(got, f), getattr(want, f)), f
        assert ring._arena.buffer.nbytes > first


def test_open_without_the_server_flag_is_failed_precondition(server):
    with fusedlayer.Client(server.target) as c:
        with pytest.raises(fusedlayer.FailedPrecondition) as e:
            c.open_call_ring(weight_sets=["v41-flash/demo"], region_bytes=0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--allow_call_rings" in e.value.message


def test_open_with_shared_memory_but_without_rings_names_the_flag_and_leaves_no_region(rng):
    s = ServerProcess(extra_args=["--allow_shared_memory"])
    try:
        with fusedlayer.Client(s.target) as c:
            with pytest.raises(fusedlayer.FailedPrecondition) as e:
                c.open_call_ring(weight_sets=["v41-flash/demo"])
            assert "--allow_call_rings" in e.value.message
            assert c.system_shared_memory_status() == []
    finally:
        s.stop()


@pytest.mark.cuda_host
def test_cuda_tensors_through_a_ring_equal_rpcs(rng):
    torch = pytest.importorskip("torch")
    from test_torch import _cuda_server, as_torch
    assert torch.cuda.is_available(), "the cuda_host tests need torch.cuda and a GPU"
    server = _cuda_server(["--allow_cuda_shared_memory", "--allow_call_rings", "--allow_shared_memory"])
    try:
        with fusedlayer.Client(server.target) as c, c.open_call_ring(weight_sets=["v41-flash/demo"]) as ring:
            inputs = seam_inputs(rng, 4, 4, 5120)
            want = c.mhc_seam("v41-flash/demo", **inputs)
            for _ in range(3):  # later calls find their allocations' regions bound
                got = ring.mhc_seam("v41-flash/demo", **{k: as_torch(v).cuda() for k, v in inputs.items()})
                assert got.y.is_cuda and got.y.dtype == torch.bfloat16
                for f in ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix"):
                    g = getattr(got, f).cpu()
                    g = g.view(torch.int16).numpy().view(np.uint16) if g.dtype == torch.bfloat16 else g.numpy()
                    assert _same_bits(g, getattr(want, f)), f
            assert any(cuda for _, cuda in ring.regions)
            qr_kv = bf16_random(rng, (5, 1280 + 512))
            swa = ring.swa_norm_quant("v41-flash/demo", as_torch(qr_kv).cuda(), output="numpy")
            assert _same_bits(swa.kv, c.swa_norm_quant("v41-flash/demo", qr_kv).kv)
    finally:
        server.stop()
