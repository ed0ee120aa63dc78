#!/usr/bin/env python3
"""Static checks of the deployment files that promtool cannot do.

    check_manifests.py yaml        every compose / Kubernetes / Grafana provisioning file parses
    check_manifests.py k8s         cross-references inside deploy/k8s (selectors, ports, probes, drain)
    check_manifests.py compose     docker-compose.yml wiring (GPU, mounts, grace period)
    check_manifests.py dashboard OUT.yml
                                   the dashboard JSON parses; writes each PromQL target as a
                                   recording rule into OUT.yml for `promtool check rules`
    check_manifests.py dockerfile  the Dockerfile's stages and runtime contract (no Docker engine
                                   or hadolint here: structure only)
    check_manifests.py probes      prints the shell commands of the Kubernetes readinessProbe and the
                                   Dockerfile HEALTHCHECKs, one a line, to run against a test server
    check_manifests.py flags       prints every fusedlayer_server flag name used by the Dockerfile,
                                   compose and Kubernetes files (one a line), for a check against
                                   the binary's --helpfull

Each failure prints one line naming the file and the problem; exit status 1 if any.
"""
import json
import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana/dashboards/fusedlayer.json"
RULES = DEPLOY / "prometheus/fusedlayer-rules.yml"

# Ports and names fixed by the service-level decisions (docs/conventions.md).
GRPC_PORT = 50051
METRICS_PORT = 9464
API_HEALTH = "fusedlayer.v1.FusedLayer"
OP_HEALTH = ("fusedlayer.mhc", "fusedlayer.swa")
SCRAPE_JOB = "fusedlayer"

errors = []


def fail(where, msg):
    errors.append(f"{where}: {msg}")


def rel(p):
    return str(pathlib.Path(p).relative_to(ROOT))


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def yaml_files():
    files = [COMPOSE, RULES, DEPLOY / "prometheus/prometheus.yml"]
    files += sorted((DEPLOY / "prometheus/tests").glob("*.yml"))
    files += sorted((DEPLOY / "grafana/provisioning").rglob("*.yml"))
    files += sorted(K8S.glob("*.yaml"))
    return files


def check_yaml():
    n = 0
    parsed = {}
    for path in yaml_files():
        try:
            docs = load_all(path)
        except yaml.YAMLError as e:
            fail(rel(path), f"YAML does not parse: {e}")
            continue
        if not docs:
            fail(rel(path), "empty")
        parsed[path] = docs
        n += len(docs)
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml" or path not in parsed:
            continue
        for doc in parsed[path]:
            for key in ("apiVersion", "kind", "metadata"):
                if key not in doc:
                    fail(rel(path), f"a document lacks {key}")
            if "name" not in doc.get("metadata", {}):
                fail(rel(path), f"{doc.get('kind')} without metadata.name")
    return n


