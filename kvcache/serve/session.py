"""What the command layer needs of a client connection (kvcache.serve.client_connection's ClientConnection):
its protocol and identity, the state commands keep on it (tracking, subscriptions, MULTI,
WATCH, authentication), and the replies and pushes it controls.

A Protocol of its own, so that the command modules (kvcache.serve.commands, commands_session and the
server_* modules) name the connection without importing the server that imports them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .tracking_mode import ClientTracking


class Session(Protocol):
    proto: int
    id: int
    name: bytes
    lib_name: bytes
    lib_ver: bytes
    authenticated: bool
    needs_auth: bool          # a TCP connection: AUTH applies to it
    gate: bool                # every command must go through the command layer's checks
    tracking: ClientTracking | None
    channels: set[bytes]
    patterns: set[bytes]
    multi: list[list[bytes]] | None  # queued commands while in MULTI
    multi_failed: bool
    in_exec: bool
    exec_keys: list[bytes]    # keys read by the commands EXEC is running (tracking)
    watching: set[tuple[str, str]]
    watch_dirty: bool
    after_reply: list[bytes]  # keys to invalidate once the reply in flight is written
    last_cmd: bytes | None    # CLIENT LIST's cmd: the last command run (`client|list`), None: unknown
    no_evict: bool            # CLIENT NO-EVICT / NO-TOUCH, shown by CLIENT LIST
    no_touch: bool
    created: int              # when it connected, time.monotonic_ns() (CLIENT LIST's age)
    confirmations: list[bytes]  # pub/sub confirmations to send although its reply is dropped

    @property
    def subscribed(self) -> bool: ...
    @property
    def silenced(self) -> bool: ...  # CLIENT REPLY OFF or SKIP drops the running command's reply
    def refresh_path(self) -> None: ...
    def push(self, data: bytes) -> None: ...
    def close_after_reply(self) -> None: ...
    def set_reply_mode(self, mode: bytes) -> bytes: ...
    def client_info(self, argv_mem: int = 0) -> str: ...
    @property
    def client_type(self) -> str: ...
    def addresses(self) -> tuple[str, str]: ...
    def kill(self) -> None: ...
