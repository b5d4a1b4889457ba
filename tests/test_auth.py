"""Secured NATS: `kvcache serve` as a real process against real nats-server processes that
demand user/password, a token, an nkey, a creds file (operator mode, JWTs made here), TLS
and mutual TLS; the least-privilege permission list of README ("Permissions"); secrets kept
out of logs and INFO; auth and TLS mistakes refused with one line before connecting.

Everything listens on 127.0.0.1. AUTH_ROWS collects each method's results (connects, reads
local and fallback, denied permission reported); `pytest -s` prints them as a markdown table at
the end of the module.
"""
from __future__ import annotations

import asyncio
import json
import re
import secrets
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nkeys
import pytest
from support.natsauth import Operator, have_openssl, make_pki, new_key, public, seed
from support.sidecar_proc import SidecarProcess, run_cli

from kvcache.app.client import ResponseError
from kvcache.natsio.nats_server import NatsServer

pytestmark = pytest.mark.servers  # each test starts its own servers or sidecar process

BUCKET = "b"
HEARTBEAT = ["--heartbeat-ms", "500", "--request-timeout-ms", "1000"]
AUTH_ROWS: dict[str, dict[str, str]] = {}


def kv_permissions(bucket: str = BUCKET, strong_reads: bool = True) -> tuple[list[str], list[str]]:
    """What kvcache needs (README, "Permissions"): publish, subscribe."""
    s = f"KV_{bucket}"
    pub = [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>", f"$JS.API.CONSUMER.MSG.NEXT.{s}.>",
           f"$JS.API.CONSUMER.DELETE.{s}.>", f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>",
           f"kvcache.state._.{bucket}", f"kvcache.relay._.{bucket}", f"kvcache.changes._.{bucket}"]
    if strong_reads:
        pub.append(f"$JS.API.STREAM.MSG.GET.{s}")
    sub = ["_INBOX.>", f"$JS.API.STREAM.PURGE.{s}", f"$JS.API.STREAM.MSG.DELETE.{s}", f"kvcache.state._.{bucket}",
           f"kvcache.relay._.{bucket}", f"kvcache.changes._.{bucket}"]
    return pub, sub


def perm_conf(pub: list[str], sub: list[str]) -> str:
    return json.dumps({"publish": {"allow": pub}, "subscribe": {"allow": sub}})


STRONG = f"$JS.API.STREAM.MSG.GET.KV_{BUCKET}"


