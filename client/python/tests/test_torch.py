"""torch.Tensor inputs and outputs (torch is optional for the package; Debian's python3-torch here).

CPU tensors against the numpy path on the same values: byte-identical outputs. The CUDA-tensor test
needs a GPU server and torch.cuda: it carries the `cuda_host` marker, which CI deselects and the GPU
host runs (scripts/test-python.sh; FUSEDLAYER_CUDA_SERVER names that server's binary).
"""

import os

import grpc
import numpy as np
import pytest
import torch

import fusedlayer
from fusedlayer import _torch
from conftest import ServerProcess
from helpers import bf16_random, seam_inputs


def as_torch(a):
    """numpy wire arrays -> torch tensors of the same values (bf16 bits -> torch.bfloat16)."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def wire_bytes(v):
    """The bytes of an output, numpy or torch (bf16 tensors through an int16 view)."""
    if isinstance(v, torch.Tensor):
        v = v.view(torch.int16) if v.dtype == torch.bfloat16 else v
        return v.contiguous().numpy().tobytes()
    return np.ascontiguousarray(v).tobytes()


MHC_FIELDS = ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix", "aux")
SWA_FIELDS = ("q_fp8", "q_scale", "kv", "q_proj")


def assert_same_outputs(a, b, fields):
    for f in fields:
        va, vb = getattr(a, f), getattr(b, f)
        assert (va is None) == (vb is None), f
        if va is not None:
            assert wire_bytes(va) == wire_bytes(vb), f


@pytest.mark.parametrize("stage", ["first", "seam", "head"])
def test_seam_torch_cpu_and_numpy_inputs_give_byte_identical_outputs(client, rng, stage):
    T, n, C = 5, 4, 5120
    inputs = seam_inputs(rng, T, n, C)
    if stage == "first":
        inputs = {"x": inputs["x"]}
    by_numpy = client.mhc_seam("v41-flash/demo", stage=stage, capture_aux=(stage == "seam"), **inputs)
    by_torch = client.mhc_seam("v41-flash/demo", stage=stage, capture_aux=(stage == "seam"),
                               **{k: as_torch(v) for k, v in inputs.items()})
    # torch inputs give torch outputs: bf16 as torch.bfloat16, fp32 as torch.float32.
    assert isinstance(by_torch.y, torch.Tensor) and by_torch.y.dtype == torch.bfloat16
    assert by_torch.y.shape == (T, C) and isinstance(by_numpy.y, np.ndarray) and by_numpy.y.dtype == np.uint16
    if stage != "head":
        assert by_torch.new_comb_mix.dtype == torch.float32 and by_torch.new_comb_mix.shape == (T, n, n)
    assert by_torch.report.path == by_numpy.report.path == "fused"
    assert_same_outputs(by_numpy, by_torch, MHC_FIELDS)
    # Either way on request: numpy inputs with output="torch", torch inputs with output="numpy".
    asked_torch = client.mhc_seam("v41-flash/demo", stage=stage, capture_aux=(stage == "seam"), output="torch", **inputs)
    assert isinstance(asked_torch.y, torch.Tensor)
    assert_same_outputs(by_numpy, asked_torch, MHC_FIELDS)
    asked_numpy = client.mhc_seam("v41-flash/demo", stage=stage, capture_aux=(stage == "seam"), output="numpy",
                                  **{k: as_torch(v) for k, v in inputs.items()})
    assert isinstance(asked_numpy.y, np.ndarray) and asked_numpy.y.dtype == np.uint16
    assert_same_outputs(by_numpy, asked_numpy, MHC_FIELDS)


def test_swa_torch_cpu_and_numpy_inputs_give_byte_identical_outputs(client, rng):
    qr_kv = bf16_random(rng, (7, 1280 + 512 + 64))
    by_numpy = client.swa_norm_quant("v41-flash/demo", qr_kv)
    by_torch = client.swa_norm_quant("v41-flash/demo", as_torch(qr_kv))
    assert by_torch.q_fp8.dtype == torch.uint8 and by_torch.kv.dtype == torch.bfloat16
    assert by_torch.q_scale.dtype == torch.float32 and by_torch.q_proj.shape == (7, 1024)
    assert_same_outputs(by_numpy, by_torch, SWA_FIELDS)
    # A column slice (non-contiguous rows) is made contiguous: the same bytes as the numpy slice.
    wide = as_torch(bf16_random(rng, (6, 2000)))
    sliced = client.swa_norm_quant("v41-flash/demo", wide[:, :1280 + 512])
    assert_same_outputs(client.swa_norm_quant("v41-flash/demo", np.ascontiguousarray(
        wide.view(torch.int16).numpy().view(np.uint16)[:, :1280 + 512])), sliced, SWA_FIELDS)


def test_torch_inputs_in_a_residual_session(client, rng):
    """x as a torch tensor into a session: y a torch tensor, bitwise the inline numpy chain's."""
    T, n, C = 3, 4, 7168
    xs = [bf16_random(rng, (T, C)) for _ in range(2)]
    first = client.mhc_seam("v4-pro/demo", xs[0], stage="first")
    inline = client.mhc_seam("v4-pro/demo", xs[1], residual=first.new_residual, post_mix=first.new_post_mix,
                             comb_mix=first.new_comb_mix, pre_mix=first.new_pre_mix)
    client.open_residual_session("py-torch", T, n, C)
    try:
        client.mhc_seam("v4-pro/demo", as_torch(xs[0]), stage="first", session="py-torch")
        kept = client.mhc_seam("v4-pro/demo", as_torch(xs[1]), session="py-torch")
    finally:
        client.close_residual_session("py-torch")
    assert isinstance(kept.y, torch.Tensor) and kept.new_residual is None
    assert wire_bytes(kept.y) == wire_bytes(inline.y)


