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
- `js`: a Node.js program whose first line names its file (`// reads.mjs: ...`): saved under
  that name and run by `node` in a directory of its own holding `kvcache-data` (the demo's)
  and `node_modules` with `ioredis` and `redis` as README.md has the reader install them, the
  versions tests/node pins (`npm ci --prefix tests/node`, `make install-test`): v5 of both,
  then v6 of both (their `-v6` aliases there) where Node.js is 20 or later. NODE_EXPECT says
  what each must print and the environment it runs with; skipped, saying so, without `node`.
- any other block must be marked: the test fails on one it cannot run.

Ports: the README names the demo's optional fixed ports, 127.0.0.1:4222 (the embedded
nats-server, `KVCACHE_EMBEDDED_PORT=4222 make demo`), 127.0.0.1:9464 (the metrics listener,
`KVCACHE_METRICS_LISTEN=127.0.0.1:9464 make demo`) and 127.0.0.1:6380 (the TCP listener the
client-side caching block starts the demo with, with its password and compat identity). The
demo here runs with all of them set, on free ports this test chooses, substituted for those
in the blocks before they run.

`pytest -s tests/test_readme.py` prints the blocks run and the blocks marked (line, kind, first line).
"""
from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.packaging import build_sdist, clean_env, pip_install, venv
from support.poll import wait_until
from support.sidecar_proc import SidecarProcess
from support.topology import nats_run

from kvcache.natsio.nats_server import free_port

pytestmark = pytest.mark.servers  # starts a demo sidecar, its nats-server and locust

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUNNABLE = ("sh", "python", "toml", "js")
MARKER = re.compile(r"^<!-- example: .+ -->$")
NATS_PORT, METRICS_PORT, LISTEN_PORT = "127.0.0.1:4222", "127.0.0.1:9464", "127.0.0.1:6380"
# what README.md's client-side caching block starts the demo with, beside the listener
DEMO_PASSWORD = "demo-password"
FAILURE = re.compile(r"\(error\)|^ERR |Traceback \(most recent call last\)", re.M)

NODE = shutil.which("node")
NODE_MODULES = ROOT / "tests" / "node" / "node_modules"
# the packages README.md's blocks import, by major version: where tests/node installs each
NODE_CLIENTS = {5: {"ioredis": "ioredis", "redis": "redis"}, 6: {"ioredis": "ioredis-v6", "redis": "redis-v6"}}
NODE_NEEDS = {5: 18, 6: 20}  # the Node.js major each needs (their package.json `engines`)
NODE_FILE = re.compile(r"^// ([\w.-]+\.mjs): ")
# What each Node block (by its file name) must print, each pattern on a line of its own
# output, and the environment it runs with (follow.mjs: a bound on what it follows).
NODE_EXPECT: dict[str, tuple[dict[str, str], list[str]]] = {
    "reads.mjs": ({}, [r"^hello from kvcache$",
                       r"'\{\"id\":1,\"name\":\"user 1\"\}',\s*'\{\"enabled\":true,\"rollout\":0\.25\}',\s*null",
                       r"'hello from kvcache',\s*'\{\"id\":42,\"name\":\"user 42\"\}'"]),
    "cache.mjs": ({}, [r"^cache hits 1, misses 1$"]),
    "follow.mjs": ({"FOLLOW_MAX": "2"}, [r"^\d+-0 PUT feature\.checkout \{\"enabled\":true",
                                         r"^\d+-0 PUT feature\.search \{"]),
}


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
    def node_file(self) -> str:
        """A `js` block's file name, from its first line (`// reads.mjs: ...`); '' if none."""
        m = NODE_FILE.match(self.text)
        return m.group(1) if m else ""

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


def test_every_node_block_names_its_file_and_what_it_prints():
    """A Node block runs as the file its first line names, and NODE_EXPECT says what it must
    print: none runs unchecked, and no expectation outlives its block."""
    names = [b.node_file for b in _runnable() if b.lang == "js"]
    assert "" not in names, "a js block's first line must be `// <name>.mjs: <what it does>`"
    assert len(set(names)) == len(names), names
    assert sorted(names) == sorted(NODE_EXPECT), (names, sorted(NODE_EXPECT))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo, as `make demo` starts it, with fixed ports of the test's choosing."""
    work = tmp_path_factory.mktemp("readme")
    ports = demo_ports()
    sc = SidecarProcess(work / "kvcache-data", None, env=demo_env_vars(ports))
    sc.args = [sys.executable, "-m", "kvcache", "serve", "--data-dir", str(sc.data_dir)]
    assert sc.socket == str(work / "kvcache-data" / "kvcache.sock")  # the sidecar's default
    sc.start()
    with sc.client() as c:
        assert c.info("server")["server"]["nats_url"] == "nats://" + ports[NATS_PORT]
    yield work, ports, sc
    assert sc.stop() == 0


def demo_ports() -> dict[str, str]:
    """The README's fixed ports, each to a free one."""
    return {port: f"127.0.0.1:{free_port()}" for port in (NATS_PORT, METRICS_PORT, LISTEN_PORT)}


