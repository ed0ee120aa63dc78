"""Every call of fusedlayer.Client against a real server, and every error code a client can cause."""

import hashlib
import socket

import grpc
import numpy as np
import pytest

import fusedlayer
from fusedlayer import reference
from conftest import SERVER_MAX_MESSAGE_BYTES
from helpers import bf16_random, load_mhc_set, mhc_weights, seam_inputs

DEMO_SETS = {"v41-flash/demo": 5120, "v4-pro/demo": 7168}


def test_server_info(client):
    info = client.server_info()
    assert info.backend == "cpu"
    assert set(info.ops) == {"mhc", "swa"}
    assert all(op.fused_available for op in info.ops.values())
    assert info.max_tokens > 0 and info.fused_max_tokens > 0 and info.queue_capacity > 0


def test_health(client):
    for service in ("", "fusedlayer.v1.FusedLayer", "fusedlayer.mhc", "fusedlayer.swa"):
        assert client.health(service) == "SERVING", service
    with pytest.raises(fusedlayer.NotFound) as e:
        client.health("no.such.service")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_list_weight_sets_has_the_demo_sets(client):
    sets = {s.name: s for s in client.list_weight_sets()}
    for name, C in DEMO_SETS.items():
        s = sets[name]
        assert s.source == "demo"
        assert s.mhc["hidden"] == C and s.mhc["hc_mult"] == 4 and s.mhc["sinkhorn_iters"] == 20
        assert s.swa is not None and s.has_norm_weight
        assert s.capabilities["mhc"].fused_available and s.capabilities["mhc"].reason == "none"
    assert sets["v41-flash/demo"].wq_b_rows == 1024
    assert sets["v4-pro/demo"].swa["scale_format"] == "ue8m0"
    assert sets["v4-pro/demo"].swa["scale_layout"] == "column_major_tma"
    assert sets["v41-flash/demo"].swa == {"q_rank": 1280, "head_dim": 512, "eps": pytest.approx(1e-6),
                                          "fp8_format": "e4m3fn", "scale_format": "fp32", "scale_layout": "row_major"}


@pytest.mark.parametrize("weight_set", sorted(DEMO_SETS))
def test_seam_on_demo_sets_fused_and_unfused_agree_bitwise(client, rng, weight_set):
    C = DEMO_SETS[weight_set]
    inputs = seam_inputs(rng, 5, 4, C)
    fused = client.mhc_seam(weight_set, **inputs)
    unfused = client.mhc_seam(weight_set, **inputs, path="force_unfused")
    assert fused.report.path == "fused" and fused.report.fallback_reason == "none"
    assert unfused.report.path == "unfused" and unfused.report.fallback_reason == "client_forced_unfused"
    assert fused.report.weight_set == weight_set and fused.report.backend == "cpu"
    assert fused.report.server_seconds > 0 and fused.report.round_trip_seconds > 0
    for report in (fused.report, unfused.report):
        assert sorted(report.stages) == ["copy_in", "copy_out", "decode", "device", "response"]
        assert all(v >= 0 for v in report.stages.values())
        assert sum(report.stages.values()) + report.queue_seconds <= report.server_seconds
    # The contract: new_residual bitwise everywhere, shifted-mode y bitwise between the paths.
    assert fused.new_residual.dtype == np.uint16 and fused.new_residual.shape == (5, 4, C)
    assert np.array_equal(fused.new_residual, unfused.new_residual)
    assert fused.y.shape == (5, C) and np.array_equal(fused.y, unfused.y)
    for name in ("new_pre_mix", "new_post_mix", "new_comb_mix"):
        a, b = getattr(fused, name), getattr(unfused, name)
        assert a.dtype == np.float32
        assert np.all(np.abs(a - b) <= 2 * (1e-5 + 1e-4 * np.abs(b)))  # twice the mixes bound between paths
    assert fused.aux is None and fused.verification is None
    assert fused.new_residual.flags.writeable


