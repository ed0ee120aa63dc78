#!/usr/bin/env python3
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
ulp: the contract of docs/spec/mhc.md), and the per-seam path and latency are printed. Then:

- the same chain again through a residual session (only x sent, y returned; the residual and the mixes
  stay on the server): every y bitwise the inline chain's;
- SWA norm+quant on the first layer's set (it has an SWA part too): kv bitwise between the fused and
  the unfused path and within 1 bf16 ulp of an fp64 reference, q codes within one code step.

The sets are loaded as numpy arrays, or with --via_manifest through a manifest of safetensors files,
or with --via_checkpoint as a small DeepSeek-V4.1-style checkpoint folder (config.json, shards, index;
DeepSeek's tensor names) that fusedlayer.import_checkpoint turns into a manifest with the prefix's
set names, as `fusedctl import-checkpoint --prefix=...` would.

Exit status 0 when every check holds, 1 otherwise.

It needs the fusedlayer package installed (README "Python client"); Debian's /usr/bin/python3 does not
have it, the virtual environment of the README's install command does:

    /usr/bin/python3 -m venv --system-site-packages .venv && .venv/bin/pip install --no-index --no-build-isolation ./client/python
    .venv/bin/python examples/whole_model.py --target=localhost:50051
    .venv/bin/python examples/whole_model.py --server=build/server/fusedlayer_server   # starts its own
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

try:
    import fusedlayer
    from fusedlayer import reference
except ModuleNotFoundError as e:
    if e.name != "fusedlayer":
        raise
    sys.exit(f"whole_model: the fusedlayer package is not installed for {sys.executable}: install it into a "
             "virtual environment (README \"Python client\") and run this with that environment's python, e.g. "
             ".venv/bin/python examples/whole_model.py")


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


def random_swa_weights(rng, Q, D):
    return {"swa.q_norm": fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, Q).astype(np.float32)),
            "swa.kv_norm": fusedlayer.float32_to_bf16(rng.uniform(0.5, 1.5, D).astype(np.float32))}


# DeepSeek's own tensor names (docs/weights.md, "Importing a checkpoint") of a layer's seam tensors.
CHECKPOINT_NAMES = {
    "attn": {"mhc.fn": "hc_attn_fn", "mhc.base": "hc_attn_base", "mhc.scale": "hc_attn_scale",
             "mhc.norm_weight": "attn_norm.weight", "swa.q_norm": "attn.q_norm.weight",
             "swa.kv_norm": "attn.kv_norm.weight"},
    "ffn": {"mhc.fn": "hc_ffn_fn", "mhc.base": "hc_ffn_base", "mhc.scale": "hc_ffn_scale",
            "mhc.norm_weight": "ffn_norm.weight"},
}


def write_checkpoint(folder, sets, prefix, layers, n, C, Q, D):
    """The sets as a small DeepSeek-V4.1-style checkpoint folder (config.json, two shards and their
    index, DeepSeek's tensor names; no hc_head, so the head set's mixes parameters import as zeros)."""
    tensors = {}
    for name, arrays in sets.items():
        kind = name.rsplit("/", 1)[-1]
        for t, a in arrays.items():
            if kind == "head":
                if t == "mhc.norm_weight":
                    tensors["norm.weight"] = a
                continue
            layer = int(name.split("/")[-2][1:])
            tensors[f"layers.{layer}.{CHECKPOINT_NAMES[kind][t]}"] = a
    shards = {}
    for i, t in enumerate(sorted(tensors)):
        shards.setdefault(f"model-{i % 2 + 1}-of-2.safetensors", {})[t] = tensors[t]
    for file, members in shards.items():
        fusedlayer.write_safetensors(os.path.join(folder, file), {
            t: ("BF16" if a.dtype == np.uint16 else "F32", a) for t, a in members.items()})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {t: file for file, members in shards.items() for t in members}}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"hidden_size": C, "hc_mult": n, "num_hidden_layers": layers, "q_lora_rank": Q, "head_dim": D,
                   "rms_norm_eps": 1e-20, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20}, f)


