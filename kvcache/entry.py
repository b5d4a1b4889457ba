"""The KV entry as ADR-8 names it, shared by the replica, the router and the clients."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Operation(StrEnum):
    """A KV entry's last operation, as ADR-8 names them (the `KV-Operation` header)."""

    PUT = "PUT"
    DEL = "DEL"
    PURGE = "PURGE"

    @classmethod
    def from_header(cls, value: str | None) -> Operation:
        """`KV-Operation` header value; absent means PUT (ADR-8)."""
        if not value:
            return cls.PUT
        try:
            return cls(value.strip().upper())
        except ValueError:
            return cls.PUT

    @classmethod
    def of(cls, headers: dict | None) -> Operation:
        """The operation a stream message stands for: its `KV-Operation` header (ADR-8), or a
        marker the server placed itself (nats-server 2.11+: TTL expiry, purges), which carries
        `Nats-Marker-Reason` instead. The feed and the router must agree on this."""
        if not headers:
            return cls.PUT
        op = headers.get("KV-Operation")
        if op is not None:
            return cls.from_header(op)
        reason = headers.get("Nats-Marker-Reason")
        if reason is not None:
            return cls.DEL if reason.strip() == "Remove" else cls.PURGE
        return cls.PUT


@dataclass(frozen=True, slots=True)
class Entry:
    """A key's entry as ADR-8 describes it, plus where kvcache read it from (`source`)."""

    bucket: str
    key: str
    value: bytes | None
    revision: int
    created: int  # ns since the epoch
    delta: int = 0
    operation: Operation = Operation.PUT
    # local, a peer's name, "leader", or "stale" (the replica, past max_stale_ms, no peer reachable)
    source: str = "local"
    expires: int = 0  # its own TTL's moment (ns), record.NEVER for `Nats-TTL: never`, 0 none
