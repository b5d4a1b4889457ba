"""The NATS credentials checked before anything connects: creds, nkey, token or user and
password, in the settings or in the URLs, and the TLS files (kvcache.config.tls_context).

Only `kvcache serve` connects to NATS, so only it calls `validate_nats_auth`: `kvcache get` or
`info` with the same config file must not need the credentials. Its own module so the settings
(kvcache.config) do not carry the parsing of creds files and JWTs; it imports them, never the
reverse.
"""
from __future__ import annotations

import base64
import json
import re

from .config import Config, read_setting_file, redact_url, tls_context, url_auth
from .errors import ConfigError


def validate_nats_auth(cfg: Config) -> None:
    """Credentials and TLS files, checked before anything connects: a missing, unreadable or
    malformed file is one line naming the setting and the file, never what the file holds.
    Only `serve` connects to NATS, so only it calls this: `kvcache get`/`info` with the same
    config file must not need the credentials."""
    n = cfg.nats
    if n.creds and n.nkey:
        raise ConfigError("creds and nkey are exclusive: a creds file holds the user's nkey seed already")
    if n.token and (n.user or n.password):
        raise ConfigError("token and user/password are exclusive")
    if n.password and not n.user:
        raise ConfigError("password needs user")
    if n.user and not n.password:
        raise ConfigError("user needs password")
    others = n.creds or n.nkey or n.token or n.user
    for servers in [n.servers] + [p.servers for p in cfg.peers]:
        in_urls = {url_auth(u) for u in servers} - {(None, None)}
        if len(in_urls) > 1:
            raise ConfigError(f"the NATS URLs {', '.join(map(redact_url, servers))} carry different credentials")
        if in_urls and others:  # nats-py would ignore the URL's
            url = next(u for u in servers if url_auth(u) != (None, None))
            raise ConfigError(f"the NATS URL {redact_url(url)} carries credentials and "
                              "creds, nkey, token or user is set too: give them once")
    if n.creds:
        check_creds_file(n.creds)
    if n.nkey:
        check_nkey_file(n.nkey)
    tls_context(n)


_JWT = re.compile(rb"^[A-Za-z0-9_-]+\.([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+$")


def _block_line(data: bytes, marker: bytes) -> bytes | None:
    """The line after the one holding `marker`, as nats-py reads a creds file."""
    lines = data.split(b"\n")
    for i, line in enumerate(lines[:-1]):
        if marker in line:
            return lines[i + 1]
    return None


def _user_seed(seed: bytes) -> str | None:
    """Why `seed` is not a user nkey seed, or None when it is."""
    import nkeys

    try:
        kp = nkeys.from_seed(bytearray(seed))
        kind = kp.public_key[:1]
        kp.wipe()
    except Exception:  # nkeys raises its own errors, binascii's and ValueError
        return "not an nkey seed"
    if kind != b"U":
        return "not a user nkey seed (a user seed starts with SU)"
    return None


def check_creds_file(path: str) -> None:
    """A creds file as nats-py reads it: the line after `BEGIN NATS USER JWT` is a JWT, the
    line after `BEGIN USER NKEY SEED` a user seed. (nats-py itself loops forever on a file
    with no JWT block.)"""
    data = read_setting_file(path, "creds")
    jwt = _block_line(data, b"BEGIN NATS USER JWT")
    if jwt is None:
        raise ConfigError(f"creds file {path}: no user JWT in it (expected a -----BEGIN NATS USER JWT----- block)")
    m = _JWT.match(jwt)
    try:
        claims = json.loads(base64.urlsafe_b64decode(m.group(1) + b"=" * (-len(m.group(1)) % 4))) if m else None
    except ValueError:
        claims = None
    if not isinstance(claims, dict) or (claims.get("nats") or {}).get("type", "user") != "user":
        raise ConfigError(f"creds file {path}: its user JWT is malformed")
    seed = _block_line(data, b"BEGIN USER NKEY SEED")
    if seed is None:
        raise ConfigError(f"creds file {path}: no user nkey seed in it "
                          "(expected a -----BEGIN USER NKEY SEED----- block)")
    why = _user_seed(seed.strip())
    if why:
        raise ConfigError(f"creds file {path}: its seed is {why}")


def check_nkey_file(path: str) -> None:
    data = read_setting_file(path, "nkey")
    why = _user_seed(data.strip())
    if why:
        hint = " (a creds file goes to creds, --creds)" if b"BEGIN NATS USER JWT" in data else ""
        raise ConfigError(f"nkey file {path}: {why}{hint}")