def test_seam_stages_and_options(client, rng):
    inputs = seam_inputs(rng, 3, 4, 5120)
    first = client.mhc_seam("v41-flash/demo", inputs["x"], stage="first")
    assert first.new_residual.shape == (3, 4, 5120) and first.new_pre_mix.shape == (3, 4)
    # first: the embedding broadcast to the n streams.
    assert np.array_equal(first.new_residual, np.broadcast_to(inputs["x"][:, None, :], (3, 4, 5120)))
    head = client.mhc_seam("v41-flash/demo", **inputs, stage="head")
    assert head.new_pre_mix is None and head.new_comb_mix is None and head.y.shape == (3, 5120)
    normal = client.mhc_seam("v4-pro/demo", **{**seam_inputs(rng, 3, 4, 7168), "pre_mix": None}, mode="normal")
    assert normal.report.path == "fused"
    aux = client.mhc_seam("v41-flash/demo", **inputs, capture_aux=True)
    assert aux.aux.shape == (3, 5120)
    want_aux = reference.double_to_bf16(fusedlayer.bf16_to_float32(aux.new_residual).astype(np.float64).mean(axis=1))
    assert np.array_equal(aux.aux, want_aux)
    no_pre = client.mhc_seam("v41-flash/demo", **{**inputs, "pre_mix": None}, request_id="py-test-7")
    assert no_pre.request_id == "py-test-7"
    empty = client.mhc_seam("v41-flash/demo", **seam_inputs(rng, 0, 4, 5120))
    assert empty.new_residual.shape == (0, 4, 5120) and empty.y.shape == (0, 5120)


def test_residual_session_chain_is_bitwise_the_inline_chain(client, rng):
    """A layer and a half through two demo sets with the state kept on the server: y bitwise the inline chain's."""
    T, n, C = 3, 4, 7168
    assert client.open_residual_session("py-chain", T, n, C) >= 2 * T * n * C * 2
    try:
        state = {}
        for i, stage in enumerate(["first", "seam", "seam", "head"]):
            x = bf16_random(rng, (T, C))
            inline = client.mhc_seam("v4-pro/demo", x, stage=stage, **state)
            kept = client.mhc_seam("v4-pro/demo", x, stage=stage, session="py-chain", return_state=(i == 2))
            assert np.array_equal(kept.y, inline.y), stage
            if i == 2:
                assert np.array_equal(kept.new_residual, inline.new_residual)
                assert np.array_equal(kept.new_comb_mix, inline.new_comb_mix)
            else:
                assert kept.new_residual is None and kept.new_comb_mix is None
            if inline.new_pre_mix is not None:
                state = dict(residual=inline.new_residual, post_mix=inline.new_post_mix, comb_mix=inline.new_comb_mix,
                             pre_mix=inline.new_pre_mix)
        [info] = client.list_residual_sessions()
        assert info["name"] == "py-chain" and info["calls"] == 4 and not info["has_mixes"]
        with pytest.raises(fusedlayer.FailedPrecondition):  # after head: no mixes until a new first
            client.mhc_seam("v4-pro/demo", bf16_random(rng, (T, C)), session="py-chain")
    finally:
        assert client.close_residual_session("py-chain") == 1
    with pytest.raises(fusedlayer.NotFound):
        client.mhc_seam("v4-pro/demo", bf16_random(rng, (T, C)), stage="first", session="py-chain")


def test_seam_verify(client, rng):
    r = client.mhc_seam("v41-flash/demo", **seam_inputs(rng, 4, 4, 5120), verify=True)
    assert r.verification.compared and not r.verification.mismatch
    outputs = {o["output"]: o for o in r.verification.outputs}
    assert set(outputs) >= {"new_residual", "y"}
    assert outputs["new_residual"]["max_ulp_distance"] == 0 and outputs["new_residual"]["rule"] == "bitwise"
    r = client.mhc_seam("v41-flash/demo", **seam_inputs(rng, 4, 4, 5120), verify=True, path="force_unfused")
    assert not r.verification.compared and "client_forced_unfused" in r.verification.reason