def load_sets(client, sets, config, swa_configs, via):
    """Loads every set: as numpy arrays ("arrays"), through a manifest of safetensors files ("manifest"),
    or as a checkpoint folder imported with fusedlayer.import_checkpoint ("checkpoint").
    swa_configs: set name -> SWA config for the sets that have an SWA part too."""
    if via == "checkpoint":
        prefix = next(iter(sets)).rsplit("/", 2)[0]
        layers = sum(name.endswith("/attn") for name in sets)
        with tempfile.TemporaryDirectory() as d:
            some_swa = next(iter(swa_configs.values()))
            write_checkpoint(d, sets, prefix, layers, config["hc_mult"], config["hidden"], some_swa["q_rank"],
                             some_swa["head_dim"])
            imported = fusedlayer.import_checkpoint(d, output=os.path.join(d, "manifest.json"), prefix=prefix)
            assert sorted(imported.set_names) == sorted(sets), imported.set_names
            client.load_weights(imported.manifest_path, replace=True)
        return
    if via == "arrays":
        for name, tensors in sets.items():
            client.load_weights(tensors, name=name, mhc=config, swa=swa_configs.get(name), replace=True)
        return
    with tempfile.TemporaryDirectory() as d:
        entries = []
        for i, (name, tensors) in enumerate(sets.items()):
            file = f"set{i}.safetensors"
            fusedlayer.write_safetensors(os.path.join(d, file), {
                t: ("BF16" if a.dtype == np.uint16 else "F32", a) for t, a in tensors.items()})
            entry = {"name": name, "mhc": config, "tensors": {t: {"file": file, "tensor": t} for t in tensors}}
            if name in swa_configs:
                entry["swa"] = swa_configs[name]
            entries.append(entry)
        path = os.path.join(d, "manifest.json")
        with open(path, "w") as f:
            json.dump({"weight_sets": entries}, f)
        client.load_weights(path, replace=True)


