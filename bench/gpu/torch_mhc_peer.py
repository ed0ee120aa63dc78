#!/usr/bin/env python3
"""PyTorch eager peer of the mHC seam (spec/mhc.md, n = 4, shifted mode, norm weight present).

Same math as the GPU kernels (post -> bf16 R', fp32 mixes GEMM + sum of squares, sigmoid gates,
Sinkhorn, shifted collapse -> bf16 z, RMSNorm from the rounded z), written the way a framework
user would (einsum, matmul with TF32 off, a Python Sinkhorn loop). It is a timing peer, not a
reference: its fp32 summation orders differ from the contract's fixed ones.

Timing (BENCHMARKS.md, "Method"): cold L2 (a 512 MiB zero-fill before every timed call), CUDA events,
median of 15 after 3 warm-ups. Two numbers per shape: eager (launch overheads included, what an
eager model pays) and the same calls replayed from a CUDA graph (device time only).

usage: python3 torch_mhc_peer.py [--quick] [--csv FILE]
"""
import argparse
import statistics

import torch

N = 4
HP = dict(hc_norm_eps=1e-6, norm_eps=1e-6, hc_pre_eps=1e-6, sinkhorn_eps=1e-6, post_scale=2.0, iters=20)


def seam(x, R, post, comb, pre, fn, scale, base, g):
    T, n, C = R.shape
    # Post: R'[j] = x*post[j] + sum_i comb[i][j] R[i], one bf16 rounding.
    v = x.float().unsqueeze(1) * post.unsqueeze(-1) + torch.einsum("tij,tic->tjc", comb, R.float())
    Rn = v.to(torch.bfloat16)
    flat = Rn.float().view(T, n * C)
    S = (flat * flat).sum(-1)
    r = torch.rsqrt(S / (n * C) + HP["hc_norm_eps"])
    d = flat @ fn.t()
    alpha = torch.cat([scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)])
    a = r[:, None] * d * alpha + base
    new_pre = torch.sigmoid(a[:, :n]) + HP["hc_pre_eps"]
    new_post = torch.sigmoid(a[:, n:2 * n]) * HP["post_scale"]
    eps = HP["sinkhorn_eps"]
    P = torch.softmax(a[:, 2 * n:].view(T, n, n), dim=-1) + eps
    P = P / (P.sum(-2, keepdim=True) + eps)
    for _ in range(HP["iters"] - 1):
        P = P / (P.sum(-1, keepdim=True) + eps)
        P = P / (P.sum(-2, keepdim=True) + eps)
    # Shifted collapse with the given pre mix, then RMSNorm from the rounded z.
    z = (pre.unsqueeze(-1) * Rn.float()).sum(1).to(torch.bfloat16)
    zf = z.float()
    rho = torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + HP["norm_eps"])
    y = (zf * rho * g.float()).to(torch.bfloat16)
    return Rn, new_pre, new_post, P, y


def rand_bf16(*shape):
    t = torch.rand(*shape, device="cuda") * 2 - 1
    t = torch.where(torch.rand_like(t) < 0.01, t * 16, t)
    t = torch.where(t == 0, torch.full_like(t, 0.5), t)
    return t.to(torch.bfloat16)


def bench(C, T, flush):
    K = N * C
    x = rand_bf16(T, C)
    R = rand_bf16(T, N, C)
    post = torch.rand(T, N, device="cuda") * 1.9 + 0.1
    comb = torch.rand(T, N, N, device="cuda") + 0.01
    pre = torch.rand(T, N, device="cuda") + 0.01
    fn = (torch.rand(N * (N + 2), K, device="cuda") * 2 - 1) / K ** 0.5
    scale = torch.tensor([1.0, 0.7, 1.3], device="cuda")
    base = torch.rand(N * (N + 2), device="cuda") * 2 - 1
    g = (torch.rand(C, device="cuda") + 0.5).to(torch.bfloat16)
    args = (x, R, post, comb, pre, fn, scale, base, g)
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn_call):
        ms = []
        for rep in range(18):
            flush.zero_()
            s0.record()
            fn_call()
            s1.record()
            s1.synchronize()
            if rep >= 3:
                ms.append(s0.elapsed_time(s1))
        return statistics.median(ms) * 1e3

    eager_us = timed(lambda: seam(*args))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        seam(*args)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        seam(*args)
    graph_us = timed(graph.replay)
    del graph
    return eager_us, graph_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    Cs = [7168] if a.quick else [4096, 5120, 7168]
    Ts = [1, 64, 4096] if a.quick else [1, 16, 64, 128, 1024, 4096, 16384]
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'C':>6} {'T':>6} {'eager_us':>10} {'graph_us':>10} {'floor_us':>10}")
    rows = []
    for C in Cs:
        for T in Ts:
            e, gr = bench(C, T, flush)
            floor = (20.0 * C * T + 200.0 * T + 96.0 * C * 4) / 4.2e12 * 1e6
            print(f"{C:>6} {T:>6} {e:>10.2f} {gr:>10.2f} {floor:>10.2f}", flush=True)
            rows.append((C, T, e, gr, floor))
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("C,T,torch_eager_us,torch_graph_us,floor_us\n")
            for r in rows:
                f.write(",".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r) + "\n")


if __name__ == "__main__":
    main()