def demo_env_vars(ports: dict[str, str]) -> dict[str, str]:
    """The environment README.md starts `make demo` with where a block needs it: the embedded
    server's and the metrics listener's ports, and (client-side caching with redis-py) a TCP
    listener with a password and the compat identity."""
    return {"KVCACHE_EMBEDDED_PORT": ports[NATS_PORT].rsplit(":", 1)[1],
            "KVCACHE_METRICS_LISTEN": ports[METRICS_PORT], "KVCACHE_LISTEN": ports[LISTEN_PORT],
            "KVCACHE_REQUIREPASS": DEMO_PASSWORD, "KVCACHE_COMPAT_IDENTITY": "true"}


def _env() -> dict[str, str]:
    """This interpreter's scripts (kvcache, locust) first on PATH: an activated venv."""
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    return {**env, "PATH": bindir + os.pathsep + env.get("PATH", "")}


def _runnable() -> list[Block]:
    return [b for b in blocks(README.read_text()) if not b.marked and b.lang in RUNNABLE]


def node_missing(major: int) -> str:
    """Why Node blocks cannot run with v`major` of the clients here ('' when they can): no
    `node`, or one older than they need. tests/node's packages missing is a failure instead:
    `make install-test` installs them wherever there is a `node`."""
    if NODE is None:
        return "node is not installed: README.md's Node.js blocks are not run (make test installs it)"
    version = subprocess.run([NODE, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < NODE_NEEDS[major]:
        return f"ioredis and node-redis v{major} need Node.js {NODE_NEEDS[major]}+, node is {version}"
    for package in NODE_CLIENTS[major].values():
        if not (NODE_MODULES / package).is_dir():
            pytest.fail(f"{NODE_MODULES / package} is missing: run `make install-test` "
                        "(npm ci --prefix tests/node)")
    return ""


def node_dir(work: Path, major: int) -> Path:
    """A fresh directory to run a Node block in, as the reader's clone after `npm install
    --no-save ioredis@<major> redis@<major>`: the demo's `kvcache-data`, and `node_modules`
    where `ioredis` and `redis` are tests/node's packages of that major version."""
    where = Path(tempfile.mkdtemp(prefix=f"node-v{major}-", dir=work))
    (where / "kvcache-data").symlink_to(work / "kvcache-data")
    (where / "node_modules").mkdir()
    for name, package in NODE_CLIENTS[major].items():
        (where / "node_modules" / name).symlink_to(NODE_MODULES / package)
    return where


def node_command(block: Block, where: Path) -> list[str]:
    """The block saved in `where` as the file its first line names, and `node <file>`."""
    assert NODE is not None and block.node_file, block.title
    (where / block.node_file).write_text(block.text)
    return [NODE, block.node_file]


def run_block(block: Block, work: Path, ports: dict[str, str], python: Path, env: dict[str, str],
              node_major: int = 5) -> str:
    """Run one block as the README's reader would, in `work` (the clone, after `make demo`)
    with `python` and `env` (PATH first: that interpreter's scripts); its output. Fails the
    test on an exit status, an error reply or a traceback. A Node block runs with v`node_major`
    of the clients, with the environment NODE_EXPECT gives it, and must print what that says."""
    text = block.text
    for written, actual in ports.items():
        text = text.replace(written, actual)
    cwd = work
    if block.lang == "js":
        cwd = node_dir(work, node_major)
        cmd = node_command(Block(block.line, block.lang, text), cwd)
        env = {**env, **NODE_EXPECT[block.node_file][0]}
    elif block.lang == "toml":
        f = work / f"readme-{block.line}.toml"
        f.write_text(text)
        # a ConfigError (invalid TOML, unknown key, bad value) fails, as `kvcache serve --config` would
        cmd = [str(python), "-c", "import sys; from kvcache import config_sources; "
                                  "config_sources.load(sys.argv[1], env={})", str(f)]
    elif block.lang == "sh":
        cmd = ["bash", "-euo", "pipefail", "-c", text]
    else:
        cmd = [str(python), "-c", text]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    print(f"{block.title}\n{out}")
    assert r.returncode == 0, f"{block.title} exited {r.returncode}:\n{out}"
    assert not FAILURE.search(out), f"{block.title} answered an error:\n{out}"
    if block.lang == "js":
        for pattern in NODE_EXPECT[block.node_file][1]:
            assert re.search(pattern, r.stdout, re.M), f"{block.title} did not print /{pattern}/:\n{out}"
    return out


@pytest.mark.parametrize("block", [b for b in _runnable() if b.lang != "js"], ids=lambda b: f"line{b.line}-{b.lang}")
def test_readme_block(block: Block, demo):
    work, ports, sc = demo
    run_block(block, work, ports, Path(sys.executable), _env())
    assert "Traceback" not in sc.log()


@pytest.mark.parametrize("major", sorted(NODE_CLIENTS), ids=lambda m: f"v{m}")
@pytest.mark.parametrize("block", [b for b in _runnable() if b.lang == "js"], ids=lambda b: b.node_file)
def test_readme_node_block(block: Block, major: int, demo):
    """A Node block, as written, with v5 and with v6 of ioredis and node-redis: it exits 0
    and prints what NODE_EXPECT says."""
    if why := node_missing(major):
        pytest.skip(why)
    work, ports, sc = demo
    run_block(block, work, ports, Path(sys.executable), _env(), node_major=major)
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


def _follower() -> Block:
    (block,) = [b for b in _runnable() if b.node_file == "follow.mjs"]
    return block


def _demo_kv(url: str, change) -> int:
    """`change(kv)` on the demo bucket through NATS; the bucket's last revision after it."""
    async def go(js):
        kv = await js.key_value("demo")
        await change(kv)
        return (await js.stream_info("KV_demo")).state.last_seq
    return nats_run(url, go)


def _entries(out: str) -> list[tuple[int, str, str]]:
    """follow.mjs's entry lines: (revision, op, key)."""
    return [(int(m.group(1)), m.group(2), m.group(3))
            for m in re.finditer(r"^(\d+)-0 (PUT|DEL|PURGE) (\S+)", out, re.M)]


@pytest.mark.parametrize("major", sorted(NODE_CLIENTS), ids=lambda m: f"v{m}")
def test_readme_follower_resumes_after_restarts(major: int, demo):
    """README.md's follow.mjs as written, with v5 and v6 of ioredis. Its first run lists the
    flags from 0 and keeps the last ID; run again after a put and a delete, it prints those
    two (the delete without a value) and nothing it had listed. Blocked in XREAD when the
    sidecar stops, it gets `ERR stream read ended ... read again from the last ID you have`,
    waits through the restart, reads again from the same ID and prints the put made after it:
    an app without that loop would have exited at the error."""
    if why := node_missing(major):
        pytest.skip(why)
    work, ports, sc = demo
    url = "nats://" + ports[NATS_PORT]
    where = node_dir(work, major)
    cmd = node_command(_follower(), where)
    env = {**_env(), "FOLLOW_MAX": "2"}

    def run() -> str:
        r = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=60)
        print(r.stdout + r.stderr)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    first = _entries(run())
    assert {(op, key) for _, op, key in first} >= {("PUT", "feature.checkout"), ("PUT", "feature.search")}, first
    kept = (where / "follow.last-id").read_text()
    assert kept == f"{max(rev for rev, _, _ in first)}-0"

    async def put_and_delete(kv):
        await kv.put("feature.search", f'{{"enabled":true,"by":"v{major}"}}'.encode())
        await kv.delete("feature.gone")
    last = _demo_kv(url, put_and_delete)
    out = run()  # the follower's own restart: from the ID it kept
    assert _entries(out) == [(last - 1, "PUT", "feature.search"), (last, "DEL", "feature.gone")], out
    assert f"{last}-0 DEL feature.gone (no value: deleted)\n" in out
    kept = (where / "follow.last-id").read_text()
    assert kept == f"{last}-0"

    env["FOLLOW_MAX"] = "1"
    follower = subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def waiting() -> bool:
            assert follower.poll() is None, follower.communicate()
            with sc.client() as c:
                listing = c.execute("CLIENT", "LIST").decode()
            return "cmd=xread" in listing
        wait_until(waiting, 30, "follow.mjs to wait in XREAD")
        assert sc.stop() == 0
        sc.start()
        after = _demo_kv(url, lambda kv: kv.put("feature.search", b'{"enabled":"after the restart"}'))
        out, err = follower.communicate(timeout=90)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    print(out + err)
    assert follower.returncode == 0, out + err
    assert (f"ERR stream read ended: bucket demo: kvcache is shutting down; read again from the last ID "
            f"you have: reading again from {kept}") in out, out
    assert _entries(out) == [(after, "PUT", "feature.search")], out
    assert f'{after}-0 PUT feature.search {{"enabled":"after the restart"}}' in out


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
    ports = demo_ports()
    sc = SidecarProcess(work / "kvcache-data", None)
    sc.args = [str(demo_env), "-m", "kvcache", "serve", "--data-dir", str(sc.data_dir)]
    sc.cwd = work  # (from the test's directory, `-m kvcache` would import this tree's package)
    sc.env = {**env, **demo_env_vars(ports)}
    no_node = node_missing(5)
    with sc:
        sc.start()
        for block in _runnable():
            if block.lang == "js" and no_node:
                print(f"{block.title}: skipped, {no_node}")
                continue
            run_block(block, work, ports, demo_env, env)
        (locust,) = LOCUST.findall(README.read_text())
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", locust], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
        out = r.stdout[-4000:] + r.stderr[-4000:]
        assert r.returncode == 0, f"{locust} exited {r.returncode}:\n{out}"
        assert "Aggregated" in out, out
        assert "Traceback" not in sc.log()
