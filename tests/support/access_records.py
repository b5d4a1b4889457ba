"""The records an access log directory holds (kvcache.ops.accesslog): what tests read back."""
from __future__ import annotations

from pathlib import Path

from kvcache.ops.accesslog import FIELDS


def read_records(directory: Path) -> list[dict[str, str]]:
    """Every line of access.log*, oldest file first."""
    files = sorted(directory.glob("access.log*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    out = []
    for f in files:
        for line in f.read_text().splitlines():
            out.append(dict(zip(FIELDS, line.split("\t"), strict=True)))
    return out
