"""A small FlatBuffers reader that checks every position and reads under a budget.

The generated accessors neither check bounds nor run fast (microseconds per field, which
was most of a load), so runtime/load.py reads the header with this instead. Each field's
vtable slot, type and default come from schema/layout.py (derived from the generated code
by tools/regen_schema.py); each vtable in a file becomes one struct that reads all of a
table's fields in one call; Reader reads one field of many tables at once with list
comprehensions (plain Python on purpose: a model has hundreds of tables, not millions, and
numpy's per-call overhead costs more than the loops do). Every position is checked
against the header's bytes before it is read, and every vector and string is charged
against a budget the size of the header before any of it is read, so a hostile file
cannot make the reader loop or allocate more than a small multiple of its header size.
Damage found here raises PmxFormatError naming the file and the field; struct and index
errors that escape are the caller's to name.
"""

from __future__ import annotations

import itertools
import operator
import struct

from pmx.runtime.errors import PmxFormatError
from pmx.schema import layout as schema

# _field learns each field's layout from the generated accessors; _vtable turns one
# vtable into a struct that reads every field of a table in one call; Reader reads a
# field of many tables at once, checking every position and charging the budget.


class _Field:
    """Where one field of a table type lives (a plain class: a dataclass would cost a
    millisecond of import time)."""

    __slots__ = ("slot", "code", "size", "default", "scalar")

    def __init__(self, slot, code, default, scalar):
        self.slot = slot  # byte offset of the field's entry in its table's vtable
        # struct code of a scalar or of a vector's elements (None: strings, tables)
        self.code = code
        self.default = default if scalar else 0  # what an absent field reads as
        # stored in the table itself (else the table holds a uoffset to it)
        self.scalar = scalar
        self.size = struct.calcsize("<" + code) if scalar else 4  # bytes inside the table


class Layout:
    """The fields of one table type that the loader reads, in the order _vtable's readers
    return them in; each attribute named as given holds that field's index."""

    def __init__(self, table, **accessors):
        self.fields = tuple(_Field(*schema.TABLES[table][name]) for name in accessors.values())
        vars(self).update((name, k) for k, name in enumerate(accessors))


_SOFFSET, UOFFSET, _VOFFSET = (struct.Struct(f).unpack_from for f in ("<i", "<I", "<H"))


class _Vtables(dict):
    """vtable position -> its reader (_vtable) for one table type in one header, built on
    first use (a writer shares one vtable between all tables with the same fields
    present, so a header has a handful)."""

    def __init__(self, r, layout, what):
        super().__init__()
        self.r, self.layout, self.what = r, layout, what

    def __missing__(self, vt):
        read = self[vt] = _vtable(self.r, self.layout, vt, self.what)
        return read


def _vtable(r, layout, vt, what):
    """The reader of tables whose vtable is at byte `vt`: read(raw, pos) gives a table's
    fields in the layout's order, absent ones as their defaults (0 for strings and
    vectors), then `at`: each field's byte offset in the table (0 where absent), so a
    string or vector field's uoffset `u` read at `pos` points at `pos + at[k] + u`."""
    at = _field_offsets(r.raw, layout, vt, what)
    read = READERS.get((layout, at))
    if read is None:
        if len(READERS) > 256:
            READERS.clear()
        read = READERS[layout, at] = _new_reader(layout, at)
    return read


def _field_offsets(raw, layout, vt, what):
    """`at` of the vtable at byte vt: each field's byte offset in its table (0 = absent)."""
    if vt < 0:
        raise IndexError(f"{what} vtable at byte {vt} is outside the {len(raw)}-byte header")
    (vlen,) = _VOFFSET(raw, vt)
    return tuple([_VOFFSET(raw, vt + f.slot)[0] if f.slot < vlen else 0 for f in layout.fields])


def _read_one(raw, layout, pos, at):
    """One table's fields (then `at`), as a reader would give them, read one by one: for
    the types a header holds once (model, tensor and node columns), building a reader
    costs more in a fresh process than reading its fields (docs/performance.md, "Kernel
    measurements")."""
    return tuple(
        [_SCALARS[f.code if f.scalar else "I"](raw, pos + a)[0] if a else f.default for f, a in zip(layout.fields, at)]
    ) + (at,)


_SCALARS = {code: struct.Struct("<" + code).unpack_from for code in "bBhHiIqQfd?"}

# (layout, `at`) -> reader: the files pmx writes share their few vtables, so later loads
# in a process skip building them.
READERS = {}