def k8s_objects():
    objs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_all(path):
            objs[(doc["kind"], doc["metadata"]["name"])] = (path, doc)
    return objs


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def flag_value(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def check_k8s():
    objs = k8s_objects()
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust.get("resources", []))
    present = {p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"}
    if listed != present:
        fail("deploy/k8s/kustomization.yaml", f"resources {sorted(listed)} != files {sorted(present)}")

    need = [("Deployment", "fusedlayer"), ("Service", "fusedlayer"), ("Service", "fusedlayer-metrics"),
            ("ServiceMonitor", "fusedlayer"), ("PrometheusRule", "fusedlayer"),
            ("PodDisruptionBudget", "fusedlayer"), ("ConfigMap", "fusedlayer-weights"),
            ("NetworkPolicy", "fusedlayer")]
    for key in need:
        if key not in objs:
            fail("deploy/k8s", f"missing {key[0]} {key[1]}")
    if any(k not in objs for k in need):
        return

    dpath, dep = objs[("Deployment", "fusedlayer")]
    where = rel(dpath)
    spec = dep["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    if not selects(spec["selector"]["matchLabels"], pod_labels):
        fail(where, "spec.selector does not match the pod template labels")
    pod = spec["template"]["spec"]
    containers = pod["containers"]
    if len(containers) != 1:
        fail(where, "expected one container")
    c = containers[0]
    args = c.get("args", [])

    # One GPU per pod, in limits (extended resources must be set there).
    if str(c["resources"].get("limits", {}).get("nvidia.com/gpu")) != "1":
        fail(where, "resources.limits nvidia.com/gpu must be 1")

    # Ports: the flags, the container ports and the probes agree.
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if ports.get("grpc") != GRPC_PORT or ports.get("metrics") != METRICS_PORT:
        fail(where, f"container ports {ports} != grpc {GRPC_PORT}, metrics {METRICS_PORT}")
    addr = flag_value(args, "address")
    maddr = flag_value(args, "metrics_address")
    if addr is None or not addr.endswith(f":{GRPC_PORT}"):
        fail(where, f"--address={addr} does not listen on {GRPC_PORT}")
    if maddr is None or not maddr.endswith(f":{METRICS_PORT}"):
        fail(where, f"--metrics_address={maddr} does not listen on {METRICS_PORT}")

    # Probes on grpc.health.v1 with the service's names.
    for probe in ("startupProbe", "livenessProbe"):
        g = c.get(probe, {}).get("grpc")
        if not g or g.get("port") != GRPC_PORT or g.get("service") != API_HEALTH:
            fail(where, f"{probe} must be a grpc probe on {GRPC_PORT} service {API_HEALTH}")
    ready = c.get("readinessProbe", {})
    ready_cmd = " ".join(ready.get("exec", {}).get("command", []))
    for name in OP_HEALTH:
        if f"--service={name}" not in ready_cmd or f"--target=127.0.0.1:{GRPC_PORT}" not in ready_cmd:
            fail(where, f"readinessProbe must check {name} on 127.0.0.1:{GRPC_PORT}")
    if ready.get("timeoutSeconds", 1) > ready.get("periodSeconds", 10):
        fail(where, "readinessProbe timeout longer than its period")

    # Drain: grace period > preStop sleep + --drain_seconds.
    drain = flag_value(args, "drain_seconds")
    drain_s = float(drain) if drain is not None else 30.0  # the server's default
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_s = float(pre[-1]) if pre and pre[0].endswith("sleep") else 0.0
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if not grace > pre_s + drain_s:
        fail(where, f"terminationGracePeriodSeconds {grace} <= preStop {pre_s} + drain {drain_s}")

    # Hardening.
    psc = pod.get("securityContext", {})
    csc = c.get("securityContext", {})
    if psc.get("runAsNonRoot") is not True or not psc.get("runAsUser"):
        fail(where, "pod securityContext must set runAsNonRoot and a non-zero runAsUser")
    if csc.get("readOnlyRootFilesystem") is not True:
        fail(where, "container must have readOnlyRootFilesystem: true")
    if csc.get("allowPrivilegeEscalation") is not False:
        fail(where, "container must set allowPrivilegeEscalation: false")
    if csc.get("capabilities", {}).get("drop") != ["ALL"]:
        fail(where, "container must drop ALL capabilities")

    # Manifest: the flag points into the ConfigMap mount, and the ConfigMap has that key.
    manifest = flag_value(args, "weights_manifest")
    mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    cm_path, cm = objs[("ConfigMap", "fusedlayer-weights")]
    cm_vol = [n for n, v in vols.items() if v.get("configMap", {}).get("name") == "fusedlayer-weights"]
    if manifest is None or not cm_vol or cm_vol[0] not in mounts:
        fail(where, "--weights_manifest must point into a mounted fusedlayer-weights ConfigMap")
    else:
        mdir = mounts[cm_vol[0]]["mountPath"].rstrip("/")
        key = manifest[len(mdir) + 1:] if manifest.startswith(mdir + "/") else None
        if key is None or key not in cm.get("data", {}):
            fail(where, f"--weights_manifest={manifest} is not a key of ConfigMap fusedlayer-weights")
        else:
            try:
                json.loads(cm["data"][key])
            except ValueError as e:
                fail(rel(cm_path), f"data[{key}] is not JSON: {e}")
    if mounts.get("tmp", {}).get("mountPath") != "/tmp":
        fail(where, "read-only root filesystem needs a writable /tmp volume")

    # Services: the headless gRPC Service and the metrics Service select the pods.
    spath, grpc_svc = objs[("Service", "fusedlayer")]
    if grpc_svc["spec"].get("clusterIP") != "None":
        fail(rel(spath), "Service fusedlayer must be headless (clusterIP: None) for client-side balancing")
    mpath, met_svc = objs[("Service", "fusedlayer-metrics")]
    for p, svc, port_name, port in ((spath, grpc_svc, "grpc", GRPC_PORT), (mpath, met_svc, "metrics", METRICS_PORT)):
        if not selects(svc["spec"]["selector"], pod_labels):
            fail(rel(p), f"Service {svc['metadata']['name']} selector does not match the pods")
        sp = {q["name"]: q for q in svc["spec"]["ports"]}
        if port_name not in sp or sp[port_name]["port"] != port or sp[port_name]["targetPort"] not in (port_name, port):
            fail(rel(p), f"Service {svc['metadata']['name']} must expose {port_name} {port}")

    # ServiceMonitor: selects the metrics Service only, on its metrics port, with job="fusedlayer".
    smpath, sm = objs[("ServiceMonitor", "fusedlayer")]
    sel = sm["spec"]["selector"]["matchLabels"]
    if not selects(sel, met_svc["metadata"]["labels"]):
        fail(rel(smpath), "selector does not match Service fusedlayer-metrics")
    if selects(sel, grpc_svc["metadata"]["labels"]):
        fail(rel(smpath), "selector also matches the gRPC Service (would scrape the gRPC port)")
    if [e.get("port") for e in sm["spec"]["endpoints"]] != ["metrics"]:
        fail(rel(smpath), "must scrape the metrics port only")
    job_label = sm["spec"].get("jobLabel")
    job = met_svc["metadata"]["labels"].get(job_label) if job_label else met_svc["metadata"]["name"]
    if job != SCRAPE_JOB:
        fail(rel(smpath), f"scraped series would carry job={job!r}; the rules expect job={SCRAPE_JOB!r}")

    # PDB selects the pods and leaves at least one replica.
    ppath, pdb = objs[("PodDisruptionBudget", "fusedlayer")]
    if not selects(pdb["spec"]["selector"]["matchLabels"], pod_labels):
        fail(rel(ppath), "selector does not match the pods")
    if pdb["spec"].get("maxUnavailable", 0) >= spec.get("replicas", 1) and "minAvailable" not in pdb["spec"]:
        fail(rel(ppath), "maxUnavailable would allow evicting every replica")

    check_network_policy(objs[("NetworkPolicy", "fusedlayer")], pod_labels)


def check_network_policy(obj, pod_labels):
    """The pods' ingress is restricted: the policy selects them, covers Ingress, and every rule names
    its peers and only the gRPC or metrics port (an empty `from` or no `ports` would allow all)."""
    npath, np = obj
    where = rel(npath)
    spec = np.get("spec", {})
    if not selects(spec.get("podSelector", {}).get("matchLabels", {}), pod_labels) or \
            not spec.get("podSelector", {}).get("matchLabels"):
        fail(where, "podSelector must select the fusedlayer pods (and only them)")
    if "Ingress" not in spec.get("policyTypes", []):
        fail(where, "policyTypes must include Ingress")
    rules = spec.get("ingress", [])
    open_ports = set()
    for i, rule in enumerate(rules):
        peers = rule.get("from") or []
        ports = rule.get("ports") or []
        if not peers or any(not p for p in peers):
            fail(where, f"ingress[{i}] has no peers: it would admit every source")
        for p in peers:
            if "ipBlock" in p and p["ipBlock"].get("cidr") in ("0.0.0.0/0", "::/0"):
                fail(where, f"ingress[{i}] admits the whole internet")
        if not ports:
            fail(where, f"ingress[{i}] names no port: it would open every port")
        for p in ports:
            port = p.get("port")
            if port not in (GRPC_PORT, METRICS_PORT, "grpc", "metrics"):
                fail(where, f"ingress[{i}] opens port {port}, not the gRPC or metrics port")
            open_ports.add({"grpc": GRPC_PORT, "metrics": METRICS_PORT}.get(port, port))
    if GRPC_PORT not in open_ports or METRICS_PORT not in open_ports:
        fail(where, f"ingress must admit clients to {GRPC_PORT} and Prometheus to {METRICS_PORT}")


def check_compose():
    where = rel(COMPOSE)
    doc = yaml.safe_load(COMPOSE.read_text())
    svcs = doc.get("services", {})
    for name in ("fusedlayer", "prometheus", "grafana"):
        if name not in svcs:
            fail(where, f"missing service {name}")
    if any(n not in svcs for n in ("fusedlayer", "prometheus", "grafana")):
        return
    fl = svcs["fusedlayer"]
    cmd = fl.get("command", [])
    if "--demo_weights" not in cmd:
        fail(where, "fusedlayer command must load --demo_weights")
    if not (flag_value(cmd, "metrics_address") or "").endswith(f":{METRICS_PORT}"):
        fail(where, f"fusedlayer --metrics_address must listen on {METRICS_PORT}")
    devs = fl.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if not any(d.get("driver") == "nvidia" and d.get("count") == 1 and "gpu" in d.get("capabilities", []) for d in devs):
        fail(where, "fusedlayer must reserve one nvidia GPU (deploy.resources.reservations.devices)")
    drain = float(flag_value(cmd, "drain_seconds") or 30)
    grace = fl.get("stop_grace_period", "10s")
    m = re.fullmatch(r"(\d+)s", str(grace))
    if not m or not int(m.group(1)) > drain:
        fail(where, f"stop_grace_period {grace} must exceed --drain_seconds {drain}")

    prom_cfg = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom_cfg["scrape_configs"]}
    if SCRAPE_JOB not in jobs:
        fail("deploy/prometheus/prometheus.yml", f"no scrape job {SCRAPE_JOB!r}")
    else:
        targets = [t for sc in jobs[SCRAPE_JOB].get("static_configs", []) for t in sc["targets"]]
        if targets != [f"fusedlayer:{METRICS_PORT}"]:
            fail("deploy/prometheus/prometheus.yml", f"job {SCRAPE_JOB} targets {targets} != fusedlayer:{METRICS_PORT}")

    # Every bind mount source exists in the repository, and the rules land where rule_files looks.
    for name, svc in svcs.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                if not (DEPLOY / src).exists():
                    fail(where, f"{name}: mount source {src} does not exist")
    prom_mounts = [v.split(":")[1] for v in svcs["prometheus"].get("volumes", []) if v.startswith("./prometheus/fusedlayer-rules.yml")]
    patterns = prom_cfg.get("rule_files", [])
    if not prom_mounts or not any(pathlib.PurePath(prom_mounts[0]).match(p) for p in patterns):
        fail(where, f"the rules file is not mounted where rule_files {patterns} looks")

    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    if ds["datasources"][0]["url"] != "http://prometheus:9090":
        fail("deploy/grafana/provisioning/datasources/prometheus.yml", "datasource url is not the compose Prometheus")
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/fusedlayer.yml").read_text())
    dash_dir = prov["providers"][0]["options"]["path"]
    if not any(v.startswith("./grafana/dashboards:") and v.split(":")[1] == dash_dir
               for v in svcs["grafana"].get("volumes", [])):
        fail(where, f"grafana does not mount deploy/grafana/dashboards at the provider path {dash_dir}")


def dashboard_exprs():
    """(panel title, refId, expr) for every query target of the dashboard, rows included."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p.get("title", "?"), t.get("refId", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return dash, out


def substitute(expr, rate_interval):
    """Grafana's variables replaced by what the dashboard would send with every value selected."""
    return (expr.replace("$__rate_interval", rate_interval)
                .replace("$job", ".+").replace("$instance", ".+"))


def check_dashboard(out_path):
    where = rel(DASHBOARD)
    try:
        dash, exprs = dashboard_exprs()
    except (ValueError, KeyError) as e:
        fail(where, f"does not parse: {e}")
        return
    if not exprs:
        fail(where, "no PromQL targets")
    ids = [p["id"] for p in dash["panels"]]
    if len(ids) != len(set(ids)):
        fail(where, "duplicate panel ids")
    text = json.dumps(dash)
    for metric in ("fusedlayer_op_executions_total", "fusedlayer_op_fallbacks_total",
                   "fusedlayer_fused_kernel_available", "fusedlayer_op_duration_seconds_bucket",
                   "fusedlayer_requests_total", "fusedlayer_inflight_requests",
                   "fusedlayer_weights_resident_bytes", "fusedlayer_build_info"):
        if metric not in text:
            fail(where, f"no panel uses {metric}")
    for title, ref, expr in exprs:
        # Every range selector is Grafana's $__rate_interval (at least 4 scrapes, follows zoom).
        for rng in re.findall(r"\[([^\]]*)\]", expr):
            if rng != "$__rate_interval":
                fail(where, f"panel {title!r} {ref}: range [{rng}] instead of [$__rate_interval]")
        leftover = re.findall(r"\$\{?\w+", substitute(expr, "5m"))
        if leftover:
            fail(where, f"panel {title!r} {ref}: unknown variable {leftover}")
    rules = [{"record": f"dashboard:panel_{i}:check", "expr": substitute(e, "5m")}
             for i, (_, _, e) in enumerate(exprs)]
    pathlib.Path(out_path).write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]},
                                                     sort_keys=False))
    print(f"{len(exprs)} dashboard expressions written to {out_path}")


