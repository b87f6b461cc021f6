"""A tiny store-only zip writer for tests: writes archives the way pnnx's StoreZipWriter
does (zip64 extras everywhere, zip64 end records) or plain ones, and can be told to lie
(wrong sizes, counts, offsets, methods, CRCs) to produce malformed archives.

Offsets of every structure are returned with the bytes so tests can damage them in
place."""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Entry:
    name: str
    data: bytes
    method: int = 0
    flag: int = 0
    size: int | None = None  # size written in the directory (default: len(data))
    crc: int | None = None
    local_name: str | None = None  # name in the local header (default: name)
    lfh_offset: int | None = None  # local header offset written in the directory


@dataclass
class Layout:
    data: bytes
    local_headers: list = field(default_factory=list)  # offset of each local header
    data_offsets: list = field(default_factory=list)
    cd_offset: int = 0
    cd_records: list = field(default_factory=list)  # offset of each directory record
    eocd64_offset: int | None = None
    locator_offset: int | None = None
    eocd_offset: int = 0


def build_zip(
    entries,
    zip64=True,
    count=None,
    cd_offset=None,
    cd_size=None,
    comment=b"",
    trailing_cd_bytes=b"",
):
    """Store-only zip of `entries` (Entry or (name, bytes)). zip64=True writes it as
    pnnx does: saturated 32-bit fields, zip64 extras, zip64 end record and locator."""
    entries = [e if isinstance(e, Entry) else Entry(*e) for e in entries]
    out = bytearray()
    lay = Layout(b"")
    for e in entries:
        size = len(e.data) if e.size is None else e.size
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        name = (e.local_name if e.local_name is not None else e.name).encode()
        lay.local_headers.append(len(out))
        if zip64:
            extra = struct.pack("<HHQQQI", 1, 28, size, size, 0, 0)
            fields = (0xFFFFFFFF, 0xFFFFFFFF)
        else:
            extra = b""
            fields = (size, size)
        out += struct.pack(
            "<4sHHHHHIIIHH",
            b"PK\x03\x04",
            45 if zip64 else 20,
            e.flag,
            e.method,
            0,
            0,
            crc,
            *fields,
            len(name),
            len(extra),
        )
        out += name + extra
        lay.data_offsets.append(len(out))
        out += e.data
    start = len(out)
    for e, lfh in zip(entries, lay.local_headers):
        size = len(e.data) if e.size is None else e.size
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        off = lfh if e.lfh_offset is None else e.lfh_offset
        name = e.name.encode()
        lay.cd_records.append(len(out))
        if zip64:
            extra = struct.pack("<HHQQQI", 1, 28, size, size, off, 0)
            fields = (0xFFFFFFFF, 0xFFFFFFFF)
            disk, off32 = 0xFFFF, 0xFFFFFFFF
        else:
            extra = b""
            fields = (size, size)
            disk, off32 = 0, off
        out += struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            b"PK\x01\x02",
            45,
            45,
            e.flag,
            e.method,
            0,
            0,
            crc,
            *fields,
            len(name),
            len(extra),
            0,
            disk,
            0,
            0,
            off32,
        )
        out += name + extra
    out += trailing_cd_bytes
    lay.cd_offset = start if cd_offset is None else cd_offset
    size_cd = len(out) - start if cd_size is None else cd_size
    n = len(entries) if count is None else count
    if zip64:
        lay.eocd64_offset = len(out)
        out += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, size_cd, lay.cd_offset)
        lay.locator_offset = len(out)
        out += struct.pack("<4sIQI", b"PK\x06\x07", 0, lay.eocd64_offset, 1)
        lay.eocd_offset = len(out)
        out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, len(comment))
    else:
        lay.eocd_offset = len(out)
        out += struct.pack(
            "<4sHHHHIIH",
            b"PK\x05\x06",
            0,
            0,
            n & 0xFFFF,
            n & 0xFFFF,
            size_cd,
            lay.cd_offset,
            len(comment),
        )
    out += comment
    lay.data = bytes(out)
    return lay


def array_bytes(a):
    return np.ascontiguousarray(a).tobytes()


def write_bin(path, weights, how="pnnx"):
    """Write {entry name: numpy array or bytes} as a .bin. how: 'pnnx' (own zip64 writer),
    'plain' (own writer, no zip64), 'zipfile' (Python zipfile, ZIP_STORED) or
    'zipfile64' (zipfile with force_zip64=True)."""
    items = [(k, v if isinstance(v, bytes) else array_bytes(v)) for k, v in weights.items()]
    if how in ("pnnx", "plain"):
        data = build_zip(items, zip64=how == "pnnx").data
        with open(path, "wb") as f:
            f.write(data)
        return
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in items:
            if how == "zipfile64":
                with z.open(name, "w", force_zip64=True) as f:
                    f.write(data)
            else:
                z.writestr(name, data)