def _new_reader(layout, at):
    """One struct reads every present field (absent ones come from `tail`, and
    itemgetter puts all in the layout's order)."""
    fields = layout.fields
    present = sorted((a, k) for k, a in enumerate(at) if a)
    absent = [k for k, a in enumerate(at) if not a]
    codes = {k: fields[k].code if fields[k].scalar else "I" for _, k in present}  # offsets: u32
    fmt, end, overlap = "<", 0, False
    for a, k in present:
        overlap |= a < end  # legal FlatBuffers, never written: read such fields one by one
        fmt += f"{a - end}x{codes[k]}"
        end = a + fields[k].size
    if overlap:
        parts = [(a, struct.Struct("<" + codes[k]).unpack_from) for a, k in present]

        def unpack(raw, pos):
            return tuple(read(raw, pos + a)[0] for a, read in parts)
    else:
        unpack = struct.Struct(fmt).unpack_from
    tail = tuple(fields[k].default for k in absent) + (at,)
    order = [0] * len(fields)  # where each field is in unpack(...) + tail
    for j, k in enumerate([k for _, k in present] + absent):
        order[k] = j
    pick = operator.itemgetter(*order, len(fields))  # the fields, then `at`
    return lambda raw, pos: pick(unpack(raw, pos) + tail)


class _Tables:
    """Tables of one type: their positions, their vtables' `at`, their fields as columns
    (one tuple per field, in layout order), and the layout's fields."""

    __slots__ = ("pos", "at", "columns", "fields")


