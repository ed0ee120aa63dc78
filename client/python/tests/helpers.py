"""Random weight sets and inputs for the client tests (fresh each run, with outliers)."""

import json
import os

import numpy as np

import fusedlayer


def bf16_random(rng, shape, scale=1.0, outliers=True):
    v = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    if outliers and v.size:
        idx = rng.choice(v.size, size=max(1, v.size // 200), replace=False)
        v.reshape(-1)[idx] *= np.float32(40.0)
    return fusedlayer.float32_to_bf16(v)


def mhc_weights(rng, n, C, norm_weight=True):
    M, K = n * (n + 2), n * C
    w = {
        "mhc.fn": (rng.standard_normal((M, K)) / np.sqrt(K)).astype(np.float32),
        "mhc.scale": rng.uniform(0.5, 2.0, 3).astype(np.float32),
        "mhc.base": (rng.standard_normal(M) * 0.1).astype(np.float32),
    }
    if norm_weight:
        w["mhc.norm_weight"] = fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, C).astype(np.float32))
    return w


def seam_inputs(rng, T, n, C):
    """x, residual, post_mix, comb_mix, pre_mix of realistic magnitude (mixes as a seam produces them)."""
    post = (2.0 / (1.0 + np.exp(-rng.standard_normal((T, n))))).astype(np.float32)
    logits = rng.standard_normal((T, n, n))
    comb = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).astype(np.float32)
    pre = (1.0 / (1.0 + np.exp(-rng.standard_normal((T, n)))) + 1e-6).astype(np.float32)
    return dict(x=bf16_random(rng, (T, C)), residual=bf16_random(rng, (T, n, C)), post_mix=post, comb_mix=comb,
                pre_mix=pre)


def load_mhc_set(client, rng, name, n=4, C=256, replace=True, **hyper):
    w = mhc_weights(rng, n, C)
    [info] = client.load_weights(w, name=name, mhc=dict(hc_mult=n, hidden=C, **hyper), replace=replace)
    return w, info


def mhc_manifest(folder, rng, tag, names, n=2, C=64, refused=None):
    """A manifest of mHC sets with fresh random tensors, one safetensors file per set, in folder; the set
    named refused gets an mhc.fn the server refuses (INVALID_ARGUMENT: [M, K/2], not the [M, K] its
    hc_mult and hidden need), which the client packs and sends like any other."""
    entries = []
    for i, name in enumerate(names):
        w = mhc_weights(rng, n, C)
        if name == refused:
            w["mhc.fn"] = np.ascontiguousarray(w["mhc.fn"][:, :n * C // 2])
        file = f"{tag}-{i}.safetensors"
        fusedlayer.write_safetensors(os.path.join(folder, file), {
            t: ("BF16" if a.dtype == np.uint16 else "F32", a) for t, a in w.items()})
        entries.append({"name": name, "mhc": {"hc_mult": n, "hidden": C},
                        "tensors": {t: {"file": file, "tensor": t} for t in w}})
    path = os.path.join(folder, f"{tag}.json")
    with open(path, "w") as f:
        json.dump({"weight_sets": entries}, f)
    return path


def loaded_sets(client):
    """name -> (sha256, source, resident_bytes) of every set the server lists."""
    return {s.name: (s.sha256, s.source, s.resident_bytes) for s in client.list_weight_sets()}
