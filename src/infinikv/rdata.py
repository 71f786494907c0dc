"""A reader for R's lazy-load databases (``.rdx`` index + ``.rdb`` records).

R packages store their data sets this way: the ``.rdx`` file is a compressed, serialized
named list whose ``variables`` entry maps each object name to ``(offset, length)`` in the
``.rdb`` file; each ``.rdb`` record is ``[4-byte big-endian length][zlib stream]`` of one
XDR-serialized R object. Only the object kinds found in data packages are decoded
(vectors, lists, pairlists, symbols, strings); anything else raises ``ValueError``.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path
from typing import Any

NILVALUE, REFSXP, EMPTYENV, BASEENV, GLOBALENV = 254, 255, 242, 241, 253
SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 1, 2, 9, 10, 13, 14, 16, 19
NA_INTEGER = -(2**31)


class _Reader:
    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an XDR-serialized R object")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer's and minimal reader's R versions
        if version == 3:
            name_length = self.int()
            self.pos += name_length  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two 32-bit halves
            n = (self.int() << 32) + self.int()
        return n

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (NILVALUE, EMPTYENV, BASEENV, GLOBALENV):
            return None
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == LISTSXP:
            return self._pairlist(has_attr, has_tag)
        if kind == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            text = self.data[self.pos : self.pos + n].decode("utf-8", errors="replace")
            self.pos += n
            return text
        if kind in (LGLSXP, INTSXP):
            n = self.length()
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
            value: Any = [None if v == NA_INTEGER else v for v in values]
        elif kind == REALSXP:
            n = self.length()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (STRSXP, VECSXP):
            value = [self.item() for _ in range(self.length())]
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            attributes = self.item()
            names = attributes.get("names") if isinstance(attributes, dict) else None
            if names is not None and kind == VECSXP:
                value = dict(zip(names, value, strict=True))
        return value

    def _pairlist(self, has_attr: int, has_tag: int) -> dict[str, Any]:
        """A pairlist (attribute lists, mostly) as a dict of tag -> value."""
        out: dict[str, Any] = {}
        while True:
            if has_attr:
                self.item()
            tag = self.item() if has_tag else str(len(out))
            out[tag] = self.item()
            flags = self.int()
            if flags & 0xFF != LISTSXP:
                if flags & 0xFF != NILVALUE:
                    raise ValueError("malformed pairlist")
                return out
            has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)


def unserialize(data: bytes) -> Any:
    """Decode one XDR-serialized R object into Python lists, dicts, strings and numbers."""
    return _Reader(data).item()


def read_lazyload(rdx: Path, rdb: Path) -> dict[str, Any]:
    """All objects of a lazy-load database, by name."""
    raw = rdx.read_bytes()
    index = unserialize(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:]))
    blob = rdb.read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        record = blob[offset : offset + length]
        objects[name] = unserialize(zlib.decompress(record[4:]))
    return objects