def dockerfile_stages(text):
    """[(stage name, base image, [(instruction, argument text)])] with continuation lines joined."""
    lines = re.sub(r"\\\n", " ", text).splitlines()
    stages = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
            stages.append((m.group(2), m.group(1), []))
        elif stages:
            stages[-1][2].append((instr, rest.strip()))
    return stages


def check_dockerfile():
    where = "Dockerfile"
    text = (ROOT / "Dockerfile").read_text()
    stages = dockerfile_stages(text)
    names = [s[0] for s in stages]
    want = {"cpu-build": "debian:12", "cpu": "debian:12",
            "cuda-build": "nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04",
            "cuda": "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04"}
    for name, base in want.items():
        if name not in names:
            fail(where, f"no stage {name!r}")
        elif stages[names.index(name)][1] != base:
            fail(where, f"stage {name!r} is FROM {stages[names.index(name)][1]}, expected {base}")
    if not stages or names[-1] != "cuda":
        fail(where, "the last stage (docker build's default target) must be the CUDA runtime image 'cuda'")
    if not re.search(r"^ARG CUDA_VERSION=13\.0\.0$", text, re.M):
        fail(where, "ARG CUDA_VERSION=13.0.0 (the pinned CUDA tag) missing")
    for name, body in ((s[0], s[2]) for s in stages):
        for instr, arg in body:
            if instr == "COPY" and arg.startswith("--from="):
                src = arg.split()[0][len("--from="):]
                if src not in names[:names.index(name)]:
                    fail(where, f"stage {name!r} copies from {src!r}, not an earlier stage")
    builds = {"cpu-build": "-DFUSEDLAYER_CUDA=OFF", "cuda-build": "-DFUSEDLAYER_CUDA=ON"}
    for name, opt in builds.items():
        if name not in names:
            continue
        runs = " ".join(a for i, a in stages[names.index(name)][2] if i == "RUN")
        for needle in (opt, "--target fusedlayer_server fusedctl", "/build/server/fusedlayer_server",
                       "/build/client/fusedctl"):
            if needle not in runs:
                fail(where, f"stage {name!r} does not run {needle!r}")
        if name == "cuda-build" and '-DFUSEDLAYER_CUDA_ARCHS="${CUDA_ARCHS}"' not in runs:
            fail(where, "cuda-build does not pass -DFUSEDLAYER_CUDA_ARCHS=${CUDA_ARCHS}")
    for name in ("cpu", "cuda"):
        if name not in names:
            continue
        body = stages[names.index(name)][2]
        get = lambda i: [a for ins, a in body if ins == i]
        user = get("USER")
        if not user or not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user[-1]):
            fail(where, f"stage {name!r}: USER must be a numeric non-root uid (runAsNonRoot can verify it)")
        if get("EXPOSE") != [f"{GRPC_PORT} {METRICS_PORT}"]:
            fail(where, f"stage {name!r}: EXPOSE {get('EXPOSE')} != {GRPC_PORT} {METRICS_PORT}")
        hc = " ".join(get("HEALTHCHECK"))
        if f'"fusedctl", "health", "--target=127.0.0.1:{GRPC_PORT}"' not in hc:
            fail(where, f"stage {name!r}: HEALTHCHECK must run fusedctl health on 127.0.0.1:{GRPC_PORT}")
        if get("ENTRYPOINT") != ['["fusedlayer_server"]']:
            fail(where, f"stage {name!r}: ENTRYPOINT must be [\"fusedlayer_server\"]")
        runs = " ".join(get("RUN"))
        if "ldd /usr/local/bin/fusedlayer_server /usr/local/bin/fusedctl" not in runs:
            fail(where, f"stage {name!r}: no build-time ldd check of the binaries")
        if "-dev" in re.sub(r"/dev/\S*", "", runs):
            fail(where, f"stage {name!r}: installs a -dev package into a runtime image")


