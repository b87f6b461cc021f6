"""The fixed 64-byte preamble of a .pmx file, shared by the writer and the loader.

    offset size field
    0      8    magic b"PMXMODEL"
    8      4    format version (u32)
    12     4    flags (u32, 0)
    16     8    header offset (u64, always 64): the FlatBuffer
    24     8    header size (u64)
    32     8    data offset (u64): the constants, at the first 64-byte boundary after
                the header (the bytes between are zero)
    40     8    data size (u64)
    48     4    CRC32 of the header bytes
    52     4    CRC32 of the data bytes
    56     4    CRC32 of preamble bytes [0, 56)
    60     4    reserved (0; the loader refuses anything else, so every preamble byte
                is checked: 0..55 by the CRC, 56..63 by value)

CRC32 detects accidental damage (truncated downloads, flipped bits); it is not a
defence against a deliberately forged file, which the structural verifier handles. The
loader checks the preamble's and the header's CRCs (and the zero padding) at every load,
so every byte before the data section is covered; the data's CRC reads every weight
byte, so it is checked by `pmx verify` and InferenceSession(verify=True).
"""

import struct
import zlib

MAGIC = b"PMXMODEL"
FILE_IDENTIFIER = b"PMX2"
# Newest version this code writes and reads. Version 3 is version 2's layout plus node
# semantics a version-2 runtime would get wrong without noticing (a conv's input scale,
# a channel shuffle's split parts, a reshape following its like inputs: it would ignore
# the extra input or attribute), so the writer stamps 3 only on files that use them
# (compiler/write.py `_format_version`), and version-2 runtimes refuse those with
# "newer than this runtime reads" while reading every other new file. Version 4 adds an
# adaptive pool's output size 0 (the input's size, torch's None) and a group norm's
# groups 0 (one per channel: instance norm), stamped the same way.
FORMAT_VERSION = 4
OLDEST_READABLE_VERSION = 2
PREAMBLE_SIZE = 64
ALIGNMENT = 64
_LAYOUT = struct.Struct("<8sIIQQQQIIII")
assert _LAYOUT.size == PREAMBLE_SIZE


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def pack_preamble(header_size, data_offset, data_size, header_crc, data_crc, version=FORMAT_VERSION) -> bytes:
    head = _LAYOUT.pack(
        MAGIC,
        version,
        0,
        PREAMBLE_SIZE,
        header_size,
        data_offset,
        data_size,
        header_crc,
        data_crc,
        0,
        0,
    )
    return head[:56] + struct.pack("<I", crc32(head[:56])) + head[60:]


def unpack_preamble(raw: bytes) -> dict:
    (
        magic,
        version,
        flags,
        header_offset,
        header_size,
        data_offset,
        data_size,
        header_crc,
        data_crc,
        preamble_crc,
        reserved,
    ) = _LAYOUT.unpack(raw[:PREAMBLE_SIZE])
    return dict(
        magic=magic,
        version=version,
        flags=flags,
        header_offset=header_offset,
        header_size=header_size,
        data_offset=data_offset,
        data_size=data_size,
        header_crc=header_crc,
        data_crc=data_crc,
        preamble_crc=preamble_crc,
        preamble_crc_actual=crc32(raw[:56]),
        reserved=reserved,
    )
