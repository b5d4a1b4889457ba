"""Credentials for secured test servers, made on the spot: nkeys, JWTs (operator mode), creds
files and TLS certificates. Nothing here talks to the network.

JWTs follow the NATS JWT v2 format: `base64url(header).base64url(claims).base64url(sig)`, the
header `{"typ":"JWT","alg":"ed25519-nkey"}`, the signature an ed25519 signature by the issuer's
nkey over the first two parts, `jti` a digest of the claims.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
UNLIMITED = -1


def new_key(prefix: int) -> nkeys.KeyPair:
    """A fresh nkey pair of the given kind (nkeys.PREFIX_BYTE_OPERATOR / _ACCOUNT / _USER)."""
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def public(kp: nkeys.KeyPair) -> str:
    return kp.public_key.decode()


def seed(kp: nkeys.KeyPair) -> str:
    return bytes(kp.seed).decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def encode_jwt(claims: dict, issuer: nkeys.KeyPair) -> str:
    claims = {"iat": int(time.time()), "iss": public(issuer), **claims}
    body = json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()
    claims["jti"] = base64.b32encode(hashlib.sha256(body).digest()).decode().rstrip("=")
    signing_input = _b64(json.dumps(HEADER, separators=(",", ":")).encode()) + "." + _b64(
        json.dumps(claims, separators=(",", ":")).encode())
    return signing_input + "." + _b64(issuer.sign(signing_input.encode()))


def operator_jwt(op: nkeys.KeyPair, name: str, system_account: str) -> str:
    return encode_jwt({"sub": public(op), "name": name,
                       "nats": {"type": "operator", "version": 2, "system_account": system_account}}, op)


def account_jwt(op: nkeys.KeyPair, acct: nkeys.KeyPair, name: str, jetstream: bool = True) -> str:
    limits = {"subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED, "imports": UNLIMITED,
              "exports": UNLIMITED, "wildcards": True, "conn": UNLIMITED, "leaf": UNLIMITED}
    if jetstream:  # JetStream is on for an account whose storage limits are not zero
        limits.update({"mem_storage": UNLIMITED, "disk_storage": UNLIMITED, "streams": UNLIMITED,
                       "consumer": UNLIMITED})
    return encode_jwt({"sub": public(acct), "name": name,
                       "nats": {"type": "account", "version": 2, "limits": limits,
                                "default_permissions": {"pub": {}, "sub": {}}}}, op)


def user_jwt(acct: nkeys.KeyPair, user: nkeys.KeyPair, name: str, pub_allow: list[str] | None = None,
             sub_allow: list[str] | None = None) -> str:
    nats: dict = {"type": "user", "version": 2, "subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED,
                  "pub": {}, "sub": {}}
    if pub_allow is not None:
        nats["pub"] = {"allow": pub_allow}
    if sub_allow is not None:
        nats["sub"] = {"allow": sub_allow}
    return encode_jwt({"sub": public(user), "name": name, "nats": nats}, acct)


def creds_text(jwt: str, user_seed: str) -> str:
    """A .creds file as `nsc` writes it."""
    return (f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user_seed}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


class Operator:
    """An operator with a system account and one JetStream account: `server_conf()` is the
    config that trusts them (memory resolver), `user_creds()` makes users of the account."""

    def __init__(self, name: str = "kvcache-test") -> None:
        self.op = new_key(nkeys.PREFIX_BYTE_OPERATOR)
        self.sys = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
        self.acct = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
        self.jwt = operator_jwt(self.op, name, public(self.sys))
        self.accounts = {public(self.sys): account_jwt(self.op, self.sys, "SYS", jetstream=False),
                         public(self.acct): account_jwt(self.op, self.acct, "APP")}

    def server_conf(self) -> str:
        preload = "\n".join(f"  {k}: {json.dumps(v)}" for k, v in self.accounts.items())
        return (f"operator: {json.dumps(self.jwt)}\nsystem_account: {public(self.sys)}\n"
                f"resolver: MEMORY\nresolver_preload: {{\n{preload}\n}}")

    def user_creds(self, path: Path, name: str, pub_allow: list[str] | None = None,
                   sub_allow: list[str] | None = None) -> Path:
        user = new_key(nkeys.PREFIX_BYTE_USER)
        path.write_text(creds_text(user_jwt(self.acct, user, name, pub_allow, sub_allow), seed(user)))
        path.chmod(0o600)
        return path


# ---------------------------------------------------------------------------- TLS

def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_pki(d: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and two client
    certificates (CN=kvcache-client, CN=kvcache-admin), all EC P-256, valid for a day; the
    paths by name."""
    d.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", "-new", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=kvcache test CA", cwd=d)
    exts = {"server": "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
            "client": "extendedKeyUsage=clientAuth\n", "admin": "extendedKeyUsage=clientAuth\n"}
    for name, ext in exts.items():
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", "-new", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=kvcache-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return {f"{n}.{x}": d / f"{n}.{x}" for n in ("ca", "server", "client", "admin") for x in ("pem", "key")}