def print_probes():
    """The exec probe and HEALTHCHECK commands as shell lines (they name fusedctl by PATH)."""
    import shlex
    dep = k8s_objects()[("Deployment", "fusedlayer")][1]
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    if cmd[:2] != ["/bin/sh", "-c"]:
        raise SystemExit("readinessProbe is not /bin/sh -c")
    print(" ".join(cmd[2].split()))
    for m in re.finditer(r'HEALTHCHECK .*?CMD (\[.*?\])', re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())):
        print(shlex.join(json.loads(m.group(1))))


def print_flags():
    """Every --flag passed to fusedlayer_server by the deployment files."""
    names = set()
    for arg in yaml.safe_load(COMPOSE.read_text())["services"]["fusedlayer"].get("command", []):
        names.add(arg)
    dep = k8s_objects()[("Deployment", "fusedlayer")][1]
    for arg in dep["spec"]["template"]["spec"]["containers"][0].get("args", []):
        names.add(arg)
    for m in re.finditer(r'^CMD \[(.*)\]', (ROOT / "Dockerfile").read_text(), re.M):
        names.update(json.loads("[" + m.group(1) + "]"))
    for n in sorted({a.split("=", 1)[0][2:] for a in names if a.startswith("--")}):
        print(n)


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cmd = argv[1]
    if cmd == "yaml":
        n = check_yaml()
        if not errors:
            print(f"OK: {len(yaml_files())} YAML files ({n} documents) parse")
    elif cmd == "k8s":
        check_k8s()
        if not errors:
            print("OK: Kubernetes manifests are consistent (selectors, ports, probes, drain, hardening)")
    elif cmd == "compose":
        check_compose()
        if not errors:
            print("OK: docker-compose.yml wiring is consistent")
    elif cmd == "dashboard" and len(argv) == 3:
        check_dashboard(argv[2])
    elif cmd == "dockerfile":
        check_dockerfile()
        if not errors:
            print("OK: Dockerfile stages, base images, build options and runtime contract")
    elif cmd == "probes":
        print_probes()
    elif cmd == "flags":
        print_flags()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for e in errors:
        print(f"FAIL {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
