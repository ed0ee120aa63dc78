"""fusedlayer.import_checkpoint against `fusedctl import-checkpoint` on the same synthetic DeepSeek-V4 /
V4.1 folders (both tensor-name dialects, several shards, F16 / F32 / BF16 norm weights, FP8 wq_b with
UE8M0 block scales): the same manifest, the same head tensors, the same packed sets (SHA-256), the
same errors. fusedctl: $FUSEDLAYER_FUSEDCTL, else client/fusedctl next to the server's build folder."""

import json
import os
import subprocess

import grpc
import numpy as np
import pytest

import fusedlayer
from fusedlayer.weights import _SafetensorsFile
from conftest import REPO


def fusedctl_binary():
    path = os.environ.get("FUSEDLAYER_FUSEDCTL")
    if not path:
        server = os.environ.get("FUSEDLAYER_SERVER", os.path.join(REPO, "build", "server", "fusedlayer_server"))
        path = os.path.join(os.path.dirname(os.path.dirname(server)), "client", "fusedctl")
    assert os.access(path, os.X_OK), f"no fusedctl at {path}: build it or set FUSEDLAYER_FUSEDCTL"
    return path


def fusedctl(*args):
    return subprocess.run([fusedctl_binary(), "import-checkpoint", *args], capture_output=True, text=True)


DS = {"attn_fn": "hc_attn_fn", "attn_base": "hc_attn_base", "attn_scale": "hc_attn_scale",
      "attn_norm": "attn_norm.weight", "ffn_fn": "hc_ffn_fn", "ffn_base": "hc_ffn_base", "ffn_scale": "hc_ffn_scale",
      "ffn_norm": "ffn_norm.weight", "q_norm": "attn.q_norm.weight", "kv_norm": "attn.kv_norm.weight",
      "wq_b": "attn.wq_b.weight", "wq_b_scale": "attn.wq_b.scale", "other": "ffn.experts.0.w1.weight"}
HF = {"attn_fn": "attn_hc.fn", "attn_base": "attn_hc.base", "attn_scale": "attn_hc.scale",
      "attn_norm": "input_layernorm.weight", "ffn_fn": "ffn_hc.fn", "ffn_base": "ffn_hc.base",
      "ffn_scale": "ffn_hc.scale", "ffn_norm": "post_attention_layernorm.weight",
      "q_norm": "self_attn.q_a_norm.weight", "kv_norm": "self_attn.kv_norm.weight",
      "wq_b": "self_attn.q_b_proj.weight", "wq_b_scale": "self_attn.q_b_proj.weight_scale_inv",
      "other": "mlp.experts.0.gate_proj.weight"}


def norm_values(rng, count, dtype):
    """bf16-exact values around 1 with outliers, stored as BF16 bits, F16 or F32."""
    v = rng.uniform(0.5, 1.5, count).astype(np.float32)
    v[5::37] *= np.float32(-24.0)  # outliers, still inside fp16's range
    v = fusedlayer.round_to_bf16(v)
    if dtype == "BF16":
        return ("BF16", fusedlayer.float32_to_bf16(v))
    return (dtype, v.astype(np.float16) if dtype == "F16" else v)


