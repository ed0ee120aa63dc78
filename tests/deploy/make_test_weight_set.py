#!/usr/bin/env python3
"""Writes a small weight set as a manifest + safetensors file (docs/weights.md), standard library only.

    make_test_weight_set.py DIR NAME [--file_prefix=PREFIX]

DIR/manifest.json names one set NAME with an mHC part (hc_mult 4, hidden 64) and an SWA part
(q_rank 128, head_dim 64, no wq_b); the tensors are in DIR/weights.safetensors with fresh random
values (the seed is printed). Manifest `file` entries are PREFIX + "weights.safetensors" (default:
relative, resolved against the manifest's directory), so the files can be mounted elsewhere.
Used by scripts/test-image.sh to load a weight set from a read-only mount in the container.
"""
import json
import os
import pathlib
import random
import struct
import sys

# hc_mult 4: the CPU fused mHC kernel is specialised for it (other values run unfused).
HC_MULT, HIDDEN, Q_RANK, HEAD_DIM = 4, 64, 128, 64


def bf16_bytes(values):
    # Truncating the fp32 bit pattern gives a bf16 value (the file's value is what it stores).
    return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:] for v in values)


def f32_bytes(values):
    return struct.pack(f"<{len(values)}f", *values)


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    prefix = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--file_prefix=")), "")
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, name = pathlib.Path(args[0]), args[1]
    seed = int.from_bytes(os.urandom(8), "little")
    rng = random.Random(seed)
    n, c = HC_MULT, HIDDEN
    m, k = n * (n + 2), n * c
    # name -> (dtype, shape, bytes); values of the magnitudes real checkpoints have.
    tensors = {
        "layer.hc_fn": ("F32", [m, k], f32_bytes([rng.gauss(0.0, 0.05) for _ in range(m * k)])),
        "layer.hc_scale": ("F32", [3], f32_bytes([rng.uniform(0.5, 1.5) for _ in range(3)])),
        "layer.hc_base": ("F32", [m], f32_bytes([rng.gauss(0.0, 0.5) for _ in range(m)])),
        "layer.norm": ("BF16", [c], bf16_bytes([rng.uniform(0.5, 1.5) for _ in range(c)])),
        "layer.q_norm": ("BF16", [Q_RANK], bf16_bytes([rng.uniform(0.5, 1.5) for _ in range(Q_RANK)])),
        "layer.kv_norm": ("BF16", [HEAD_DIM], bf16_bytes([rng.uniform(0.5, 1.5) for _ in range(HEAD_DIM)])),
    }
    header, data = {}, b""
    for tname, (dtype, shape, blob) in tensors.items():
        header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    hjson = json.dumps(header).encode()
    hjson += b" " * (-len(hjson) % 8)  # the data section starts 8-byte aligned
    out.mkdir(parents=True, exist_ok=True)
    (out / "weights.safetensors").write_bytes(struct.pack("<Q", len(hjson)) + hjson + data)
    f = prefix + "weights.safetensors"
    manifest = {"weight_sets": [{
        "name": name,
        "mhc": {"hc_mult": n, "hidden": c},
        "swa": {"q_rank": Q_RANK, "head_dim": HEAD_DIM},
        "tensors": {
            "mhc.fn": {"file": f, "tensor": "layer.hc_fn"},
            "mhc.scale": {"file": f, "tensor": "layer.hc_scale"},
            "mhc.base": {"file": f, "tensor": "layer.hc_base"},
            "mhc.norm_weight": {"file": f, "tensor": "layer.norm"},
            "swa.q_norm": {"file": f, "tensor": "layer.q_norm"},
            "swa.kv_norm": {"file": f, "tensor": "layer.kv_norm"},
        }}]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"weight set {name}: {out}/manifest.json + weights.safetensors (seed {seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