def test_shifted_seam_against_fp64_reference(client, rng):
    n, C = 4, 256
    hyper = dict(sinkhorn_iters=10, norm_eps=1e-20, hc_norm_eps=1e-20, post_scale=1.5)
    w, _ = load_mhc_set(client, rng, "py-test/ref", n=n, C=C, **hyper)
    for stage in ("seam", "head", "first"):
        inputs = seam_inputs(rng, 33, n, C)
        if stage == "first":
            inputs = {"x": inputs["x"]}
        ref = reference.mhc_seam(w, **inputs, stage=stage, hc_mult=n, **hyper)
        for path in ("auto", "force_unfused"):
            got = client.mhc_seam("py-test/ref", **inputs, stage=stage, path=path)
            assert got.report.path == ("fused" if path == "auto" else "unfused")
            reference.check_seam(got, ref)
    # Normal mode (V4): y collapses with the new pre mix; the contract's element-wise bound.
    for stage in ("seam", "first"):
        inputs = {**seam_inputs(rng, 33, n, C), "pre_mix": None}
        if stage == "first":
            inputs = {"x": inputs["x"]}
        ref = reference.mhc_seam(w, **inputs, stage=stage, mode="normal", hc_mult=n, **hyper)
        for path in ("auto", "force_unfused"):
            got = client.mhc_seam("py-test/ref", **inputs, stage=stage, mode="normal", path=path)
            reference.check_seam(got, ref, mode="normal")
    # Without a pre_mix the collapse selects stream 0.
    inputs = {**seam_inputs(rng, 9, n, C), "pre_mix": None}
    reference.check_seam(client.mhc_seam("py-test/ref", **inputs),
                         reference.mhc_seam(w, **inputs, hc_mult=n, **hyper))
    client.unload_weight_set("py-test/ref")


