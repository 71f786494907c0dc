import struct
import zlib

import pytest

from infinikv.data import AUSTEN
from infinikv.rdata import read_lazyload, unserialize


def xdr_header() -> bytes:
    return b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"


def charsxp(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">ii", 0x00040009, len(raw)) + raw


def test_named_character_vector():
    body = struct.pack(">ii", 16 | (1 << 9), 2) + charsxp("a") + struct.pack(">ii", 9, -1)  # "a", NA
    body += struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + charsxp("names")  # attr pairlist, tag sym
    body += struct.pack(">ii", 16, 2) + charsxp("x") + charsxp("y") + struct.pack(">i", 254)
    assert unserialize(xdr_header() + body) == ["a", None]


def test_named_list_becomes_dict():
    body = struct.pack(">ii", 19 | (1 << 9), 2) + struct.pack(">ii", 13, 1) + struct.pack(">i", 7)
    body += struct.pack(">ii", 14, 1) + struct.pack(">d", 2.5)
    body += struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + charsxp("names")
    body += struct.pack(">ii", 16, 2) + charsxp("i") + charsxp("r") + struct.pack(">i", 254)
    assert unserialize(xdr_header() + body) == {"i": [7], "r": [2.5]}


def test_rejects_what_it_cannot_read():
    with pytest.raises(ValueError):
        unserialize(b"RDX2\n")
    with pytest.raises(ValueError, match="unsupported R object type"):
        unserialize(xdr_header() + struct.pack(">i", 4))  # an environment


def test_lazyload_roundtrip(tmp_path):
    record = xdr_header() + struct.pack(">ii", 16, 1) + charsxp("Emma Woodhouse")
    blob = struct.pack(">i", len(record)) + zlib.compress(record)
    index = xdr_header() + struct.pack(">ii", 19 | (1 << 9), 1)
    index += struct.pack(">ii", 19 | (1 << 9), 1) + struct.pack(">ii", 13, 2) + struct.pack(">ii", 0, len(blob))
    index += struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + charsxp("names")
    index += struct.pack(">ii", 16, 1) + charsxp("emma") + struct.pack(">i", 254)
    index += struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + charsxp("names")
    index += struct.pack(">ii", 16, 1) + charsxp("variables") + struct.pack(">i", 254)
    (tmp_path / "x.rdx").write_bytes(struct.pack(">i", len(index)) + zlib.compress(index))
    (tmp_path / "x.rdb").write_bytes(blob)
    assert read_lazyload(tmp_path / "x.rdx", tmp_path / "x.rdb") == {"emma": ["Emma Woodhouse"]}


def test_fetched_novels_are_the_real_texts():
    from infinikv.data import load_text

    emma = load_text("austen:emma", from_chapter_one=True)
    assert emma.startswith("CHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich")
    assert len(load_text("austen:all")) > 3_900_000
    assert len(AUSTEN) == 6
