"""What this sidecar's consumers are called on the server, and who it is among the fleet.

An ephemeral consumer with a random name outlives a killed sidecar by its inactive_threshold
(60 s): in a fleet's restart storm each stream held twice the consumers in use until they aged
out, and a crash loop would add one per crash (bench/README.md, "A fleet on one cluster"). A
name derived from the data directory lets the sidecar started on it find what its predecessor
left and replace it at once (kvcache.feed.consumer.PullConsumer), so a bucket's stream holds
one consumer per sidecar whatever happened before.

The id is random, made once and kept in the data directory (one sidecar per directory: its
lock). The host's name goes into the consumer name too, so that a directory copied to another
host (a disk image, a snapshot) does not make two running sidecars replace each other's
consumers. The same id orders the fleet's state polls (kvcache.feed.fleet): a restarted sidecar
keeps its place.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import socket

log = logging.getLogger("kvcache.feed")

ID_FILE = "sidecar.id"
_ID = re.compile(r"[0-9a-f]{16}")
# The feed's consumer is `kvcache_<digest>`; the reconcile pass's headers-only one (run beside
# it after a restart or a reconnect) takes this suffix.
RECONCILE_SUFFIX = "_r"
# The fleet relay's consumer (relay_name) takes this one.
RELAY_SUFFIX = "_relay"


def sidecar_id(data_dir: str) -> str:
    """This data directory's id, made on first use. A directory that cannot keep it (read-only
    or full) gets a new one each start: its consumers then age out as random ones did."""
    path = os.path.join(data_dir, ID_FILE)
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        if _ID.fullmatch(text):
            return text
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    except OSError as e:
        log.warning("cannot read %s (%s): this start's consumers get a new name", path, e.strerror)
    text = os.urandom(8).hex()
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write %s (%s): a restart will not find this start's consumers", path, e.strerror)
    return text


def consumer_name(sid: str, host: str | None = None) -> str:
    """The feed consumers' name on every bucket's stream (a stream's names are its own)."""
    digest = hashlib.sha256(f"{host if host is not None else socket.gethostname()}\0{sid}".encode())
    return "kvcache_" + digest.hexdigest()[:16]


def relay_name(sid: str, host: str | None = None) -> str:
    """The consumer this sidecar's relay (kvcache.feed.relay) holds on a bucket's stream while
    it relays for the fleet: its own name, so that a restarted relay replaces what a killed
    one left, and an operator can tell the fleet's one consumer per bucket from the others."""
    return consumer_name(sid, host) + RELAY_SUFFIX
