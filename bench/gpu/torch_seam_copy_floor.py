#!/usr/bin/env python3
"""Practical floor of the mHC seam on this GPU: torch's vectorised copy_ moving as many bytes as the
shifted seam must (read residual 4TC + x TC bf16 + fn 24x4C fp32; write new residual 4TC + y TC bf16:
a copy_ of max(read, write) bytes), K copies back to back in one CUDA graph over buffers rotating
through more than the L2, so each copy starts cold; per-copy time = graph time / K, median of 50
replays. BENCHMARKS.md holds the fused seam against it per card.

usage: python3 torch_seam_copy_floor.py
"""
import torch

dev = torch.device("cuda")
K = 20


def per_copy_us(nbytes):
    n = max(nbytes // 2, 64)
    reps = max(2, min(K, (256 << 20) // (2 * nbytes) + 1))  # distinct pairs to rotate through > L2
    src = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(reps)]
    dst = [torch.empty(n, device=dev, dtype=torch.bfloat16) for _ in range(reps)]
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(reps):
            dst[i].copy_(src[i])
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(K):
            dst[i % reps].copy_(src[i % reps])
    ts = []
    for _ in range(50):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / K)
    ts.sort()
    return ts[len(ts) // 2]


print(torch.cuda.get_device_name(), "torch", torch.__version__)
per_copy_us(1 << 20)  # warm the clocks
print(f"{'C':>5} {'T':>6} {'read MB':>8} {'write MB':>9} {'(r+w)/4.2TB/s us':>17} {'copy_ us':>9} {'copy TB/s':>10}")
for C in (4096, 5120, 7168):
    for T in (1, 16, 64, 128, 1024, 4096, 16384):
        rd = 4 * T * C * 2 + T * C * 2 + 24 * 4 * C * 4
        wr = 4 * T * C * 2 + T * C * 2
        nb = max(rd, wr)
        us = per_copy_us(nb)
        print(f"{C:>5} {T:>6} {rd / 1e6:>8.2f} {wr / 1e6:>9.2f} {(rd + wr) / 4.2e6:>17.2f} {us:>9.2f} {2 * nb / us / 1e6:>10.2f}")
