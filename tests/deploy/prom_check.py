#!/usr/bin/env python3
"""Assertions against a live Prometheus that scrapes a live fusedlayer_server (HTTP API v1).

Used by tests/deploy/prometheus_integration.sh; each subcommand prints what it checked and exits
1 on the first failed assertion (with the query and what came back).

  prom_check.py URL wait-scraped TIMEOUT_S
      up{job="fusedlayer"} == 1 and fusedlayer_build_info present.
  prom_check.py URL wait-series SELECTOR TIMEOUT_S
      until the instant query SELECTOR returns a series.
  prom_check.py URL snapshot OUT.json
      current fusedlayer_op_executions_total / fusedlayer_op_fallbacks_total values.
  prom_check.py URL wait-counters BASELINE.json N TIMEOUT_S
      until Prometheus has scraped N fused + N unfused executions per op since BASELINE.
  prom_check.py URL traffic BASELINE.json N
      after N AUTO and N FORCE_UNFUSED calls per op: exact counter deltas, the hit-rate recording
      rule (0.5), FusedHitRateLow pending, FusedKernelErrors / FusedCapabilityLost quiet with their
      selectors matching the server's series.
  prom_check.py URL rule-selectors RULES.yml
      every series selector in every rule of RULES.yml matches series of the live server (a
      renamed metric or label value would otherwise leave an alert silently dead).
  prom_check.py URL dashboard DASHBOARD.json RATE_INTERVAL
      every panel expression returns data.
  prom_check.py URL capability-lost OP REASON N TIMEOUT_S
      after a restart with the fused path of OP off and N AUTO calls of OP: the capability gauge,
      FusedCapabilityLost pending for OP only, N fallbacks with REASON, ServiceDown resolved.
  prom_check.py URL shadow N TIMEOUT_S
      with --shadow_sample_rate=1 and N AUTO (fused) calls per op: every one was shadow-verified or
      dropped (compared + dropped == N), at least one compared, zero mismatches for every op x output
      series, ShadowMismatch quiet.
  prom_check.py URL wait-alert ALERTNAME STATE TIMEOUT_S
      ALERTS{alertname=ALERTNAME, alertstate=STATE, job="fusedlayer"} appears.
"""
import json
import math
import re
import pathlib
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

sys.dont_write_bytecode = True  # importing check_manifests must not write into the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_manifests  # noqa: E402  (the dashboard walker and variable substitution)

JOB = "fusedlayer"
OPS = ("mhc", "swa")
RECORD = "job_op:fusedlayer_op_executions_fused_per_executions:ratio_rate5m"
# The ratio is computed by rate() over a window the test only partly fills, and rate()
# extrapolates each series by its own first value; with AUTO and FORCE_UNFUSED calls interleaved
# the two counters stay within one call of each other, so the ratio is 0.5 to about 1/N.
RATIO_TOLERANCE = 0.05


class Failure(Exception):
    pass


def query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        raise Failure(f"query {expr!r}: HTTP {e.code}: {e.read().decode(errors='replace')}")
    if body.get("status") != "success":
        raise Failure(f"query {expr!r}: {body}")
    data = body["data"]
    if data["resultType"] != "vector":
        raise Failure(f"query {expr!r}: result type {data['resultType']}, expected vector")
    return [(s["metric"], float(s["value"][1])) for s in data["result"]]


def by(result, *labels):
    out = {}
    for metric, value in result:
        key = tuple(metric.get(l, "") for l in labels)
        if key in out:
            raise Failure(f"two series for {dict(zip(labels, key))}: {result}")
        out[key] = value
    return out


def counters(base):
    ex = by(query(base, f'fusedlayer_op_executions_total{{job="{JOB}"}}'), "op", "path")
    fb = by(query(base, f'fusedlayer_op_fallbacks_total{{job="{JOB}"}}'), "op", "reason")
    return {"executions": {"/".join(k): v for k, v in ex.items()},
            "fallbacks": {"/".join(k): v for k, v in fb.items()}}


def expect(cond, msg, detail=None):
    """Prints msg when cond holds; else fails with msg and detail() (computed only on failure)."""
    if not cond:
        raise Failure(msg + (f" -- {detail()}" if detail else ""))
    print(f"  ok: {msg}")


