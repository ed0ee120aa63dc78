"""load_weights (arrays and manifests) + list + unload round trips against a real server."""

import json

import grpc
import numpy as np
import pytest

import fusedlayer
from fusedlayer import reference
from conftest import ServerProcess
from helpers import bf16_random, loaded_sets, mhc_manifest, mhc_weights, seam_inputs


def _wq_b(rng, N, Q):
    """fp8 e4m3fn codes (never the NaN codes 0x7f / 0xff) and fp32 block scales."""
    codes = rng.integers(0, 256, (N, Q), dtype=np.uint16).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    return codes, rng.uniform(1e-3, 1e-2, (N // 128, Q // 128)).astype(np.float32)


def test_arrays_round_trip_load_list_unload(client, rng):
    n, C, Q, D, N = 4, 128, 256, 64, 128
    tensors = mhc_weights(rng, n, C)
    wq_b, wq_b_scale = _wq_b(rng, N, Q)
    tensors.update({"swa.q_norm": fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, Q).astype(np.float32)),
                    "swa.kv_norm": fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, D).astype(np.float32)),
                    "swa.wq_b": wq_b, "swa.wq_b_scale": wq_b_scale})
    [info] = client.load_weights(tensors, name="py-test/both", mhc=dict(hc_mult=n, hidden=C, sinkhorn_iters=7),
                                 swa=dict(q_rank=Q, head_dim=D, scale_format="ue8m0"), replace=True)
    assert info.name == "py-test/both" and info.source == "rpc" and info.resident_bytes > 0
    assert info.mhc["sinkhorn_iters"] == 7 and info.swa["scale_format"] == "ue8m0"
    assert info.wq_b_rows == N and info.has_norm_weight
    listed = {s.name: s for s in client.list_weight_sets()}
    assert listed["py-test/both"].sha256 == info.sha256
    # The reported configs read back as load_weights arguments: same set, same digest.
    [again] = client.load_weights(tensors, name="py-test/both", mhc=info.mhc, swa=info.swa, replace=True)
    assert again.sha256 == info.sha256 and again.mhc == info.mhc and again.swa == info.swa
    # The loaded values are the ones sent: the seam matches the reference computed from our arrays.
    inputs = seam_inputs(rng, 6, n, C)
    reference.check_seam(client.mhc_seam("py-test/both", **inputs),
                         reference.mhc_seam(tensors, **inputs, hc_mult=n, sinkhorn_iters=7))
    swa = client.swa_norm_quant("py-test/both", bf16_random(rng, (3, Q + D)))
    assert swa.q_proj.shape == (3, N)
    assert client.unload_weight_set("py-test/both") > 0
    assert "py-test/both" not in {s.name for s in client.list_weight_sets()}
    with pytest.raises(fusedlayer.NotFound):
        client.mhc_seam("py-test/both", **inputs)


