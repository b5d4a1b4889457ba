"""`kvcache load` into secured NATS: the credential and TLS flags are `serve`'s (one
definition in kvcache.cli), used by the driver and by every Spark partition; refused
credentials, a certificate that does not verify and a flag mistake are each one line.

Servers are real nats-server processes on 127.0.0.1 with certificates and keys made here
(tests/support/natsauth.py); the loads run on the test session's local Spark."""
from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import nats
import nkeys
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.natsauth import have_openssl, make_pki, new_key, public, seed
from support.sidecar_proc import run_cli
from test_pipeline_load import load, summary_of

from kvcache.natsio.nats_server import NatsServer

pytestmark = pytest.mark.servers  # each test starts its own secured servers

ROWS = {f"sec.{i}": f"value {i}".encode() for i in range(50)}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    if not have_openssl():
        pytest.skip("the openssl CLI makes the test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def _data(tmp_path: Path) -> str:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"k": list(ROWS), "v": pa.array(list(ROWS.values()), pa.binary())}), path)
    return str(path)


def _tls_conf(pki: dict[str, Path], verify: bool = False) -> str:
    extra = f', ca_file: "{pki["ca.pem"]}", verify_and_map: true' if verify else ""
    return f'tls {{ cert_file: "{pki["server.pem"]}", key_file: "{pki["server.key"]}"{extra} }}\n'


async def _read_back(url: str, bucket: str, **connect: object) -> dict[str, bytes]:
    nc = await nats.connect(url, **connect)
    try:
        kv = await nc.jetstream().key_value(bucket)
        return {k: (await kv.get(k)).value for k in ROWS}
    finally:
        await nc.close()


def test_load_over_tls_with_user_and_password(spark, pki, tmp_path, capsys):
    """A TLS-only server: the CA from --tls-ca, the user from --user/--password."""
    conf = _tls_conf(pki) + 'authorization { users = [ {user: "loader", password: "load-pw"} ] }'
    server = NatsServer(tmp_path / "js", server_name="tls", extra_conf=conf).start()
    try:
        code, out, err = load(capsys, _data(tmp_path), "--nats", server.url, "--bucket", "sec", "--key", "k",
                              "--value", "v", "--tls-ca", str(pki["ca.pem"]), "--user", "loader",
                              "--password", "load-pw")
        assert code == 0, out + err
        assert summary_of(out)["written"] == len(ROWS)
        ctx = ssl.create_default_context(cafile=str(pki["ca.pem"]))
        assert asyncio.run(_read_back(server.url, "sec", tls=ctx, user="loader", password="load-pw")) == ROWS
    finally:
        server.stop()


def test_load_with_mutual_tls_and_with_an_nkey(spark, pki, tmp_path, capsys):
    """A client certificate (--tls-cert/--tls-key, mapped to the user by the server), then an
    nkey seed file (--nkey)."""
    conf = _tls_conf(pki, verify=True) + 'authorization { users = [ {user: "CN=kvcache-client"} ] }'
    server = NatsServer(tmp_path / "mtls", server_name="mtls", extra_conf=conf).start()
    try:
        code, out, err = load(capsys, _data(tmp_path), "--nats", server.url, "--bucket", "mtls", "--key", "k",
                              "--value", "v", "--tls-ca", str(pki["ca.pem"]), "--tls-cert", str(pki["client.pem"]),
                              "--tls-key", str(pki["client.key"]))
        assert code == 0, out + err
        ctx = ssl.create_default_context(cafile=str(pki["ca.pem"]))
        ctx.load_cert_chain(str(pki["client.pem"]), str(pki["client.key"]))
        assert asyncio.run(_read_back(server.url, "mtls", tls=ctx)) == ROWS
    finally:
        server.stop()

    kp = new_key(nkeys.PREFIX_BYTE_USER)
    (tmp_path / "loader.nk").write_text(seed(kp) + "\n")
    server = NatsServer(tmp_path / "nk", server_name="nk",
                        extra_conf=f'authorization {{ users = [ {{nkey: "{public(kp)}"}} ] }}').start()
    try:
        code, out, err = load(capsys, _data(tmp_path), "--nats", server.url, "--bucket", "nk", "--key", "k",
                              "--value", "v", "--nkey", str(tmp_path / "loader.nk"))
        assert code == 0, out + err
        assert asyncio.run(_read_back(server.url, "nk", nkeys_seed=str(tmp_path / "loader.nk"))) == ROWS
    finally:
        server.stop()


def test_refused_credentials_and_mistakes_are_one_line(pki, tmp_path):
    """A wrong password and an unverifiable server certificate: exit 1 with the reason, before
    Spark starts; a flag mistake: exit 2 before connecting. One line each, no secret shown."""
    conf = _tls_conf(pki) + 'authorization { users = [ {user: "loader", password: "right-pw"} ] }'
    server = NatsServer(tmp_path / "js", server_name="wrong", jetstream=False, extra_conf=conf).start()
    data = _data(tmp_path)
    try:
        cases = [
            (["--tls-ca", str(pki["ca.pem"]), "--user", "loader", "--password", "wrong-pw"], 1,
             f"kvcache: error: cannot connect to NATS at {server.url}: authorization violation"),
            (["--user", "loader", "--password", "right-pw"], 1,
             f"kvcache: error: cannot connect to NATS at {server.url}: "),  # then the TLS reason
            (["--tls-key", str(pki["client.key"])], 2, "kvcache: error: tls_key needs tls_cert"),
            (["--user", "loader"], 2, "kvcache: error: user needs password"),
            (["--nkey", str(tmp_path / "missing.nk")], 2, f"kvcache: error: nkey file {tmp_path / 'missing.nk'}"),
        ]
        for flags, exit_code, expect in cases:
            p = run_cli("load", data, "--nats", server.url, "--bucket", "b", "--key", "k", "--value", "v",
                        *flags, timeout=60)
            lines = p.stderr.strip().splitlines()
            assert p.returncode == exit_code and len(lines) == 1 and lines[0].startswith(expect), (flags, p.stderr)
            assert "wrong-pw" not in p.stderr and "right-pw" not in p.stderr
        assert "certificate verify failed" in run_cli(
            "load", data, "--nats", server.url, "--bucket", "b", "--key", "k", timeout=60).stderr.lower()
    finally:
        server.stop()
