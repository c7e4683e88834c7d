"""The deployment checks of scripts/deploy-checks.sh (run with the tools' venv Python).

Renders the Helm chart with the real Helm engine (helm-python-sdk) for every values file
in helm/tally/ci/ and lints it; validates every rendered object (kubernetes-validate
--strict; KEDA and Prometheus Operator objects against their CRD schemas); renders every values file in
helm/tally/tests/refused/ and requires the failure its `# expect:` line names; renders a
queues-only upgrade and requires that no service's pod template changes; runs
`docker compose config` on docker-compose.yml; checks the files against each other (the
image, ports and listeners, queues, volumes, KEDA); and feeds every container's config
and environment to `tally config check`.

Prints every failure and closes with `deploy: N passed, N failed`; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tally"
CACHE = Path(os.environ.get("TALLY_DEPLOY_CACHE", Path.home() / ".cache" / "tally"))
VENV = CACHE / "deploy-venv"
NPM = CACHE / "deploy-npm"
# The Kubernetes versions manifests must be valid for: the chart's kubeVersion floor
# and the newest kubernetes-validate knows.
KUBE_VERSIONS = ["1.25.0", "1.37.0"]
# A Docker daemon that is not there: `docker compose config` must not need one.
NO_DOCKER = "tcp://127.0.0.1:1"

# What each tally binary listens on: container port name → config key of its section.
LISTENERS = {
    "ingester": {"admin": "admin_listen"},
    "counter": {"admin": "admin_listen", "read": "read_listen"},
    "graph": {"admin": "admin_listen", "read": "read_listen"},
    "query": {"http": "listen", "admin": "admin_listen"},
    "broker": {"http": "listen", "admin": "admin_listen"},
    "worker": {"admin": "admin_listen"},
}
# Stand-ins for values only a cluster or a container runtime knows.
POD_IP = "10.1.2.3"
CONTAINER_IP = "172.18.0.5"
# librdkafka settings whose value is a secret: never in a ConfigMap (the chart refuses
# them in kafka.client; they come from Secrets as TALLY__KAFKA__CLIENT__<NAME>).
SECRET_CLIENT_KEY = re.compile(r"password|secret|^ssl\.key\.pem$", re.I)
# The long-running services of the chart (pod template label app.kubernetes.io/component).
SERVICES = ("ingester", "counter", "graph", "query", "broker")
# The values a queues-only upgrade starts from: several queues, one rate-limited, with workers.
QUEUES_BASE = CHART / "ci" / "queues-values.yaml"
# The binaries that talk to Kafka: all but the workers, which only talk to the brokers.
NO_KAFKA = {"tally-worker"}
# The binaries that take and restore snapshots: the only ones given the S3 credentials
# (AWS_* variables from snapshots.credentialsSecret; never in the ConfigMap).
SNAPSHOTTERS = {"tally-counter", "tally-graph"}
# The base image's libraries (debian:bookworm-slim); everything else the binaries link
# must come from a package the runtime stage installs (or one of its dependencies).
BASE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libzstd1", "liblzma5", "libbz2-1.0"}


class Report:
    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.passed = 0
        self.failures: list[str] = []
        self.skips: list[str] = []

    def section(self, title: str) -> None:
        print(f"==> {title}", flush=True)

    def check(self, name: str, ok: bool, why: str = "") -> bool:
        if ok:
            self.passed += 1
            if self.verbose:
                print(f"  ok    {name}")
        else:
            self.failures.append(f"{name}: {why}")
            print(f"  FAIL  {name}: {why}", flush=True)
        return ok

    def skip(self, what: str) -> None:
        self.skips.append(what)
        print(f"  SKIP  {what}", flush=True)


# ---------------------------------------------------------------- the files themselves


def dockerfile_facts() -> dict:
    """The Dockerfile's stages: packages installed, directories made and owned, USER."""
    text = (ROOT / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    stages: list[dict] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stages.append({"from": rest, "packages": set(), "dirs": set(), "owned": set(), "user": None, "copies": []})
            continue
        if not stages:
            continue
        stage = stages[-1]
        if word == "RUN":
            for command in re.split(r"&&|;", rest):
                words = shlex.split(command, comments=False) if command.strip() else []
                if "apt-get" in words and "install" in words:
                    stage["packages"] |= {w for w in words[words.index("install") + 1 :] if not w.startswith("-")}
                if words[:1] == ["mkdir"]:
                    stage["dirs"] |= {w for w in words[1:] if not w.startswith("-")}
                if words[:1] == ["chown"]:
                    args = [w for w in words[1:] if not w.startswith("-")]
                    stage["owned"] |= {(args[0], p, "-R" in words) for p in args[1:]}
                if words[:1] == ["cp"]:
                    stage["copies"] += [w for w in words[1:] if not w.startswith("-")]
        elif word == "USER":
            stage["user"] = rest.strip()
    return {"stages": stages, "text": text}


def common_build_packages() -> list[str]:
    """The packages scripts/common.sh installs for a build."""
    text = (ROOT / "scripts" / "common.sh").read_text()
    match = re.search(r"local packages=\(([^)]*)\)", text)
    if not match:
        return []
    return [p for p in shlex.split(match.group(1)) if not p.startswith("$")]


def workspace_bins() -> set[str]:
    bins = set()
    for cargo in ROOT.glob("services/*/Cargo.toml"):
        data = tomllib.loads(cargo.read_text())
        bins |= {b["name"] for b in data.get("bin", [])}
    return bins


def workspace_version() -> str:
    return tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]


def builtin_declarations() -> dict:
    return tomllib.loads((ROOT / "topics" / "topics.toml").read_text())


def example_config() -> dict:
    return tomllib.loads((ROOT / "tally.example.toml").read_text())


def limits_problems(limits: dict, partitions: int) -> list[str]:
    """A queue's [queue.limits] as tally's loader checks it (core/src/jobs/limits.rs)."""
    problems = []
    unknown = set(limits) - {"per_key", "total", "key_field", "at_limit", "overrides"}
    if unknown:
        problems.append(f"limits: unknown keys {sorted(unknown)}")
    overrides = limits.get("overrides", [])
    per_keys = [limits.get("per_key", 1)] + [o.get("per_key") for o in overrides]
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in per_keys):
        problems.append("limits: per_key must be an integer of at least 1")
    if any(set(o) != {"pattern", "per_key"} or not 1 <= len(str(o["pattern"])) <= 256 for o in overrides):
        problems.append("limits: an override is a pattern (1-256 bytes) and a per_key")
    total = limits.get("total")
    if total is not None and (not isinstance(total, int) or total < max(1, partitions)):
        problems.append(f"limits: total must be at least the queue's partitions ({partitions})")
    if limits.get("at_limit", "wait") not in ("wait", "drop_newest", "cancel_in_progress"):
        problems.append("limits: at_limit must be wait, drop_newest or cancel_in_progress")
    if limits.get("at_limit", "wait") != "wait" and "per_key" not in limits and not overrides:
        problems.append("limits: drop_newest and cancel_in_progress need a per-key limit")
    return problems


