"""README.md's code blocks, run against the demo `make demo` starts, so they cannot drift from it;
and bench/locustfile.py, headless for a few seconds against the same demo.

The demo is started as `make demo` starts it, `python -m kvcache serve --data-dir DIR` (an
embedded nats-server and the `demo` bucket), with DIR = <work>/kvcache-data: each block runs in
<work>, where `kvcache-data/kvcache.sock` is the demo's socket, as in a clone after `make demo`.

How a block is treated, by its fence's info string and its first line:

- marked: a block right after an HTML comment `<!-- example: <what it needs> -->` (out of the
  rendered page's sight) is for another setup (a NATS cluster, Docker, a tool the demo does
  not have) or is not code (a picture), and is not run. The block's own first comment says
  what it needs, for the reader.
- `sh`: run by `bash -euo pipefail` with the `kvcache` command of this interpreter first on
  PATH (as in an activated ./.venv); `python`: run by this interpreter; `toml`: loaded with
  kvcache's configuration loader (parsed and validated, as `kvcache serve --config` does).
  Each must succeed with no error reply (`(error)`, `ERR`) and no traceback in its output.
- any other block must be marked: the test fails on one it cannot run.

Ports: the README names the demo's optional fixed ports, 127.0.0.1:4222 (the embedded
nats-server, `KVCACHE_EMBEDDED_PORT=4222 make demo`) and 127.0.0.1:9464 (the metrics listener,
`KVCACHE_METRICS_LISTEN=127.0.0.1:9464 make demo`). The demo here runs with both set to free
ports this test chooses, substituted for those two in the blocks before they run.

`pytest -s tests/test_readme.py` prints the blocks run and the blocks marked (line, kind, first line).
"""
from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.packaging import build_sdist, clean_env, pip_install, venv
from support.sidecar_proc import SidecarProcess

from kvcache.natsio.nats_server import free_port

pytestmark = pytest.mark.servers  # starts a demo sidecar, its nats-server and locust

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUNNABLE = ("sh", "python", "toml")
MARKER = re.compile(r"^<!-- example: .+ -->$")
NATS_PORT, METRICS_PORT = "127.0.0.1:4222", "127.0.0.1:9464"
FAILURE = re.compile(r"\(error\)|^ERR |Traceback \(most recent call last\)", re.M)


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    before: str = ""  # the line above the opening fence

    @property
    def marked(self) -> bool:
        return bool(MARKER.match(self.before))

    @property
    def title(self) -> str:
        return f"README.md:{self.line} [{self.lang or 'text'}] {self.text.strip().splitlines()[0][:90]}"


def blocks(text: str) -> list[Block]:
    """Every fenced block (``` at the start of a line), in order."""
    out: list[Block] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)", lines[i])
        if m:
            start, lang, body = i, m.group(1), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append(Block(start + 1, lang, "\n".join(body) + "\n", lines[start - 1] if start else ""))
        i += 1
    return out


def test_the_block_parser_sees_every_block():
    text = "a\n```sh\necho 1\n```\n<!-- example: x -->\n```\nplain\n```\n```python\nprint(1)\n```\n"
    got = blocks(text)
    assert [(b.line, b.lang, b.marked) for b in got] == [(2, "sh", False), (6, "", True), (9, "python", False)]
    assert len(blocks(README.read_text())) == README.read_text().count("\n```") // 2


def test_every_block_runs_or_is_marked():
    """Every block is in a language the test runs, or marked; and the marker and the list are
    not vacuous."""
    all_blocks = blocks(README.read_text())
    unrunnable = [b.title for b in all_blocks if not b.marked and b.lang not in RUNNABLE]
    assert unrunnable == [], "mark these `<!-- example: <what they need> -->` (above the fence) or make them runnable"
    run = [b for b in all_blocks if not b.marked]
    print("\nREADME.md blocks run against the demo:")
    for b in run:
        print("  run    " + b.title)
    print("README.md blocks marked as examples for another setup (not run):")
    for b in all_blocks:
        if b.marked:
            print("  marked " + b.title)
    assert len(run) >= 8 and len(run) < len(all_blocks)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo, as `make demo` starts it, with fixed ports of the test's choosing."""
    work = tmp_path_factory.mktemp("readme")
    ports = {NATS_PORT: f"127.0.0.1:{free_port()}", METRICS_PORT: f"127.0.0.1:{free_port()}"}
    env = {"KVCACHE_EMBEDDED_PORT": ports[NATS_PORT].rsplit(":", 1)[1], "KVCACHE_METRICS_LISTEN": ports[METRICS_PORT]}
    sc = SidecarProcess(work / "kvcache-data", None, env=env)
    sc.args = [sys.executable, "-m", "kvcache", "serve", "--data-dir", str(sc.data_dir)]
    assert sc.socket == str(work / "kvcache-data" / "kvcache.sock")  # the sidecar's default
    sc.start()
    with sc.client() as c:
        assert c.info("server")["server"]["nats_url"] == "nats://" + ports[NATS_PORT]
    yield work, ports, sc
    assert sc.stop() == 0


def _env() -> dict[str, str]:
    """This interpreter's scripts (kvcache, locust) first on PATH: an activated venv."""
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    return {**env, "PATH": bindir + os.pathsep + env.get("PATH", "")}


def _runnable() -> list[Block]:
    return [b for b in blocks(README.read_text()) if not b.marked and b.lang in RUNNABLE]