def poll(timeout_s, fn, what):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            if fn():
                return
        except Failure as e:
            last = e
        time.sleep(0.5)
    raise Failure(f"timed out after {timeout_s}s waiting for {what}" + (f" (last error: {last})" if last else ""))


def cmd_wait_scraped(base, timeout_s):
    def ready():
        up = query(base, f'up{{job="{JOB}"}}')
        info = query(base, f'fusedlayer_build_info{{job="{JOB}"}}')
        return len(up) == 1 and up[0][1] == 1 and len(info) == 1
    poll(float(timeout_s), ready, f'up{{job="{JOB}"}} == 1 and fusedlayer_build_info')
    info = query(base, f'fusedlayer_build_info{{job="{JOB}"}}')[0][0]
    print(f"  ok: scraped; build_info version={info.get('version')} backend={info.get('backend')} "
          f"arch={info.get('arch')}")


def cmd_wait_series(base, selector, timeout_s):
    poll(float(timeout_s), lambda: len(query(base, selector)) > 0, selector)
    print(f"  ok: {selector} is scraped")


def cmd_snapshot(base, out):
    snap = counters(base)
    for op in OPS:
        for path in ("fused", "unfused"):
            if f"{op}/{path}" not in snap["executions"]:
                raise Failure(f"fusedlayer_op_executions_total{{op={op!r},path={path!r}}} is not exported "
                              "before traffic (the server pre-creates every op x path series)")
    pathlib.Path(out).write_text(json.dumps(snap, indent=1, sort_keys=True))
    print(f"  ok: baseline of {len(snap['executions'])} execution and {len(snap['fallbacks'])} fallback series")


def deltas(base, baseline):
    now = counters(base)
    d = {}
    for kind in ("executions", "fallbacks"):
        for k, v in now[kind].items():
            d[(kind, k)] = v - baseline[kind].get(k, 0.0)
    return d


def cmd_wait_counters(base, baseline_path, n, timeout_s):
    baseline = json.loads(pathlib.Path(baseline_path).read_text())
    n = int(n)

    def done():
        d = deltas(base, baseline)
        return all(d.get(("executions", f"{op}/{p}"), 0) >= n for op in OPS for p in ("fused", "unfused"))
    poll(float(timeout_s), done, f"Prometheus to scrape {n} fused and {n} unfused executions per op")
    print(f"  ok: Prometheus has scraped all {4 * n} executions")