def check_queue_file(report: Report, where: str, text: str) -> list[str]:
    """A declarations file as tally's loader takes it (shared/src/topics.rs); returns
    the queue names it declares."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        report.check(f"{where}: queues file is TOML", False, str(err))
        return []
    report.check(f"{where}: queues file holds only [[topic]] and [[queue]]", set(data) <= {"topic", "queue"}, f"keys {sorted(data)}")
    ints = {"partitions", "max_attempts", "backoff_ms", "backoff_max_ms", "lease_ms", "buffer", "delayed_buffer",
            "buffer_bytes", "retention_ms", "rate_limit_per_sec", "priority_levels", "priority_aging_ms",
            "wait_slo_ms", "unique_for_ms", "max_lease_ms", "max_retry_ms", "debounce_ms"}
    names = []
    for i, q in enumerate(data.get("queue", [])):
        name = q.get("name")
        # The values of these are checked by tally's own loader (`tally config check`).
        unknown = set(q) - ints - {"name", "fifo", "limits", "on_duplicate", "schedule"}
        problems = []
        if unknown:
            problems.append(f"unknown keys {sorted(unknown)}")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_-]{1,64}", name):
            problems.append(f"name {name!r} must match [a-z0-9_-]{{1,64}}")
        if "partitions" not in q:
            problems.append("partitions is required")
        for key in ints & set(q):
            if not isinstance(q[key], int) or isinstance(q[key], bool):
                problems.append(f"{key} = {q[key]!r} is not an integer")
        if "fifo" in q and not isinstance(q["fifo"], bool):
            problems.append("fifo is not a boolean")
        if not problems:
            if q["partitions"] < 1:
                problems.append("partitions must be at least 1")
            if q.get("lease_ms", 30000) < 1 or q.get("backoff_ms", 1000) < 0 or q.get("backoff_max_ms", 300000) < q.get("backoff_ms", 1000):
                problems.append("lease_ms must be positive, 0 <= backoff_ms <= backoff_max_ms")
            if q.get("rate_limit_per_sec") == 0:
                problems.append("rate_limit_per_sec must be at least 1")
            if not 1 <= q.get("priority_levels", 1) <= 10 or q.get("priority_aging_ms", 60000) < 0:
                problems.append("priority_levels must be 1 to 10, priority_aging_ms not negative")
            if q.get("wait_slo_ms", 300000) < 1:
                problems.append("wait_slo_ms must be at least 1")
            problems += limits_problems(q.get("limits", {}), q["partitions"])
        report.check(f"{where}: queue {i} ({name}) is a valid declaration", not problems, "; ".join(problems))
        names.append(name)
    report.check(f"{where}: queue names are distinct", len(names) == len(set(names)), f"{names}")
    return names


def effective(section: str, key: str, toml: dict, env: dict, defaults: dict):
    """A setting as tally resolves it: TALLY__SECTION__KEY, else the file, else the default."""
    var = f"TALLY__{section.upper()}__{key.upper()}"
    if var in env:
        return env[var]
    if key in toml.get(section, {}):
        return toml[section][key]
    return defaults.get(section, {}).get(key)


def port_of(listen) -> int | None:
    m = re.search(r":(\d+)$", str(listen or ""))
    return int(m.group(1)) if m else None


def is_loopback(listen) -> bool:
    host = str(listen or "").rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


# ----------------------------------------------------------------------- tally config check


class ConfigCheck:
    """`tally config check` on a config file and an environment, as a container has them."""

    def __init__(self, report: Report):
        self.report = report
        self.binary = None
        self.reason = ""
        candidates = [os.environ.get("TALLY_BIN")] if os.environ.get("TALLY_BIN") else []
        candidates += [ROOT / "target" / "debug" / "tally", ROOT / "target" / "release" / "tally"]
        for c in candidates:
            if c and Path(c).is_file() and os.access(c, os.X_OK):
                self.binary = str(c)
                break
        if not self.binary:
            self.reason = "no tally binary (target/debug/tally, target/release/tally or $TALLY_BIN): build it first"
            return
        probe = subprocess.run([self.binary, "config", "check", "--help"], capture_output=True, text=True,
                               env={"PATH": os.environ.get("PATH", "")})
        if probe.returncode != 0:
            self.reason = f"{self.binary} has no `config check` subcommand yet ({probe.stderr.strip().splitlines()[0] if probe.stderr.strip() else 'exit ' + str(probe.returncode)})"
            self.binary = None

    def run(self, name: str, config: Path | None, env: dict, expect: dict, secrets: list[str]) -> dict | None:
        """Returns the effective config the command printed, when it ran and printed one."""
        if not self.binary:
            return None
        command = [self.binary, "config", "check"] + (["--config", str(config)] if config else [])
        clean = {k: v for k, v in env.items() if k != "TALLY_CONFIG"}
        clean["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        result = subprocess.run(command, capture_output=True, text=True, env=clean, timeout=60)
        shown = " ".join(f"{k}={v!r}" for k, v in sorted(env.items()) if k.startswith("TALLY"))
        ok = self.report.check(f"config check: {name}", result.returncode == 0,
                               f"exit {result.returncode}: {(result.stderr or result.stdout).strip()[-600:]}\n"
                               f"        ran: {' '.join(command)} with {shown}")
        if not ok:
            return None
        # A token printed in clear would be a TOML string holding it.
        leaked = [s for s in secrets if s and (json.dumps(s) in result.stdout or f"'{s}'" in result.stdout)]
        self.report.check(f"config check: {name}: secrets redacted", not leaked, "printed a secret (token or password) in clear")
        # The effective config (TOML after comment lines) says what the service will use.
        try:
            shown_config = tomllib.loads(result.stdout)
        except tomllib.TOMLDecodeError:
            return None
        for dotted, want in expect.items():
            # "kafka.client" and a librdkafka name with dots: ("kafka", "client", "sasl.password").
            parts = dotted if isinstance(dotted, tuple) else tuple(dotted.split("."))
            got = shown_config
            for part in parts:
                got = got.get(part) if isinstance(got, dict) else None
            label = ".".join(parts[:2] + (f'"{parts[2]}"',)) if isinstance(dotted, tuple) else dotted
            self.report.check(f"config check: {name}: {label} = {want!r}", got == want and type(got) is type(want),
                              f"the effective config has {got!r}")
        return shown_config


# ------------------------------------------------------------------------------- Helm


def render(chart, values: dict, release: str, upgrade: bool = False):
    """The chart's objects for `values`: as `helm install` renders them, or as a
    `helm upgrade` to revision 2 does."""
    if upgrade:
        manifests = chart.render(values, name=release, namespace="tally", revision=2, is_upgrade=True)
    else:
        manifests = chart.render(values, name=release, namespace="tally", revision=1, is_install=True)
    objects = []
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt") or not text.strip():
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append((template, doc))
    return objects


def values_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.yaml") if p.is_file())


def pod_spec(obj: dict) -> dict | None:
    if obj.get("kind") in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return obj["spec"]["template"]["spec"]
    return None


def volume_configmaps(volume: dict) -> list[str]:
    """The ConfigMaps a pod volume shows: a configMap volume's, a projected volume's sources."""
    if "configMap" in volume:
        return [volume["configMap"]["name"]]
    return [s["configMap"]["name"] for s in (volume.get("projected") or {}).get("sources", []) if "configMap" in s]


def volume_secrets(volume: dict) -> list[str]:
    """The Secrets a pod volume shows: a secret volume's, a projected volume's sources."""
    if "secret" in volume:
        return [volume["secret"]["secretName"]]
    return [s["secret"]["name"] for s in (volume.get("projected") or {}).get("sources", []) if "secret" in s]


def client_var(setting: str) -> str:
    """The variable that sets a librdkafka setting: sasl.password → TALLY__KAFKA__CLIENT__SASL_PASSWORD."""
    return "TALLY__KAFKA__CLIENT__" + setting.upper().replace(".", "_")


def user_secrets(values: dict) -> dict[str, set[str]]:
    """The Secrets the values say the user made, and the keys the chart reads from them."""
    auth = values.get("auth") or {}
    kafka = values.get("kafka") or {}
    sasl = kafka.get("sasl") or {}
    made: dict[str, set[str]] = {}
    if auth.get("existingSecret"):
        defaults = {"reader": "reader-token", "worker": "worker-token", "operator": "operator-token", "cluster": "cluster-token"}
        made.setdefault(auth["existingSecret"], set()).update(
            k for k in (auth.get(f"{role}TokenKey", key) for role, key in defaults.items()) if k)
    if sasl.get("existingSecret"):
        made.setdefault(sasl["existingSecret"], set()).add(sasl.get("passwordKey", "sasl-password"))
    if kafka.get("tlsSecret"):
        made.setdefault(kafka["tlsSecret"], set()).update(k for k in [kafka.get("tlsKeyPasswordKey")] if k)
    for name, keys in s3_credentials(values).items():
        made.setdefault(name, set()).update(keys.values())
    return made


def s3_credentials(values: dict) -> dict[str, dict[str, str]]:
    """The snapshot store's credentials the values ask for: Secret → {variable: key}."""
    snap = values.get("snapshots") or {}
    if not (snap.get("url") and snap.get("credentialsSecret")):
        return {}
    keys = {"AWS_ACCESS_KEY_ID": snap.get("accessKeyIdKey", "AWS_ACCESS_KEY_ID"),
            "AWS_SECRET_ACCESS_KEY": snap.get("secretAccessKeyKey", "AWS_SECRET_ACCESS_KEY"),
            "AWS_SESSION_TOKEN": snap.get("sessionTokenKey", "")}
    return {snap["credentialsSecret"]: {var: key for var, key in keys.items() if key}}


