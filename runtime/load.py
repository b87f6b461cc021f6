"""Open a .pmx file: mmap it, read its header into plain data, have it verified, and wrap its weights.

The reader owns the preamble's checks and CRC32 and the header's CRC32 and padding,
checked first, so accidental damage is refused before anything reads the header; the
decoding of the header into Model, TensorInfo and NodeInfo (through the bounded reader of
runtime/flatbuffer_reader.py); the parsing of expression text into trees (_expression,
memoized); the zero-copy weight views; the pause of the garbage collector. Nothing here
trusts the file: a forged file with recomputed CRCs meets the reader's checks and then
the verifier's.

Tensors and nodes are stored as columns (format versions 2 and 3, one layout:
schema/pmx.fbs; runtime/fileformat.py says what 3 adds): each field of all tensors is one
vector, read with one struct call, and the names are one string cut at stored ends, so a
model's hundreds of tensors cost a few dozen calls instead of a table each. Attribute
sets, which a CNN repeats across hundreds of nodes, are stored once each
(compiler/write.py) and nodes with equal attributes share one dict (read-only: nothing in
pmx changes a loaded node's attributes). Decoding checks what decoding itself needs:
every column's length and every set of ends (names, shapes, node inputs and outputs)
against what it cuts, ranks, dim ranges, dtype and attribute kind codes, and the string
and attribute-set entries nodes name.

Everything else the header claims is checked by runtime/verify.py, which open_model runs
on the decoded model before any numpy view is made (and, with verify_checksum, which
checks the data's CRC32). The reader trusts it: once verify_structure returns, every
constant lies inside the data section, so _wrap_constants makes its views unchecked
(read-only numpy views of the mmap). The verifier is handed _expression and parses each
node's expression in its own order of checks, so the first fault in a file is the one
named. Any failure raises PmxFormatError naming the field and the values found; sizes
beyond the configured limits raise PmxResourceError before anything is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import mmap
import os
import struct

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime import fileformat as ff
from pmx.runtime.errors import PmxError, PmxFormatError, PmxResourceError
from pmx.runtime.header import Model, read_header
from pmx.runtime.hints import foreign_model_hint
from pmx.runtime.verify import MAX_EXPANDED_EXPR, _fail, check_data_checksum, verify_structure
from pmx.schema import layout as schema

# Refuse files whose arena or tensors exceed this before allocating anything; raise it
# with InferenceSession(..., max_arena_bytes=N) for models that really need more.
DEFAULT_MAX_ARENA_BYTES = 8 << 30

# What reading a damaged header can raise: positions outside it (IndexError, from
# fb.Reader, which turns struct's errors into it), names that are not UTF-8, and (kept as
# a safety net) struct or Python refusing a nonsensical size.
_READ_ERRORS = (IndexError, ValueError, UnicodeDecodeError, TypeError, OverflowError, struct.error)


# How messages name a model given as bytes instead of a path.
BYTES_LABEL = "<model bytes>"


def open_model(path, verify_checksum=False, max_arena_bytes=DEFAULT_MAX_ARENA_BYTES) -> Model:
    """mmap and verify `path`, or verify the bytes of a model given as bytes, bytearray
    or memoryview (the same checks; weights are views of those bytes, copied first unless
    they are immutable bytes, so a later change to the buffer cannot reach them).
    The header's CRC32 is always checked; verify_checksum also checks the data's (reads
    every weight byte: `pmx verify`, InferenceSession(verify=True))."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        buf = path if isinstance(path, bytes) else bytes(path)
        path, size = BYTES_LABEL, len(buf)
        if size < ff.PREAMBLE_SIZE:
            _fail(
                path,
                f"{size} bytes, shorter than the {ff.PREAMBLE_SIZE}-byte preamble: bytes are read as the "
                f"model's content (pass a str or os.PathLike for a path)",
            )
        return _open_buffer(path, buf, size, verify_checksum, max_arena_bytes)
    try:
        f = open(path, "rb")  # noqa: SIM115 - the with below closes it; only the open is guarded
    except (OSError, ValueError) as e:
        raise PmxFormatError(f"{path}: cannot open: {getattr(e, 'strerror', None) or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < ff.PREAMBLE_SIZE:
            _fail(
                path,
                f"file is {size} bytes, shorter than the {ff.PREAMBLE_SIZE}-byte preamble (truncated or not a .pmx)",
            )
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise PmxFormatError(f"{path}: cannot map the file: {e}") from None
    return _open_buffer(path, buf, size, verify_checksum, max_arena_bytes)


def _open_buffer(path, buf, size, verify_checksum, max_arena_bytes):
    """Verify the model in `buf` (an mmap or bytes of `size` bytes) and wrap it."""
    pre = _check_preamble(path, buf, size)
    check_header_checksum(path, buf, pre)
    if verify_checksum:
        check_data_checksum(path, buf, pre)
    with memoryview(buf) as view:
        header = bytes(view[pre["header_offset"] : pre["header_offset"] + pre["header_size"]])
    with collector_paused():
        try:
            if header[4:8] != ff.FILE_IDENTIFIER:
                _fail(path, f"header file identifier is {header[4:8]!r}, expected {ff.FILE_IDENTIFIER!r}")
            model = read_header(path, header, pre, size)
        except PmxError:
            raise
        except _READ_ERRORS as e:
            _fail(path, f"damaged header (an offset or length points outside it): {type(e).__name__}: {str(e)[:120]}")
        except MemoryError:
            raise PmxResourceError(f"{path}: out of memory while reading the header") from None
        verify_structure(model, pre, max_arena_bytes, _expression)
        model._map = buf
        _wrap_constants(model, buf, pre)
    return model


@contextlib.contextmanager
def collector_paused():
    """Reading a header allocates thousands of small tuples and lists, none in a cycle;
    the cyclic garbage collector's passes over them cost a measurable share of a load
    (measured on torchvision models), so it waits until the load is done. Binding a
    model's kernels (session.py) pauses it too, for a larger share of a bind (DenseNet-121,
    GoogLeNet; docs/performance.md, "Kernel measurements"). Its state is restored as
    found (with overlapping loads on several threads, it ends enabled if it was enabled
    when the first one started)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_preamble(path, buf, size):
    pre = ff.unpack_preamble(bytes(buf[: ff.PREAMBLE_SIZE]))
    if pre["magic"] != ff.MAGIC:
        hint = foreign_model_hint(path, "run") if isinstance(path, (str, os.PathLike)) else None
        _fail(
            path, f"magic is {pre['magic']!r}, expected {ff.MAGIC!r}: not a .pmx file" + (f"; {hint}" if hint else "")
        )
    if pre["preamble_crc"] != pre["preamble_crc_actual"]:
        _fail(
            path,
            f"preamble checksum {pre['preamble_crc']:#010x} does not match its bytes ({pre['preamble_crc_actual']:#010x}): the file is damaged",
        )
    if pre["reserved"] != 0:
        _fail(path, f"preamble bytes 60..63 are {pre['reserved']:#010x}, expected 0: the file is damaged")
    if pre["version"] > ff.FORMAT_VERSION:
        _fail(
            path,
            f"format version {pre['version']} is newer than this runtime reads ({ff.FORMAT_VERSION}): run it with "
            "the pnnx-pmx that compiled it (a newer install), or compile the model again with this one",
        )
    if pre["version"] < 1:
        _fail(path, f"format version {pre['version']} is invalid")
    if pre["version"] < ff.OLDEST_READABLE_VERSION:
        # version 1 stored a table per tensor and per node (version 2: columns, read faster)
        _fail(
            path,
            f"format version {pre['version']} was written by an older pmx; this runtime reads versions "
            f"{ff.OLDEST_READABLE_VERSION}-{ff.FORMAT_VERSION}: compile the model again (pmx compile model.pnnx.param)",
        )
    if pre["flags"] != 0:
        _fail(path, f"preamble flags {pre['flags']:#x}: this runtime knows no flags")
    if pre["header_offset"] != ff.PREAMBLE_SIZE:
        _fail(path, f"header offset {pre['header_offset']} (expected {ff.PREAMBLE_SIZE})")
    if pre["header_size"] < 8 or pre["header_offset"] + pre["header_size"] > pre["data_offset"]:
        _fail(
            path,
            f"header [{pre['header_offset']}, +{pre['header_size']}) is too small or overlaps the data section at {pre['data_offset']}",
        )
    header_end = pre["header_offset"] + pre["header_size"]
    if pre["data_offset"] != ff.align(header_end):
        _fail(
            path,
            f"data offset {pre['data_offset']} is not the first {ff.ALIGNMENT}-byte boundary after the "
            f"header's end at {header_end} ({ff.align(header_end)})",
        )
    if pre["data_offset"] + pre["data_size"] != size:
        _fail(
            path,
            f"header says the file is {pre['data_offset'] + pre['data_size']} bytes (data at {pre['data_offset']}, {pre['data_size']} bytes) but it is {size} bytes: truncated or padded",
        )
    return pre


def check_header_checksum(path, buf, pre):
    """CRC32 of the header against the preamble, and the padding after it all zero, at
    every load: the header is small (tens of kilobytes) and every byte of it steers the
    reader, so damage there is refused here rather than met as whatever structure the
    flipped bytes happen to describe."""
    h0, h1 = pre["header_offset"], pre["header_offset"] + pre["header_size"]
    with memoryview(buf) as view:
        crc = ff.crc32(view[h0:h1])
        padding = bytes(view[h1 : pre["data_offset"]])  # under 64 bytes (_check_preamble)
    if crc != pre["header_crc"]:
        _fail(
            path,
            f"header checksum mismatch: stored {pre['header_crc']:#010x}, computed {crc:#010x}: the file is damaged",
        )
    if padding.count(0) != len(padding):
        _fail(
            path,
            f"the padding between header and data (bytes {h1}..{pre['data_offset'] - 1}) is not zero: the file is damaged",
        )


# --- expressions ------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _expression(text, num_inputs):
    """(tree, _expanded_size) of a stored expression: the one place the runtime parses
    expression text. Memoized: a model repeats the same few activations many times, and
    nodes with equal text then share one tree object (verify.check_shape_rules relies on it:
    trees that differ only in a literal's type compare equal, their objects do not)."""
    tree = E.parse(text, num_inputs)
    return tree, _expanded_size(E.desugar(tree))


def _expanded_size(tree):
    """Terms of `tree` written out as the backends write it (shared subtrees counted each
    time they appear, operands of square/maximum/minimum twice: numexpr text repeats
    them). Memoized on identity, so linear in the size of the shared structure, and
    iterative, since desugared trees can be deeper than Python's recursion limit."""
    memo = {}
    twice = ("square", "maximum", "minimum")
    stack = [(tree, False)]
    while stack:
        t, ready = stack.pop()
        if id(t) in memo:
            continue
        if t[0] in ("@", "#"):
            memo[id(t)] = 1
        elif ready:
            s = 1 + sum(memo[id(a)] for a in t[1:]) * (2 if t[0] in twice else 1)
            memo[id(t)] = min(s, MAX_EXPANDED_EXPR + 1)
        else:
            stack.append((t, True))
            stack.extend((a, False) for a in t[1:] if id(a) not in memo)
    return memo[id(tree)]


def _wrap_constants(model, buf, pre):
    """Read-only views of the mmap (np.ndarray over the buffer: one call, where
    frombuffer + reshape is two), placed where the verifier checked they fit."""
    base, constant = pre["data_offset"], schema.TensorKind.Constant
    model.constants.update(
        (i, np.ndarray(t.shape, t.dtype, buffer=buf, offset=base + t.data_offset))
        for i, t in enumerate(model.tensors)
        if t.kind == constant
    )
