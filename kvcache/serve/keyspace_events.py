"""`notify-keyspace-events`: Redis's flags, read and shown as Redis does.

kvcache's events are in the classes `g` (del), `$` (set) and `x` (expired); the other
data-type classes are accepted and never fire, as they never would in Redis for a database of
strings. `m` (key misses) and `n` (new keys) are refused: kvcache does not send those.
A module of its own: the configuration checks the flags, the pub/sub server uses them.
"""
from __future__ import annotations

from ..errors import CommandError

# Redis's class characters in the order CONFIG GET shows them, and the class of each event
CLASS_FLAGS = "g$lshzxetd"
EVENT_CLASS = {"set": "$", "del": "g", "expired": "x"}
REFUSED_FLAGS = {"m": "key-miss events (m)", "n": "new-key events (n)"}


def parse_flags(text: str) -> str:
    """`notify-keyspace-events` as Redis reads it, in Redis's canonical order (`KEA` -> `AKE`)."""
    classes: set[str] = set()
    space = event = False
    for ch in text:
        if ch == "A":
            classes.update(CLASS_FLAGS)
        elif ch in CLASS_FLAGS:
            classes.add(ch)
        elif ch == "K":
            space = True
        elif ch == "E":
            event = True
        elif ch in REFUSED_FLAGS:
            raise CommandError(f"ERR kvcache does not send {REFUSED_FLAGS[ch]}")
        else:
            raise CommandError("ERR Invalid event class character. Use 'Ag$lshzxeKEtmdn'.")
    if not (space or event):
        return ""  # Redis keeps nothing when neither K nor E is given
    shown = "A" if classes == set(CLASS_FLAGS) else "".join(c for c in CLASS_FLAGS if c in classes)
    return shown + ("K" if space else "") + ("E" if event else "")