def test_swa_norm_quant(client, rng):
    Q, D, M = 1280, 512, 37
    qr_kv = bf16_random(rng, (M, Q + D + 64))  # a row stride beyond Q + D, as the merged wqa/wkv output
    fused = client.swa_norm_quant("v41-flash/demo", qr_kv)
    unfused = client.swa_norm_quant("v41-flash/demo", qr_kv, path="force_unfused")
    assert fused.report.path == "fused" and unfused.report.fallback_reason == "client_forced_unfused"
    assert fused.q_fp8.dtype == np.uint8 and fused.q_fp8.shape == (M, Q) and fused.fp8_format == "e4m3fn"
    assert fused.q_scale.shape == (M, Q // 128) and fused.kv.shape == (M, D) and fused.q_proj.shape == (M, 1024)
    assert np.array_equal(fused.kv, unfused.kv)  # contract: kv bitwise between the paths
    # fp32 scales: at most one code step between the paths.
    table = np.sort(np.unique(fusedlayer.fp8_to_float32(np.arange(256, dtype=np.uint8))[~np.isnan(
        fusedlayer.fp8_to_float32(np.arange(256, dtype=np.uint8)))]))
    step = np.abs(np.searchsorted(table, fusedlayer.fp8_to_float32(fused.q_fp8)) -
                  np.searchsorted(table, fusedlayer.fp8_to_float32(unfused.q_fp8)))
    assert step.max() <= 1
    assert np.mean(step != 0) <= 0.03  # contract: at most 3% of the codes differ between the paths
    pro = client.swa_norm_quant("v4-pro/demo", bf16_random(rng, (5, 1536 + 512)))
    assert pro.q_proj is None and pro.q_scale.shape == (1536 // 128, 8)  # column-major TMA: [G, align(M, 4)]
    assert np.all(np.log2(pro.q_scale[:, :5]) == np.round(np.log2(pro.q_scale[:, :5])))  # UE8M0: powers of 2
    v = client.swa_norm_quant("v41-flash/demo", qr_kv, verify=True)
    assert v.verification.compared and not v.verification.mismatch


def test_swa_against_fp64_reference(client, rng):
    Q, D, M, eps = 256, 128, 40, 1e-6
    q_norm = fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, Q).astype(np.float32))
    kv_norm = fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, D).astype(np.float32))
    client.load_weights({"swa.q_norm": q_norm, "swa.kv_norm": kv_norm}, name="py-test/swa",
                        swa=dict(q_rank=Q, head_dim=D, eps=eps), replace=True)
    qr_kv = bf16_random(rng, (M, Q + D))
    got = client.swa_norm_quant("py-test/swa", qr_kv)
    assert got.report.path == "fused"
    x = fusedlayer.bf16_to_float32(qr_kv).astype(np.float64)

    def rms(part, w):
        return part / np.sqrt(np.mean(part * part, axis=1, keepdims=True) + eps) * \
            fusedlayer.bf16_to_float32(w).astype(np.float64)
    kv_ref = reference.double_to_bf16(rms(x[:, Q:], kv_norm))
    dist = reference.bf16_ulp_distance(got.kv, kv_ref)
    assert dist.max() <= 1 and np.mean(dist == 0) >= 0.999
    y = rms(x[:, :Q], q_norm).reshape(M, Q // 128, 128)
    scale_ref = np.maximum(1e-10, np.abs(y).max(axis=2)) / 448.0
    assert np.all(np.abs(got.q_scale - scale_ref) <= 2.0 ** -20 * scale_ref)
    # q within one code step of the fp64 value's nearest code.
    decoded = fusedlayer.fp8_to_float32(got.q_fp8).reshape(M, Q // 128, 128)
    target = y / got.q_scale[:, :, None]
    codes = fusedlayer.fp8_to_float32(np.arange(256, dtype=np.uint8))
    table = np.sort(np.unique(codes[~np.isnan(codes)])).astype(np.float64)
    nearest = np.abs(target[..., None] - table).argmin(axis=-1)
    code_step = np.abs(np.searchsorted(table, decoded) - nearest)
    assert code_step.max() <= 1
    assert np.mean(code_step == 0) >= 0.999  # contract: bitwise on at least 99.9% of the codes
    client.unload_weight_set("py-test/swa")


def test_require_fused_raises_with_the_reason(client, rng):
    load_mhc_set(client, rng, "py-test/n2", n=2, C=128)
    load_mhc_set(client, rng, "py-test/c96", n=4, C=96)
    for name, n, C, reason in (("py-test/n2", 2, 128, "hc_mult_unsupported"),
                               ("py-test/c96", 4, 96, "hidden_size_unsupported")):
        inputs = seam_inputs(rng, 2, n, C)
        auto = client.mhc_seam(name, **inputs)
        assert auto.report.path == "unfused" and auto.report.fallback_reason == reason
        assert auto.report.fallback_detail
        with pytest.raises(fusedlayer.FusedUnavailable) as e:
            client.mhc_seam(name, **inputs, path="require_fused")
        assert e.value.reason == reason and e.value.detail
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert isinstance(e.value, fusedlayer.FailedPrecondition)
        caps = {s.name: s for s in client.list_weight_sets()}[name].capabilities["mhc"]
        assert not caps.fused_available and caps.reason == reason
        client.unload_weight_set(name)


def test_require_fused_swa(client, rng):
    Q, D = 128, 96  # head_dim not a multiple of the CPU fused kv tile (64)
    ones = fusedlayer.float32_to_bf16(np.ones(Q + D, np.float32))
    client.load_weights({"swa.q_norm": ones[:Q], "swa.kv_norm": ones[Q:]}, name="py-test/d96",
                        swa=dict(q_rank=Q, head_dim=D), replace=True)
    qr_kv = bf16_random(rng, (4, Q + D))
    auto = client.swa_norm_quant("py-test/d96", qr_kv)
    assert auto.report.path == "unfused" and auto.report.fallback_reason == "hidden_size_unsupported"
    with pytest.raises(fusedlayer.FusedUnavailable) as e:
        client.swa_norm_quant("py-test/d96", qr_kv, path="require_fused")
    assert e.value.reason == "hidden_size_unsupported" and "head_dim" in e.value.detail
    client.unload_weight_set("py-test/d96")


def test_invalid_arguments(client, rng):
    inputs = seam_inputs(rng, 2, 4, 5120)
    bad_width = {**inputs, "x": bf16_random(rng, (2, 5000))}
    with pytest.raises(fusedlayer.InvalidArgument) as e:
        client.mhc_seam("v41-flash/demo", **bad_width)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "x" in e.value.message
    with pytest.raises(fusedlayer.InvalidArgument):
        client.mhc_seam("v41-flash/demo", **{**inputs, "residual": None})  # seam without a residual
    with pytest.raises(fusedlayer.InvalidArgument):
        client.swa_norm_quant("v41-flash/demo", bf16_random(rng, (3, 1280)))  # narrower than Q + D
    with pytest.raises(fusedlayer.InvalidArgument):
        client.load_weights(mhc_weights(rng, 4, 64), name="bad name!", mhc=dict(hc_mult=4, hidden=64))
    with pytest.raises(fusedlayer.InvalidArgument):  # fn of the wrong width for hidden
        client.load_weights(mhc_weights(rng, 4, 64), name="py-test/bad", mhc=dict(hc_mult=4, hidden=128))
    # Caught before sending: a float32 array where bf16 bits go, unknown options.
    with pytest.raises(TypeError):
        client.mhc_seam("v41-flash/demo", **{**inputs, "x": fusedlayer.bf16_to_float32(inputs["x"])})
    with pytest.raises(ValueError):
        client.mhc_seam("v41-flash/demo", **inputs, path="fused_please")
    with pytest.raises(ValueError):
        client.mhc_seam("v41-flash/demo", **inputs, mode="v5")


def test_not_found(client, rng):
    with pytest.raises(fusedlayer.NotFound) as e:
        client.mhc_seam("no/such/set", **seam_inputs(rng, 1, 4, 64))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no/such/set" in e.value.message
    with pytest.raises(fusedlayer.NotFound):
        client.unload_weight_set("no/such/set")
    w, _ = load_mhc_set(client, rng, "py-test/mhc-only", C=128)
    with pytest.raises(fusedlayer.NotFound):  # the set has no SWA part
        client.swa_norm_quant("py-test/mhc-only", bf16_random(rng, (2, 1024)))
    client.unload_weight_set("py-test/mhc-only")


def test_already_exists_and_replace(client, rng):
    w1, info = load_mhc_set(client, rng, "py-test/dup", C=64)
    assert info.source == "rpc" and info.sha256
    with pytest.raises(fusedlayer.AlreadyExists) as e:
        client.load_weights(w1, name="py-test/dup", mhc=dict(hc_mult=4, hidden=64))
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    w2, info2 = load_mhc_set(client, rng, "py-test/dup", C=64, replace=True)
    assert info2.sha256 != info.sha256
    client.unload_weight_set("py-test/dup")


def test_data_loss_on_a_wrong_checksum(client, rng):
    packed = fusedlayer.pack_arrays("py-test/sha", mhc_weights(rng, 4, 64), mhc=dict(hc_mult=4, hidden=64))
    assert packed.header.sha256 == hashlib.sha256(packed.payload).hexdigest()
    packed.header.sha256 = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(fusedlayer.DataLoss) as e:
        client.upload(packed)
    assert e.value.code == grpc.StatusCode.DATA_LOSS
    assert "py-test/sha" not in {s.name for s in client.list_weight_sets()}


def test_deadline_exceeded(client, rng):
    with pytest.raises(fusedlayer.DeadlineExceeded) as e:
        client.mhc_seam("v4-pro/demo", **seam_inputs(rng, 64, 4, 7168), timeout=1e-6)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unavailable_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with fusedlayer.Client(f"127.0.0.1:{port}", timeout=5) as c:
        with pytest.raises(fusedlayer.Unavailable) as e:
            c.server_info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_resource_exhausted_over_the_server_message_limit(client, rng):
    T = SERVER_MAX_MESSAGE_BYTES // (4 * 7168 * 2) + 1  # the residual alone is over the limit
    with pytest.raises(fusedlayer.ResourceExhausted) as e:
        client.mhc_seam("v4-pro/demo", **seam_inputs(rng, T, 4, 7168))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.server_info().backend == "cpu"  # the server goes on serving


def test_resource_exhausted_over_the_client_message_limit(server, rng):
    with fusedlayer.Client(server.target, max_message_bytes=64 << 10) as c:
        with pytest.raises(fusedlayer.ResourceExhausted) as e:
            c.mhc_seam("v41-flash/demo", **seam_inputs(rng, 4, 4, 5120))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_transport_other_than_tcp_and_shm_is_not_implemented():
    for transport in ("cuda_ipc", "residual_session", "udp"):
        with pytest.raises(ValueError, match="not implemented yet"):
            fusedlayer.Client("127.0.0.1:1", transport=transport)


def test_target_is_local():
    for t in ("127.0.0.1:50051", "localhost:1", "[::1]:50051", "ipv4:127.0.0.2:5", "dns:///localhost:5",
              "unix:/tmp/sock", "unix-abstract:x"):
        assert fusedlayer.target_is_local(t), t
    for t in ("10.0.0.1:50051", "fusedlayer.internal:50051", "dns:///svc.ns:50051", "[2001:db8::1]:1"):
        assert not fusedlayer.target_is_local(t), t