def write_checkpoint(folder, rng, dialect="deepseek", hc_head=True, layers=3, shards=3, n=4, C=256, Q=256, D=128,
                     N=256, extra=(), wq_b=True):
    """A synthetic checkpoint folder; extra: more tensor names (small F32) to put in it."""
    os.makedirs(folder, exist_ok=True)
    names = DS if dialect == "deepseek" else HF
    lp = "layers." if dialect == "deepseek" else "model.layers."
    M, K = n * (n + 2), n * C
    t = {}
    for layer in range(layers):
        def put(key, value):
            t[f"{lp}{layer}.{names[key]}"] = value
        f32 = lambda shape, sigma: ("F32", (rng.standard_normal(shape) * sigma).astype(np.float32))  # noqa: E731
        bf = lambda shape, sigma: ("BF16", fusedlayer.float32_to_bf16(  # noqa: E731
            (rng.standard_normal(shape) * sigma).astype(np.float32)))
        put("attn_fn", (bf if layer == 1 else f32)((M, K), K ** -0.5))
        put("attn_scale", f32((3,), 1.0))
        put("attn_base", (bf if layer == 2 else f32)((M,), 0.1))
        put("attn_norm", norm_values(rng, C, "F16" if layer == 0 else "BF16"))
        put("q_norm", norm_values(rng, Q, "F32" if layer == 1 else "F16"))
        put("kv_norm", norm_values(rng, D, "BF16"))
        if wq_b:
            codes = rng.integers(0, 256, (N, Q), dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0x11  # never the NaN code
            put("wq_b", ("F8_E4M3", codes))
            put("wq_b_scale", ("F8_E8M0", rng.integers(110, 136, (N // 128, Q // 128), dtype=np.uint8)))
        put("ffn_fn", (bf if layer == 0 else f32)((M, K), K ** -0.5))
        put("ffn_scale", f32((3,), 1.0))
        put("ffn_base", f32((M,), 0.1))
        put("ffn_norm", norm_values(rng, C, "F16" if layer == 2 else "F32"))
        put("other", f32((8, 4), 1.0))
    t["embed.weight" if dialect == "deepseek" else "model.embed_tokens.weight"] = ("F32", np.ones((16, C), np.float32))
    t["norm.weight" if dialect == "deepseek" else "model.norm.weight"] = norm_values(rng, C, "F16")
    if hc_head:
        heads = (("hc_head_fn", "hc_head_base", "hc_head_scale") if dialect == "deepseek" else
                 ("model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"))
        t[heads[0]] = ("BF16", fusedlayer.float32_to_bf16((rng.standard_normal((n, K)) * K ** -0.5).astype(np.float32)))
        t[heads[1]] = ("F32", (rng.standard_normal(n) * 0.1).astype(np.float32))
        t[heads[2]] = ("F32", rng.standard_normal(1).astype(np.float32))
    for name in extra:
        t[name] = ("F32", np.ones(4, np.float32))
    shard_of = {name: f"model-{int(rng.integers(1, shards + 1))}-of-{shards}.safetensors" for name in t}
    for shard in sorted(set(shard_of.values())):
        fusedlayer.write_safetensors(os.path.join(folder, shard),
                                     {name: v for name, v in t.items() if shard_of[name] == shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": shard_of}, f)
    config = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": C, "hc_mult": n, "num_hidden_layers": layers,
              "q_lora_rank": Q, "head_dim": D, "rms_norm_eps": 1e-20, "hc_eps": 1e-6, "hc_sinkhorn_iters": 10,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": [128, 128]}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def import_both(tmp_path, ckpt, *flags, **kwargs):
    """Imports with fusedctl into tmp/ctl/m.json and with Python into tmp/py/m.json (sibling folders, so
    the relative shard paths are comparable); returns (python result, fusedctl run)."""
    for d in ("ctl", "py"):
        os.makedirs(tmp_path / d, exist_ok=True)
    run = fusedctl(str(ckpt), f"--output={tmp_path / 'ctl' / 'm.json'}", *flags)
    try:
        result = fusedlayer.import_checkpoint(ckpt, output=tmp_path / "py" / "m.json", **kwargs)
    except fusedlayer.FusedLayerError as e:
        result = e
    return result, run


def assert_same_import(tmp_path, result, run):
    assert run.returncode == 0, run.stdout + run.stderr
    assert not isinstance(result, Exception), result
    ctl_manifest = json.loads((tmp_path / "ctl" / "m.json").read_text())
    py_manifest = json.loads((tmp_path / "py" / "m.json").read_text())
    assert py_manifest == ctl_manifest
    # What fusedctl prints about the import, from the Python result.
    assert f"{len(result.set_names)} weight sets ({result.dialect} tensor names)" in run.stdout
    for note in result.notes:
        assert f"note: {note}" in run.stdout
    if result.head_tensors_path:
        py_head = _SafetensorsFile(result.head_tensors_path)
        ctl_head = _SafetensorsFile(str(tmp_path / "ctl" / "m.head.safetensors"))
        for name in ("head.fn", "head.scale", "head.base"):
            a, b = py_head.read(name), ctl_head.read(name)
            assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes() and a[1].shape == b[1].shape, name
    else:
        assert not (tmp_path / "ctl" / "m.head.safetensors").exists()
    # Packed exactly alike: the same bytes reach the server either way.
    py_sets = fusedlayer.pack_manifest(tmp_path / "py" / "m.json")
    ctl_sets = fusedlayer.pack_manifest(tmp_path / "ctl" / "m.json")
    assert [s.header.sha256 for s in py_sets] == [s.header.sha256 for s in ctl_sets]
    assert [s.header.name for s in py_sets] == result.set_names
    return py_manifest


@pytest.mark.parametrize("dialect", ["deepseek", "huggingface"])
@pytest.mark.parametrize("hc_head", [True, False], ids=["v4", "v41"])
def test_python_and_fusedctl_write_the_same_manifest(tmp_path, rng, dialect, hc_head):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rng, dialect=dialect, hc_head=hc_head)
    result, run = import_both(tmp_path, ckpt)
    manifest = assert_same_import(tmp_path, result, run)
    assert result.dialect == dialect
    assert result.set_names == ["L0/attn", "L0/ffn", "L1/attn", "L1/ffn", "L2/attn", "L2/ffn", "head"]
    assert manifest["weight_sets"][0]["tensors"]["mhc.fn"]["file"].startswith("../ckpt/")
    assert ("no hc_head tensors" in " ".join(result.notes)) == (not hc_head)


def test_layers_prefix_and_a_checkpoint_without_wq_b(tmp_path, rng):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rng, dialect="huggingface", wq_b=False)
    for flags, kwargs, names in (
            (["--layers=1"], dict(layers="1"), ["L1/attn", "L1/ffn"]),
            (["--layers=1-2", "--prefix=v4/b"], dict(layers=(1, 2), prefix="v4/b"),
             ["v4/b/L1/attn", "v4/b/L1/ffn", "v4/b/L2/attn", "v4/b/L2/ffn", "v4/b/head"])):
        result, run = import_both(tmp_path, ckpt, *flags, **kwargs)
        assert_same_import(tmp_path, result, run)
        assert result.set_names == names
        assert any("have no wq_b" in note for note in result.notes)


def test_the_same_errors_with_the_same_codes(tmp_path, rng):
    cases = [
        # An hc_head in an unknown spelling (fusedctl used to write a zero head for it and exit 0).
        (dict(extra=("hc_head.fn", "hc_head.base", "hc_head.scale"), hc_head=False), [], {},
         fusedlayer.InvalidArgument, "\"hc_head.fn\""),
        (dict(dialect="huggingface", extra=("model.layers.0.self_attn.q_norm.weight",)), [], {},
         fusedlayer.InvalidArgument, "\"model.layers.0.self_attn.q_norm.weight\""),
        (dict(), ["--layers=2-3"], dict(layers="2-3"), fusedlayer.InvalidArgument, "the model has 3 layers"),
        (dict(), ["--prefix=/x"], dict(prefix="/x"), fusedlayer.InvalidArgument, "--prefix=/x"),
    ]
    for i, (spec, flags, kwargs, cls, text) in enumerate(cases):
        ckpt = tmp_path / f"ckpt{i}"
        write_checkpoint(ckpt, rng, **spec)
        result, run = import_both(tmp_path / f"out{i}", ckpt, *flags, **kwargs)
        assert type(result) is cls and text in result.message, (text, result)
        assert run.returncode == 1 and f"fusedctl: error: {result.code.name}: " in run.stderr + run.stdout, run
        assert text in run.stderr + run.stdout
        assert not (tmp_path / f"out{i}" / "py" / "m.json").exists()
    # A tensor the index names but no file holds: NotFound from both.
    ckpt = tmp_path / "ckpt-missing"
    write_checkpoint(ckpt, rng)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.1.hc_ffn_base"] = "model-9-of-9.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    result, run = import_both(tmp_path / "out-missing", ckpt)
    assert type(result) is fusedlayer.NotFound and result.code == grpc.StatusCode.NOT_FOUND
    assert "layers.1.hc_ffn_base" in result.message
    assert run.returncode == 1 and "NOT_FOUND" in run.stderr + run.stdout
    with pytest.raises(fusedlayer.NotFound, match="does not exist"):
        fusedlayer.import_checkpoint(tmp_path / "absent", output=tmp_path / "x.json")


def test_an_imported_checkpoint_serves(client, tmp_path, rng):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rng, layers=2, C=128, Q=256, D=128)
    r = fusedlayer.import_checkpoint(ckpt, output=tmp_path / "m.json", prefix="py-import")
    infos = client.load_weights(r.manifest_path, replace=True)
    assert [i.name for i in infos] == r.set_names
    seam = client.mhc_seam("py-import/L0/attn", fusedlayer.float32_to_bf16(
        rng.standard_normal((3, 128)).astype(np.float32)), stage="first")
    assert seam.y.shape == (3, 128)
    swa = client.swa_norm_quant("py-import/L1/attn", fusedlayer.float32_to_bf16(
        rng.standard_normal((4, 256 + 128)).astype(np.float32)))
    assert swa.q_proj.shape == (4, 256)
    for name in r.set_names:
        client.unload_weight_set(name)