def check_swa(client, name, tensors, rng, M, Q, D, eps=1e-6):
    """SWA norm+quant of one set on both paths: kv bitwise between them and within 1 bf16 ulp of an fp64
    reference, q codes within one code step between them. Prints one line; returns 1 on a failure."""
    qr_kv = fusedlayer.float32_to_bf16(rng.standard_normal((M, Q + D)).astype(np.float32))
    fused = client.swa_norm_quant(name, qr_kv)
    unfused = client.swa_norm_quant(name, qr_kv, path="force_unfused")
    x = fusedlayer.bf16_to_float32(qr_kv[:, Q:]).astype(np.float64)
    kv_ref = reference.double_to_bf16(x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) *
                                      fusedlayer.bf16_to_float32(tensors["swa.kv_norm"]).astype(np.float64))
    codes = fusedlayer.fp8_to_float32(np.arange(256, dtype=np.uint8))
    table = np.sort(np.unique(codes[~np.isnan(codes)]))
    q_steps = int(np.abs(np.searchsorted(table, fusedlayer.fp8_to_float32(fused.q_fp8)) -
                         np.searchsorted(table, fusedlayer.fp8_to_float32(unfused.q_fp8))).max())
    kv_ulp = int(reference.bf16_ulp_distance(fused.kv, kv_ref).max())
    ok = np.array_equal(fused.kv, unfused.kv) and kv_ulp <= 1 and q_steps <= 1
    r = fused.report
    print(f"swa {name}: M = {M}, Q = {Q}, D = {D}; path {r.path} ({r.fallback_reason}), server "
          f"{r.server_seconds * 1e3:.3f} ms; kv {'bitwise' if np.array_equal(fused.kv, unfused.kv) else 'DIFFERS'} "
          f"between the paths, <= {kv_ulp} ulp from fp64; q codes <= {q_steps} step apart: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


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
    p.add_argument("--via_checkpoint", action="store_true",
                   help="write the sets as a small DeepSeek-style checkpoint folder, import it with "
                        "fusedlayer.import_checkpoint and load the manifest it writes")
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

    via = "checkpoint" if args.via_checkpoint else "manifest" if args.via_manifest else "arrays"
    Q, D, M = 256, 128, 8  # the SWA part of the first attention set (of every one from a checkpoint): q_rank, head_dim, rows
    swa_eps = 1e-20 if via == "checkpoint" else 1e-6  # an import takes the SWA eps from rms_norm_eps
    swa_configs = {name: {"q_rank": Q, "head_dim": D, "eps": swa_eps}
                   for name in (sublayers[::2] if via == "checkpoint" else sublayers[:1])}
    for name in swa_configs:
        sets[name].update(random_swa_weights(rng, Q, D))
    if via == "checkpoint":  # a V4.1 checkpoint has no hc_head: the head set's mixes parameters import as zeros
        M_rows = n * (n + 2)
        sets[names[-1]].update({"mhc.fn": np.zeros((M_rows, n * C), np.float32),
                                "mhc.scale": np.zeros(3, np.float32), "mhc.base": np.zeros(M_rows, np.float32)})

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
            load_sets(client, sets, config, swa_configs, via)
            how = {"arrays": "", "manifest": " through a manifest",
                   "checkpoint": " from a checkpoint folder (fusedlayer.import_checkpoint)"}[via]
            print(f"loaded {len(sets)} weight sets{how}\n")
            print(f"{'#':>3} {'stage':5} {'weight set':24} {'path':8} {'fallback':22} {'server ms':>9} "
                  f"{'rtt ms':>8}  check")

            def run(i, stage, name, **inputs):
                nonlocal failures
                got = client.mhc_seam(name, stage=stage, **inputs)
                mhc_tensors = {t: a for t, a in sets[name].items() if t.startswith("mhc.")}
                ref = reference.mhc_seam(mhc_tensors, stage=stage, hc_mult=n, **inputs, **hyper)
                try:
                    s = reference.check_seam(got, ref)
                    mixes = ("no mixes (head)" if s["max_mix_abs_diff"] is None
                             else f"mixes max |d| {s['max_mix_abs_diff']:.1e}")
                    check = f"ok (residual bitwise, {mixes}, y <= {s['max_y_ulp']} ulp)"
                except AssertionError as e:
                    failures += 1
                    check = f"FAILED: {e}"
                r = got.report
                print(f"{i:>3} {stage:5} {name:24} {r.path:8} {r.fallback_reason:22} {r.server_seconds * 1e3:9.3f} "
                      f"{r.round_trip_seconds * 1e3:8.3f}  {check}")
                return got

            def chain(embedding, step):
                """The shifted chain first .. head; step(i, stage, name, x, state) runs one seam. Returns every y."""
                ys = []
                state = step(0, "first", sublayers[0], embedding, None)
                ys.append(state.y)
                for s, name in enumerate(sublayers):
                    x = stand_in_sublayer(state.y, gains[name])
                    nxt = sublayers[s + 1] if s + 1 < len(sublayers) else names[-1]
                    stage = "seam" if s + 1 < len(sublayers) else "head"
                    state = step(s + 1, stage, nxt, x, state)
                    ys.append(state.y)
                return ys

            def inline_step(i, stage, name, x, state):
                if state is None:
                    return run(i, stage, name, x=x)
                # Shifted mode: post, comb and the (delayed) pre mix all come from the previous seam.
                return run(i, stage, name, x=x, residual=state.new_residual, post_mix=state.new_post_mix,
                           comb_mix=state.new_comb_mix, pre_mix=state.new_pre_mix)

            embedding = fusedlayer.float32_to_bf16(rng.standard_normal((T, C)).astype(np.float32))
            inline_ys = chain(embedding, inline_step)
            print(f"\nfinal hidden state: bf16 {inline_ys[-1].shape}, "
                  f"|h| mean {np.abs(fusedlayer.bf16_to_float32(inline_ys[-1])).mean():.4f}")

            # The same chain with the residual and the mixes kept in a residual session on the server.
            session = f"{args.prefix}-session"
            client.open_residual_session(session, T, n, C)
            try:
                session_ys = chain(embedding, lambda i, stage, name, x, state: client.mhc_seam(
                    name, x, stage=stage, session=session))
            finally:
                client.close_residual_session(session)
            same = sum(np.array_equal(a, b) for a, b in zip(session_ys, inline_ys))
            print(f"residual session {session}: {same} of {len(inline_ys)} y bitwise the inline chain's "
                  f"({'ok' if same == len(inline_ys) else 'FAILED'})")
            failures += same != len(inline_ys)

            failures += check_swa(client, sublayers[0], sets[sublayers[0]], rng, M, Q, D, eps=swa_eps)
            for name in names:
                client.unload_weight_set(name)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    if failures:
        print(f"{failures} check(s) failed", file=sys.stderr)
        return 1
    print("every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
