"""Sizes as people write them: ``64MiB``, ``2GB``."""

from __future__ import annotations

import re

from .errors import InfinikvError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, flag: str = "--kv-memory") -> int:
    """``"64MiB"`` -> 67108864; accepts B, KB/MB/GB (powers of 10) and KiB/MiB/GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise InfinikvError(f"{flag} {text!r} is not a size like 64MiB, 2GiB or 500MB")
    size = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if size <= 0:
        raise InfinikvError(f"{flag} must be positive, got {text!r}")
    return size
