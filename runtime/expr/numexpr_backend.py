"""The numexpr backend: an expression compiled to one numexpr program (compile_numexpr),
for the expressions numexpr computes in their own dtype (numexpr_supported); the
compiler picks it per node. numexpr is imported only when a model uses it.
"""

import functools
import re

import numpy as np

from pmx.runtime.errors import PmxFormatError
from pmx.runtime.expr.functions import TABLE
from pmx.runtime.expr.numpy_backend import compile_numpy
from pmx.runtime.expr.special import desugar


def numexpr_supported(tree) -> bool:
    return _ne_ok(desugar(tree))


def _ne_ok(tree) -> bool:
    if tree[0] == "#":
        return not isinstance(tree[1], complex)  # to_numexpr makes float32 constants
    if tree[0] == "@":
        return True
    if TABLE[tree[0]].numexpr is None:
        return False
    return all(_ne_ok(a) for a in tree[1:])


def to_numexpr(tree):
    """Return (numexpr source, constants) where constants maps names to float32 0-d arrays.

    Float literals become float32 variables because numexpr promotes float32 arrays to
    float64 when combined with a Python float constant; maximum/minimum become where()
    because numexpr computes them in double."""
    constants = {}

    def const(v):
        if isinstance(v, bool):
            return "True" if v else "False"
        if isinstance(v, int) and abs(v) < 2**31:
            return str(v)
        value = np.array(v, dtype=np.float32)
        for name, seen in constants.items():  # one variable per value: numexpr caps inputs
            if seen.tobytes() == value.tobytes():
                return name
        name = f"k{len(constants)}"
        constants[name] = value
        return name

    def emit(t):
        kind = t[0]
        if kind == "@":
            return f"i{t[1]}"
        if kind == "#":
            return const(t[1])
        a = [emit(x) for x in t[1:]]
        template = TABLE[kind].numexpr
        if template is not None:
            return template.format(*a)
        raise PmxFormatError(f"function {kind!r} has no numexpr form")

    return emit(desugar(tree)), constants


@functools.cache
def _numexpr_compiler():
    """numexpr is imported only when a model uses it (its import is slow;
    docs/performance.md, "Kernel measurements")."""
    from numexpr import NumExpr

    return NumExpr, _numexpr_type


def _numexpr_type(a):
    """The type NumExpr's signature names for array `a` (numexpr 2's kinds: bool, int =
    int32, long = int64, float = float32, double = float64, complex): numexpr's own
    getType is internal to numexpr.necompiler, so the rule it follows is written out here."""
    kind, size = a.dtype.kind, a.dtype.itemsize
    if kind == "b":
        return bool
    if kind in "iu":
        return np.int64 if size > 4 or (kind == "u" and size == 4) else np.int32
    if kind == "f":
        return np.float64 if size > 4 else float
    if kind == "c":
        return complex
    raise PmxFormatError(f"numexpr cannot compute on {a.dtype.name} arrays")


def numexpr_threads() -> int:
    """numexpr's own thread count (read, never set: it is process-wide)."""
    import numexpr

    return numexpr.get_num_threads()


def compile_numexpr(tree, inputs, out):
    """Return a zero-argument callable running one precompiled numexpr program into out."""
    NumExpr, getType = _numexpr_compiler()
    source, constants = to_numexpr(tree)
    names = [f"i{i}" for i in range(len(inputs))]
    args = list(inputs) + list(constants.values())
    names += list(constants)
    used = [(n, a) for n, a in zip(names, args) if re.search(rf"\b{n}\b", source)]
    signature = [(n, getType(np.asarray(a))) for n, a in used]
    if not signature:  # literal-only expression: nothing for numexpr to iterate over
        return compile_numpy(tree, inputs, out)
    program = NumExpr(source, signature)
    arrays = tuple(np.asarray(a) for _, a in used)
    kwargs = dict(out=out, order="K", casting="unsafe", ex_uses_vml=False)
    return lambda: program(*arrays, **kwargs)