class Reader:
    """The header's bytes, read only at checked positions and under a budget: every vector
    and string read is charged against the header size. Each distinct position is read
    once (_each_once: tables pointing at one vector share the object read), so in any
    file the distinct vectors and strings of a column are what is charged. In a file pmx
    wrote they do not overlap and the total never exceeds the header; a hostile file whose
    strings or vectors overlap (each starting a few bytes into the previous one) is
    stopped after reading about twice its header. A whole column is charged before any
    of it is read, so nothing is allocated beyond a small multiple of the budget.

    Positions come from unsigned offsets added to positions already read, so only a
    vtable (a table's position minus a signed offset) can lie before the header; struct
    refuses any read past its end, and string slices are checked here.

    Each method reads one field of many tables with list comprehensions: on the few
    hundred tables of a model that costs less than numpy would, whose every call costs
    microseconds and, in a fresh process, tens of microseconds the first time."""

    def __init__(self, path, header):
        self.path = path
        self.raw = bytes(header)
        self.size = len(self.raw)
        self.budget = self.left = 2 * self.size + 4096
        self.vtables = {}  # layout -> _Vtables

    def charge(self, nbytes, what, count):
        self.left -= nbytes
        if self.left < 0:
            raise PmxFormatError(
                f"{self.path}: {what} ({count} elements): the header's vectors and strings add up to more than {self.budget} bytes, twice its size (damaged or hostile offsets)",
            )

    def tables(self, layout, positions, what):
        raw = self.raw
        try:
            # a table's vtable sits at its position minus the soffset stored there
            if len(positions) == 1:
                pos = positions[0]
                rows = [_read_one(raw, layout, pos, _field_offsets(raw, layout, pos - _SOFFSET(raw, pos)[0], what))]
            else:
                vtables = self.vtables.get(layout)
                if vtables is None:
                    vtables = self.vtables[layout] = _Vtables(self, layout, what)
                rows = [vtables[pos - _SOFFSET(raw, pos)[0]](raw, pos) for pos in positions]
        except struct.error as e:
            raise IndexError(f"{what} tables: {e}") from None
        t = _Tables()
        t.pos, t.fields = positions, layout.fields
        *t.columns, t.at = zip(*rows) if rows else [()] * (len(layout.fields) + 1)
        return t

    def _spans(self, t, k, column):
        """Which tables hold string or vector field k (uoffsets `column`; 0 = absent) and
        where each one's data starts."""
        held = list(itertools.compress(range(len(column)), column))
        if len(held) == len(column):
            starts = [p + at[k] + u + 4 for p, at, u in zip(t.pos, t.at, column)]
        else:
            pos, at = t.pos, t.at
            starts = [pos[i] + at[i][k] + column[i] + 4 for i in held]
        return held, starts

    def _lengths(self, starts, elem_bytes, what):
        raw = self.raw
        try:
            lengths = [UOFFSET(raw, s - 4)[0] for s in starts]
        except struct.error as e:
            raise IndexError(f"{what} lengths: {e}") from None
        count = sum(lengths)
        self.charge(count * elem_bytes, what, count)
        return lengths

    def strings(self, t, k, what, column=None):
        """Field k of every table as a str ("" where absent)."""
        column = t.columns[k] if column is None else column
        held, starts = self._spans(t, k, column)
        return _scatter(
            _each_once(starts, lambda s: self._decode(s, self._lengths(s, 1, what), what)), held, len(column), ""
        )

    def strings_at(self, positions, what):
        """The strings at `positions` (what a vector of strings points at)."""
        starts = [p + 4 for p in positions]
        return self._decode(starts, self._lengths(starts, 1, what), what)

    def _decode(self, starts, lengths, what):
        ends = list(map(operator.add, starts, lengths))
        if ends and max(ends) > self.size:
            s = next(s for s, e in zip(starts, ends) if e > self.size)
            raise IndexError(f"{what} at byte {s - 4} runs past the {self.size}-byte header")
        raw = self.raw
        return [raw[s:e].decode() for s, e in zip(starts, ends)]

    def numbers(self, t, k, what, column=None):
        """Field k (a vector of numbers) of every table as a tuple (() where absent)."""
        column = t.columns[k] if column is None else column
        code = t.fields[k].code
        held, starts = self._spans(t, k, column)
        return _scatter(_each_once(starts, lambda s: self._vectors(s, code, what)), held, len(column), ())

    def _vectors(self, starts, code, what):
        """The vectors of struct code `code` whose length words are at `starts`, as tuples
        (charged against the budget)."""
        lengths = self._lengths(starts, struct.calcsize("<" + code), what)
        structs, raw = _VECTOR_STRUCTS[code], self.raw
        try:
            return [(structs.get(n) or _vector_struct(code, n))(raw, s) for s, n in zip(starts, lengths)]
        except struct.error as e:
            raise IndexError(f"{what}: {e}") from None

    def subtable(self, t, k):
        """The position of table field k of t's first table (None where absent)."""
        u = t.columns[k][0]
        return t.pos[0] + t.at[0][k] + u if u else None

    def column(self, t, k, what):
        """Vector field k of t's first table (a table of columns) as a tuple: one vector,
        read without numbers()'s machinery for many tables (that machinery costs more per
        call, and a model reads some 30 columns; docs/performance.md, "Kernel
        measurements")."""
        u = t.columns[k][0]
        return self._vectors([t.pos[0] + t.at[0][k] + u + 4], t.fields[k].code, what)[0] if u else ()

    def targets(self, t, k, what, column=None):
        """Per table, the positions a vector of uoffsets (to tables or strings) in field
        k points at."""
        column = t.columns[k] if column is None else column
        held, starts = self._spans(t, k, column)
        structs, raw = _VECTOR_STRUCTS["I"], self.raw

        def read(starts):
            lengths = self._lengths(starts, 4, what)
            try:
                return [
                    [s + 4 * j + u for j, u in enumerate((structs.get(n) or _vector_struct("I", n))(raw, s))]
                    for s, n in zip(starts, lengths)
                ]
            except struct.error as e:
                raise IndexError(f"{what}: {e}") from None

        return _scatter(_each_once(starts, read), held, len(column), ())


def _each_once(starts, read):
    """read(starts), reading each distinct start once: tables that point at the same
    string or vector (pmx writes each equal one once: compiler/write.py) get the same
    object, and only distinct bytes are charged against the budget, so a hostile file
    pointing every table at one vector costs one read of it."""
    distinct = list(dict.fromkeys(starts))
    if len(distinct) == len(starts):
        return read(starts)
    found = dict(zip(distinct, read(distinct)))
    return list(map(found.__getitem__, starts))


def _scatter(values, held, n, absent):
    """`values` of the tables `held` among n, `absent` for the others."""
    if len(held) == n:
        return values
    out = [absent] * n
    for i, v in zip(held, values):
        out[i] = v
    return out


_VECTOR_STRUCTS = {code: {} for code in "bBhHiIqQfd?"}  # code -> {length: unpack_from}


def _vector_struct(code, n):
    structs = _VECTOR_STRUCTS[code]
    if len(structs) > 256:
        structs.clear()
    read = structs[n] = struct.Struct(f"<{n}{code}").unpack_from
    return read
