"""Several devices per server: a fusedlayer_server started with --backend=cpu --devices=0,1 (two CPU
devices, every weight set resident on both). device_id= runs a call on the device it names, the
same request gives the same bits on either device, report.device_id says which ran it, residual
sessions live on the device they were opened on, and an id the server does not serve on is
INVALID_ARGUMENT; the asyncio client likewise."""

import asyncio
import copy
import pickle

import grpc
import numpy as np
import pytest

import fusedlayer
import fusedlayer.aio
from fusedlayer import ring as fring
from fusedlayer.v1 import fusedlayer_pb2 as pb
from conftest import TWO_DEVICES
from helpers import bf16_random, load_mhc_set, seam_inputs

MHC_OUTPUTS = ("new_residual", "y", "new_pre_mix", "new_post_mix", "new_comb_mix", "aux")
SWA_OUTPUTS = ("q_fp8", "q_scale", "kv", "q_proj")
SWA_Q, SWA_D = 1280, 512  # v41-flash/demo's q_rank and head_dim
UNKNOWN_DEVICE = 5


def _same_bits(a, b):
    return a is None and b is None or (a is not None and b is not None and a.shape == b.shape and
                                       a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def _assert_same_outputs(a, b, names):
    for name in names:
        assert _same_bits(getattr(a, name), getattr(b, name)), name


def _assert_invalid_argument(e):
    assert type(e.value) is fusedlayer.InvalidArgument
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "device_id" in e.value.message, e.value.message


def test_server_info_lists_both_devices(devices_client):
    info = devices_client.server_info()
    assert [d.device_id for d in info.devices] == list(TWO_DEVICES)
    assert [d.label for d in info.devices] == [f"cpu:{d}" for d in TWO_DEVICES]
    for d in info.devices:
        assert isinstance(d, fusedlayer.DeviceInfo)
        assert d.serving and d.error == "", d
        assert d.name and d.arch == info.arch
        assert d.lanes >= 0 and d.calls_in_flight >= 0
        assert d.resident_bytes > 0  # the demo sets, resident on every device
        assert set(d.ops) == {"mhc", "swa"}
        assert all(isinstance(op, fusedlayer.OpCapability) and op.fused_available for op in d.ops.values())
    assert info.device_id == -1  # the first serving GPU's id: none on the CPU backend


@pytest.mark.parametrize("stage,mode", [("seam", "shifted"), ("head", "shifted"), ("first", "shifted"),
                                        ("seam", "normal")])
def test_seam_is_bitwise_equal_on_either_device(devices_client, rng, stage, mode):
    T, n, C = 7, 4, 5120
    inputs = seam_inputs(rng, T, n, C)
    if stage == "first":
        inputs = {"x": inputs["x"]}
    elif mode == "normal":
        inputs["pre_mix"] = None
    results = {}
    for device in TWO_DEVICES:
        r = devices_client.mhc_seam("v41-flash/demo", **inputs, stage=stage, mode=mode,
                                    capture_aux=(stage == "seam"), device_id=device)
        assert r.report.device_id == device
        assert r.report.path == "fused" and r.report.backend == "cpu"
        results[device] = r
    a, b = (results[d] for d in TWO_DEVICES)
    assert a.y.shape == (T, C) and (a.aux is not None) == (stage == "seam")
    _assert_same_outputs(a, b, MHC_OUTPUTS)
    # The unfused path of the other device: new_residual and shifted-mode y are bitwise between the paths.
    unfused = devices_client.mhc_seam("v41-flash/demo", **inputs, stage=stage, mode=mode, path="force_unfused",
                                      device_id=TWO_DEVICES[1])
    assert unfused.report.device_id == TWO_DEVICES[1] and unfused.report.path == "unfused"
    assert _same_bits(a.new_residual, unfused.new_residual)
    if mode == "shifted":
        assert _same_bits(a.y, unfused.y)


def test_a_set_loaded_at_run_time_serves_on_both_devices(devices_client, rng):
    n, C, T = 4, 256, 5
    load_mhc_set(devices_client, rng, "py-devices/set", n=n, C=C)
    try:
        inputs = seam_inputs(rng, T, n, C)
        a, b = (devices_client.mhc_seam("py-devices/set", **inputs, device_id=d) for d in TWO_DEVICES)
        assert (a.report.device_id, b.report.device_id) == TWO_DEVICES
        _assert_same_outputs(a, b, MHC_OUTPUTS)
    finally:
        assert devices_client.unload_weight_set("py-devices/set") > 0


def test_swa_is_bitwise_equal_on_either_device(devices_client, rng):
    qr_kv = bf16_random(rng, (37, SWA_Q + SWA_D + 64))
    a, b = (devices_client.swa_norm_quant("v41-flash/demo", qr_kv, device_id=d) for d in TWO_DEVICES)
    assert (a.report.device_id, b.report.device_id) == TWO_DEVICES
    assert a.q_proj is not None and a.fp8_format == b.fp8_format
    _assert_same_outputs(a, b, SWA_OUTPUTS)


def test_without_device_id_the_server_picks_a_device(devices_client, rng):
    r = devices_client.mhc_seam("v41-flash/demo", **seam_inputs(rng, 2, 4, 5120))
    assert r.report.device_id in TWO_DEVICES
    s = devices_client.swa_norm_quant("v41-flash/demo", bf16_random(rng, (3, SWA_Q + SWA_D)))
    assert s.report.device_id in TWO_DEVICES


def test_unknown_device_is_invalid_argument(devices_client, rng):
    with pytest.raises(fusedlayer.FusedLayerError) as e:
        devices_client.mhc_seam("v41-flash/demo", **seam_inputs(rng, 2, 4, 5120), device_id=UNKNOWN_DEVICE)
    _assert_invalid_argument(e)
    with pytest.raises(fusedlayer.FusedLayerError) as e:
        devices_client.swa_norm_quant("v41-flash/demo", bf16_random(rng, (2, SWA_Q + SWA_D)), device_id=UNKNOWN_DEVICE)
    _assert_invalid_argument(e)
    with pytest.raises(fusedlayer.FusedLayerError) as e:
        devices_client.open_residual_session("py-devices-unknown", 2, 4, 5120, device_id=UNKNOWN_DEVICE)
    _assert_invalid_argument(e)
    assert devices_client.list_residual_sessions() == []
    with pytest.raises(fusedlayer.InvalidArgument):
        devices_client.mhc_seam("v41-flash/demo", bf16_random(rng, (2, 5120)), stage="first", device_id=-1)


def test_session_opened_on_a_device_runs_there(devices_client, rng):
    T, n, C = 3, 4, 5120
    device = TWO_DEVICES[1]
    opened = devices_client.open_residual_session("py-devices-session", T, n, C, device_id=device)
    try:
        assert isinstance(opened, fusedlayer.OpenedResidualSession) and isinstance(opened, int)
        assert opened.device_id == device
        assert opened >= 2 * T * n * C * 2 and opened.bytes == int(opened)
        [info] = devices_client.list_residual_sessions()
        assert info["name"] == "py-devices-session" and info["device_id"] == device and info["bytes"] == opened
        # Calls on the session run on its device, without naming it or naming it.
        x = bf16_random(rng, (T, C))
        first = devices_client.mhc_seam("v41-flash/demo", x, stage="first", session="py-devices-session")
        assert first.report.device_id == device
        inline = devices_client.mhc_seam("v41-flash/demo", x, stage="first", device_id=TWO_DEVICES[0])
        x = bf16_random(rng, (T, C))
        kept = devices_client.mhc_seam("v41-flash/demo", x, session="py-devices-session", device_id=device)
        assert kept.report.device_id == device
        want = devices_client.mhc_seam("v41-flash/demo", x, residual=inline.new_residual,
                                       post_mix=inline.new_post_mix, comb_mix=inline.new_comb_mix,
                                       pre_mix=inline.new_pre_mix, device_id=TWO_DEVICES[0])
        assert _same_bits(kept.y, want.y)
        # Another device than the session's is refused.
        with pytest.raises(fusedlayer.InvalidArgument) as e:
            devices_client.mhc_seam("v41-flash/demo", x, session="py-devices-session", device_id=TWO_DEVICES[0])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        assert devices_client.close_residual_session("py-devices-session") == 1


def test_session_without_device_id_reports_its_device(devices_client):
    opened = devices_client.open_residual_session("py-devices-any", 2, 4, 5120)
    try:
        assert opened.device_id in TWO_DEVICES
        [info] = devices_client.list_residual_sessions()
        assert info["device_id"] == opened.device_id
    finally:
        devices_client.close_residual_session("py-devices-any")


def test_opened_residual_session_is_the_int_it_was():
    opened = fusedlayer.OpenedResidualSession(4096, 1)
    assert opened == 4096 and opened + 1 == 4097 and str(opened) == "4096" and f"{opened}" == "4096"
    assert "device_id=1" in repr(opened)
    for again in (pickle.loads(pickle.dumps(opened)), copy.copy(opened), copy.deepcopy(opened)):
        assert again == 4096 and again.device_id == 1 and type(again) is fusedlayer.OpenedResidualSession


def test_device_id_is_checked_before_sending(devices_client, rng):
    x = bf16_random(rng, (2, 5120))
    for bad in (True, "1", 1.0):
        with pytest.raises(TypeError, match="device_id"):
            devices_client.mhc_seam("v41-flash/demo", x, stage="first", device_id=bad)
    with pytest.raises(ValueError, match="int32"):
        devices_client.swa_norm_quant("v41-flash/demo", bf16_random(rng, (2, SWA_Q + SWA_D)), device_id=1 << 40)
    # numpy integers are ints.
    r = devices_client.mhc_seam("v41-flash/demo", x, stage="first", device_id=np.int64(TWO_DEVICES[1]))
    assert r.report.device_id == TWO_DEVICES[1]


def test_ring_descriptors_name_no_device():
    req = pb.MhcSeamRequest(weight_set="w", device_id=1)
    with pytest.raises(fusedlayer.InvalidArgument, match="device"):
        fring.ring_call_of(req, ["w"], [])
    with pytest.raises(fusedlayer.InvalidArgument, match="device"):
        fring.ring_call_of(pb.SwaNormQuantRequest(weight_set="w", device_id=0), ["w"], [])


def test_a_ring_opened_on_a_device_serves_and_one_not_served_is_refused(devices_client, rng):
    """A ring bound to a device (open_call_ring(device_id=)) runs every call there; the server checks
    the device when the ring opens (which device ran each call is the server's metrics': the C++
    suite checks them)."""
    with pytest.raises(fusedlayer.InvalidArgument, match="device_id"):
        devices_client.open_call_ring(weight_sets=["v41-flash/demo"], device_id=UNKNOWN_DEVICE)
    inputs = seam_inputs(rng, 3, 4, 5120)
    want = devices_client.mhc_seam("v41-flash/demo", **inputs, device_id=TWO_DEVICES[0])
    with devices_client.open_call_ring(weight_sets=["v41-flash/demo"], device_id=TWO_DEVICES[1]) as ring:
        assert ring.device_id == TWO_DEVICES[1]
        got = ring.mhc_seam("v41-flash/demo", **inputs)
    _assert_same_outputs(got, want, MHC_OUTPUTS)


def test_one_device_server(client, rng):
    """A server started without --devices serves on one device, 0."""
    info = client.server_info()
    assert [(d.device_id, d.label, d.serving) for d in info.devices] == [(0, "cpu:0", True)]
    r = client.mhc_seam("v41-flash/demo", bf16_random(rng, (2, 5120)), stage="first")
    assert r.report.device_id == 0
    assert client.mhc_seam("v41-flash/demo", bf16_random(rng, (2, 5120)), stage="first",
                           device_id=0).report.device_id == 0
    with pytest.raises(fusedlayer.InvalidArgument):
        client.mhc_seam("v41-flash/demo", bf16_random(rng, (2, 5120)), stage="first", device_id=1)


def test_async_device_id_round_trip(devices_server, devices_client, rng):
    T, n, C = 4, 4, 5120
    inputs = seam_inputs(rng, T, n, C)
    qr_kv = bf16_random(rng, (5, SWA_Q + SWA_D))

    async def main():
        async with fusedlayer.aio.AsyncClient(devices_server.target) as c:
            info = await c.server_info()
            seams = await asyncio.gather(*(c.mhc_seam("v41-flash/demo", **inputs, device_id=d) for d in TWO_DEVICES))
            swas = await asyncio.gather(*(c.swa_norm_quant("v41-flash/demo", qr_kv, device_id=d)
                                          for d in TWO_DEVICES))
            with pytest.raises(fusedlayer.InvalidArgument) as e:
                await c.mhc_seam("v41-flash/demo", **inputs, device_id=UNKNOWN_DEVICE)
            _assert_invalid_argument(e)
            opened = await c.open_residual_session("py-devices-aio", T, n, C, device_id=TWO_DEVICES[1])
            try:
                listed = await c.list_residual_sessions()
                first = await c.mhc_seam("v41-flash/demo", inputs["x"], stage="first", session="py-devices-aio")
            finally:
                assert await c.close_residual_session("py-devices-aio") == 1
            return info, seams, swas, opened, listed, first

    info, seams, swas, opened, listed, first = asyncio.run(main())
    assert [d.label for d in info.devices] == [f"cpu:{d}" for d in TWO_DEVICES]
    assert all(d.serving for d in info.devices)
    assert [r.report.device_id for r in seams] == list(TWO_DEVICES)
    assert [r.report.device_id for r in swas] == list(TWO_DEVICES)
    _assert_same_outputs(*seams, MHC_OUTPUTS)
    _assert_same_outputs(*swas, SWA_OUTPUTS)
    want = devices_client.mhc_seam("v41-flash/demo", **inputs, device_id=TWO_DEVICES[0])
    _assert_same_outputs(seams[0], want, MHC_OUTPUTS)
    assert opened.device_id == TWO_DEVICES[1] and opened > 0
    assert [(s["name"], s["device_id"]) for s in listed] == [("py-devices-aio", TWO_DEVICES[1])]
    assert first.report.device_id == TWO_DEVICES[1]