def cmd_traffic(base, baseline_path, n):
    baseline = json.loads(pathlib.Path(baseline_path).read_text())
    n = int(n)
    d = deltas(base, baseline)

    # Ground truth from the raw counters: AUTO calls ran fused, FORCE_UNFUSED ones unfused with the
    # reason client_forced_unfused, and nothing else fell back.
    cap = by(query(base, f'fusedlayer_fused_kernel_available{{job="{JOB}"}}'), "op")
    for op in OPS:
        expect(cap.get((op,)) == 1, f"fusedlayer_fused_kernel_available{{op={op!r}}} == 1 (precondition: AUTO runs fused)")
        expect(d[("executions", f"{op}/fused")] == n, f"{op}: executions{{path='fused'}} rose by {n} "
               f"(got {d[('executions', f'{op}/fused')]:g})")
        expect(d[("executions", f"{op}/unfused")] == n, f"{op}: executions{{path='unfused'}} rose by {n} "
               f"(got {d[('executions', f'{op}/unfused')]:g})")
        expect(d[("fallbacks", f"{op}/client_forced_unfused")] == n,
               f"{op}: fallbacks{{reason='client_forced_unfused'}} rose by {n} "
               f"(got {d[('fallbacks', f'{op}/client_forced_unfused')]:g})")
        others = {k[1]: v for k, v in d.items() if k[0] == "fallbacks" and k[1].startswith(op + "/")
                  and not k[1].endswith("/client_forced_unfused") and v != 0}
        expect(not others, f"{op}: no other fallback reason moved {others or ''}")

    # The recording rule, evaluated by Prometheus from the production rules file.
    ratio = by(query(base, f'{RECORD}{{job="{JOB}"}}'), "op")
    for op in OPS:
        v = ratio.get((op,))
        expect(v is not None and not math.isnan(v) and abs(v - 0.5) <= RATIO_TOLERANCE,
               f"{RECORD}{{op={op!r}}} = {v} (expected 0.5 +- {RATIO_TOLERANCE})")

    # FusedHitRateLow: its expression holds, so it is pending (for: 10m keeps it from firing here).
    pend = by(query(base, f'ALERTS{{alertname="FusedHitRateLow",job="{JOB}"}}'), "op", "alertstate")
    for op in OPS:
        expect(pend.get((op, "pending")) == 1, f"FusedHitRateLow{{op={op!r}}} is pending",
               lambda: f"ALERTS: {sorted(pend)}; rules API: {alert_state(base, 'FusedHitRateLow')}")

    # FusedKernelErrors: the selector matches the server's pre-created series (0 increase), quiet.
    kexpr = (f'sum by (job, instance, op) (increase(fusedlayer_op_fallbacks_total'
             f'{{job="{JOB}",reason="fused_kernel_error"}}[10m]))')
    ke = by(query(base, kexpr), "op")
    expect(sorted(ke) == [(op,) for op in OPS] and all(v == 0 for v in ke.values()),
           f"FusedKernelErrors' expression finds the fused_kernel_error series of both ops at 0 ({ke})")
    expect(not query(base, 'ALERTS{alertname="FusedKernelErrors"}'), "FusedKernelErrors is not active")

    # ShadowMismatch: the selector matches every pre-created op x output series (0 increase), quiet.
    sexpr = (f'sum by (job, instance, op, output) (increase(fusedlayer_shadow_mismatches_total'
             f'{{job="{JOB}"}}[10m]))')
    se = by(query(base, sexpr), "op", "output")
    expect(len(se) == 10 and sorted({op for op, _ in se}) == sorted(OPS) and all(v == 0 for v in se.values()),
           f"ShadowMismatch's expression finds the 10 op x output series at 0 ({se})")
    expect(not query(base, 'ALERTS{alertname="ShadowMismatch"}'), "ShadowMismatch is not active")

    # FusedCapabilityLost: the selector matches, value 1, quiet.
    cexpr = f'min by (job, instance, op) (fusedlayer_fused_kernel_available{{job="{JOB}"}})'
    ce = by(query(base, cexpr), "op")
    expect(sorted(ce) == [(op,) for op in OPS] and all(v == 1 for v in ce.values()),
           f"FusedCapabilityLost's expression finds both ops available ({ce})")
    expect(not query(base, 'ALERTS{alertname="FusedCapabilityLost"}'), "FusedCapabilityLost is not active")
    expect(not query(base, 'ALERTS{alertname="ServiceDown"}'), "ServiceDown is not active")


def alert_state(base, name):
    """The rules API's view of an alerting rule (state, health, last error), for failure messages."""
    with urllib.request.urlopen(f"{base}/api/v1/rules?type=alert", timeout=10) as r:
        groups = json.load(r)["data"]["groups"]
    for g in groups:
        for rule in g["rules"]:
            if rule["name"] == name:
                return {k: rule.get(k) for k in ("state", "health", "lastError", "alerts")}
    return None


# Series selectors in the project's rules: its metrics, its recording rules, and `up`.
SELECTOR = re.compile(r"(?<![A-Za-z0-9_:])((?:fusedlayer_|job_op:)[A-Za-z0-9_:]*|up)(\{[^}]*\})?")


def cmd_rule_selectors(base, rules_path):
    import yaml
    groups = yaml.safe_load(pathlib.Path(rules_path).read_text())["groups"]
    seen = set()
    for g in groups:
        for rule in g["rules"]:
            name = rule.get("alert") or rule.get("record")
            for metric, matchers in SELECTOR.findall(rule["expr"]):
                sel = metric + (matchers or "")
                if sel in seen:
                    continue
                seen.add(sel)
                expect(len(query(base, sel)) > 0, f"{name}: {sel} matches the server's series")
    expect(len(seen) > 0, f"{len(seen)} distinct selectors checked")


