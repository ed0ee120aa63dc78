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
    check_manifests.py runtime-libs STAGE BUILD_DIR
                                   every shared library (readelf NEEDED) of BUILD_DIR's
                                   fusedlayer_server and fusedctl comes from the runtime stage
                                   STAGE's package list (cuda: Debian name or its Ubuntu t64 name),
                                   the base image, or the CUDA base image of CUDA_VERSION; the
                                   dlopen()ed cuBLASLt matches CUDA_VERSION and the stage checks it
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
# The images' listen address: read by the entrypoint and by the HEALTHCHECK (Dockerfile).
ADDRESS_ENV = "FUSEDLAYER_ADDRESS"
ENTRYPOINT_SCRIPT = ROOT / "scripts/container-entrypoint.sh"

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
    # The image's entrypoint takes the listen address from FUSEDLAYER_ADDRESS and refuses --address.
    if flag_value(args, "address") is not None:
        fail(where, "--address in args: the image refuses it; set the env FUSEDLAYER_ADDRESS")
    addr = {e.get("name"): e.get("value") for e in c.get("env", [])}.get(ADDRESS_ENV)
    maddr = flag_value(args, "metrics_address")
    if addr is None or not addr.endswith(f":{GRPC_PORT}"):
        fail(where, f"env {ADDRESS_ENV}={addr} does not listen on {GRPC_PORT}")
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


# The Compose specification's keys this file may use (a subset: a typo or an unsupported key fails).
COMPOSE_TOP_KEYS = {"name", "services", "volumes", "networks", "configs", "secrets"}
COMPOSE_SERVICE_KEYS = {
    "build", "image", "command", "entrypoint", "environment", "env_file", "ports", "expose", "volumes",
    "tmpfs", "deploy", "depends_on", "restart", "read_only", "cap_drop", "cap_add", "security_opt",
    "stop_grace_period", "stop_signal", "healthcheck", "user", "networks", "labels", "logging", "ulimits",
    "init", "working_dir", "container_name", "profiles", "shm_size", "mem_limit", "cpus", "gpus",
}
COMPOSE_BUILD_KEYS = {"context", "dockerfile", "target", "args", "labels", "cache_from", "network", "pull"}
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, ${VAR:+x}; $$ is a literal $.
COMPOSE_INTERPOLATION = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?:(?::?[-?+])[^}]*)?\}")


def compose_port(spec):
    """[IP:]HOST:CONTAINER[/tcp|udp] or CONTAINER -> (host port or None, container port), else None."""
    m = re.fullmatch(r"(?:(?:(\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]):)?(\d+):)?(\d+)(?:/(tcp|udp))?", str(spec))
    if not m:
        return None
    host, cont = (int(m.group(2)) if m.group(2) else None), int(m.group(3))
    if not 1 <= cont <= 65535 or (host is not None and not 1 <= host <= 65535):
        return None
    return host, cont


