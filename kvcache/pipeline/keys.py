"""KV keys for loaded rows: a column or a template over several columns, checked by ADR-8's
rules (the same token rule the sidecar's config uses for key filters)."""
from __future__ import annotations

import string
from dataclasses import dataclass

from ..errors import ConfigError
from ..keys import KEY_RE as KEY

RESERVED_PREFIX = "_kv"  # ADR-8: keys starting with _kv are for internal use
KEY_RE2 = f"^(?:{KEY.pattern})$"  # the same for Arrow's match_substring_regex (RE2: $ is the end)


def key_problem(key: str | None) -> str | None:
    """Why `key` cannot be a KV key, or None when it can. ADR-8: `[-/_=.a-zA-Z0-9]+`, not
    starting or ending with `.`; we also refuse empty tokens (`a..b` is no valid subject)."""
    if key is None:
        return "null key"
    if KEY.fullmatch(key) is None:
        return "empty key" if not key else "invalid characters or empty token"
    if key.startswith(RESERVED_PREFIX):
        return "reserved prefix _kv"
    return None


@dataclass(frozen=True)
class KeySpec:
    """`--key COL` or `--key '{region}.{id}'`: literal text and column references."""

    parts: tuple[tuple[str, bool], ...]  # (text, is_column)

    @classmethod
    def parse(cls, spec: str) -> KeySpec:
        if not spec:
            raise ConfigError("--key must name a column or a template like '{region}.{id}'")
        if "{" not in spec and "}" not in spec:
            return cls(((spec, True),))
        parts: list[tuple[str, bool]] = []
        try:
            for literal, field, fmt, conv in string.Formatter().parse(spec):
                if literal:
                    parts.append((literal, False))
                if field is not None:
                    if not field or fmt or conv:
                        raise ConfigError(f"--key template '{spec}': use plain {{column}} references")
                    parts.append((field, True))
        except ValueError as e:
            raise ConfigError(f"--key template '{spec}': {e}") from None
        if not any(is_col for _, is_col in parts):
            raise ConfigError(f"--key template '{spec}' references no column")
        return cls(tuple(parts))

    @property
    def columns(self) -> list[str]:
        return [text for text, is_col in self.parts if is_col]