def resolve_env(container: dict, secrets: dict, external: dict) -> tuple[dict, list[str]]:
    """A container's environment as Kubernetes would give it; and the secret values in it."""
    env: dict[str, str] = {}
    secret_values = []
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            value = str(item["value"])
            # $(VAR) refers to a variable defined before; $$( escapes.
            value = re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)
            env[name] = value.replace("$$(", "$(")
        elif "valueFrom" in item:
            source = item["valueFrom"]
            if "fieldRef" in source:
                env[name] = POD_IP if source["fieldRef"]["fieldPath"] == "status.podIP" else "stand-in"
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                if (ref["name"], ref["key"]) in secrets:
                    env[name] = secrets[(ref["name"], ref["key"])]
                else:
                    # A stand-in for a value of the user's Secret, all digits as a password or a
                    # token may be (20 digits: tokens have at least 16 bytes).
                    env[name] = external.get(ref["name"], {}).get(ref["key"], str(int(hashlib.sha256(f"{ref['name']}/{ref['key']}".encode()).hexdigest(), 16) % 10**20).zfill(20))
                secret_values.append(env[name])
            else:
                env[name] = "stand-in"
    return env, secret_values


def check_chart(report: Report, config_check: ConfigCheck, work: Path) -> None:
    import helm_python as helm

    docker = dockerfile_facts()
    runtime = docker["stages"][-1]
    uid, _, gid = (runtime["user"] or "").partition(":")
    defaults = example_config()
    builtin_queues = {q["name"] for q in builtin_declarations().get("queue", [])}
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())

    report.section("Helm chart: metadata")
    report.check("Chart.yaml appVersion is the workspace version (the default image tag)",
                 str(chart_meta.get("appVersion")) == workspace_version(),
                 f"appVersion {chart_meta.get('appVersion')} vs Cargo.toml {workspace_version()}")
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    shards = re.search(r'define "tally.shards" -\}\}(\d+)', helpers)
    shard_topic = next((t for t in builtin_declarations()["topic"] if t["name"] == "shards"), {})
    report.check("the chart's shard count is the shards topic's partitions (topics/topics.toml)",
                 bool(shards) and int(shards.group(1)) == shard_topic.get("partitions"),
                 f"chart {shards and shards.group(1)} vs topics.toml {shard_topic.get('partitions')}")

    all_objects: list[tuple[str, str, dict]] = []  # (case, template, object)
    for values_path in values_files(CHART / "ci"):
        case = values_path.name
        report.section(f"Helm chart: {case}")
        text = values_path.read_text()
        values = yaml.safe_load(text) or {}
        release = (re.search(r"^# release: (\S+)", text, re.M) or [None, "tally"])[1]
        lint = helm.lint(str(CHART), values, strict=True, namespace="tally")
        problems = [m for m in lint.get("messages", []) if m.get("severity", 0) >= 2] + [{"error": e} for e in lint.get("errors", [])]
        report.check(f"{case}: helm lint --strict", not problems, "; ".join(str(m.get("error")).strip() for m in problems))
        try:
            with helm.Chart.load(str(CHART)) as chart:
                objects = render(chart, values, release)
        except Exception as err:  # noqa: BLE001 - any render failure is the finding
            report.check(f"{case}: renders", False, str(err).strip())
            continue
        report.check(f"{case}: renders", True)
        for template, obj in objects:
            all_objects.append((case, template, obj))
        check_rendered(report, config_check, work / case, case, values, objects, uid, gid, defaults, builtin_queues)

    report.section("Helm chart: a queues-only upgrade restarts no service")
    check_queues_only_upgrade(report, helm)

    report.section("Helm chart: rendered objects against the Kubernetes, KEDA and Prometheus Operator schemas")
    validate_objects(report, work, all_objects)

    report.section("Helm chart: values that must be refused")
    for values_path in values_files(CHART / "tests" / "refused"):
        text = values_path.read_text()
        expect = re.search(r"^# expect: (.+)$", text, re.M)
        if not report.check(f"refused/{values_path.name}: has an `# expect:` line", bool(expect), "add one"):
            continue
        values = yaml.safe_load(text) or {}
        try:
            with helm.Chart.load(str(CHART)) as chart:
                render(chart, values, "tally")
            report.check(f"refused/{values_path.name}: refused", False, "it rendered")
        except Exception as err:  # noqa: BLE001
            message = " ".join(str(err).split())
            report.check(f"refused/{values_path.name}: refused with “{expect.group(1).strip()}”",
                         expect.group(1).strip() in message, f"the message was: {message}")


