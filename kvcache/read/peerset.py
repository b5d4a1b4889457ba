"""Where the peers come from: the `[[peer]]` entries of the config, and the mirrors a bucket
stream lists as `alternates` (the server orders them by distance).

Peers that name the same servers share one connection; a peer on the main connection's
servers uses the main connection. A peer's bucket is read from its stream: a mirror names its
upstream (`KV_<bucket>`), which holds the subjects `$KV.<bucket>.<key>` the mirror holds too.
A peer that cannot be reached or read at start is left out with a warning: peers are extra
read capacity, and the main connection serves every bucket without them.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

import nats.errors
from nats.aio.client import Client as NATS

from ..config import PeerConfig
from ..errors import KvcacheError
from ..natsio import jetstream as jsapi
from .peer import Peer

log = logging.getLogger("kvcache")

Connect = Callable[[list[str]], Awaitable[NATS]]


class PeerConnections:
    """One connection per distinct server set."""

    def __init__(self, main_servers: list[str], main: NATS, connect: Connect) -> None:
        self._main_key = frozenset(main_servers)
        self._main = main
        self._connect = connect
        self._own: dict[frozenset[str], NATS] = {}

    async def get(self, servers: list[str]) -> NATS:
        key = frozenset(servers)
        if key == self._main_key:
            return self._main
        if key not in self._own:
            self._own[key] = await self._connect(servers)
        return self._own[key]

    async def close(self) -> None:
        for nc in self._own.values():
            try:
                await nc.close()
            except (OSError, nats.errors.Error):
                pass
        self._own.clear()


async def configured_peers(peers: Iterable[PeerConfig], buckets: set[str], conns: PeerConnections,
                           timeout: float) -> list[Peer]:
    out = []
    for pc in peers:
        try:
            nc = await conns.get(pc.servers)
            info = await jsapi.stream_info(nc, pc.stream, timeout, jsapi.api_prefix(pc.domain))
        except (KvcacheError, OSError, nats.errors.Error) as e:
            log.warning("peer %s left out: %s", pc.name, e)
            continue
        bucket = bucket_of(pc.stream, info)
        if bucket not in buckets:
            log.warning("peer %s left out: stream %s serves no configured bucket", pc.name, pc.stream)
            continue
        out.append(Peer(pc.name, nc, pc.stream, bucket, domain=pc.domain,
                        direct=bool(info.get("config", {}).get("allow_direct"))))
    return out


def bucket_of(stream: str, info: dict) -> str | None:
    """The KV bucket whose subjects a stream holds: its mirror's upstream's, or its own."""
    for name in ((info.get("config", {}).get("mirror") or {}).get("name", ""), stream):
        if name.startswith("KV_"):
            return name[3:]
    return None


def discovered_peers(nc: NATS, bucket: str, info: dict, known: Iterable[Peer]) -> list[Peer]:
    """Mirrors listed in the bucket stream's `alternates`, reached over the main connection
    (a mirror in another domain through `$JS.<domain>.API`); the stream itself and streams
    already configured are skipped."""
    here = info.get("domain") or None
    seen = {(p.stream, p.domain) for p in known} | {(jsapi.kv_stream(bucket), None)}
    out = []
    for alt in info.get("alternates") or []:
        stream, domain = alt.get("name", ""), alt.get("domain") or None
        if domain == here:
            domain = None  # our own domain: the plain $JS.API reaches it
        if not stream or (stream, domain) in seen:
            continue
        seen.add((stream, domain))
        out.append(Peer(f"{stream}@{domain}" if domain else stream, nc, stream, bucket, domain=domain))
    return out
