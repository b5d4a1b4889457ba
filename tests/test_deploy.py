"""deploy/'s examples, checked by the tools that judge them where they run: the Kubernetes
manifest against the API's OpenAPI schema (kubernetes-validate, which bundles it), the
systemd unit with `systemd-analyze verify`, the alert rules and the scrape configuration with
promtool (and the rules' own unit tests), the TOML with kvcache's loader; and what each must
say to work with kvcache: settings that exist, probes and ports that match, metric names that
docs/metrics.md documents, the alert list deploy/README.md shows. (tests/test_metrics.py
evaluates the rules and the dashboard against a live sidecar.)"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.poll import wait_until

from kvcache import config, config_sources
from kvcache.app.client import Client

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "deployment.yaml"
UNIT = DEPLOY / "systemd" / "kvcache.service"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
UNIT_KVCACHE = "/opt/kvcache/bin/kvcache"  # where deploy/README.md's systemd recipe installs it
K8S_VERSION = "1.30.0"  # native sidecars (restartPolicy: Always on an init container) are 1.29+


def test_every_yaml_parses():
    files = sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 4
    for f in files:
        assert [d for d in yaml.safe_load_all(f.read_text()) if d], f


def _deployment() -> dict:
    (doc,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return doc


def test_kubernetes_manifest_matches_the_api_schema():
    doc = _deployment()
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError
    broken = json.loads(json.dumps(doc))
    broken["spec"]["template"]["spec"]["initContainers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _settings_env() -> set[str]:
    """Every environment variable kvcache reads its settings from."""
    names = {config_sources.env_var(f) for f in _fields()}
    return names | {config.PASSWORD_ENV, "KVCACHE_CONFIG", "KVCACHE_BUCKETS", "KVCACHE_NATS_SERVERS"}


def _fields() -> list[str]:
    import dataclasses
    out = [f.name for f in dataclasses.fields(config.Config) if f.name not in ("nats", "buckets", "peers")]
    out += [f"nats_{f.name}" for f in dataclasses.fields(config.NatsConfig)]
    return out


def test_kubernetes_sidecar_is_wired_to_kvcache():
    spec = _deployment()["spec"]["template"]["spec"]
    (kv,) = [c for c in spec["initContainers"] if c["name"] == "kvcache"]
    (app,) = spec["containers"]
    assert kv["restartPolicy"] == "Always"  # a native sidecar: up before the app, down after
    env = {e["name"]: e.get("value") for e in kv["env"]}
    unknown = {n for n in env if n.startswith("KVCACHE_")} - _settings_env()
    assert unknown == set()
    assert config_sources.load(env={k: v for k, v in env.items() if v is not None}).metrics_address == ("0.0.0.0", 9464)
    # the socket on a volume both containers mount, where KVCACHE_SOCKET says
    socket_dir = str(Path(env["KVCACHE_SOCKET"]).parent)
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (kv, app)}
    assert mounts["kvcache"][socket_dir] == mounts["app"][socket_dir]
    assert {e["name"]: e["value"] for e in app["env"]}["REDIS_URL"] == f"unix://{env['KVCACHE_SOCKET']}"
    # probes on the metrics listener's port, the paths it serves
    port = int(env["KVCACHE_METRICS_LISTEN"].rsplit(":", 1)[1])
    assert [p["containerPort"] for p in kv["ports"] if p["name"] == "metrics"] == [port]
    paths = {k: kv[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {k: (v["path"], v["port"]) for k, v in paths.items()} == {
        "startupProbe": ("/healthz", "metrics"), "livenessProbe": ("/healthz", "metrics"),
        "readinessProbe": ("/readyz", "metrics")}
    # the data directory on a volume too (the root filesystem is read-only)
    assert kv["securityContext"]["readOnlyRootFilesystem"] is True
    assert env["KVCACHE_DATA_DIR"] in mounts["kvcache"]
    assert spec["terminationGracePeriodSeconds"] >= 10


def _kvcache_command() -> str | None:
    """The `kvcache` command of this interpreter (its venv's bin), else the one on PATH."""
    beside = Path(sys.executable).with_name("kvcache")
    return str(beside) if beside.exists() else shutil.which("kvcache")


@pytest.mark.servers  # runs systemd-analyze: a process, so not in the quick tier
def test_systemd_unit_verifies():
    exe = shutil.which("systemd-analyze")
    kvcache = _kvcache_command()
    if exe is None or kvcache is None:
        pytest.skip("systemd-analyze or the kvcache command is not installed")
    text = UNIT.read_text()
    assert "RuntimeDirectory=kvcache" in text and "StateDirectory=kvcache" in text

    def verify(unit_text: str, tmp: Path) -> subprocess.CompletedProcess:
        unit = tmp / "kvcache.service"  # ExecStart must name an executable that exists here
        unit.write_text(unit_text.replace(UNIT_KVCACHE, kvcache))
        return subprocess.run([exe, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        r = verify(text, Path(d))
        # a directive systemd cannot parse is only a warning (exit 0): any line about the unit fails
        assert r.returncode == 0 and "kvcache.service" not in r.stdout + r.stderr, r.stdout + r.stderr
        r = verify(text.replace("ProtectSystem=strict", "ProtectSystem=strictly"), Path(d))
        assert "protect system value" in r.stderr  # the check can fail


def _recipe(heading: str) -> str:
    """The first ```sh block under a `## heading` of deploy/README.md."""
    text = (DEPLOY / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def _commands(script: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments dropped."""
    joined = script.replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def _tree_copy(dest: Path) -> Path:
    """The repository's files as a clone has them (tracked and new, not ignored), at dest."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in names:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _scratch_etc(root: Path) -> None:
    """A scratch /etc that groupadd/useradd --prefix can write: this host's user database."""
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group", "shadow", "gshadow", "login.defs"):
        if Path("/etc", name).exists():
            shutil.copy(Path("/etc", name), root / "etc" / name)


def _run(cmd: str, cwd: Path) -> None:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=cwd, capture_output=True, text=True,
                       timeout=900, env={k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")})
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"


@pytest.mark.servers  # builds kvcache into a virtualenv: a minute, processes
@pytest.mark.slow
def test_systemd_recipe_in_a_scratch_root(tmp_path):
    """deploy/README.md's systemd install, command by command, into a scratch root: /opt and
    /etc under it, groupadd/useradd with --prefix (this host's users are left alone), the
    group `kvcache` in `install -g` as this process's (no such group here), apt-get skipped.
    Then the venv's kvcache runs and systemd-analyze verifies the unit as installed."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("the recipe runs as root with useradd (shadow's --prefix)")
    root, clone = tmp_path / "root", _tree_copy(tmp_path / "clone")
    _scratch_etc(root)
    ran = []
    for cmd in _commands(_recipe("systemd, on a Debian host")):
        if cmd.startswith("apt-get "):
            continue
        cmd = cmd.replace("/opt/", f"{root}/opt/").replace(" /etc/", f" {root}/etc/")
        if cmd.startswith(("groupadd ", "useradd ")):
            cmd = cmd.replace(" ", f" --prefix {shlex.quote(str(root))} ", 1)
        cmd = cmd.replace("-g kvcache ", f"-g {os.getgid()} ")
        (root / "etc" / "systemd" / "system").mkdir(parents=True, exist_ok=True)
        _run(cmd, clone)
        ran.append(cmd.split()[0])
    assert ran[:3] == ["python3", f"{root}/opt/kvcache/bin/pip", "groupadd"], ran
    kvcache = root / "opt" / "kvcache" / "bin" / "kvcache"
    r = subprocess.run([str(kvcache), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("kvcache "), r.stderr
    assert re.search(r"^kvcache:x:\d+:\d+::/var/lib/kvcache:/usr/sbin/nologin$",
                     (root / "etc" / "passwd").read_text(), re.M)
    assert re.search(r"^kvcache:x:\d+:$", (root / "etc" / "group").read_text(), re.M)
    config_sources.load(str(root / "etc" / "kvcache" / "kvcache.toml"), env={})
    unit = (root / "etc" / "systemd" / "system" / "kvcache.service").read_text()
    assert f"ExecStart={UNIT_KVCACHE} " in unit
    exe = shutil.which("systemd-analyze")
    if exe:
        check = tmp_path / "kvcache.service"
        check.write_text(unit.replace(UNIT_KVCACHE, str(kvcache)))
        r = subprocess.run([exe, "verify", "--man=no", str(check)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "kvcache.service" not in r.stdout + r.stderr, r.stdout + r.stderr


def _dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), by stage."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    stages: list[list[str]] = []
    for instr in "\n".join(lines).replace("\\\n", " ").splitlines():
        if instr.startswith("FROM "):
            stages.append([])
        if instr.strip() and stages:
            stages[-1].append(" ".join(instr.split()))
    return stages


@pytest.mark.servers  # builds wheels and starts a sidecar
@pytest.mark.slow
def test_dockerfile_steps_outside_docker(tmp_path):
    """The Dockerfile's steps that need no base image, run here (there is no Docker daemon):
    the build stage's COPYs and `pip wheel` (in a fresh venv standing in for python:3.11-slim's
    Python), the runtime stage's RUN (its pip install into another fresh venv, the nkeys check,
    groupadd/useradd --prefix into a scratch root, the directories under it), then the installed
    kvcache serving the demo with the image's ENV, its socket mode 660."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("the image's steps run as root with useradd (shadow's --prefix)")
    build, run = _dockerfile_stages()
    src, root = tmp_path / "src", tmp_path / "root"
    _scratch_etc(root)
    for instr in build:
        if instr.startswith("COPY "):
            *sources, _ = instr.split()[1:]
            for name in sources:
                target = src / name
                if (ROOT / name).is_dir():
                    shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns(
                        "__pycache__", "*.so", "*.c", "*.html"))  # as .dockerignore keeps them out
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / name, target)
    (wheel_cmd,) = [i.removeprefix("RUN ") for i in build if i.startswith("RUN pip wheel")]
    for venv in ("build-venv", "run-venv"):
        subprocess.run([sys.executable, "-m", "venv", str(tmp_path / venv)], check=True, timeout=120)
    wheels = root / "wheels"
    _run(wheel_cmd.replace("pip ", f"{tmp_path}/build-venv/bin/python -m pip ", 1)
         .replace("/wheels", str(wheels)), src)
    (install,) = [i.removeprefix("RUN ") for i in run if i.startswith("RUN pip install")]
    for part in (p.strip() for p in install.split("&&")):
        if part.startswith("pip "):
            part = part.replace("pip ", f"{tmp_path}/run-venv/bin/python -m pip ", 1)
        elif part.startswith("python "):
            part = part.replace("python ", f"{tmp_path}/run-venv/bin/python ", 1)
        elif part.startswith(("groupadd ", "useradd ")):
            _run(part.replace(" ", f" --prefix {shlex.quote(str(root))} ", 1), tmp_path)
            continue
        part = re.sub(r"(?<![\w/])/(wheels|var/lib/kvcache|run/kvcache)", lambda m: f"{root}/{m.group(1)}", part)
        _run(part, tmp_path)
    assert re.search(r"^kvcache:x:10001:10001::/var/lib/kvcache:/usr/sbin/nologin$",
                     (root / "etc" / "passwd").read_text(), re.M)
    for d in ("var/lib/kvcache", "run/kvcache"):
        st = (root / d).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (10001, 10001, 0o750), d
    assert "USER 10001:10001" in run
    env = dict(re.findall(r"(KVCACHE_\w+)=(\S+)", " ".join(i for i in run if i.startswith("ENV "))))
    assert env == {"KVCACHE_DATA_DIR": "/var/lib/kvcache", "KVCACHE_SOCKET": "/run/kvcache/kvcache.sock"}
    data, sock = tmp_path / "data", tmp_path / "sock" / "kvcache.sock"  # (root-owned here: not 10001's dirs)
    proc = subprocess.Popen([str(tmp_path / "run-venv" / "bin" / "kvcache"), "serve"], cwd=tmp_path,
                            env={**os.environ, "KVCACHE_DATA_DIR": str(data), "KVCACHE_SOCKET": str(sock)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def serves() -> bool:
            assert proc.poll() is None, "kvcache serve exited"
            with Client(str(sock), timeout=2) as c:
                return c.get("greeting") == b"hello from kvcache"
        wait_until(serves, 60, "the image's kvcache serve to answer")
        assert sock.stat().st_mode & 0o777 == 0o660
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_systemd_example_configuration_loads():
    cfg = config_sources.load(str(DEPLOY / "systemd" / "kvcache.toml"), env={})
    unit = UNIT.read_text()
    assert cfg.socket_path.startswith("/run/kvcache/") and cfg.data_dir == "/var/lib/kvcache"
    assert "--config /etc/kvcache/kvcache.toml" in unit
    assert cfg.metrics_address == ("127.0.0.1", 9464) and cfg.log_format == "json"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (make system-deps installs Debian's prometheus)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=ALERTS.parent)


@pytest.mark.servers  # runs promtool
def test_alert_rules_check_and_pass_their_unit_tests():
    r = _promtool("check", "rules", "alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _promtool("test", "rules", "alerts.test.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    r = _promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def _alerts() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_every_alert_is_unit_tested_and_listed():
    names = [r["alert"] for r in _alerts()]
    assert len(names) == len(set(names)) >= 10
    tested = {t["alertname"] for case in yaml.safe_load((ALERTS.parent / "alerts.test.yml").read_text())["tests"]
              for t in case["alert_rule_test"]}
    assert set(names) == tested
    listed = re.findall(r"^\| `(Kvcache\w+)` \|", (DEPLOY / "README.md").read_text(), re.M)
    assert listed == names  # same alerts, same order
    for r in _alerts():
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def _documented() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(kvcache_[a-z_]+)` \|", text, re.M))


def _metric_names(expr: str) -> set[str]:
    """The kvcache_* series an expression reads (a histogram's _bucket/_sum/_count by its name)."""
    names = set(re.findall(r"\bkvcache_[a-z_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) if n.startswith("kvcache_command_duration_seconds") else n
            for n in names}


def test_rules_and_dashboard_use_documented_metrics():
    documented = _documented()
    assert len(documented) > 40
    for r in _alerts():
        assert _metric_names(r["expr"]) <= documented, r["alert"]
    dash = json.loads((DEPLOY / "grafana" / "kvcache.json").read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert len(exprs) > 20
    used: set[str] = set()
    for e in exprs:
        assert _metric_names(e) <= documented, e
        used |= _metric_names(e)
    # the dashboard shows what an SRE looks at first: reads, lag, latency, peers, sync
    for name in ("kvcache_reads_total", "kvcache_replica_lag_seconds", "kvcache_command_duration_seconds",
                 "kvcache_peer_up", "kvcache_replica_synced", "kvcache_build_info"):
        assert name in used
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "bucket"} <= variables