def check_queues_only_upgrade(report: Report, helm) -> None:
    """Issue 8: adding a queue or changing its settings reaches running brokers without a
    restart (the topics hook writes the declarations topic, brokers follow it). So a
    `helm upgrade` that changes only `queues:` must leave the pod templates of the
    services as they were (same checksum annotations: no rollout), change the queues
    ConfigMap, and give the topics hook Job the new declarations. A tally.toml change
    must still roll every service (the control that shows the comparison can fail)."""
    import copy

    text = QUEUES_BASE.read_text()
    base = yaml.safe_load(text) or {}
    release = (re.search(r"^# release: (\S+)", text, re.M) or [None, "tally"])[1]
    name = f"{QUEUES_BASE.name} upgraded"
    limited = next((q for q in base.get("queues") or [] if "rate_limit_per_sec" in q), None)
    if not report.check(f"{name}: the base values declare a rate-limited queue", limited is not None, "none has rate_limit_per_sec"):
        return
    added = copy.deepcopy(base)
    new_queue = {"name": "reports_daily", "partitions": 2, "rate_limit_per_sec": 5, "fifo": True}
    added["queues"].append(new_queue)
    added.setdefault("workers", []).append({"queue": new_queue["name"], "command": ["/app/report"]})
    rated = copy.deepcopy(base)
    new_rate = int(limited["rate_limit_per_sec"]) // 4 or 1
    next(q for q in rated["queues"] if q["name"] == limited["name"])["rate_limit_per_sec"] = new_rate
    relogged = copy.deepcopy(base)
    relogged.setdefault("log", {})["level"] = "debug"

    try:
        with helm.Chart.load(str(CHART)) as chart:
            before = [o for _, o in render(chart, base, release)]
            variants = {
                "one more queue (and its worker)": ([o for _, o in render(chart, added, release, upgrade=True)], new_queue),
                f"queue {limited['name']}'s rate limit {limited['rate_limit_per_sec']} → {new_rate}":
                    ([o for _, o in render(chart, rated, release, upgrade=True)], {"name": limited["name"], "rate_limit_per_sec": new_rate}),
            }
            control = [o for _, o in render(chart, relogged, release, upgrade=True)]
    except Exception as err:  # noqa: BLE001 - any render failure is the finding
        report.check(f"{name}: renders", False, str(err).strip())
        return

    def is_hook(obj: dict) -> bool:
        return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})

    def services(objects) -> dict[str, list[dict]]:
        found: dict[str, list[dict]] = {}
        for o in objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                component = (o["spec"]["template"]["metadata"].get("labels") or {}).get("app.kubernetes.io/component")
                found.setdefault(component, []).append(o)
        return found

    def checksums(obj: dict) -> dict:
        return {k: v for k, v in (obj["spec"]["template"]["metadata"].get("annotations") or {}).items() if k.startswith("checksum/")}

    def configmap_with(objects, key: str, hook: bool) -> list[dict]:
        return [o for o in objects if o["kind"] == "ConfigMap" and key in (o.get("data") or {}) and is_hook(o) == hook]

    def queue_in(text: str, want: dict) -> tuple[bool, str]:
        queues = {q.get("name"): q for q in tomllib.loads(text).get("queue", [])}
        got = queues.get(want["name"])
        if got is None:
            return False, f"no queue {want['name']!r} (queues {sorted(queues)})"
        wrong = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
        return not wrong, f"queue {want['name']!r} has {wrong}, not {({k: want[k] for k in wrong})}"

    old = services(before)
    for comp in SERVICES:
        report.check(f"{name}: the base render has one {comp} workload with checksum annotations",
                     len(old.get(comp, [])) == 1 and bool(checksums(old[comp][0])), f"{len(old.get(comp, []))} workloads")
    old_queues_cm = configmap_with(before, "queues.toml", hook=False)
    old_tally_cm = configmap_with(before, "tally.toml", hook=False)

    for label, (after, want) in variants.items():
        where = f"{name}: {label}"
        new = services(after)
        for comp in SERVICES:
            if len(old.get(comp, [])) != 1 or not report.check(f"{where}: one {comp} workload", len(new.get(comp, [])) == 1, f"{len(new.get(comp, []))}"):
                continue
            a, b = old[comp][0], new[comp][0]
            report.check(f"{where}: {b['kind']}/{b['metadata']['name']}: pod-template checksum annotations unchanged (no rollout)",
                         checksums(a) == checksums(b), f"{checksums(a)} → {checksums(b)}")
            report.check(f"{where}: {b['kind']}/{b['metadata']['name']}: pod template unchanged",
                         a["spec"]["template"] == b["spec"]["template"], "the pod template differs: the pods would roll")
        # Workers of the queues that were there before do not roll either.
        old_workers = {o["metadata"]["name"]: o for o in old.get("worker", [])}
        new_workers = {o["metadata"]["name"]: o for o in new.get("worker", [])}
        for wname, w in sorted(old_workers.items()):
            report.check(f"{where}: Deployment/{wname} (an existing queue's worker): pod template unchanged",
                         wname in new_workers and w["spec"]["template"] == new_workers[wname]["spec"]["template"],
                         "missing" if wname not in new_workers else "the pod template differs: the pods would roll")
        if label.startswith("one more queue"):
            fresh = [o for n, o in new_workers.items() if n not in old_workers]
            report.check(f"{where}: the new queue's worker is a new Deployment",
                         len(fresh) == 1 and (fresh[0]["metadata"].get("annotations") or {}).get("tally.io/queue") == want["name"],
                         f"new worker Deployments {[o['metadata']['name'] for o in fresh]}")
        # tally.toml stays; queues.toml changes and holds the change.
        tally_cm = configmap_with(after, "tally.toml", hook=False)
        report.check(f"{where}: the tally.toml ConfigMap is unchanged", len(tally_cm) == 1 and tally_cm == old_tally_cm,
                     f"{len(tally_cm)} ConfigMaps with tally.toml" if len(tally_cm) != 1 else "it differs")
        queues_cm = configmap_with(after, "queues.toml", hook=False)
        if report.check(f"{where}: one ConfigMap holds queues.toml", len(queues_cm) == 1 and len(old_queues_cm) == 1,
                        f"{len(old_queues_cm)} before, {len(queues_cm)} after"):
            cm = queues_cm[0]
            report.check(f"{where}: ConfigMap/{cm['metadata']['name']} (queues.toml) changes",
                         cm["metadata"]["name"] == old_queues_cm[0]["metadata"]["name"] and cm["data"] != old_queues_cm[0]["data"],
                         "it is the same as before")
            ok, why = queue_in(cm["data"]["queues.toml"], want)
            report.check(f"{where}: ConfigMap/{cm['metadata']['name']} holds the change", ok, why)
            mounted = {comp: any(cm["metadata"]["name"] in volume_configmaps(v) for v in pod_spec(new[comp][0]).get("volumes", []))
                       for comp in SERVICES if len(new.get(comp, [])) == 1}
            report.check(f"{where}: every service mounts ConfigMap/{cm['metadata']['name']}", all(mounted.values()) and len(mounted) == len(SERVICES),
                         f"mounted: {mounted}")
        # The topics hook Job applies the new declarations (and writes the declarations topic).
        jobs = [o for o in after if o["kind"] == "Job" and "pre-upgrade" in str((o["metadata"].get("annotations") or {}).get("helm.sh/hook", ""))]
        if report.check(f"{where}: one pre-upgrade topics Job", len(jobs) == 1, f"{len(jobs)} Jobs"):
            job = jobs[0]
            container = pod_spec(job)["containers"][0]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            config_path = Path(env.get("TALLY_CONFIG", "/etc/tally/tally.toml"))
            copies = {}
            for vol in pod_spec(job).get("volumes", []):
                mount = next((m for m in container.get("volumeMounts", []) if m["name"] == vol["name"]), None)
                for cm_name in volume_configmaps(vol):
                    cm = next((o for o in after if o["kind"] == "ConfigMap" and o["metadata"]["name"] == cm_name), None)
                    if mount and cm:
                        copies.update({Path(mount["mountPath"]) / k: (cm_name, v, is_hook(cm)) for k, v in (cm.get("data") or {}).items()})
            decl = tomllib.loads(copies[config_path][1]).get("broker", {}).get("declarations") if config_path in copies else None
            if report.check(f"{where}: the topics Job sees its tally.toml and the declarations it names",
                            decl is not None and Path(decl) in copies, f"TALLY_CONFIG {config_path}, declarations {decl}, files {sorted(map(str, copies))}"):
                cm_name, text, hook = copies[Path(decl)]
                report.check(f"{where}: the topics Job's {Path(decl).name} is the hook's own copy (made before the upgrade)",
                             hook, f"ConfigMap {cm_name} is not a hook")
                ok, why = queue_in(text, want)
                report.check(f"{where}: the topics Job's copy (ConfigMap/{cm_name}) holds the change", ok, why)

    # The control: a change to tally.toml does roll every service.
    new = services(control)
    for comp in SERVICES:
        if len(old.get(comp, [])) == 1 and len(new.get(comp, [])) == 1:
            report.check(f"{name}: control: log.level debug (tally.toml) changes {comp}'s checksum annotations",
                         checksums(old[comp][0]) != checksums(new[comp][0]), "unchanged: the checksums do not follow tally.toml")


# The roles whose tokens each binary checks or sends (shared/src/auth.rs).
ROLE_TOKENS = {"tally-query": ("reader", "cluster"), "tally-counter": ("operator", "cluster"), "tally-graph": ("operator", "cluster"),
               "tally-broker": ("worker", "operator", "cluster"), "tally-worker": ("worker",)}

# Which components may reach each component's internal port (ARCHITECTURE.md, "Trust boundaries").
INTERNAL_PEERS = {"counter": ("read", {"query"}), "graph": ("read", {"query"}), "broker": ("http", {"query", "worker"})}


def check_network_policies(report, case: str, values: dict, objects, policies: list[dict]) -> None:
    """The counters', tally-graph's and brokers' internal ports admit only their peers' pods; admin ports stay open."""
    if not (values.get("networkPolicy") or {}).get("enabled", True):
        report.check(f"{case}: networkPolicy.enabled false renders no NetworkPolicy", not policies, f"{len(policies)} rendered")
        return
    pods = [(obj["spec"]["template"]["metadata"].get("labels") or {}, pod_spec(obj)) for _, obj in objects if pod_spec(obj) is not None and obj["kind"] != "Job"]
    component = lambda labels: labels.get("app.kubernetes.io/component")
    selects = lambda selector, labels: all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
    for name, (port_name, peers) in INTERNAL_PEERS.items():
        targets = [(labels, spec) for labels, spec in pods if component(labels) == name]
        if not targets:
            continue
        mine = [p for p in policies if any(selects(p["spec"]["podSelector"], labels) for labels, _ in targets)]
        if not report.check(f"{case}: one NetworkPolicy selects the {name} pods", len(mine) == 1, f"{len(mine)} select them"):
            continue
        policy = mine[0]["spec"]
        report.check(f"{case}: the {name} NetworkPolicy governs ingress", policy.get("policyTypes") == ["Ingress"], f"{policy.get('policyTypes')}")
        ports = {c["name"]: c["containerPort"] for c in targets[0][1]["containers"][0].get("ports", [])}
        rules = policy.get("ingress", [])
        open_ports = {p["port"] for r in rules if not r.get("from") for p in r.get("ports", [])}
        report.check(f"{case}: the {name} admin port is open (metrics, probes)", ports.get("admin") in open_ports, f"open: {open_ports}")
        report.check(f"{case}: the {name} internal port is not open to all", ports.get(port_name) not in open_ports and port_name not in open_ports,
                     f"open: {open_ports}")
        allowed = [r for r in rules if r.get("from") and {p["port"] for p in r.get("ports", [])} & {port_name, ports.get(port_name)}]
        # A peer names a component of this release (its pods may not be rendered: workers).
        release = {k: v for k, v in targets[0][0].items() if k != "app.kubernetes.io/component"}
        admitted = {(peer["podSelector"].get("matchLabels") or {}).get("app.kubernetes.io/component") for r in allowed
                    for peer in r["from"] if "podSelector" in peer and selects({"matchLabels": release}, peer["podSelector"].get("matchLabels") or {})}
        extra = (values.get("networkPolicy") or {}).get("extraFrom") or []
        others = [peer for r in allowed for peer in r["from"] if "podSelector" not in peer or peer in extra]
        report.check(f"{case}: the {name} internal port admits exactly {sorted(peers)} pods (and networkPolicy.extraFrom)",
                     admitted == peers and len(others) == len(extra) * len(allowed), f"admits {sorted(admitted)}, other peers {others}")


