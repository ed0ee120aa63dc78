#!/usr/bin/python3
"""A synthetic model's whole mHC chain driven through fusedlayer, the way an orchestration layer would.

The model: LAYERS layers of two sublayers each (attention, FFN), hidden size C, n = 4 residual streams,
random weights. Every seam's weight set is loaded by this program (one per sublayer, named by what the
seam feeds: "<prefix>/L{i}/attn", "<prefix>/L{i}/ffn", and "<prefix>/head"). The chain, in V4.1's
shifted mode:

    first(e)                     with L0/attn  -> residual, mixes, y (the attention's normalised input)
    for each sublayer s:
        x = sublayer_s(y)        a stand-in (no attention / FFN here), computed locally
        seam(x, residual, mixes, pre_mix = the previous seam's pre mix) with the NEXT sublayer's set
    head(x, residual, mixes)     with head                -> the final hidden state

Each service result is checked against a local fp64 numpy reference of the same step on the same
inputs (fusedlayer.reference: new_residual bitwise, mixes within 1e-5 + 1e-4 |ref|, y within 1 bf16
ulp: the contract of docs/spec/mhc.md), and the per-seam path and latency are printed. Exit status 0
when every seam is within the contract, 1 otherwise.

    /usr/bin/python3 examples/whole_model.py --target=localhost:50051
    /usr/bin/python3 examples/whole_model.py --server=build/server/fusedlayer_server   # starts its own

Needs the fusedlayer package (README "Python client").
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading

import numpy as np

import fusedlayer
from fusedlayer import reference


def random_mhc_weights(rng, n, C):
    M, K = n * (n + 2), n * C
    return {
        "mhc.fn": (rng.standard_normal((M, K)) / np.sqrt(K)).astype(np.float32),
        "mhc.scale": rng.uniform(0.5, 2.0, 3).astype(np.float32),
        "mhc.base": (rng.standard_normal(M) * 0.1).astype(np.float32),
        "mhc.norm_weight": fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, C).astype(np.float32)),
    }


def stand_in_sublayer(y, gain):
    """In place of attention / FFN: a cheap elementwise map of the normalised input, back to bf16."""
    return fusedlayer.float32_to_bf16((np.tanh(fusedlayer.bf16_to_float32(y)) * gain).astype(np.float32))


def load_sets(client, sets, config, via_manifest):
    """Loads every set: as numpy arrays, or through a manifest of safetensors files (as an importer writes)."""
    if not via_manifest:
        for name, tensors in sets.items():
            client.load_weights(tensors, name=name, mhc=config, replace=True)
        return
    with tempfile.TemporaryDirectory() as d:
        entries = []
        for i, (name, tensors) in enumerate(sets.items()):
            file = f"set{i}.safetensors"
            fusedlayer.write_safetensors(os.path.join(d, file), {
                t: ("BF16" if a.dtype == np.uint16 else "F32", a) for t, a in tensors.items()})
            entries.append({"name": name, "mhc": config,
                            "tensors": {t: {"file": file, "tensor": t} for t in tensors}})
        path = os.path.join(d, "manifest.json")
        with open(path, "w") as f:
            json.dump({"weight_sets": entries}, f)
        client.load_weights(path, replace=True)


def start_server(binary):
    proc = subprocess.Popen([binary, "--backend=cpu", "--address=127.0.0.1:0", "--metrics_address="],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:
        log.append(line)
        m = re.search(r"serving fusedlayer\.v1\.FusedLayer .*\(port ([0-9]+)\)", line)
        if m:
            # Drain the rest in the background so the server never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, f"127.0.0.1:{m.group(1)}"
    proc.wait()
    sys.exit("whole_model: the server exited before serving:\n" + "".join(log))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:50051", help="gRPC target of a running server")
    p.add_argument("--server", help="start this fusedlayer_server binary on loopback instead (and stop it after)")
    p.add_argument("--token_file", help="bearer token file (a server with --auth_tokens_file)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256, help="C (a multiple of 64 runs fused on the CPU backend)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prefix", default="example-model", help="weight-set name prefix")
    p.add_argument("--via_manifest", action="store_true", help="load the sets through a manifest file")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    n, C, T = 4, args.hidden, args.tokens
    config = {"hc_mult": n, "hidden": C, "norm_eps": 1e-20, "hc_norm_eps": 1e-20}  # V4.1's eps values
    hyper = {"norm_eps": 1e-20, "hc_norm_eps": 1e-20}
    sublayers = [f"{args.prefix}/L{i}/{kind}" for i in range(args.layers) for kind in ("attn", "ffn")]
    names = sublayers + [f"{args.prefix}/head"]
    sets = {name: random_mhc_weights(rng, n, C) for name in names}
    gains = {name: rng.uniform(0.5, 2.0, C).astype(np.float32) for name in sublayers}

    server = None
    target = args.target
    if args.server:
        server, target = start_server(args.server)
    failures = 0
    try:
        with fusedlayer.Client(target, token_file=args.token_file) as client:
            info = client.server_info()
            print(f"server {target}: backend {info.backend}, device {info.device}; seed {seed}; "
                  f"{args.layers} layers, C = {C}, n = {n}, T = {T}")
            load_sets(client, sets, config, args.via_manifest)
            print(f"loaded {len(sets)} weight sets{' through a manifest' if args.via_manifest else ''}\n")
            print(f"{'#':>3} {'stage':5} {'weight set':24} {'path':8} {'fallback':22} {'server ms':>9} "
                  f"{'rtt ms':>8}  check")

            def run(i, stage, name, **inputs):
                nonlocal failures
                got = client.mhc_seam(name, stage=stage, **inputs)
                ref = reference.mhc_seam(sets[name], stage=stage, hc_mult=n, **inputs, **hyper)
                try:
                    s = reference.check_seam(got, ref)
                    check = f"ok (residual bitwise, mixes max |d| {s['max_mix_abs_diff']:.1e}, y <= {s['max_y_ulp']} ulp)"
                except AssertionError as e:
                    failures += 1
                    check = f"FAILED: {e}"
                r = got.report
                print(f"{i:>3} {stage:5} {name:24} {r.path:8} {r.fallback_reason:22} {r.server_seconds * 1e3:9.3f} "
                      f"{r.round_trip_seconds * 1e3:8.3f}  {check}")
                return got

            embedding = fusedlayer.float32_to_bf16(rng.standard_normal((T, C)).astype(np.float32))
            state = run(0, "first", sublayers[0], x=embedding)
            for s, name in enumerate(sublayers):
                x = stand_in_sublayer(state.y, gains[name])
                nxt = sublayers[s + 1] if s + 1 < len(sublayers) else names[-1]
                stage = "seam" if s + 1 < len(sublayers) else "head"
                # Shifted mode: post, comb and the (delayed) pre mix all come from the previous seam.
                state = run(s + 1, stage, nxt, x=x, residual=state.new_residual, post_mix=state.new_post_mix,
                            comb_mix=state.new_comb_mix, pre_mix=state.new_pre_mix)
            print(f"\nfinal hidden state: bf16 {state.y.shape}, "
                  f"|h| mean {np.abs(fusedlayer.bf16_to_float32(state.y)).mean():.4f}")
            for name in names:
                client.unload_weight_set(name)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    if failures:
        print(f"{failures} seam(s) outside the contract", file=sys.stderr)
        return 1
    print("every seam within the contract")
    return 0


if __name__ == "__main__":
    sys.exit(main())