@dataclass
class Secured:
    """A server set up for one auth method: its config, how the admin connects (to make the
    bucket), the sidecar's flags, and the secrets that must never show."""

    conf: str
    admin: dict
    flags: list[str]
    secrets: list[str]
    url_auth: str = ""  # user:pass@ or token@ in the sidecar's URL
    denies_strong: bool = True  # the sidecar's user lacks STREAM.MSG.GET (strong reads)
    files: dict[str, Path] = field(default_factory=dict)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    if not have_openssl():
        pytest.skip("the openssl CLI makes the test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: dict[str, Path], who: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki["ca.pem"]))
    if who:
        ctx.load_cert_chain(str(pki[f"{who}.pem"]), str(pki[f"{who}.key"]))
    return ctx


def _users(kv_user: dict, admin: bool = True) -> str:
    pub, sub = kv_permissions(strong_reads=False)
    users = ([{"user": "admin", "password": "adminpw"}] if admin else []) + [
        {**kv_user, "permissions": json.loads(perm_conf(pub, sub))}]
    return f"authorization {{ users = {json.dumps(users)} }}"


def setup_method(method: str, d: Path, pki_dir: Path | None) -> Secured:
    password = "pw-" + secrets.token_hex(8)
    admin = {"user": "admin", "password": "adminpw"}
    if method in ("user/password", "user:password@ in URL"):
        s = Secured(_users({"user": "kv", "password": password}), admin,
                    ["--user", "kv", "--password", password] if method == "user/password" else [], [password])
        if method != "user/password":
            s.url_auth = f"kv:{password}@"
        return s
    if method == "token":
        token = "tok-" + secrets.token_hex(12)
        return Secured(f'authorization {{ token: "{token}" }}', {"token": token}, ["--token", token], [token],
                       denies_strong=False)
    if method == "nkey":
        kp = new_key(nkeys.PREFIX_BYTE_USER)
        (d / "kv.nk").write_text(seed(kp) + "\n")
        return Secured(_users({"nkey": public(kp)}), admin, ["--nkey", str(d / "kv.nk")], [seed(kp)])
    if method == "creds (JWT)":
        op = Operator()
        pub, sub = kv_permissions(strong_reads=False)
        creds = op.user_creds(d / "kv.creds", "kvcache", pub, sub)
        admin_creds = op.user_creds(d / "admin.creds", "admin")
        text = creds.read_text()
        jwt, user_seed = text.split("\n")[1], re.search(r"(SU[A-Z0-9]+)", text).group(1)
        return Secured(op.server_conf(), {"user_credentials": str(admin_creds)}, ["--creds", str(creds)],
                       [jwt, user_seed])
    assert pki_dir is not None
    pki = {p.name: p for p in pki_dir.iterdir()}
    server_tls = f'cert_file: "{pki["server.pem"]}", key_file: "{pki["server.key"]}"'
    if method == "TLS":
        return Secured(f"tls {{ {server_tls} }}\n" + _users({"user": "kv", "password": password}),
                       {**admin, "tls": _tls(pki)}, ["--tls-ca", str(pki["ca.pem"]), "--user", "kv",
                                                     "--password", password], [password])
    if method == "mutual TLS":
        key = pki["client.key"].read_text()
        key_body = "".join(key.splitlines()[1:-1])[:40]
        conf = (f'tls {{ {server_tls}, ca_file: "{pki["ca.pem"]}", verify_and_map: true }}\n'
                + _users({"user": "CN=kvcache-client"}, admin=False).replace(
                    "users = [", 'users = [{"user": "CN=kvcache-admin"}, '))
        return Secured(conf, {"tls": _tls(pki, "admin")},
                       ["--tls-ca", str(pki["ca.pem"]), "--tls-cert", str(pki["client.pem"]),
                        "--tls-key", str(pki["client.key"])], [key_body])
    raise AssertionError(method)


async def make_bucket(url: str, admin: dict) -> None:
    nc = await nats.connect(url, **admin)
    try:
        kv = await nc.jetstream().create_key_value(bucket=BUCKET, direct=True)
        await kv.put("a", b"one")
        await kv.put("other.x", b"outside")
    finally:
        await nc.close()


METHODS = ["user/password", "user:password@ in URL", "token", "nkey", "creds (JWT)", "TLS", "mutual TLS"]


@pytest.mark.parametrize("method", METHODS)
def test_auth_method(method: str, tmp_path: Path, request) -> None:
    """Connects, reads locally after sync, reads a key outside the filters with Direct Get
    through the same connection, and a permission the user lacks (strong reads) is one
    warning naming the subject; no secret in the log or INFO."""
    pki_dir = None
    if "TLS" in method:
        pki_dir = request.getfixturevalue("pki")["ca.pem"].parent
    sec = setup_method(method, tmp_path, pki_dir)
    server = NatsServer(tmp_path / "js", server_name="secured", extra_conf=sec.conf).start()
    row = AUTH_ROWS.setdefault(method, {})
    try:
        asyncio.run(make_bucket(server.url, sec.admin))
        url = server.url.replace("nats://", "nats://" + sec.url_auth)
        sc = SidecarProcess(tmp_path / "sc", url, buckets=[f"{BUCKET}:a"], extra=HEARTBEAT + sec.flags)
        with sc:
            sc.start(timeout=20)
            row["connects"] = "yes"
            with sc.client() as c:
                e = c.entry("a")
                assert (e.value, e.source) == (b"one", "local")
                row["reads (local)"] = "yes"
                e = c.entry("other.x")
                assert (e.value, e.source) == (b"outside", f"main.{BUCKET}")
                row["fallback reads"] = "yes"
                if sec.denies_strong:
                    with pytest.raises(ResponseError, match="upstream read failed"):
                        c.entry("a", consistency="strong")
                    sc.wait_for(lambda: f'NATS permission denied: publish to "{STRONG}"' in sc.log(),
                                what="the permission warning")
                    row["denied permission reported"] = "yes: one warning naming " + STRONG
                else:
                    assert c.entry("a", consistency="strong").source == "leader"
                    row["denied permission reported"] = "n/a (nats-server gives a token no permissions)"
                info = c.execute("INFO").decode()
            assert f"nats_url:{server.url}\r\n" in info  # credentials stripped from the URL
            assert sc.stop() == 0
        log = sc.log()
        assert log.count("NATS permission denied") == (1 if sec.denies_strong else 0), log
        for secret in [*sec.secrets, "adminpw"]:
            assert secret not in log and secret not in info, f"secret in the log or INFO:\n{log}\n{info}"
        assert "Traceback" not in log and "eof_received" not in log, log
    finally:
        server.stop()


# ---------------------------------------------------------------------------- least privilege

def test_least_privilege(tmp_path: Path) -> None:
    """A user with exactly README's list: sync, live updates, a single-key purge seen through
    the PURGE subscription, fallback, MGET and strong reads all work, with no warning."""
    pub, sub = kv_permissions()
    users = [{"user": "admin", "password": "adminpw"},
             {"user": "kv", "password": "kvpw", "permissions": json.loads(perm_conf(pub, sub))}]
    conf = f"authorization {{ users = {json.dumps(users)} }}"
    server = NatsServer(tmp_path / "js", server_name="lp", extra_conf=conf).start()
    admin = {"user": "admin", "password": "adminpw"}
    try:
        asyncio.run(make_bucket(server.url, admin))
        sc = SidecarProcess(tmp_path / "sc", server.url, buckets=[f"{BUCKET}:a,b.>"],
                     extra=[*HEARTBEAT, "--user", "kv", "--password", "kvpw"])
        with sc:
            sc.start(timeout=20)

            async def writes() -> None:
                nc = await nats.connect(server.url, **admin)
                kv = await nc.jetstream().key_value(BUCKET)
                await kv.put("a", b"two")
                await kv.put("b.1", b"x")
                await kv.put("b.2", b"y")
                await nc.close()

            asyncio.run(writes())
            with sc.client() as c:
                sc.wait_for(lambda: c.get("a") == b"two" and c.get("b.2") == b"y", what="live updates")

            async def purge_one() -> None:  # STREAM.PURGE with a filter: no marker message remains
                nc = await nats.connect(server.url, **admin)
                await nc.jetstream().purge_stream(f"KV_{BUCKET}", subject=f"$KV.{BUCKET}.b.1")
                await nc.close()

            asyncio.run(purge_one())
            with sc.client() as c:
                sc.wait_for(lambda: c.entry("b.1") is None, what="the purged key gone")
                assert c.entry("b.2").source == "local"
                assert c.entry("other.x").source == f"main.{BUCKET}"
                assert c.mget(["other.x", "other.none", "a"]) == [b"outside", None, b"two"]
                assert c.entry("a", consistency="strong").value == b"two"
                assert c.info("buckets")["buckets"][BUCKET]["synced"] == 1
            assert sc.stop() == 0
        assert "permission" not in sc.log().lower(), sc.log()
    finally:
        server.stop()


@pytest.mark.parametrize("missing", [f"$JS.API.CONSUMER.CREATE.KV_{BUCKET}.>", "_INBOX.>"])
def test_missing_permission_ends_with_one_line(missing: str, tmp_path: Path) -> None:
    """A permission the feed cannot work without: exit 1 with one error line naming the
    subject, at once (not a request timeout, not a retry loop), no traceback."""
    pub, sub = kv_permissions()
    users = [{"user": "admin", "password": "adminpw"},
             {"user": "kv", "password": "kvpw", "permissions": json.loads(perm_conf(
                 [p for p in pub if p != missing], [s for s in sub if s != missing]))}]
    server = NatsServer(tmp_path / "js", server_name="mp",
                        extra_conf=f"authorization {{ users = {json.dumps(users)} }}").start()
    try:
        asyncio.run(make_bucket(server.url, {"user": "admin", "password": "adminpw"}))
        t0 = time.monotonic()
        r = run_cli("serve", "--data-dir", str(tmp_path / "sc"), "--nats", server.url, "--bucket", BUCKET,
                    "--user", "kv", "--password", "kvpw", *HEARTBEAT, timeout=30)
        assert r.returncode == 1, r.stderr
        assert time.monotonic() - t0 < 10
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kvcache: error:")]
        prefix = missing.rstrip(">").rstrip("*")
        verb = "subscribe" if missing.startswith("_INBOX") else "publish"
        assert len(errors) == 1 and f'NATS permission denied: {verb} to "{prefix}' in errors[0], r.stderr
        assert "Traceback" not in r.stderr and "kvpw" not in r.stderr
    finally:
        server.stop()


# ---------------------------------------------------------------------------- mistakes

@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    files = {"garbage": d / "garbage.pem", "bad.creds": d / "bad.creds", "bad.nk": d / "bad.nk",
             "acct.nk": d / "acct.nk"}
    files["garbage"].write_text("not a certificate\n")
    files["bad.creds"].write_text("-----BEGIN NATS USER JWT-----\nnot.a.jwt!\n------END NATS USER JWT------\n")
    files["bad.nk"].write_text("SUNOTASEED\n")
    files["acct.nk"].write_text(seed(new_key(nkeys.PREFIX_BYTE_ACCOUNT)) + "\n")
    return files


def _cert_only(pki: dict[str, Path]) -> list[str]:
    return ["--tls-cert", str(pki["client.pem"])]


MISTAKES = [
    (lambda f, p: ["--tls-ca", "/nonexistent/ca.pem"], "tls_ca file /nonexistent/ca.pem: No such file"),
    (lambda f, p: ["--tls-ca", str(f["garbage"])], "no PEM certificate in it"),
    (lambda f, p: ["--creds", "/nonexistent/kv.creds"], "creds file /nonexistent/kv.creds: No such file"),
    (lambda f, p: ["--creds", str(f["bad.creds"])], "its user JWT is malformed"),
    (lambda f, p: ["--creds", str(f["garbage"])], "no user JWT in it"),
    (lambda f, p: ["--nkey", "/nonexistent/kv.nk"], "nkey file /nonexistent/kv.nk: No such file"),
    (lambda f, p: ["--nkey", str(f["bad.nk"])], "not an nkey seed"),
    (lambda f, p: ["--nkey", str(f["acct.nk"])], "not a user nkey seed"),
    (lambda f, p: _cert_only(p), "no private key in it"),
    (lambda f, p: ["--tls-key", str(p["client.key"])], "tls_key needs tls_cert"),
    (lambda f, p: ["--tls-cert", str(p["client.pem"]), "--tls-key", str(p["server.key"])], "does not belong"),
    (lambda f, p: ["--user", "kv"], "user needs password"),
]


def test_mistakes_refused_before_connecting(bad_files, pki, tmp_path: Path) -> None:
    """Each: exit 2 with one `kvcache: error:` line, no traceback, nothing created upstream
    (the URL points at a closed port: no attempt to connect is made)."""
    for make, expect in MISTAKES:
        args = make(bad_files, pki)
        r = run_cli("serve", "--data-dir", str(tmp_path / "sc"), "--nats", "nats://127.0.0.1:1",
                    "--bucket", BUCKET, *args, timeout=30)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvcache: error:") and expect in lines[0], (args, r.stderr)
        assert "SUNOTASEED" not in r.stderr


def test_secret_in_a_bad_url_is_not_shown(tmp_path: Path) -> None:
    r = run_cli("serve", "--data-dir", str(tmp_path / "sc"), "--nats", "nats://kv:s3cr/et@127.0.0.1:1",
                "--bucket", BUCKET, timeout=30)
    assert r.returncode == 2 and "invalid NATS URL 'nats://***@127.0.0.1:1'" in r.stderr, r.stderr
    assert "s3cr" not in r.stderr


def test_wrong_password_and_untrusted_server(pki, tmp_path: Path) -> None:
    """Refused credentials and a server certificate kvcache cannot verify: exit 1 at once with
    the server's (or TLS's) reason, not "no servers available", not a retry loop."""
    conf = (f'tls {{ cert_file: "{pki["server.pem"]}", key_file: "{pki["server.key"]}" }}\n'
            'authorization { users = [ {user: "kv", password: "right-pw"} ] }')
    server = NatsServer(tmp_path / "js", server_name="wp", jetstream=False, extra_conf=conf).start()
    try:
        cases = [(["--tls-ca", str(pki["ca.pem"]), "--user", "kv", "--password", "wrong-pw"],
                  "authorization violation"),
                 (["--user", "kv", "--password", "right-pw"], "certificate verify failed")]
        for args, expect in cases:
            t0 = time.monotonic()
            r = run_cli("serve", "--data-dir", str(tmp_path / "sc"), "--nats", server.url, "--bucket", BUCKET,
                        "--connect-timeout-s", "2", *args, timeout=30)
            assert r.returncode == 1 and time.monotonic() - t0 < 10, r.stderr
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and f"cannot connect to NATS at {server.url}: " in lines[0], r.stderr
            assert expect in lines[0].lower(), r.stderr
            assert "wrong-pw" not in r.stderr and "right-pw" not in r.stderr
    finally:
        server.stop()


def teardown_module() -> None:
    if not AUTH_ROWS:
        return
    cols = ["connects", "reads (local)", "fallback reads", "denied permission reported"]
    print("\n| method | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for method in METHODS:
        if method in AUTH_ROWS:
            print(f"| {method} | " + " | ".join(AUTH_ROWS[method].get(c, "FAILED") for c in cols) + " |")