def check_compose_structure(doc, where):
    """What `docker compose config` would reject, plus references to files, stages and volumes."""
    if not isinstance(doc, dict):
        fail(where, "not a mapping")
        return
    for key in doc:
        if key not in COMPOSE_TOP_KEYS and not str(key).startswith("x-"):
            fail(where, f"unknown top-level key {key!r}")
    for bad in re.findall(r"\$\{[^}]*\}", COMPOSE.read_text()):
        if not COMPOSE_INTERPOLATION.fullmatch(bad):
            fail(where, f"malformed interpolation {bad}")
    svcs = doc.get("services")
    if not isinstance(svcs, dict) or not svcs:
        fail(where, "no services")
        return
    named_volumes = set((doc.get("volumes") or {}).keys())
    used_volumes = set()
    stages = {s[0] for s in dockerfile_stages((ROOT / "Dockerfile").read_text())}
    dockerfile_args = set(re.findall(r"^ARG ([A-Za-z_][A-Za-z0-9_]*)", (ROOT / "Dockerfile").read_text(), re.M))
    for name, svc in svcs.items():
        w = f"{where}: service {name}"
        if not isinstance(svc, dict):
            fail(w, "not a mapping")
            continue
        for key in svc:
            if key not in COMPOSE_SERVICE_KEYS:
                fail(w, f"unknown key {key!r}")
        if "image" not in svc and "build" not in svc:
            fail(w, "neither image nor build")
        if "image" in svc and not re.fullmatch(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]+)?(@sha256:[0-9a-f]{64})?",
                                               str(svc["image"])):
            fail(w, f"image {svc['image']!r} is not a valid reference")
        build = svc.get("build")
        if build is not None:
            build = {"context": build} if isinstance(build, str) else build
            for key in build:
                if key not in COMPOSE_BUILD_KEYS:
                    fail(w, f"unknown build key {key!r}")
            ctx = (DEPLOY / build.get("context", ".")).resolve()
            dockerfile = ctx / build.get("dockerfile", "Dockerfile")
            if not ctx.is_dir():
                fail(w, f"build context {build.get('context')} does not exist")
            elif not dockerfile.is_file():
                fail(w, f"build dockerfile {dockerfile} does not exist")
            elif dockerfile == ROOT / "Dockerfile":
                if "target" in build and build["target"] not in stages:
                    fail(w, f"build target {build['target']!r} is not a Dockerfile stage {sorted(stages)}")
                for arg in (build.get("args") or {}):
                    if arg not in dockerfile_args:
                        fail(w, f"build arg {arg} is not an ARG of the Dockerfile")
        for key in ("command", "entrypoint", "cap_drop", "cap_add", "security_opt", "tmpfs", "expose", "ports", "volumes"):
            if key in svc and not isinstance(svc[key], list):
                fail(w, f"{key} must be a list")
        for p in svc.get("ports", []) or []:
            if compose_port(p) is None:
                fail(w, f"port {p!r} is not [IP:]HOST:CONTAINER[/proto]")
        for p in svc.get("expose", []) or []:
            if compose_port(p) is None or compose_port(p)[0] is not None:
                fail(w, f"expose {p!r} is not a container port")
        env = svc.get("environment", {})
        if isinstance(env, list):
            if not all(isinstance(e, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(=.*)?", e) for e in env):
                fail(w, "environment entries must be NAME or NAME=value")
        elif not isinstance(env, dict) or not all(isinstance(v, (str, int, float, bool)) or v is None for v in env.values()):
            fail(w, "environment must be a mapping of scalars or a list")
        for vol in svc.get("volumes", []) or []:
            parts = str(vol).split(":")
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")) \
                    or not parts[1].startswith("/"):
                fail(w, f"volume {vol!r} is not SOURCE:/container/path[:ro|rw]")
                continue
            src = parts[0]
            if src.startswith((".", "/")):
                if not (DEPLOY / src).exists():
                    fail(w, f"bind mount source {src} does not exist")
            else:
                used_volumes.add(src)
                if src not in named_volumes:
                    fail(w, f"named volume {src} is not declared under the top-level volumes")
        deps = svc.get("depends_on", [])
        for dep in (deps if isinstance(deps, list) else list(deps)):
            if dep not in svcs:
                fail(w, f"depends_on {dep!r}, which is not a service")
            elif dep == name:
                fail(w, "depends on itself")
        grace = svc.get("stop_grace_period")
        if grace is not None and not re.fullmatch(r"(\d+(\.\d+)?(us|ms|s|m|h))+", str(grace)):
            fail(w, f"stop_grace_period {grace!r} is not a duration")
    for vol in named_volumes - used_volumes:
        fail(where, f"top-level volume {vol} is used by no service")


def check_compose():
    where = rel(COMPOSE)
    doc = yaml.safe_load(COMPOSE.read_text())
    check_compose_structure(doc, where)
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        return
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
    # The listen address goes through the environment (the image's entrypoint refuses --address).
    if flag_value(cmd, "address") is not None:
        fail(where, "fusedlayer command passes --address: the image refuses it; set environment FUSEDLAYER_ADDRESS")
    env = fl.get("environment", {})
    env = dict(e.split("=", 1) for e in env if "=" in e) if isinstance(env, list) else env
    if not str(env.get(ADDRESS_ENV, "")).endswith(f":{GRPC_PORT}"):
        fail(where, f"fusedlayer environment {ADDRESS_ENV} must listen on {GRPC_PORT}")
    if not any((compose_port(p) or (0, 0))[1] == GRPC_PORT for p in fl.get("ports", [])):
        fail(where, f"fusedlayer does not publish the gRPC port {GRPC_PORT}")
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
    # Every base image is a build argument (a mirror or a digest-pinned base can be used) whose
    # default is the tag the images are tested with.
    want = {"cpu-build": "${DEBIAN_IMAGE}", "cpu": "${DEBIAN_IMAGE}", "grpc-proto": "${DEBIAN_IMAGE}",
            "cuda-build": "${CUDA_DEVEL_IMAGE}", "cuda": "${CUDA_RUNTIME_IMAGE}"}
    arg_defaults = {"DEBIAN_IMAGE": "debian:12",
                    "CUDA_DEVEL_IMAGE": "nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04",
                    "CUDA_RUNTIME_IMAGE": "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04"}
    preamble = text.split("\nFROM ", 1)[0]
    for arg, default in arg_defaults.items():
        if not re.search(rf"^ARG {re.escape(arg)}={re.escape(default)}$", preamble, re.M):
            fail(where, f"global ARG {arg}={default} (before the first FROM) missing")
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
        # The HEALTHCHECK and the entrypoint read the same variable, so the probe follows the port.
        if f"{ADDRESS_ENV}=0.0.0.0:{GRPC_PORT}" not in get("ENV"):
            fail(where, f"stage {name!r}: no ENV {ADDRESS_ENV}=0.0.0.0:{GRPC_PORT}")
        hc = get("HEALTHCHECK")
        hc_cmd = re.search(r"\bCMD (\[.*\])$", hc[-1]) if hc else None
        want_hc = ["/bin/sh", "-c", f'exec fusedctl health --target="127.0.0.1:${{{ADDRESS_ENV}##*:}}" --deadline=2s']
        if not hc_cmd or json.loads(hc_cmd.group(1)) != want_hc:
            fail(where, f"stage {name!r}: HEALTHCHECK CMD must be {json.dumps(want_hc)} "
                        f"(fusedctl health on the port of {ADDRESS_ENV})")
        if get("ENTRYPOINT") != ['["fusedlayer-entrypoint"]']:
            fail(where, f"stage {name!r}: ENTRYPOINT must be [\"fusedlayer-entrypoint\"]")
        if "scripts/container-entrypoint.sh /usr/local/bin/fusedlayer-entrypoint" not in get("COPY"):
            fail(where, f"stage {name!r}: does not install scripts/container-entrypoint.sh as fusedlayer-entrypoint")
        if any("--address=" in c for c in get("CMD")):
            fail(where, f"stage {name!r}: CMD passes --address, which the entrypoint refuses")
        runs = " ".join(get("RUN"))
        if "ldd /usr/local/bin/fusedlayer_server /usr/local/bin/fusedctl" not in runs:
            fail(where, f"stage {name!r}: no build-time ldd check of the binaries")
        if "-dev" in re.sub(r"/dev/\S*", "", runs):
            fail(where, f"stage {name!r}: installs a -dev package into a runtime image")


# Provided by every Debian/Ubuntu base image (apt itself needs them), so never in a stage's list.
BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}
# Shared libraries of the CUDA toolkit: the CUDA runtime base image provides them (cudart, cuBLAS,
# ...) or the NVIDIA Container Toolkit mounts them at run time (libcuda.so.1, the driver).
CUDA_LIB = re.compile(r"lib(cuda|cudart|cublas|cublasLt|nvrtc|nvJitLink|cufft|curand|cusparse|cusolver|nvToolsExt)\.so(\.\d+)*")
# Every dlopen() in the sources and the library it loads; a new dlopen fails the check until its
# library is added to the runtime stages and here.
DLOPENED = {"kernels/gpu/cublaslt_loader.cc": "libcublasLt.so.<CUBLAS_VER_MAJOR>",
            # cuMemGetAddressRange for CUDA IPC bounds: the driver, mounted at run time by the NVIDIA
            # Container Toolkit (the CUDA stage's ldd check exempts it, checked below).
            "kernels/gpu/gpu_backend.cc": "libcuda.so.1"}


def stage_apt_packages(stage_body):
    """Package names of the `apt-get install` in a stage's RUN instructions."""
    pkgs = []
    for instr, arg in stage_body:
        if instr != "RUN":
            continue
        for m in re.finditer(r"apt-get install ((?:(?!&&).)*)", arg):
            pkgs += [t for t in m.group(1).split() if not t.startswith("-") and "$" not in t]
    return pkgs


def needed_sonames(binary):
    import subprocess
    out = subprocess.run(["readelf", "-d", str(binary)], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def host_package_of(soname):
    """The Debian package that installed soname on this host (via ldconfig's cache), or None."""
    import os
    import subprocess
    cache = subprocess.run(["/sbin/ldconfig", "-p"], check=True, capture_output=True, text=True).stdout
    paths = re.findall(rf"^\s+{re.escape(soname)} \(.*?\) => (\S+)$", cache, re.M)
    for path in paths:
        cands = {path, os.path.realpath(path)}
        cands |= {c.replace("/usr/lib/", "/lib/", 1) for c in cands if c.startswith("/usr/lib/")}
        cands |= {c.replace("/lib/", "/usr/lib/", 1) for c in cands if c.startswith("/lib/")}
        for c in sorted(cands):
            r = subprocess.run(["dpkg", "-S", c], capture_output=True, text=True)
            if r.returncode == 0:
                return r.stdout.split(":", 1)[0].strip()
    return None


def check_runtime_libs(stage, build_dir):
    """Every shared library the binaries of BUILD_DIR need comes from the runtime stage's package
    list (Debian name, or its Ubuntu 24.04 `t64` name in the CUDA stage), the base image, or (CUDA
    stage) the CUDA base image of CUDA_VERSION; every dlopen()ed library is checked in the stage."""
    where = "Dockerfile"
    text = (ROOT / "Dockerfile").read_text()
    stages = {s[0]: s[2] for s in dockerfile_stages(text)}
    if stage not in stages:
        fail(where, f"no stage {stage!r}")
        return
    body = stages[stage]
    listed = set(stage_apt_packages(body))
    if not listed:
        fail(where, f"stage {stage!r} installs no packages")
    build_dir = pathlib.Path(build_dir)
    binaries = [build_dir / "server/fusedlayer_server", build_dir / "client/fusedctl"]
    cuda_major = re.search(r"^ARG CUDA_VERSION=(\d+)\.", text, re.M).group(1)
    checked = 0
    for binary in binaries:
        if not binary.is_file():
            fail(rel(binary) if binary.is_relative_to(ROOT) else str(binary), "missing (build it first)")
            continue
        for so in needed_sonames(binary):
            checked += 1
            what = f"stage {stage!r}: {binary.name} needs {so}"
            if CUDA_LIB.fullmatch(so):
                if stage != "cuda":
                    fail(where, f"{what}, a CUDA library, in a non-CUDA image")
                elif so == "libcuda.so.1":
                    if "grep -v 'libcuda\\.so\\.1'" not in " ".join(a for i, a in body if i == "RUN"):
                        fail(where, f"{what} (the driver): the stage's ldd check must exempt it")
                elif so.startswith("libcublasLt"):
                    fail(where, f"{what}: cuBLASLt must stay dlopen()ed (kernels/gpu/cublaslt_loader.cc), not linked")
                elif not re.fullmatch(rf"lib\w+\.so\.{cuda_major}(\.\d+)*", so):
                    fail(where, f"{what}: not of CUDA {cuda_major} (ARG CUDA_VERSION), so the CUDA runtime image lacks it")
                continue
            pkg = host_package_of(so)
            if pkg is None:
                fail(where, f"{what}: no Debian package on this host provides it (cannot map it to a package)")
            elif pkg in BASE_IMAGE_PACKAGES:
                continue
            elif not (pkg in listed or (stage == "cuda" and f"{pkg}t64" in listed)):
                alt = f" or {pkg}t64 (Ubuntu 24.04)" if stage == "cuda" else ""
                fail(where, f"{what} (Debian package {pkg}): {pkg}{alt} is not in the stage's apt-get install list")
    # dlopen(): every call in the sources is one this check knows, and its library is checked in the stage.
    for src in sorted(p for d in ("kernels", "server", "client") for p in (ROOT / d).rglob("*")
                      if p.suffix in (".cc", ".cu", ".h", ".cuh") and "dlopen(" in p.read_text(errors="replace")):
        if rel(src) not in DLOPENED:
            fail(rel(src), "calls dlopen(): add its library to the runtime stages and to DLOPENED in this check")
    if stage == "cuda":
        if "grep -v 'libcuda\\.so\\.1'" not in " ".join(a for i, a in body if i == "RUN"):
            fail(where, "stage 'cuda': kernels/gpu/gpu_backend.cc dlopens libcuda.so.1 (the driver): the stage's "
                 "ldd check must exempt it")
        loader = (ROOT / "kernels/gpu/cublaslt_loader.cc").read_text()
        if 'StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR)' not in loader:
            fail("kernels/gpu/cublaslt_loader.cc", "no longer dlopens libcublasLt.so.<CUBLAS_VER_MAJOR>: update this check")
        header = cublas_header(build_dir)
        major = re.search(r"^#define CUBLAS_VER_MAJOR (\d+)", header.read_text(), re.M).group(1) if header else None
        if major is None:
            fail(str(build_dir), "cannot find cublas_api.h of the CUDA toolkit the build used "
                 "(ninja -t deps, CMakeCache.txt, CMakeCUDACompiler.cmake)")
        elif major != cuda_major:
            fail(where, f"the build dlopens libcublasLt.so.{major} but ARG CUDA_VERSION is {cuda_major}.x")
        if 'ldconfig -p | grep -q "libcublasLt\\.so\\.${CUDA_VERSION%%.*} "' not in " ".join(a for i, a in body if i == "RUN"):
            fail(where, "stage 'cuda' does not check (ldconfig -p) that libcublasLt.so.<CUDA major> is present")
    return checked


def cublas_header(build_dir):
    """cublas_api.h of the toolkit the build in BUILD_DIR compiled against.

    First the header the compiler itself read (ninja's dependency log: exact, whatever the toolkit's
    layout), then the toolkit folders CMake recorded (CMakeCache.txt, CMakeCUDACompiler.cmake) and the
    folder of the real nvcc behind any symlink, each with its targets/<arch>/include."""
    import subprocess
    build_dir = pathlib.Path(build_dir)
    if (build_dir / "build.ninja").is_file():
        try:
            deps = subprocess.run(["ninja", "-C", str(build_dir), "-t", "deps"], capture_output=True,
                                  text=True, timeout=120).stdout
        except (OSError, subprocess.TimeoutExpired):
            deps = ""
        for line in deps.splitlines():
            h = pathlib.Path(line.strip())
            if h.name == "cublas_api.h" and h.is_file():
                return h
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return None
    texts = [cache.read_text()] + [f.read_text() for f in build_dir.glob("CMakeFiles/*/CMakeCUDACompiler.cmake")]
    roots = []
    for text in texts:
        roots += re.findall(r"^CUDAToolkit_\w*INCLUDE_DIR(?::\w+)?=(.+)$", text, re.M)
        roots += re.findall(r"^FIND_PACKAGE_MESSAGE_DETAILS_CUDAToolkit:INTERNAL=\[([^\]]+)\]", text, re.M)
        roots += [d for v in re.findall(r'^set\(CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES "([^"]*)"\)', text, re.M)
                  for d in v.split(";")]
        roots += [str(pathlib.Path(r) / "include")
                  for r in re.findall(r'^set\(CMAKE_CUDA_COMPILER_TOOLKIT_ROOT "([^"]+)"\)', text, re.M)]
        for n in re.findall(r"^CMAKE_CUDA_COMPILER(?::\w+)?=(.+)$", text, re.M):
            for nvcc in {pathlib.Path(n.strip()), pathlib.Path(n.strip()).resolve()}:
                roots.append(str(nvcc.parent.parent / "include"))
    for d in roots:
        d = pathlib.Path(d.strip())
        for inc in [d] + sorted(d.parent.glob("targets/*/include")):
            h = inc / "cublas_api.h"
            if h.is_file():
                return h
    return None


def print_probes():
    """The exec probe and HEALTHCHECK commands as shell lines (they name fusedctl by PATH)."""
    import shlex
    dep = k8s_objects()[("Deployment", "fusedlayer")][1]
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    if cmd[:2] != ["/bin/sh", "-c"]:
        raise SystemExit("readinessProbe is not /bin/sh -c")
    print(" ".join(cmd[2].split()))
    # They read FUSEDLAYER_ADDRESS: run them with it set to the test server's address.
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
    # The images' entrypoint adds --address=$FUSEDLAYER_ADDRESS.
    names.update(re.findall(r"(?<![\w-])(--[a-z_]+)=", ENTRYPOINT_SCRIPT.read_text()))
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
    elif cmd == "runtime-libs" and len(argv) == 4:
        n = check_runtime_libs(argv[2], argv[3])
        if not errors:
            print(f"OK: the {n} NEEDED entries of the binaries in {argv[3]} come from the package list of stage {argv[2]!r}, "
                  "its base image or the CUDA base image; dlopen()ed libraries checked")
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
