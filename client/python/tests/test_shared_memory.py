"""transport="shm" against a real server with --allow_shared_memory: outputs bitwise those of the
same call over TCP (fresh random inputs with outliers), the region registered once and reused,
close() unregistering it, and a server without the flag refusing with FailedPrecondition."""

import grpc
import numpy as np
import pytest

import fusedlayer
from conftest import ServerProcess
from helpers import bf16_random, seam_inputs


@pytest.fixture(scope="module")
def shm_server():
    s = ServerProcess(extra_args=["--allow_shared_memory"])
    yield s
    s.stop()


def _same_bits(a, b):
    return a is None and b is None or (a.shape == b.shape and a.dtype == b.dtype and
                                       np.array_equal(a.view(np.uint8), b.view(np.uint8)))


@pytest.mark.parametrize("stage,capture_aux", [("seam", False), ("seam", True), ("first", False), ("head", False)])
def test_mhc_over_shm_equals_tcp_bitwise(shm_server, rng, stage, capture_aux):
    T, n, C = 5, 4, 5120
    inputs = seam_inputs(rng, T, n, C)
    if stage == "first":
        inputs = dict(x=inputs["x"])
    with fusedlayer.Client(shm_server.target) as tcp, fusedlayer.Client(shm_server.target, transport="shm") as shm:
        for path in ("auto", "force_unfused"):
            want = tcp.mhc_seam("v41-flash/demo", stage=stage, capture_aux=capture_aux, path=path, **inputs)
            got = shm.mhc_seam("v41-flash/demo", stage=stage, capture_aux=capture_aux, path=path, **inputs)
            for f in ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix", "aux"):
                assert _same_bits(getattr(got, f), getattr(want, f)), f
            assert got.report.path == want.report.path
        # One region for the client, reused by every call.
        assert len(shm.system_shared_memory_status()) == 1


def test_swa_over_shm_equals_tcp_bitwise(shm_server, rng):
    with fusedlayer.Client(shm_server.target) as tcp, fusedlayer.Client(shm_server.target, transport="shm") as shm:
        for name, width in (("v41-flash/demo", 1280 + 512), ("v4-pro/demo", 1536 + 512 + 7)):
            for M in (0, 1, 9):
                qr_kv = bf16_random(rng, (M, width))
                want, got = tcp.swa_norm_quant(name, qr_kv), shm.swa_norm_quant(name, qr_kv)
                for f in ("q_fp8", "q_scale", "kv", "q_proj"):
                    assert _same_bits(getattr(got, f), getattr(want, f)), (name, M, f)


def test_close_unregisters_the_region(shm_server, rng):
    with fusedlayer.Client(shm_server.target) as admin:
        admin.unregister_system_shared_memory("")  # the anonymous identity's leftovers, if any
        with fusedlayer.Client(shm_server.target, transport="shm") as shm:
            shm.swa_norm_quant("v41-flash/demo", bf16_random(rng, (2, 1280 + 512)))
            assert [r["name"].startswith("py-") for r in admin.system_shared_memory_status()] == [True]
        assert admin.system_shared_memory_status() == []


def test_shm_is_failed_precondition_without_the_server_flag(server, rng):
    with fusedlayer.Client(server.target, transport="shm") as shm:
        with pytest.raises(fusedlayer.FailedPrecondition) as e:
            shm.swa_norm_quant("v41-flash/demo", bf16_random(rng, (2, 1280 + 512)))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--allow_shared_memory" in e.value.message


def test_cuda_shared_memory_is_failed_precondition_on_the_cpu_backend(rng):
    """The CPU backend has no GPU to open a CUDA IPC handle on: with the flag on, registering is
    FailedPrecondition (and without the flag too); status and unregister likewise. The two-process flow
    on a GPU is tests/gpu/cuda_ipc_e2e_test.cc."""
    for flags in (["--allow_cuda_shared_memory"], []):
        s = ServerProcess(extra_args=flags)
        try:
            with fusedlayer.Client(s.target) as c:
                info = c.server_info()
                assert info.cuda_shared_memory_enabled is False and info.device_id == -1
                with pytest.raises(fusedlayer.FailedPrecondition):
                    c.register_cuda_shared_memory("r", rng.bytes(64), 0, 0, 4096)
                with pytest.raises(fusedlayer.FailedPrecondition):
                    c.cuda_shared_memory_status()
                with pytest.raises(fusedlayer.FailedPrecondition):
                    c.unregister_cuda_shared_memory()
        finally:
            s.stop()