def test_cpu_tensor_views_are_zero_copy():
    x = torch.randn(4, 128).to(torch.bfloat16)
    a = _torch.host_array("x", x, np.dtype("<u2"))
    assert a.dtype == np.uint16 and a.ctypes.data == x.data_ptr()  # a view, not a copy
    f = torch.randn(4, 4)
    assert _torch.host_array("post_mix", f, np.dtype("<f4")).ctypes.data == f.data_ptr()
    back = _torch.to_torch(a)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)


def test_torch_dtype_mistakes_are_type_errors(client, rng):
    x = torch.randn(2, 5120)
    with pytest.raises(TypeError, match="torch.bfloat16"):
        client.mhc_seam("v41-flash/demo", x, stage="first")  # float32 where bf16 goes: would round
    with pytest.raises(TypeError, match="torch.float32"):
        client.mhc_seam("v41-flash/demo", x.to(torch.bfloat16), residual=as_torch(bf16_random(rng, (2, 4, 5120))),
                        post_mix=torch.ones(2, 4, dtype=torch.float64), comb_mix=torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="output"):
        client.mhc_seam("v41-flash/demo", x.to(torch.bfloat16), stage="first", output="cupy")


def test_bf16_helpers_for_numpy_users():
    v = np.array([1.0, 1.0 + 2.0 ** -8, -3.5, np.inf], np.float32)
    bits = fusedlayer.float32_to_bf16(v)
    assert bits.dtype == np.uint16
    assert np.array_equal(fusedlayer.bf16_to_float32(bits), fusedlayer.round_to_bf16(v))
    # The same bits torch's own bf16 rounding gives (round to nearest even).
    assert np.array_equal(bits, torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


# ---- CUDA tensors (GPU host only) -----------------------------------------------------------------

def test_torch_cuda_ipc_handles_of_every_format():
    # The 64 bytes of a cudaIpcMemHandle_t, as older torch gives them; newer torch puts a version
    # byte and a kind byte first ("c": a cudaMalloc block, "e": an expandable segment).
    raw = bytes(range(3, 67))
    assert _torch.cuda_ipc_handle(raw) == raw
    assert _torch.cuda_ipc_handle(b"\x02c" + raw) == raw
    with pytest.raises(fusedlayer.FailedPrecondition, match="expandable segments"):
        _torch.cuda_ipc_handle(b"\x02e" + raw[:40])
    for bad in (raw[:63], b"\x02x" + raw, raw + b"\x00"):
        with pytest.raises(fusedlayer.InvalidArgument, match=f"has {len(bad)} bytes"):
            _torch.cuda_ipc_handle(bad)


def test_cuda_inputs_to_a_server_without_cuda_shared_memory_fail_before_registering():
    """The check every CUDA-tensor call makes first (the GPU-host test below makes it on a real call):
    FailedPrecondition naming the server flag, and no region registered."""
    regions = _torch.CudaRegions("py-test")
    with pytest.raises(fusedlayer.FailedPrecondition, match="--allow_cuda_shared_memory") as e:
        fusedlayer.client._cuda_prepare(regions, False, "127.0.0.1:1", object(), {"x": (object(), 0)}, {})
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and regions.names() == []


def _cuda_server(extra=()):
    """A CUDA-backend server: $FUSEDLAYER_CUDA_SERVER (a GPU build), else $FUSEDLAYER_SERVER."""
    binary = os.environ.get("FUSEDLAYER_CUDA_SERVER") or os.environ.get("FUSEDLAYER_SERVER")
    saved = os.environ.get("FUSEDLAYER_SERVER")
    os.environ["FUSEDLAYER_SERVER"] = binary
    try:
        # The CUDA backend is the flag given last; ServerProcess passes --backend=cpu first.
        return ServerProcess(extra_args=["--backend=cuda", *extra])
    finally:
        if saved is None:
            del os.environ["FUSEDLAYER_SERVER"]
        else:
            os.environ["FUSEDLAYER_SERVER"] = saved


@pytest.mark.cuda_host
def test_cuda_tensors_go_by_cuda_shared_memory(rng):
    assert torch.cuda.is_available(), "the cuda_host tests need torch.cuda and a GPU"
    server = _cuda_server(["--allow_cuda_shared_memory"])
    try:
        with fusedlayer.Client(server.target) as c:
            assert c.server_info().cuda_shared_memory_enabled
            T, n, C = 4, 4, 5120
            inputs = seam_inputs(rng, T, n, C)
            want = c.mhc_seam("v41-flash/demo", **inputs)
            for _ in range(2):  # the second call reuses the registered allocations
                got = c.mhc_seam("v41-flash/demo", **{k: as_torch(v).cuda() for k, v in inputs.items()})
                assert got.y.is_cuda and got.y.dtype == torch.bfloat16
                assert_same_outputs(want, type(got)(**{f: (getattr(got, f).cpu() if getattr(got, f) is not None
                                                           else None) for f in MHC_FIELDS},
                                                    report=got.report, request_id=got.request_id,
                                                    verification=None), MHC_FIELDS)
            assert c.cuda_shared_memory_status()
            qr_kv = bf16_random(rng, (5, 1280 + 512))
            swa = c.swa_norm_quant("v41-flash/demo", as_torch(qr_kv).cuda())
            assert swa.kv.is_cuda
            assert wire_bytes(swa.kv.cpu()) == wire_bytes(c.swa_norm_quant("v41-flash/demo", qr_kv).kv)
    finally:
        server.stop()
    server = _cuda_server()  # without --allow_cuda_shared_memory: a clear client-side error
    try:
        with fusedlayer.Client(server.target) as c:
            with pytest.raises(fusedlayer.FailedPrecondition, match="allow_cuda_shared_memory") as e:
                c.mhc_seam("v41-flash/demo", as_torch(bf16_random(rng, (2, 5120))).cuda(), stage="first")
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop()
