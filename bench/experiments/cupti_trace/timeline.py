#!/usr/bin/env python3
"""Per-call GPU timeline of a traced server (run.sh in this folder).

Reads cupti_trace.cc's CSV and groups the GPU work into calls:
one call = the host->device copies, kernels and device->host copies that follow each other on the
lane's stream with no idle gap longer than GAP_US. For each call it measures the H2D, kernel and
D2H busy time, the idle gaps between them (launch and enqueue latency seen by the GPU), and the
span from the first H2D start to the last D2H end; it prints their medians, plus the median gap
between one call's end and the next call's start (the host and gRPC part of a round trip), the
call in the middle of the run op by op, and the CUDA runtime calls of the whole window divided by
the number of calls (how often and how long, on average, the host spent in each per call).
"""
import statistics
import sys

GAP_US = 200.0  # idle time on the stream that separates two calls (calls at c1 are >= 300 us apart)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main(path):
    ops, api = [], []  # (start_ns, end_ns, kind, name)
    with open(path) as f:
        for line in f:
            kind, start, end, _, name = line.rstrip("\n").split(",", 4)
            start, end = int(start), int(end)
            if kind == "K":
                ops.append((start, end, "kernel", name))
            elif kind == "R":
                api.append((start, end, name))
            elif kind.startswith("M"):
                ops.append((start, end, {"M1": "h2d", "M2": "d2h"}.get(kind, "copy" + kind[1:]), name))
    ops.sort()
    calls, cur = [], []
    for op in ops:
        if cur and (op[0] - max(o[1] for o in cur)) / 1e3 > GAP_US:
            calls.append(cur)
            cur = []
        cur.append(op)
    if cur:
        calls.append(cur)
    # Keep calls with a kernel; drop the first 10 (warm-up) and the last 5.
    calls = [c for c in calls if any(o[2] == "kernel" for o in c)]
    if len(calls) > 20:
        calls = calls[10:-5]
    print(f"\n== per-call GPU timeline ({len(calls)} calls, an idle gap > {GAP_US:.0f} us separates calls)")
    if not calls:
        return
    rows = {"span": [], "h2d": [], "kernel": [], "d2h": [], "idle": [], "n_ops": []}
    for c in calls:
        span = (max(o[1] for o in c) - c[0][0]) / 1e3
        busy = {k: sum(o[1] - o[0] for o in c if o[2] == k) / 1e3 for k in ("h2d", "kernel", "d2h")}
        rows["span"].append(span)
        for k, v in busy.items():
            rows[k].append(v)
        rows["idle"].append(span - sum(busy.values()))
        rows["n_ops"].append(len(c))
    for k, v in rows.items():
        print(f"  {k:8s} p50 {med(v):9.2f}{'' if k == 'n_ops' else ' us'}")
    between = [(calls[i + 1][0][0] - max(o[1] for o in calls[i])) / 1e3 for i in range(len(calls) - 1)]
    print(f"  GPU idle between calls p50 {med(between):.1f} us")
    mid = calls[len(calls) // 2]
    print("  the call in the middle of the run, op by op (start offset us, duration us, kind, name or bytes):")
    for o in mid:
        print(f"    {(o[0] - mid[0][0]) / 1e3:8.2f} {(o[1] - o[0]) / 1e3:8.2f}  {o[2]:6s} {o[3][:70]}")
    # Host side: the CUDA runtime calls made during the kept calls' window, per call.
    lo, hi = calls[0][0][0], max(o[1] for o in calls[-1])
    per = {}
    for start, end, name in api:
        if lo <= start <= hi:
            n, t = per.get(name, (0, 0))
            per[name] = (n + 1, t + end - start)
    n = len(calls)
    print(f"  CUDA runtime calls per GPU call (over the same window, / {n} calls):")
    for name, (count, total) in sorted(per.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"    {name:44s} {count / n:6.2f} calls {total / 1e3 / n:9.2f} us")


if __name__ == "__main__":
    main(sys.argv[1])
