#!/usr/bin/env bash
# Static checks of the deployment files (no server, no network). Run by CI from any directory:
#   tests/deploy/check_static.sh
# Needs (Debian 12): prometheus (promtool 2.42), python3-yaml, shellcheck.
# Exit status: 0 when every check passed; the first failing check stops the script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# Debian's interpreter and its python3-yaml, independent of any python3 earlier on PATH.
PYTHON="${PYTHON:-/usr/bin/python3}"
PROMTOOL="${PROMTOOL:-promtool}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cd "$ROOT"

step() { printf '\n== %s\n' "$*"; }

step "promtool check rules (production rules)"
"$PROMTOOL" check rules deploy/prometheus/fusedlayer-rules.yml

step "promtool test rules (unit tests: each alert fires, and stays quiet on healthy series)"
"$PROMTOOL" test rules deploy/prometheus/tests/*.yml

step "promtool check config (compose prometheus.yml as shipped)"
"$PROMTOOL" check config deploy/prometheus/prometheus.yml

# The shipped config names the in-container rules path; check the config and the rules together
# by pointing rule_files at the repository's file.
step "promtool check config (prometheus.yml with the repository's rules loaded)"
sed "s#/etc/prometheus/rules/\*\.yml#$ROOT/deploy/prometheus/fusedlayer-rules.yml#" \
  deploy/prometheus/prometheus.yml > "$TMP/prometheus.yml"
grep -q "$ROOT/deploy/prometheus/fusedlayer-rules.yml" "$TMP/prometheus.yml"
"$PROMTOOL" check config "$TMP/prometheus.yml"

step "YAML parses (compose, Prometheus, Grafana provisioning, Kubernetes)"
"$PYTHON" tests/deploy/check_manifests.py yaml

step "PrometheusRule carries the same rules as deploy/prometheus/fusedlayer-rules.yml"
"$PYTHON" tests/deploy/sync_prometheusrule.py --check

step "Kubernetes manifests cross-reference (selectors, ports, probes, drain, hardening)"
"$PYTHON" tests/deploy/check_manifests.py k8s

step "docker-compose: structure (keys, ports, volumes, build target/args, depends_on) and wiring (GPU, mounts, scrape target, grace period)"
"$PYTHON" tests/deploy/check_manifests.py compose

step "Dockerfile structure (stages, bases, build options, non-root, ports, healthcheck; not built here)"
"$PYTHON" tests/deploy/check_manifests.py dockerfile

step "Grafana dashboard parses; every PromQL target parses (as recording rules)"
"$PYTHON" tests/deploy/check_manifests.py dashboard "$TMP/dashboard-rules.yml"
"$PROMTOOL" check rules "$TMP/dashboard-rules.yml"

step "shellcheck tests/deploy/*.sh, the image test and the images' entrypoint"
shellcheck tests/deploy/*.sh scripts/test-image.sh scripts/container-entrypoint.sh

printf '\nOK: all static deployment checks passed\n'
