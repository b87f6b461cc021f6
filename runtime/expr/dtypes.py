"""The dtype an expression produces for given input dtypes (result_dtype), as torch's
promotion gives it: known without evaluating for float inputs through float-keeping
functions, else by evaluating the tree on one-element samples with NUMPY_FUNCS, memoized.
The loader checks every elementwise node's dtype with it, and the numpy backend types
its temporaries with it.
"""

import functools

import numpy as np

from pmx.runtime.expr.functions import FLOAT_KEEPING, NUMPY_FUNCS
from pmx.runtime.expr.numpy_funcs import _floor_divide, _rsqrt, _sigmoid
from pmx.runtime.expr.special import desugar
from pmx.runtime.expr.tree import Exact


def _torch_float(result, args):
    """torch keeps a float tensor's dtype against integer tensors and makes integer
    math with a float literal float32, where numpy would widen both to float64."""
    result = np.asarray(result)
    if result.dtype.kind != "f":
        return result
    widths = [a.dtype.itemsize for a in args if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
    width = max(widths) if widths else 4
    if result.dtype.itemsize > width:
        return result.astype(f"f{width}")
    return result


def result_dtype(tree, input_dtypes):
    """dtype the expression produces for the given input dtypes (numpy promotion with
    weak literals, true division and integer pow as torch does). Inputs of one float
    dtype through functions that keep it (no comparison, logic or where) and plain
    number literals give that dtype, known without evaluating: the evaluation on samples
    is costly per expression in a fresh process (each ufunc's first call), a sizeable
    share of a small CNN's load (docs/performance.md, "Kernel measurements"). Otherwise
    it evaluates the tree on samples, memoized: the loader's shape-rule check asks for
    every elementwise node."""
    dtypes = tuple(np.dtype(d) for d in input_dtypes)
    if dtypes and dtypes[0].kind == "f" and dtypes.count(dtypes[0]) == len(dtypes) and _keeps_float_dtype(tree):
        return dtypes[0]
    return _result_dtype(tree, dtypes)


@functools.lru_cache(maxsize=4096)
def _keeps_float_dtype(tree):
    """Only FLOAT_KEEPING functions, each reading an input somewhere below it, over
    inputs and float or int literals (ints exactly representable as floats, so none
    overflows the conversion). A function of literals alone is evaluated to an array, no
    longer a weak literal (div(1, 2) is float32 and would widen a float16 input)."""
    reads_input = {}  # id(subtree) -> whether an input is below it
    stack = [(tree, False)]
    while stack:
        t, ready = stack.pop()
        if t[0] == "@":
            reads_input[id(t)] = True
        elif t[0] == "#":
            if not (type(t[1]) is float or (type(t[1]) is int and abs(t[1]) <= 1 << 53)):
                return False
            reads_input[id(t)] = False
        elif t[0] not in FLOAT_KEEPING:
            return False
        elif ready:
            if not any(reads_input[id(a)] for a in t[1:]):
                return False
            reads_input[id(t)] = True
        else:
            stack.append((t, True))
            stack.extend((a, False) for a in t[1:])
    return reads_input[id(tree)]


def _result_dtype(tree, input_dtypes):
    return _result_dtype_exact(Exact(tree), input_dtypes)


@functools.lru_cache(maxsize=4096)
def _result_dtype_exact(key, input_dtypes):
    tree = key.tree
    samples = [np.ones((1,), dtype=d) for d in input_dtypes]

    def ev(t):
        if t[0] == "@":
            return samples[t[1]]
        if t[0] == "#":
            return t[1]
        args = [ev(a) for a in t[1:]]
        fn = NUMPY_FUNCS[t[0]]
        arrays = [a if isinstance(a, np.ndarray) else np.asarray(a) for a in args]
        if t[0] == "where":
            if arrays[0].dtype != np.bool_:  # torch refuses it; the kernel casts the condition safely
                raise ValueError(f"where's condition is of dtype {arrays[0].dtype.name}, not bool")
            return _torch_float(np.where(arrays[0], args[1], args[2]), args[1:])
        if t[0] in ("div", "reciprocal", "sqrt", "rsqrt", "exp", "log", "sigmoid") and all(
            np.asarray(a).dtype.kind in "biu" for a in args
        ):
            return np.ones((1,), np.float32)
        with np.errstate(all="ignore"):
            if fn in (_sigmoid, _rsqrt, _floor_divide):
                base = np.result_type(*args) if t[0] == "floor_divide" else np.result_type(args[0], 1.0)
                return _torch_float(np.ones((1,), base), args)
            return _torch_float(fn(*args), args)

    out = ev(desugar(tree))
    return np.asarray(out).dtype
