"""The KV key grammar, the subject-filter matcher and the Redis glob: one definition of each.

ADR-8: a key is tokens of `[-/_=a-zA-Z0-9]` joined by single dots (no empty token, no dot at
either end); a key filter may use `*` for one token and `>` for the rest (last). Every Python
check of a key or a filter uses this module; the C copies (ext/resp_get.pxd, the server's GET
path) are tested against it on generated keys (tests/test_keys.py). A RESP key may carry a
`bucket:` prefix (split_address) before the KV key checked here.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable

TOKEN_CHARS = "-/_=a-zA-Z0-9"  # a regex character class body: ADR-8's token characters
TOKEN = f"[{TOKEN_CHARS}]+"
# fullmatch, never match(): `$` also matches before a trailing "\n", and a newline in a key
# would end the NATS protocol line of the Direct Get request built from it.
KEY_RE = re.compile(rf"{TOKEN}(?:\.{TOKEN})*")
KEY_TOKEN_RE = re.compile(TOKEN)
# ADR-8: keys starting with `_kv` are for NATS's own use. kvcache reads none (every read
# command answers an error naming the rule; KEYS and SCAN list none), so a key an application
# should not have written reads the same everywhere instead of nil here and a value there.
RESERVED_PREFIX = "_kv"


def reserved_key(key: str) -> bool:
    """Does `key` start with ADR-8's reserved `_kv`?"""
    return key.startswith(RESERVED_PREFIX)


def readable_key(key: str) -> bool:
    """May a read name `key`: a KV key, not reserved (the GET fast path's C check is held
    to this: tests/test_keys.py)."""
    return KEY_RE.fullmatch(key) is not None and not key.startswith(RESERVED_PREFIX)


def invalid_key(key: str) -> str | None:
    """Why a read may not name `key` (the socket's `ERR invalid key ...` reply, which
    LocalReader raises too); None when it may. One line: a line break in the key shows as
    a space, as an error reply carries it."""
    shown = key[:64].translate(_ONE_LINE)
    if not KEY_RE.fullmatch(key):
        return f"ERR invalid key '{shown}': KV keys use A-Z a-z 0-9 - / _ = and dots between tokens"
    if key.startswith(RESERVED_PREFIX):
        return (f"ERR invalid key '{shown}': keys starting with {RESERVED_PREFIX} are reserved for "
                "NATS's own use (ADR-8)")
    return None


_ONE_LINE = str.maketrans("\r\n", "  ")


def valid_filter(f: str) -> bool:
    """A NATS subject filter over KV keys: tokens, `*` for one token, `>` last."""
    tokens = f.split(".")
    for i, t in enumerate(tokens):
        if t == ">":
            if i != len(tokens) - 1:
                return False
        elif t != "*" and KEY_TOKEN_RE.fullmatch(t) is None:
            return False
    return True


def subject_match(pattern: str, key: str) -> bool:
    """Does `key` match the filter `pattern` (`*` one token, `>` one or more at the end)?
    The one matcher for every place that asks whether a key falls under a filter (a bucket's
    replicated set, a purge request's filter)."""
    if pattern == ">":
        return True
    pt, kt = pattern.split("."), key.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(kt) > i
        if i >= len(kt) or (p != "*" and p != kt[i]):
            return False
    return len(pt) == len(kt)


class FilterSet:
    """Filters compiled for the question asked per message and per key read: does a key fall
    under any of them? A literal filter is a set lookup and a `prefix.>` filter a lookup per
    token prefix of the key; only filters with `*` are matched one by one (subject_match). So
    the cost grows with the key's tokens, not with the filters: `kvcache hotkeys` proposes
    hundreds of `prefix.>` filters, and matching those one by one cost about 0.3 ms per key
    outside them (the feed asks for every message when the bucket has a near cache)."""

    __slots__ = ("_everything", "_exact", "_others", "_tails", "filters")

    def __init__(self, filters: list[str] | tuple[str, ...]) -> None:
        self.filters = tuple(filters)
        self._everything = ">" in self.filters
        self._exact: set[str] = set()
        self._tails: set[str] = set()  # `a.b.>` as `a.b`: a key with more tokens after it
        self._others: list[str] = []
        for f in self.filters:
            tokens = f.split(".")
            if "*" in tokens:
                self._others.append(f)
            elif tokens[-1] == ">":
                if len(tokens) > 1:
                    self._tails.add(f[:-2])
            else:
                self._exact.add(f)

    def match(self, key: str) -> bool:
        if self._everything or key in self._exact:
            return True
        tails = self._tails
        if tails:
            i = key.find(".")
            while i != -1:
                if key[:i] in tails:
                    return True
                i = key.find(".", i + 1)
        return any(subject_match(f, key) for f in self._others)


# A token no filter can name (no key token has a NUL): in filter_within, the key a `*` or a
# `>` stands for, which only another filter's `*` or `>` matches
_ANY_TOKEN = "\x00"


def filter_within(f: str, filters: list[str] | tuple[str, ...]) -> bool:
    """Is every key the (valid) filter `f` matches matched by one of `filters`? A stream of
    `f` served from a replica of `filters` (kvcache.serve.streams) must miss no key.

    Each `*` of `f` becomes a token no filter names: a filter that matches the key so made
    matches every key with any token there. A trailing `>` becomes 1 to N + 1 such tokens,
    N the most tokens of any filter: beyond N only a filter's own `>` matches, alike for every
    length. So `a.>` is within `a.*` and `a.*.>` together, though within neither alone."""
    fs = FilterSet(filters)
    tokens = [_ANY_TOKEN if t == "*" else t for t in f.split(".")]
    if tokens[-1] != ">":
        return fs.match(".".join(tokens))
    head = tokens[:-1]
    longest = max((g.count(".") + 1 for g in filters), default=0)
    return all(fs.match(".".join(head + [_ANY_TOKEN] * n)) for n in range(1, longest + 2))


@functools.lru_cache(maxsize=256)
def glob_matcher(pattern: str) -> Callable[[str], bool]:
    """Redis glob: * ? [abc] [^a] [a-z] and backslash escapes."""
    if pattern == "*":
        return lambda _: True
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        elif c == "[":
            j = pattern.find("]", i + 2 if i + 1 < n and pattern[i + 1] in "^!" else i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                neg = body[:1] in ("^", "!")
                if neg:
                    body = body[1:]
                body = body.replace("\\", "\\\\").replace("]", "\\]")
                out.append(f"[{'^' if neg else ''}{body}]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    rx = re.compile("".join(out), re.DOTALL)
    return lambda s: rx.fullmatch(s) is not None


def split_address(text: str, default: str | None) -> tuple[str, str, bool]:
    """`bucket:key` names the bucket; a bare key reads the default (first) bucket:
    (bucket, key, whether the bucket was named). The one addressing rule of the socket and
    of LocalReader."""
    bucket, sep, key = text.partition(":")
    if not sep:
        return default or "", text, False
    return bucket, key, True