def cmd_dashboard(base, dashboard, rate_interval):
    check_manifests.DASHBOARD = pathlib.Path(dashboard)
    _, exprs = check_manifests.dashboard_exprs()
    for title, ref, expr in exprs:
        q = check_manifests.substitute(expr, rate_interval)
        res = query(base, q)
        expect(len(res) > 0, f"panel {title!r} {ref}: {len(res)} series")
        if title == "RPC error ratio by code":
            v = by(res, "code").get(("NOT_FOUND",))
            expect(v is not None and v > 0, f"panel {title!r}: NOT_FOUND = {v} (> 0: the UnloadWeightSet error)")
        if title.startswith("Fused hit rate"):
            vals = by(res, "op")
            for op in OPS:
                v = vals.get((op,))
                expect(v is not None and abs(v - 0.5) <= RATIO_TOLERANCE,
                       f"panel {title!r}: {op} = {v} (expected 0.5 +- {RATIO_TOLERANCE})")


def cmd_capability_lost(base, op, reason, n, timeout_s):
    n = int(n)
    other = [o for o in OPS if o != op]
    sel = f'fusedlayer_op_fallbacks_total{{job="{JOB}",op="{op}",reason="{reason}"}}'
    # The restarted process starts its counters at 0, so the latest sample is this run's count.
    poll(float(timeout_s), lambda: [v for _, v in query(base, sel)] == [n], f"{sel} == {n}")
    print(f"  ok: {sel} == {n}")
    cap = by(query(base, f'fusedlayer_fused_kernel_available{{job="{JOB}"}}'), "op")
    expect(cap.get((op,)) == 0 and all(cap.get((o,)) == 1 for o in other),
           f"fusedlayer_fused_kernel_available: {op} = 0, {', '.join(other)} = 1 ({cap})")
    alert = f'ALERTS{{alertname="FusedCapabilityLost",job="{JOB}"}}'
    poll(float(timeout_s), lambda: len(query(base, alert)) > 0, alert)
    states = by(query(base, alert), "op", "alertstate")
    expect(sorted(states) == [(op, "pending")], f"FusedCapabilityLost pending for {op} only ({sorted(states)})")
    poll(float(timeout_s), lambda: not query(base, 'ALERTS{alertname="ServiceDown"}'), "ServiceDown to resolve")
    print("  ok: ServiceDown resolved after the restart")


def cmd_shadow(base, n, timeout_s):
    n = int(n)

    def settled():
        comp = by(query(base, f'fusedlayer_shadow_comparisons_total{{job="{JOB}"}}'), "op")
        drop = by(query(base, f'fusedlayer_shadow_dropped_total{{job="{JOB}"}}'), "op")
        return all(comp.get((op,), 0) + drop.get((op,), 0) == n for op in OPS)

    poll(float(timeout_s), settled, f"shadow comparisons + drops == {n} per op")
    comp = by(query(base, f'fusedlayer_shadow_comparisons_total{{job="{JOB}"}}'), "op")
    expect(all(comp.get((op,), 0) >= 1 for op in OPS), f"shadow comparisons per op ({comp})")
    mism = by(query(base, f'fusedlayer_shadow_mismatches_total{{job="{JOB}"}}'), "op", "output")
    expect(len(mism) == 10 and all(v == 0 for v in mism.values()),
           f"no shadow mismatch in any of the 10 op x output series ({mism})")
    expect(not query(base, 'ALERTS{alertname="ShadowMismatch"}'), "ShadowMismatch is not active")


def cmd_wait_alert(base, name, state, timeout_s):
    expr = f'ALERTS{{alertname="{name}",alertstate="{state}",job="{JOB}"}}'
    poll(float(timeout_s), lambda: len(query(base, expr)) > 0, expr)
    print(f"  ok: {expr} is present")


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    base, cmd, args = argv[1].rstrip("/"), argv[2], argv[3:]
    table = {"wait-scraped": (cmd_wait_scraped, 1), "wait-series": (cmd_wait_series, 2),
             "snapshot": (cmd_snapshot, 1),
             "wait-counters": (cmd_wait_counters, 3), "traffic": (cmd_traffic, 2),
             "rule-selectors": (cmd_rule_selectors, 1), "dashboard": (cmd_dashboard, 2), "wait-alert": (cmd_wait_alert, 3),
             "capability-lost": (cmd_capability_lost, 4), "shadow": (cmd_shadow, 2)}
    if cmd not in table or len(args) != table[cmd][1]:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        table[cmd][0](base, *args)
    except Failure as e:
        print(f"FAIL {cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