def test_manifest_round_trip_with_checkpoint_dtypes(client, rng, tmp_path):
    """A manifest of safetensors files in checkpoint dtypes (F16 / BF16 fp32 tensors, F8_E8M0 scales,
    an F32 norm weight holding bf16 values), converted exactly on the client side."""
    n, C, Q, D, N = 4, 64, 128, 64, 128
    w = mhc_weights(rng, n, C)
    fn16 = w["mhc.fn"].astype(np.float16)
    wq_b, _ = _wq_b(rng, N, Q)
    e8m0 = rng.integers(110, 125, (N // 128, Q // 128), dtype=np.uint16).astype(np.uint8)
    fusedlayer.write_safetensors(tmp_path / "layer0.safetensors", {
        "layers.0.hc_attn_fn": ("F16", fn16),
        "layers.0.hc_attn_scale": ("F32", w["mhc.scale"]),
        "layers.0.hc_attn_base": ("BF16", fusedlayer.float32_to_bf16(w["mhc.base"])),
        "layers.0.attn_norm.weight": ("F32", fusedlayer.bf16_to_float32(w["mhc.norm_weight"])),
        "layers.0.attn.q_norm.weight": ("BF16", fusedlayer.float32_to_bf16(np.ones(Q, np.float32))),
        "layers.0.attn.kv_norm.weight": ("BF16", fusedlayer.float32_to_bf16(np.ones(D, np.float32))),
        "layers.0.attn.wq_b.weight": ("F8_E4M3", wq_b),
        "layers.0.attn.wq_b.scale": ("F8_E8M0", e8m0),
        "unrelated.tensor": ("F32", np.zeros(3, np.float32)),
    })
    manifest = {"weight_sets": [{
        "name": "py-test/L0/attn",
        "mhc": {"hc_mult": n, "hidden": C, "norm_eps": 1e-20},
        "swa": {"q_rank": Q, "head_dim": D},
        "tensors": {
            "mhc.fn": {"file": "layer0.safetensors", "tensor": "layers.0.hc_attn_fn"},
            "mhc.scale": {"file": "layer0.safetensors", "tensor": "layers.0.hc_attn_scale"},
            "mhc.base": {"file": "layer0.safetensors", "tensor": "layers.0.hc_attn_base"},
            "mhc.norm_weight": {"file": "layer0.safetensors", "tensor": "layers.0.attn_norm.weight"},
            "swa.q_norm": {"file": "layer0.safetensors", "tensor": "layers.0.attn.q_norm.weight"},
            "swa.kv_norm": {"file": "layer0.safetensors", "tensor": "layers.0.attn.kv_norm.weight"},
            "swa.wq_b": {"file": "layer0.safetensors", "tensor": "layers.0.attn.wq_b.weight"},
            "swa.wq_b_scale": {"file": "layer0.safetensors", "tensor": "layers.0.attn.wq_b.scale"}}}]}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    [info] = client.load_weights(str(path), replace=True)
    assert info.name == "py-test/L0/attn" and info.wq_b_rows == N
    # The server's own manifest loader (C++, --weights_manifest), given the same files, packs the same
    # payload: same conversions, same layout, same digest.
    [packed] = fusedlayer.pack_manifest(str(path))
    assert packed.header.sha256 == info.sha256
    other = ServerProcess(extra_args=[f"--weights_manifest={path}"], demo_weights=False)
    try:
        with fusedlayer.Client(other.target) as c:
            [server_loaded] = c.list_weight_sets()
    finally:
        other.stop()
    assert server_loaded.source.startswith("manifest:")
    assert server_loaded.sha256 == info.sha256
    used = {"mhc.fn": fn16.astype(np.float32), "mhc.scale": w["mhc.scale"],
            "mhc.base": fusedlayer.round_to_bf16(w["mhc.base"]), "mhc.norm_weight": w["mhc.norm_weight"]}
    inputs = seam_inputs(rng, 5, n, C)
    reference.check_seam(client.mhc_seam("py-test/L0/attn", **inputs),
                         reference.mhc_seam(used, **inputs, hc_mult=n, norm_eps=1e-20))
    client.unload_weight_set("py-test/L0/attn")


def test_manifest_errors_are_clear(tmp_path, rng):
    fusedlayer.write_safetensors(tmp_path / "w.safetensors", {
        "norm": ("F32", np.array([1.0, 1.0 + 2.0 ** -10], np.float32)),  # not a bf16 value
        "e8": ("F8_E8M0", np.array([0xFF], np.uint8))})

    def manifest(**entry):
        p = tmp_path / "m.json"
        p.write_text(json.dumps({"weight_sets": [{"name": "s", "mhc": {"hc_mult": 1, "hidden": 2}, **entry}]}))
        return str(p)

    ref = {"file": "w.safetensors", "tensor": "norm"}
    with pytest.raises(fusedlayer.InvalidArgument, match="not a bf16 value") as e:
        fusedlayer.pack_manifest(manifest(tensors={"mhc.norm_weight": ref}))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(fusedlayer.InvalidArgument, match="0xFF"):
        fusedlayer.pack_manifest(manifest(tensors={"mhc.scale": {"file": "w.safetensors", "tensor": "e8"}}))
    # A tensor missing from an existing file and a missing file are both NOT_FOUND, as on the server.
    with pytest.raises(fusedlayer.NotFound, match="missing") as e:
        fusedlayer.pack_manifest(manifest(tensors={"mhc.fn": {"file": "w.safetensors", "tensor": "missing"}}))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(fusedlayer.NotFound, match="nope.safetensors") as e:
        fusedlayer.pack_manifest(manifest(tensors={"mhc.fn": {"file": "nope.safetensors", "tensor": "x"}}))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(fusedlayer.NotFound, match="cannot open manifest"):
        fusedlayer.pack_manifest(str(tmp_path / "no-such.json"))
    with pytest.raises(fusedlayer.InvalidArgument, match="unknown tensor name"):
        fusedlayer.pack_manifest(manifest(tensors={"mhc.typo": ref}))
    with pytest.raises(fusedlayer.InvalidArgument, match="unknown key"):
        fusedlayer.pack_manifest(manifest(tensors={}, extra=1))
    p = tmp_path / "dup.json"
    p.write_text('{"weight_sets": [], "weight_sets": []}')
    with pytest.raises(fusedlayer.InvalidArgument, match="duplicate key"):
        fusedlayer.pack_manifest(str(p))


def test_array_errors_are_caught_before_sending(rng):
    with pytest.raises(fusedlayer.InvalidArgument, match="uint16"):
        fusedlayer.pack_arrays("s", {"mhc.norm_weight": np.ones(4, np.float32)}, mhc=dict(hc_mult=1, hidden=4))
    with pytest.raises(fusedlayer.InvalidArgument, match="unknown tensor name"):
        fusedlayer.pack_arrays("s", {"mhc.weights": np.ones(4, np.float32)}, mhc=dict(hc_mult=1, hidden=4))
    with pytest.raises(fusedlayer.InvalidArgument, match="unknown mhc key"):
        fusedlayer.pack_arrays("s", {}, mhc=dict(hc_mult=1, hidden=4, hc_mul=4))
    with pytest.raises(fusedlayer.InvalidArgument, match="hidden is required"):
        fusedlayer.pack_arrays("s", {}, mhc=dict(hc_mult=1))


def test_load_weights_errors_carry_the_grpc_code_and_load_nothing(client, tmp_path, rng):
    """A manifest whose second set names a tensor its file lacks: NotFound with .code, and the first set
    (valid) is not loaded either: every set is packed before the first byte is sent."""
    n, C = 2, 64
    w = mhc_weights(rng, n, C)
    fusedlayer.write_safetensors(tmp_path / "w.safetensors", {
        t: ("BF16" if a.dtype == np.uint16 else "F32", a) for t, a in w.items()})
    good = {t: {"file": "w.safetensors", "tensor": t} for t in w}
    bad = dict(good, **{"mhc.fn": {"file": "w.safetensors", "tensor": "absent"}})
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"weight_sets": [
        {"name": "py-err/ok", "mhc": {"hc_mult": n, "hidden": C}, "tensors": good},
        {"name": "py-err/bad", "mhc": {"hc_mult": n, "hidden": C}, "tensors": bad}]}))
    with pytest.raises(fusedlayer.NotFound, match="absent") as e:
        client.load_weights(str(p))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(fusedlayer.NotFound) as e:
        client.load_weights(str(tmp_path / "missing.json"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(fusedlayer.InvalidArgument) as e:
        client.load_weights({"mhc.fn": np.ones(4, np.float64)}, name="py-err/dtype", mhc={"hc_mult": 1, "hidden": 4})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(fusedlayer.InvalidArgument, match="needs name="):
        client.load_weights(w)
    assert not {"py-err/ok", "py-err/bad", "py-err/dtype"} & {s.name for s in client.list_weight_sets()}


def test_manifest_loads_all_sets_or_none(client, rng, tmp_path, monkeypatch):
    """A manifest loads like fusedctl load: every set staged under one stage id, then one CommitWeightSets.
    A set the server refuses after others were staged, or a commit the server refuses, changes nothing;
    the stage is discarded; a sound manifest then replaces every set."""
    names = ["py-all/a", "py-all/b", "py-all/c"]
    infos = client.load_weights(mhc_manifest(tmp_path, rng, "v1", names), replace=True)
    assert [i.name for i in infos] == names and all(i.source == "rpc" for i in infos)
    before = loaded_sets(client)
    assert set(names) <= set(before)
    # A known stage id, to check afterwards that the failed load discarded its stage.
    stages = []

    def stage_id(stage):
        monkeypatch.setattr(fusedlayer.client, "_stage_id", lambda: stages.append(stage) or stage, raising=False)

    # Set 2 of 3 is refused by the server (mhc.fn of the wrong shape) after set 1 was staged.
    stage_id("py-test-stage-refused")
    refused = mhc_manifest(tmp_path, rng, "refused", names, refused="py-all/b")
    with pytest.raises(fusedlayer.FusedLayerError) as e:
        client.load_weights(refused, replace=True)
    assert type(e.value) is fusedlayer.InvalidArgument and e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert loaded_sets(client) == before
    assert 'loading "py-all/b"' in e.value.message and "mhc.fn" in e.value.message, e.value.message
    assert "nothing was loaded" in str(e.value)
    # The stage was discarded: set 1, staged under it, can no longer be published.
    assert stages == ["py-test-stage-refused"]
    with pytest.raises(fusedlayer.FusedLayerError) as e:
        client.commit_weight_sets("py-test-stage-refused")
    assert type(e.value) is fusedlayer.NotFound and e.value.code == grpc.StatusCode.NOT_FOUND
    assert loaded_sets(client) == before

    # Refused at the commit: two new sets and a loaded name without replace. Neither new set appears.
    stage_id("py-test-stage-exists")
    mixed = mhc_manifest(tmp_path, rng, "mixed", ["py-all/x", "py-all/y", "py-all/c"])
    with pytest.raises(fusedlayer.FusedLayerError) as e:
        client.load_weights(mixed)
    assert type(e.value) is fusedlayer.AlreadyExists and e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert loaded_sets(client) == before
    assert "py-all/c" in e.value.message, e.value.message
    assert stages[-1] == "py-test-stage-exists"
    with pytest.raises(fusedlayer.NotFound):  # the stage was consumed by the refused commit
        client.commit_weight_sets("py-test-stage-exists")
    monkeypatch.undo()

    # A sound manifest replaces all three; the infos come in the manifest's order.
    v2 = mhc_manifest(tmp_path, rng, "v2", names)
    want = {p.header.name: p.header.sha256 for p in fusedlayer.pack_manifest(v2)}
    infos = client.load_weights(v2, replace=True)
    assert [(i.name, i.sha256) for i in infos] == [(n, want[n]) for n in names]
    after = loaded_sets(client)
    for n in names:
        assert after[n][0] == want[n] != before[n][0], n
    assert {k: v for k, v in after.items() if k not in names} == {k: v for k, v in before.items() if k not in names}
    for n in names:
        client.unload_weight_set(n)


def test_manifest_without_sets_is_refused(client, tmp_path):
    p = tmp_path / "empty.json"
    p.write_text('{"weight_sets": []}')
    before = loaded_sets(client)
    with pytest.raises(fusedlayer.InvalidArgument, match="lists no weight sets") as e:
        client.load_weights(str(p))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert loaded_sets(client) == before
