#!/usr/bin/env python3
"""PyTorch eager peer of the SWA op (spec/swa.md, fused numerics), timed like bench_swa_gpu.

Same shapes and the same method as bench/gpu/bench_swa_gpu.cc: each CUDA graph holds L calls, each on
its own input/output set; a 512 MiB memset evicts the L2 before every replay (outside the timed
events); time per call = replay time / L, median of 15 replays after 2 warm-ups.

The eager chain is what a PyTorch user writes: q/kv RMSNorm in fp32, per-1x128 amax, scale, divide,
clamp, cast to float8_e4m3fn; kv cast to bf16. Each op is its own kernel (about a dozen launches).

usage: python3 torch_peers.py [--csv FILE] [--quick]
"""
import argparse
import statistics

import torch

FLUSH_BYTES = 512 << 20
FLOOR_BW = 4.2e12


def swa_eager(x, wq, wkv, q_rank, eps=1e-6):
    m = x.shape[0]
    q = x[:, :q_rank].float()
    kv = x[:, q_rank:].float()
    y = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)) * wq.float()
    kv_out = ((kv * torch.rsqrt(kv.pow(2).mean(-1, keepdim=True) + eps)) * wkv.float()).to(torch.bfloat16)
    g = y.view(m, q_rank // 128, 128)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-10)
    scale = amax / 448.0
    q_fp8 = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(m, q_rank)
    return q_fp8, scale.squeeze(-1), kv_out


def time_graph(fn_list, flush):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fn_list:  # warm-up outside capture (allocator, kernels' first launch)
            f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for f in fn_list:
            f()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for rep in range(17):
        flush.fill_(rep & 0xFF)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        if rep >= 2:
            times.append(e0.elapsed_time(e1))
    return statistics.median(times) / len(fn_list)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    d = 512
    qs, ms = ([1536], [64, 8192]) if args.quick else ([1024, 1280, 1536], [1, 64, 1024, 4096, 8192, 16384])
    rows = []
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print("\n| Q | M | torch eager us | floor us | eager TB/s (fused byte model) |")
    print("|---|---|---|---|---|")
    for q_rank in qs:
        wq = (1 + 0.1 * torch.randn(q_rank, device=dev)).to(torch.bfloat16)
        wkv = (1 + 0.1 * torch.randn(d, device=dev)).to(torch.bfloat16)
        for m in ms:
            fused_bytes = m * (2 * (q_rank + d) + q_rank + 4 * q_rank // 128 + 2 * d)
            n_sets = int(max(2, min(200, (1 << 30) // fused_bytes)))
            base = torch.randn(m, q_rank + d, device=dev).to(torch.bfloat16)
            base[base == 0] = 1.0
            xs = [base.clone() for _ in range(n_sets)]
            fns = [(lambda x=x: swa_eager(x, wq, wkv, q_rank)) for x in xs]
            us = time_graph(fns, flush) * 1e3
            floor = fused_bytes / FLOOR_BW * 1e6
            tbps = fused_bytes / (us * 1e-6) / 1e12
            rows.append((q_rank, d, m, n_sets, us, floor, tbps))
            print(f"| {q_rank} | {m} | {us:.2f} | {floor:.2f} | {tbps:.2f} |", flush=True)
            del xs, fns, base
            torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("Q,D,M,launches,torch_eager_us,floor_us,eager_TBps\n")
            for r in rows:
                f.write(",".join(str(v) if not isinstance(v, float) else f"{v:.3f}" for v in r) + "\n")


if __name__ == "__main__":
    main()
