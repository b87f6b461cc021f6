"""Ranges of sizes a dim may take, one spelling for the compiler, the file and the runtime.

A range is (min, max), max UNBOUNDED (-1) for no upper end; a fixed dim is (n, n). The
compiler records them for inputs and outputs (`--dynamic`, `--shape`), the file stores
them, the runtime checks inputs against them and names them in messages as --shape
writes them: 1..16, 8.., 3.
"""

UNBOUNDED = -1


def tensor_ranges(t):
    """[(min, max) per dim] of a model tensor; a tensor without stored ranges is fixed."""
    if t.dim_min is None:
        return [(d, d) for d in t.shape]
    return list(zip(t.dim_min, t.dim_max))


def in_range(size, lo, hi):
    return lo <= size and (hi == UNBOUNDED or size <= hi)


def shape_allowed(shape, ranges):
    return len(shape) == len(ranges) and all(in_range(d, lo, hi) for d, (lo, hi) in zip(shape, ranges))


def range_text(lo, hi):
    """(1, -1) -> '1..', (8, 512) -> '8..512', (3, 3) -> '3'."""
    return str(lo) if lo == hi else f"{lo}..{'' if hi == UNBOUNDED else hi}"


def format_ranges(ranges):
    """[(1, -1), (3, 3), (8, 512)] -> '[1.., 3, 8..512]' for messages."""
    return "[" + ", ".join(range_text(lo, hi) for lo, hi in ranges) + "]"