def run_block(block: Block, work: Path, ports: dict[str, str], python: Path, env: dict[str, str]) -> str:
    """Run one block as the README's reader would, in `work` (the clone, after `make demo`)
    with `python` and `env` (PATH first: that interpreter's scripts); its output. Fails the
    test on an exit status, an error reply or a traceback."""
    text = block.text
    for written, actual in ports.items():
        text = text.replace(written, actual)
    if block.lang == "toml":
        f = work / f"readme-{block.line}.toml"
        f.write_text(text)
        # a ConfigError (invalid TOML, unknown key, bad value) fails, as `kvcache serve --config` would
        cmd = [str(python), "-c", "import sys; from kvcache import config_sources; "
                                  "config_sources.load(sys.argv[1], env={})", str(f)]
    elif block.lang == "sh":
        cmd = ["bash", "-euo", "pipefail", "-c", text]
    else:
        cmd = [str(python), "-c", text]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    print(f"{block.title}\n{out}")
    assert r.returncode == 0, f"{block.title} exited {r.returncode}:\n{out}"
    assert not FAILURE.search(out), f"{block.title} answered an error:\n{out}"
    return out


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: f"line{b.line}-{b.lang}")
def test_readme_block(block: Block, demo):
    work, ports, sc = demo
    run_block(block, work, ports, Path(sys.executable), _env())
    assert "Traceback" not in sc.log()


def test_locustfile_against_the_demo(demo):
    """bench/locustfile.py as its docstring says to run it against `make demo`: no failure."""
    work, _, sc = demo
    if shutil.which("locust", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("locust is not installed: it is in the test extra (make test installs it)")
    prefix = work / "locust"
    with sc.client() as c:
        remote_before = c.info("stats")["stats"]["gets_remote"]
    r = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "bench" / "locustfile.py"), "--headless",
         "-u", "5", "-r", "5", "--run-time", "5s", "--stop-timeout", "5", "--only-summary",
         "--loglevel", "WARNING", "--csv", str(prefix), "--kv-socket", sc.socket],
        cwd=work, env=_env(), capture_output=True, text=True, timeout=120)
    out = r.stdout[-4000:] + r.stderr[-4000:]
    rows = {row["Name"]: row for row in csv.DictReader(open(f"{prefix}_stats.csv"))}
    total = rows["Aggregated"]
    with sc.client() as c:
        remote = c.info("stats")["stats"]["gets_remote"] - remote_before
    print(f"locust: {total['Request Count']} requests, {total['Failure Count']} failures, "
          f"{remote} reads answered by NATS")
    assert r.returncode == 0, out
    assert int(total["Request Count"]) > 100 and int(total["Failure Count"]) == 0, out
    # the demo replicates every key: its remote reads are strong ones (a GET of a cold key would
    # be answered locally), each answered by NATS (a reply from the sidecar itself fails it)
    cold = "KV.GET cold strong (remote)"
    assert set(rows) == {"GET hot (zipf)", "MGET 8 hot (zipf)", cold, "GET missing", "Aggregated"}, rows.keys()
    assert remote >= int(rows[cold]["Request Count"]) > 0, (remote, rows[cold])


# ---------------------------------------------------------------- in the environment `make demo` makes

LOCUST = re.compile(r"`(locust -f bench/locustfile\.py [^`]*)`")


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory) -> Path:
    """A fresh virtualenv with kvcache[demo] and nothing else, as `make demo` makes ./.venv
    (pip install of this tree's sdist with the demo extra). The pure-Python twins
    (KVCACHE_PURE_PYTHON=1, no compile): what is checked here is what the examples import and
    run, and the native paths are tests/test_packaging.py's."""
    where = tmp_path_factory.mktemp("demo-env")
    python = venv(where / "venv")
    spec = f"{build_sdist(where / 'sdist')}[demo]"
    r = pip_install(python, spec, where, env={**clean_env(), "KVCACHE_PURE_PYTHON": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return python


def test_readme_in_the_demo_environment(demo_env, tmp_path):
    """Every runnable block, then the locust command as README.md writes it, against the demo
    started from a virtualenv with only kvcache[demo], on a PATH where redis-tools are absent
    (redis-cli, redis-benchmark and redis-server shadowed by commands that fail): what a new
    user has after `make demo` on a fresh machine. Before the demo extra, the blocks importing
    redis and the locust command failed here while passing in the test virtualenv."""
    work = tmp_path
    (work / "bench").symlink_to(ROOT / "bench")  # the clone's bench/, for the locust command
    shims = work / "no-redis-tools"
    shims.mkdir()
    for tool in ("redis-cli", "redis-benchmark", "redis-server"):
        (shims / tool).write_text(f"#!/bin/sh\necho '{tool}: not installed (no redis-tools here)' >&2\nexit 127\n")
        (shims / tool).chmod(0o755)
    test_bin = str(Path(sys.executable).parent)
    rest = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and d != test_bin]
    env = {**clean_env(), "PATH": os.pathsep.join([str(demo_env.parent), str(shims), *rest])}
    ports = {NATS_PORT: f"127.0.0.1:{free_port()}", METRICS_PORT: f"127.0.0.1:{free_port()}"}
    sc = SidecarProcess(work / "kvcache-data", None)
    sc.args = [str(demo_env), "-m", "kvcache", "serve", "--data-dir", str(sc.data_dir)]
    sc.cwd = work  # (from the test's directory, `-m kvcache` would import this tree's package)
    sc.env = {**env, "KVCACHE_EMBEDDED_PORT": ports[NATS_PORT].rsplit(":", 1)[1],
              "KVCACHE_METRICS_LISTEN": ports[METRICS_PORT]}
    with sc:
        sc.start()
        for block in _runnable():
            run_block(block, work, ports, demo_env, env)
        (locust,) = LOCUST.findall(README.read_text())
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", locust], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
        out = r.stdout[-4000:] + r.stderr[-4000:]
        assert r.returncode == 0, f"{locust} exited {r.returncode}:\n{out}"
        assert "Aggregated" in out, out
        assert "Traceback" not in sc.log()
