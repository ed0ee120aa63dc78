#!/usr/bin/env python3
"""Keeps deploy/k8s/prometheusrule.yaml in step with deploy/prometheus/fusedlayer-rules.yml.

The compose Prometheus loads the plain rules file; the prometheus-operator loads a PrometheusRule
object. Both must carry the same groups, so the object is generated from the file:

    tests/deploy/sync_prometheusrule.py           rewrite deploy/k8s/prometheusrule.yaml
    tests/deploy/sync_prometheusrule.py --check   exit 1 when the two differ (CI)

The comparison is on the parsed YAML (groups, rules, expressions, labels, annotations), so
formatting may differ but content may not.
"""
import argparse
import difflib
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/fusedlayer-rules.yml"
OBJECT = ROOT / "deploy/k8s/prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/fusedlayer-rules.yml by tests/deploy/sync_prometheusrule.py;
# edit the rules file and re-run the script. tests/deploy/check_static.sh fails on any drift.
#
# prometheus-operator selects PrometheusRule objects by label (Prometheus.spec.ruleSelector):
# adjust `metadata.labels` to your installation (kube-prometheus-stack uses release=<helm release>).
"""


class _BlockDumper(yaml.SafeDumper):
    pass


def _str_representer(dumper, value):
    # Multi-line PromQL stays readable as a literal block.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_representer)


def expected_object():
    rules = yaml.safe_load(RULES.read_text())
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "fusedlayer",
            "labels": {
                "app.kubernetes.io/name": "fusedlayer",
                "app.kubernetes.io/part-of": "fusedlayer",
                "release": "prometheus",
            },
        },
        "spec": {"groups": rules["groups"]},
    }


def render(obj):
    return HEADER + yaml.dump(obj, Dumper=_BlockDumper, sort_keys=False, width=4096, allow_unicode=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on drift")
    args = parser.parse_args()
    want = expected_object()
    if not args.check:
        OBJECT.write_text(render(want))
        print(f"wrote {OBJECT.relative_to(ROOT)}")
        return 0
    have = yaml.safe_load(OBJECT.read_text())
    if have.get("kind") != "PrometheusRule" or have.get("apiVersion") != "monitoring.coreos.com/v1":
        print(f"{OBJECT}: not a monitoring.coreos.com/v1 PrometheusRule", file=sys.stderr)
        return 1
    if have.get("spec", {}).get("groups") != want["spec"]["groups"]:
        diff = difflib.unified_diff(
            yaml.safe_dump(want["spec"]["groups"], sort_keys=True).splitlines(),
            yaml.safe_dump(have.get("spec", {}).get("groups"), sort_keys=True).splitlines(),
            fromfile=str(RULES.relative_to(ROOT)), tofile=str(OBJECT.relative_to(ROOT)), lineterm="")
        print("PrometheusRule groups differ from the rules file:", file=sys.stderr)
        print("\n".join(diff), file=sys.stderr)
        print("fix: tests/deploy/sync_prometheusrule.py", file=sys.stderr)
        return 1
    print(f"OK: {OBJECT.relative_to(ROOT)} carries the same {len(want['spec']['groups'])} rule groups "
          f"as {RULES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