def check_rendered(report, config_check, work: Path, case: str, values: dict, objects, uid, gid, defaults, builtin_queues):
    by_kind: dict[str, list[dict]] = {}
    for _, obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    configmaps = {o["metadata"]["name"]: o for o in by_kind.get("ConfigMap", [])}
    secrets = {}
    for s in by_kind.get("Secret", []):
        for key, value in (s.get("data") or {}).items():
            secrets[(s["metadata"]["name"], key)] = base64.b64decode(value).decode()
        for key, value in (s.get("stringData") or {}).items():
            secrets[(s["metadata"]["name"], key)] = value
    token_values = [v for v in secrets.values()]
    made_by_user = user_secrets(values)
    external = {name: {} for name in made_by_user}
    kafka_values = values.get("kafka") or {}
    # The Kafka passwords the values ask for: variable → (Secret, key).
    kafka_passwords = {}
    if (kafka_values.get("sasl") or {}).get("existingSecret"):
        kafka_passwords[client_var("sasl.password")] = (kafka_values["sasl"]["existingSecret"], kafka_values["sasl"].get("passwordKey", "sasl-password"))
    if kafka_values.get("tlsSecret") and kafka_values.get("tlsKeyPasswordKey"):
        kafka_passwords[client_var("ssl.key.password")] = (kafka_values["tlsSecret"], kafka_values["tlsKeyPasswordKey"])

    # Names Kubernetes accepts.
    for _, obj in objects:
        name = obj["metadata"]["name"]
        pattern = r"[a-z]([-a-z0-9]*[a-z0-9])?" if obj["kind"] == "Service" else r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
        report.check(f"{case}: {obj['kind']}/{name}: a valid name", len(name) <= 63 and re.fullmatch(pattern, name) is not None,
                     "not a DNS label of at most 63 characters")
        labels = dict(obj["metadata"].get("labels") or {})
        spec = pod_spec(obj)
        if spec is not None:
            labels.update(obj["spec"]["template"]["metadata"].get("labels") or {})
        bad = [f"{k}={v}" for k, v in labels.items()
               if len(str(v)) > 63 or not re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", str(v))]
        report.check(f"{case}: {obj['kind']}/{name}: valid label values", not bad, f"{bad}")

    # Tokens and passwords never in a ConfigMap.
    for cm in configmaps.values():
        # A token in tally.toml would be a TOML string holding it.
        leaked = [t for t in token_values if t and any(json.dumps(t) in v for v in (cm.get("data") or {}).values())]
        report.check(f"{case}: ConfigMap/{cm['metadata']['name']} holds no token", not leaked, "a token is in the ConfigMap")
        if "tally.toml" in (cm.get("data") or {}):
            client = tomllib.loads(cm["data"]["tally.toml"]).get("kafka", {}).get("client", {})
            secret_keys = sorted(k for k in client if SECRET_CLIENT_KEY.search(k))
            report.check(f"{case}: ConfigMap/{cm['metadata']['name']} holds no Kafka password", not secret_keys,
                         f"[kafka.client] sets {secret_keys}")
            snapshots = tomllib.loads(cm["data"]["tally.toml"]).get("snapshots", {})
            credential_keys = sorted(k for k in snapshots if re.search(r"key|secret|token|password|credential", k, re.I))
            report.check(f"{case}: ConfigMap/{cm['metadata']['name']} holds no S3 credentials", not credential_keys,
                         f"[snapshots] sets {credential_keys}")

    check_network_policies(report, case, values, objects, by_kind.get("NetworkPolicy", []))

    # The topics Job runs before everything else, on a config of its own.
    jobs = by_kind.get("Job", [])
    report.check(f"{case}: one topics Job", len(jobs) == 1, f"{len(jobs)} Jobs")
    for job in jobs:
        ann = job["metadata"].get("annotations") or {}
        report.check(f"{case}: the topics Job is a pre-install,pre-upgrade hook",
                     set(str(ann.get("helm.sh/hook", "")).split(",")) == {"pre-install", "pre-upgrade"}, f"annotations {ann}")
        for vol in pod_spec(job).get("volumes", []):
            for cm_name in volume_configmaps(vol):
                cm = configmaps.get(cm_name, {})
                cm_ann = (cm.get("metadata") or {}).get("annotations") or {}
                report.check(f"{case}: the topics Job's ConfigMap {cm_name} is a hook made before it",
                             "pre-install" in str(cm_ann.get("helm.sh/hook", ""))
                             and int(cm_ann.get("helm.sh/hook-weight", 0)) < int(ann.get("helm.sh/hook-weight", 0)),
                             f"ConfigMap {cm_name} annotations {cm_ann}")

    # KEDA: the target has no replicas of its own; minReplicas as asked (0 stays 0).
    deployments = {d["metadata"]["name"]: d for d in by_kind.get("Deployment", [])}
    for so in by_kind.get("ScaledObject", []):
        target = so["spec"]["scaleTargetRef"]["name"]
        report.check(f"{case}: ScaledObject/{so['metadata']['name']} targets a Deployment of the chart", target in deployments, target)
        if target in deployments:
            report.check(f"{case}: Deployment/{target} scaled by KEDA has no replicas", "replicas" not in deployments[target]["spec"],
                         f"replicas: {deployments[target]['spec'].get('replicas')}")
        address = so["spec"]["triggers"][0]["metadata"].get("serverAddress")
        report.check(f"{case}: ScaledObject/{so['metadata']['name']} has a Prometheus address", bool(address) and address != "null", repr(address))
    for w in values.get("workers") or []:
        autoscale = w.get("autoscale") or {}
        if not autoscale.get("enabled"):
            continue
        queue = str(w["queue"])
        matching = [so for so in by_kind.get("ScaledObject", []) if (so["metadata"].get("annotations") or {}).get("tally.io/queue") == queue]
        if report.check(f"{case}: queue {queue} has a ScaledObject", len(matching) == 1, f"{len(matching)} found"):
            so = matching[0]["spec"]
            want = autoscale.get("minReplicas", 1)
            report.check(f"{case}: queue {queue} scales down to minReplicas {want}", so.get("minReplicaCount") == want, f"minReplicaCount {so.get('minReplicaCount')}")
            if "query" not in autoscale:
                report.check(f"{case}: queue {queue}'s scaling query reads its backlog",
                             f'queue="{queue}"' in so["triggers"][0]["metadata"]["query"], so["triggers"][0]["metadata"]["query"])

    # StatefulSets start their pods at once.
    for sts in by_kind.get("StatefulSet", []):
        report.check(f"{case}: StatefulSet/{sts['metadata']['name']} has podManagementPolicy Parallel",
                     sts["spec"].get("podManagementPolicy") == "Parallel", str(sts["spec"].get("podManagementPolicy")))

    # Queues: the declarations file, and every worker's queue declared in it or built in.
    # The release's own ConfigMaps (not the hook's copy), mounted together at /etc/tally.
    data = {}
    for cm in configmaps.values():
        if "helm.sh/hook" not in (cm["metadata"].get("annotations") or {}):
            data.update(cm.get("data") or {})
    declared = set(builtin_queues)
    if report.check(f"{case}: a ConfigMap holds tally.toml", "tally.toml" in data, f"keys {sorted(data)}"):
        toml = tomllib.loads(data["tally.toml"])
        decl_path = toml.get("broker", {}).get("declarations")
        if decl_path:
            report.check(f"{case}: [broker] declarations is in a ConfigMap", Path(decl_path).name in data and Path(decl_path).parent == Path("/etc/tally"),
                         f"{decl_path} not among {sorted(data)}")
            declared |= set(check_queue_file(report, f"{case}: {Path(decl_path).name}", data.get(Path(decl_path).name, "")))
            # Each queue as its values say, nested tables and schedule payloads included.
            try:
                rendered = {str(q.get("name")): q for q in tomllib.loads(data.get(Path(decl_path).name, "")).get("queue", [])}
            except tomllib.TOMLDecodeError:
                rendered = {}  # reported by check_queue_file
            for queue in values.get("queues") or []:
                want = {**queue, "name": str(queue["name"])}
                report.check(f"{case}: queue {want['name']} renders as its values", rendered.get(want["name"]) == want,
                             f"rendered {rendered.get(want['name'])}")
        report.check(f"{case}: the queues asked for are declared",
                     {str(q["name"]) for q in values.get("queues") or []} <= declared, f"declared {sorted(declared)}")

    # Every tally container: image user, ports against listeners, probes, config check.
    services = by_kind.get("Service", [])
    for _, obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        pod_labels = obj["spec"]["template"]["metadata"].get("labels") or {}
        psc = spec.get("securityContext") or {}
        report.check(f"{case}: {obj['kind']}/{obj['metadata']['name']} runs as the image's user {uid}:{gid}",
                     str(psc.get("runAsUser")) == uid and str(psc.get("runAsGroup")) == gid and str(psc.get("fsGroup")) == gid
                     and psc.get("runAsNonRoot") is True, f"securityContext {psc}")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            where = f"{case}: {obj['kind']}/{obj['metadata']['name']}/{container['name']}"
            binary = Path(container["command"][0]).name
            section = binary.removeprefix("tally-") if binary.startswith("tally-") else None
            env, secret_values = resolve_env(container, secrets, external)
            # The config file, as mounted.
            root = work / obj["metadata"]["name"] / container["name"]
            config_file = None
            for mount in container.get("volumeMounts", []):
                vol = volumes.get(mount["name"], {})
                shown_keys: dict[str, str] = {}
                for cm_name in volume_configmaps(vol):
                    cm = configmaps.get(cm_name)
                    if not report.check(f"{where}: ConfigMap {cm_name} is rendered", cm is not None, "missing"):
                        continue
                    twice = sorted(set(shown_keys) & set(cm["data"]))
                    report.check(f"{where}: volume {mount['name']}: ConfigMap {cm_name} shows no file another one does",
                                 not twice, f"{twice} also in ConfigMap {[shown_keys[k] for k in twice]}")
                    target = root / mount["mountPath"].lstrip("/")
                    target.mkdir(parents=True, exist_ok=True)
                    for key, value in cm["data"].items():
                        shown_keys[key] = cm_name
                        # Paths under the mount point at the copies (a local stand-in for the mount).
                        (target / key).write_text(value.replace(mount["mountPath"].rstrip("/") + "/", str(target) + "/"))
                for name in volume_secrets(vol):
                    report.check(f"{where}: Secret {name} is the chart's or named in values",
                                 any(k[0] == name for k in secrets) or name in made_by_user, "an unknown Secret")
            if "TALLY_CONFIG" in env:
                config_file = root / env["TALLY_CONFIG"].lstrip("/")
                if not report.check(f"{where}: TALLY_CONFIG {env['TALLY_CONFIG']} is mounted", config_file.is_file(), "no such file in its mounts"):
                    continue
            toml = tomllib.loads(config_file.read_text()) if config_file else {}
            for item in container.get("env", []):
                if item["name"].startswith("TALLY") and "secretKeyRef" in (item.get("valueFrom") or {}):
                    ref = item["valueFrom"]["secretKeyRef"]
                    report.check(f"{where}: {item['name']} comes from a Secret that has it",
                                 (ref["name"], ref["key"]) in secrets or ref["key"] in made_by_user.get(ref["name"], set()), f"{ref}")
            # The Kafka passwords reach every container that talks to Kafka, from the Secret
            # the values name, and no other container.
            talks_to_kafka = binary not in NO_KAFKA
            refs = {i["name"]: (i["valueFrom"]["secretKeyRef"]["name"], i["valueFrom"]["secretKeyRef"]["key"])
                    for i in container.get("env", []) if "secretKeyRef" in (i.get("valueFrom") or {})}
            for var in sorted(set(kafka_passwords) | {v for v in refs if v.startswith("TALLY__KAFKA__CLIENT__")}):
                if talks_to_kafka:
                    report.check(f"{where}: {var} comes from Secret {kafka_passwords.get(var, ('?', '?'))[0]}",
                                 var in kafka_passwords and refs.get(var) == kafka_passwords[var], f"env has {refs.get(var)}")
                else:
                    report.check(f"{where}: {var} is not given to {binary}, which does not talk to Kafka", var not in refs, "it is")
            # The S3 credentials reach the containers that take and restore snapshots, from
            # the Secret the values name, and no other container.
            s3_refs = {var: (name, key) for name, keys in s3_credentials(values).items() for var, key in keys.items()}
            for var in sorted(set(s3_refs) | {v for v in env if v.startswith("AWS_")}):
                if binary in SNAPSHOTTERS:
                    report.check(f"{where}: {var} comes from Secret {s3_refs.get(var, ('?', '?'))[0]}",
                                 var in s3_refs and refs.get(var) == s3_refs[var], f"env has {refs.get(var)}")
                else:
                    report.check(f"{where}: {var} is not given to {binary}, which takes no snapshots", var not in env, "it is")
            expect = {}
            if binary in SNAPSHOTTERS and (values.get("snapshots") or {}).get("url"):
                snap = values["snapshots"]
                expect.update({"snapshots.url": snap["url"], "snapshots.endpoint": snap.get("endpoint", ""),
                               "snapshots.allow_http": bool(snap.get("allowHttp", False))})
            if section == "worker":
                expect["worker.queue"] = env.get("TALLY__WORKER__QUEUE", effective("worker", "queue", toml, env, defaults))
            tokens = {var for var in env if var.startswith("TALLY__AUTH__")}
            allowed = {f"TALLY__AUTH__{role.upper()}_TOKEN" for role in ROLE_TOKENS.get(binary, ())}
            report.check(f"{where}: {binary} gets only the tokens it checks or sends", tokens <= allowed, f"{sorted(tokens - allowed)}")
            for var in tokens:
                expect[var.removeprefix("TALLY__").lower().replace("__", ".")] = "<redacted>"
            for var in env:
                if var.startswith("TALLY__KAFKA__CLIENT__"):
                    # The loader's mapping: SASL_PASSWORD → "sasl.password"; shown redacted.
                    expect[("kafka", "client", var.removeprefix("TALLY__KAFKA__CLIENT__").lower().replace("_", "."))] = "<redacted>"
            shown = config_check.run(where, config_file, env, expect, secret_values)
            if shown is not None:
                # The listeners as tally itself resolved them.
                toml, env = shown, {}
            ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            if section in LISTENERS:
                for port_name, key in LISTENERS[section].items():
                    listen = effective(section, key, toml, env, defaults)
                    report.check(f"{where}: port {port_name} is the {section}.{key} listener ({listen})",
                                 ports.get(port_name) == port_of(listen) and not is_loopback(listen), f"ports {ports}")
                scrape = (obj["spec"]["template"]["metadata"].get("annotations") or {}).get("prometheus.io/port")
                report.check(f"{where}: prometheus.io/port is the admin port", scrape == str(ports.get("admin")), f"{scrape} vs {ports.get('admin')}")
                startup = container.get("startupProbe") or {}
                window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
                report.check(f"{where}: a startup probe waits {window}s (>= 120s) before liveness may restart it",
                             startup.get("httpGet", {}).get("port") == "admin" and window >= 120 and "livenessProbe" in container, f"startupProbe {startup}")
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    port = ((container.get(probe) or {}).get("httpGet") or {}).get("port")
                    report.check(f"{where}: {probe} port {port} is a container port", port in ports or port in ports.values(), f"ports {ports}")
            if section == "worker":
                queue = env.get("TALLY__WORKER__QUEUE", effective("worker", "queue", toml, env, defaults))
                report.check(f"{where}: worker queue {queue!r} is declared", queue in declared, f"declared: {sorted(declared)}")
                for url in effective("worker", "brokers", toml, env, defaults) or []:
                    m = re.fullmatch(r"https?://([^:/]+):(\d+)/?", url)
                    svc = next((s for s in services if m and s["metadata"]["name"] == m.group(1)), None)
                    report.check(f"{where}: broker URL {url} is a Service port of the brokers",
                                 bool(svc) and any(p["port"] == int(m.group(2)) for p in svc["spec"]["ports"]), "no such Service or port")
                has_command = "TALLY__WORKER__COMMAND" in env or "command" in toml.get("worker", {})
                has_webhook = "TALLY__WORKER__WEBHOOK_URL" in env or "webhook_url" in toml.get("worker", {})
                report.check(f"{where}: exactly one of command and webhook", has_command != has_webhook, f"command {has_command}, webhook {has_webhook}")
        # Services reach named ports of the pods they select.
    for svc in services:
        selector = svc["spec"].get("selector") or {}
        selected = [o for _, o in objects if pod_spec(o) is not None
                    and selector.items() <= (o["spec"]["template"]["metadata"].get("labels") or {}).items()]
        if not report.check(f"{case}: Service/{svc['metadata']['name']} selects pods", bool(selected), f"selector {selector}"):
            continue
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            found = all(any(target in ((p.get("name"), p["containerPort"])) for c in pod_spec(o)["containers"] for p in c.get("ports", []))
                        for o in selected)
            report.check(f"{case}: Service/{svc['metadata']['name']} port {port['port']} → {target} is a container port", found, "no such container port")


CRD_GROUPS = ("keda.sh/", "monitoring.coreos.com/")


def validate_objects(report: Report, work: Path, all_objects) -> None:
    custom = [(case, obj) for case, _, obj in all_objects if obj["apiVersion"].startswith(CRD_GROUPS)]
    core = [(case, template, obj) for case, template, obj in all_objects if not obj["apiVersion"].startswith(CRD_GROUPS)]
    files = []
    for i, (case, template, obj) in enumerate(core):
        path = work / "manifests" / f"{i:04d}-{case.removesuffix('.yaml')}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        files.append(path)
    for version in KUBE_VERSIONS:
        result = subprocess.run([str(VENV / "bin" / "kubernetes-validate"), "--strict", "--quiet", "-k", version] + [str(f) for f in files],
                                capture_output=True, text=True)
        lines = [l for l in (result.stdout + result.stderr).splitlines() if l.strip()]
        report.check(f"kubernetes-validate --strict -k {version}: {len(files)} objects", result.returncode == 0 and not lines,
                     "\n        " + "\n        ".join(lines[:30]))
    if custom:
        path = work / "custom.json"
        path.write_text(json.dumps([obj for _, obj in custom]))
        result = subprocess.run(["node", str(ROOT / "scripts" / "deploy" / "crd-validate.mjs"), str(NPM), str(path)], capture_output=True, text=True)
        errors = [l for l in result.stdout.splitlines() if not l.startswith("ok ")] + [l for l in result.stderr.splitlines() if "ExperimentalWarning" not in l and l.strip()]
        kinds = sorted({obj["kind"] for _, obj in custom})
        report.check(f"CRD schemas (@kubernetes-models/keda, prometheus-operator), strict: {len(custom)} objects ({', '.join(kinds)})",
                     result.returncode == 0 and not errors, "\n        " + "\n        ".join(errors[:30]))
    report.check("the CI values render at least one KEDA ScaledObject", any(o["kind"] == "ScaledObject" for _, o in custom),
                 "no autoscaled worker in helm/tally/ci")
    check_monitoring(report, all_objects)


def check_monitoring(report: Report, all_objects) -> None:
    """The PrometheusRule holds deploy/prometheus/tally-rules.yaml's groups, checked by
    promtool; the dashboard ConfigMaps hold deploy/grafana's files, each under its name."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "tally-rules.yaml").read_text())
    dashboards = {p.name: p.read_text() for p in sorted((ROOT / "deploy" / "grafana").glob("*.json"))}
    rendered = [(case, o) for case, _, o in all_objects if o["kind"] == "PrometheusRule"]
    report.check("the CI values render a PrometheusRule", bool(rendered), "none enables monitoring.prometheusRule")
    for case, rule in rendered:
        values = yaml.safe_load((ROOT / "helm" / "tally" / "ci" / case).read_text()) or {}
        base = ((values.get("monitoring") or {}).get("prometheusRule") or {}).get("runbookBaseUrl", "")
        expected = copy.deepcopy(rules["groups"])
        for group in expected:
            for alert in group["rules"]:
                if base:
                    alert["annotations"]["runbook_url"] = base.rstrip("/") + "/" + alert["annotations"]["runbook_url"]
        report.check(f"{case}: PrometheusRule/{rule['metadata']['name']}: the groups of deploy/prometheus/tally-rules.yaml"
                     + (f", runbooks under {base}" if base else ""),
                     rule["spec"] == {"groups": expected}, "it differs")
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
            yaml.safe_dump(rule["spec"], file)
            file.flush()
            try:
                result = subprocess.run(["promtool", "check", "rules", file.name], capture_output=True, text=True)
                ok, why = result.returncode == 0, result.stdout + result.stderr
            except FileNotFoundError:
                ok, why = False, "no promtool: install Debian's prometheus package"
        report.check(f"{case}: PrometheusRule/{rule['metadata']['name']}: promtool check rules", ok, why)
    maps = {}
    for case, _, o in all_objects:
        if o["kind"] == "ConfigMap" and any(key.endswith(".json") for key in (o.get("data") or {})):
            maps.setdefault(case, {}).update(o["data"])
    report.check("the CI values render the Grafana dashboards", bool(maps), "none enables monitoring.grafanaDashboards")
    for case, data in maps.items():
        report.check(f"{case}: the dashboard ConfigMaps hold deploy/grafana's files",
                     {k: v.rstrip("\n") for k, v in data.items()} == {k: v.rstrip("\n") for k, v in dashboards.items()},
                     f"{sorted(data)} against {sorted(dashboards)}")


# ----------------------------------------------------------------------- Docker, Compose


def check_dockerfile(report: Report) -> None:
    report.section("Dockerfile")
    docker = dockerfile_facts()
    stages = docker["stages"]
    if not report.check("Dockerfile has a build and a runtime stage", len(stages) >= 2, f"{len(stages)} stages"):
        return
    build, runtime = stages[0], stages[-1]
    report.check("the runtime USER is numeric uid:gid", bool(re.fullmatch(r"\d+:\d+", runtime["user"] or "")), f"USER {runtime['user']}")
    missing = [p for p in common_build_packages() if p not in build["packages"]]
    report.check("the build stage installs every package scripts/common.sh builds with", not missing, f"missing {missing}")
    needed = {"ca-certificates", "libstdc++6", "libsnappy1v5", "libssl3", "libsasl2-2", "libsasl2-modules",
              "libsasl2-modules-gssapi-mit", "libzstd1", "zlib1g", "libcurl4"}
    report.check("the runtime stage installs TLS, SASL, compression, curl and the C++ runtime",
                 needed <= runtime["packages"], f"missing {sorted(needed - runtime['packages'])}")
    text = (ROOT / "Dockerfile").read_text()
    report.check("the build stage compiles RocksDB (ROCKSDB_COMPILE=1 on its cargo build; not Debian's library with assertions)",
                 re.search(r"^RUN ROCKSDB_COMPILE=1 cargo build --release", text, re.M) is not None,
                 "no line starts RUN ROCKSDB_COMPILE=1 cargo build --release")
    bins = workspace_bins()
    copied = {Path(c).name for c in build["copies"]} & bins
    report.check("the image gets every binary of the workspace", copied == bins, f"missing {sorted(bins - copied)}")
    user = runtime["user"] or ""
    for d in ("/var/lib/tally/counter", "/var/lib/tally/graph"):
        report.check(f"the image makes {d}", d in runtime["dirs"], f"mkdir makes {sorted(runtime['dirs'])}")
        owned = any(o[0] == user and (o[1] == d or (o[2] and d.startswith(o[1].rstrip('/') + '/'))) for o in runtime["owned"])
        report.check(f"{d} belongs to {user}", owned, f"chown {sorted(runtime['owned'])}")
    check_linked_libraries(report, runtime["packages"])


def check_linked_libraries(report: Report, runtime_packages: set[str]) -> None:
    """Every shared library the built binaries load comes with the runtime image."""
    binaries = [p for p in (ROOT / "target" / d / b for d in ("release", "debug") for b in sorted(workspace_bins())) if p.is_file()]
    if not binaries:
        report.skip("linked libraries: no built binaries under target/ to inspect")
        return
    seen = {}
    for b in binaries:
        if b.name in seen:
            continue
        out = subprocess.run(["ldd", str(b)], capture_output=True, text=True)
        if out.returncode != 0:
            report.check(f"ldd {b}", False, out.stderr.strip())
            continue
        # The libraries the binary itself names (the runtime packages' dependencies
        # bring what those load in turn).
        dynamic = subprocess.run(["readelf", "-d", str(b)], capture_output=True, text=True)
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic.stdout))
        if not report.check(f"readelf -d {b.name} names the libraries it needs", dynamic.returncode == 0 and bool(needed),
                            dynamic.stderr.strip() or "no NEEDED entries"):
            continue
        unresolved = sorted(re.findall(r"^\s*(\S+) => not found", out.stdout, re.M))
        report.check(f"every library {b.name} loads is found on this machine", not unresolved, f"not found: {unresolved}")
        seen[b.name] = [m.group(2) for m in re.finditer(r"^\s*(\S+) => (/\S+)", out.stdout, re.M) if m.group(1) in needed]
    # A local build may link Debian's RocksDB (.cargo/config.toml); the image's binaries
    # have it compiled in (ROCKSDB_COMPILE=1, checked above).
    libs = sorted({lib for libs in seen.values() for lib in libs if not Path(lib).name.startswith("librocksdb.so")})
    owners = {}
    for lib in libs:
        candidates = {lib, os.path.realpath(lib)}
        for c in list(candidates):
            if c.startswith("/lib/"):
                candidates.add("/usr" + c)
            elif c.startswith("/usr/lib/"):
                candidates.add(c[4:])
        out = subprocess.run(["dpkg", "-S"] + sorted(candidates), capture_output=True, text=True)
        pkgs = {line.split(":")[0] for line in out.stdout.splitlines() if ":" in line}
        owners[lib] = pkgs
    # The runtime packages and everything they depend on (as installed on this machine).
    status = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Depends}, ${Pre-Depends}\t${Provides}\n"], capture_output=True, text=True).stdout
    depends, provides = {}, {}
    for line in status.splitlines():
        name, deps, prov = (line.split("\t") + ["", ""])[:3]
        depends[name] = {re.sub(r"[\s(:].*", "", alt.strip()) for dep in deps.split(",") for alt in dep.split("|") if alt.strip()}
        for p in prov.split(","):
            if p.strip():
                provides.setdefault(re.sub(r"[\s(].*", "", p.strip()), set()).add(name)
    closure, todo = set(), list(runtime_packages | BASE_PACKAGES)
    while todo:
        p = todo.pop()
        if p in closure:
            continue
        closure.add(p)
        todo += list(depends.get(p, set())) + list(provides.get(p, set()))
    missing = sorted(f"{Path(lib).name} ({', '.join(sorted(pkgs)) or 'no package'})" for lib, pkgs in owners.items() if not pkgs & closure)
    report.check(f"the runtime image has every library {', '.join(sorted(seen))} load ({len(libs)} libraries)", not missing,
                 f"not installed by the runtime stage: {missing}")


def check_compose(report: Report, config_check: ConfigCheck, work: Path) -> None:
    report.section("docker-compose.yml")
    compose = VENV / "bin" / "docker-compose"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "TALLY"))}
    env["DOCKER_HOST"] = NO_DOCKER
    result = subprocess.run([str(compose), "-f", str(ROOT / "docker-compose.yml"), "--project-directory", str(ROOT), "config", "--format", "json"],
                            capture_output=True, text=True, env=env, timeout=120)
    if not report.check("docker compose config", result.returncode == 0, result.stderr.strip()):
        return
    report.check("docker compose config prints no warning", not result.stderr.strip(), result.stderr.strip())
    project = json.loads(result.stdout)
    docker = dockerfile_facts()
    runtime = docker["stages"][-1]
    user = runtime["user"] or ""
    defaults = example_config()
    bins = workspace_bins()
    declared = {q["name"] for q in builtin_declarations().get("queue", [])}
    configs = project.get("configs") or {}
    services = project["services"]
    for name, svc in sorted(services.items()):
        for port in svc.get("ports") or []:
            report.check(f"compose {name}: port {port.get('published')} is published on 127.0.0.1 only",
                         port.get("host_ip") == "127.0.0.1", f"host_ip {port.get('host_ip')!r}")
    tally_services = {n: s for n, s in services.items() if "build" in s or str(s.get("image", "")).split("/")[-1].startswith("tally")}
    report.check("compose runs the tally image", bool(tally_services), "no tally service")
    # The queues the compose file declares.
    for svc in tally_services.values():
        decl = (svc.get("environment") or {}).get("TALLY__BROKER__DECLARATIONS")
        for c in svc.get("configs") or []:
            if decl and c.get("target") == decl and "content" in configs.get(c["source"], {}):
                declared |= set(check_queue_file(report, f"compose config {c['source']}", configs[c["source"]]["content"]))
    images = {s.get("image") for s in tally_services.values()}
    report.check("every tally service uses one image", len(images) == 1, f"{images}")
    for name, svc in sorted(tally_services.items()):
        where = f"compose {name}"
        command = " ".join(svc.get("command") or svc.get("entrypoint") or [])
        used = [w for w in re.findall(r"\btally(?:-[a-z]+)?\b", command) if w in bins]
        if not report.check(f"{where}: runs a binary of the image", bool(used), f"command {command!r}"):
            continue
        binary = used[-1]
        section = binary.removeprefix("tally-") if binary.startswith("tally-") else None
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items() if v is not None}
        # Variables the command sets itself before exec'ing the service.
        for var in re.findall(r"\b(TALLY__[A-Z_]+)=", command):
            env[var] = CONTAINER_IP
        for vol in svc.get("volumes") or []:
            if vol.get("type") == "volume":
                target = vol["target"]
                report.check(f"{where}: volume {vol.get('source')} mounts on {target}, which the image makes", target in runtime["dirs"],
                             f"the Dockerfile makes {sorted(runtime['dirs'])}")
                report.check(f"{where}: {target} belongs to the image's user {user}",
                             any(o[0] == user and (o[1] == target or (o[2] and target.startswith(o[1].rstrip('/') + '/'))) for o in runtime["owned"]),
                             "not chowned: Docker would mount it root-owned")
        # Config files mounted from `configs:`, written where the service would see them.
        root = work / "compose" / name
        for c in svc.get("configs") or []:
            content = configs.get(c["source"], {}).get("content")
            if content is None or not c.get("target"):
                continue
            path = root / c["target"].lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            env = {k: v.replace(c["target"], str(path)) if v == c["target"] else v for k, v in env.items()}
        shown = config_check.run(where, None, env, {"worker.queue": env["TALLY__WORKER__QUEUE"]} if "TALLY__WORKER__QUEUE" in env else {}, [])
        # The settings as tally itself resolved them, when `tally config check` printed them.
        file, env = (shown, {}) if shown is not None else ({}, env)
        if section in LISTENERS:
            listens = {k: effective(section, key, file, env, defaults) for k, key in LISTENERS[section].items()}
            for k, listen in listens.items():
                report.check(f"{where}: {section} {k} listener {listen} is reachable from other containers", not is_loopback(listen), "bound to loopback")
            for port in svc.get("ports") or []:
                report.check(f"{where}: published port {port.get('target')} is a listener", port.get("target") in {port_of(l) for l in listens.values()},
                             f"listeners {listens}")
        if section == "worker":
            queue = effective("worker", "queue", file, env, defaults)
            report.check(f"{where}: worker queue {queue!r} is declared", queue in declared, f"declared {sorted(declared)}")
            brokers = effective("worker", "brokers", file, env, defaults)
            for url in json.loads(brokers) if isinstance(brokers, str) else brokers or []:
                m = re.fullmatch(r"https?://([^:/]+):(\d+)/?", url)
                target = services.get(m.group(1)) if m else None
                listen = effective("broker", "listen", {}, {k: str(v) for k, v in (target or {}).get("environment", {}).items()}, defaults) if target else None
                report.check(f"{where}: broker URL {url} is the broker service's listener", bool(target) and port_of(listen) == int(m.group(2)), f"broker listens on {listen}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-v", "--verbose", action="store_true", help="print every check, not just failures")
    args = parser.parse_args()
    report = Report(args.verbose)
    config_check = ConfigCheck(report)
    with tempfile.TemporaryDirectory(prefix="tally-deploy-checks-") as tmp:
        work = Path(tmp)
        check_dockerfile(report)
        check_compose(report, config_check, work)
        check_chart(report, config_check, work)
    if not config_check.binary:
        report.skip(f"tally config check: {config_check.reason}")
    print(f"deploy: {report.passed} passed, {len(report.failures)} failed" + (f", {len(report.skips)} skipped" if report.skips else ""))
    if report.failures:
        print("failed:")
        for f in report.failures:
            print(f"  - {' | '.join(l.strip() for l in f.splitlines() if l.strip())[:300]}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
