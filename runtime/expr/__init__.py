"""Elementwise expressions: one grammar, two backends (numexpr and numpy ufuncs).

The same text is compiled either to one numexpr program or to a sequence of numpy ufunc
calls writing into preallocated buffers; which one runs is decided by the compiler and
stored per node (variant "numexpr" or "numpy"). The package re-exports the interface the
compiler, runtime and tests use (`from pmx.runtime import expr as E`); its modules, each
importing only those before it:

    numpy_funcs      the numpy helpers of functions numpy lacks as ufuncs (sigmoid, ...)
    functions        TABLE: every function's arity, numpy and numexpr forms and traits
                     (names_with(flag)); FUNCTIONS, NUMPY_FUNCS, COMPARISONS from it
    tree             the grammar (FUNCTIONS, parse, to_text), tree helpers, Exact
    special          desugar: erf, erfc, SiLU, max/min in terms of shared primitives
    dtypes           result_dtype: the dtype an expression produces
    gelu             the numpy backend's table form of exact GELU
    numpy_backend    compile_numpy: ufunc steps over planned, reused buffers
    numexpr_backend  compile_numexpr: one numexpr program
"""

from pmx.runtime.expr.dtypes import result_dtype
from pmx.runtime.expr.functions import COMPARISONS, NUMPY_FUNCS, TABLE, names_with
from pmx.runtime.expr.numexpr_backend import compile_numexpr, numexpr_supported, numexpr_threads
from pmx.runtime.expr.numpy_backend import compile_numpy
from pmx.runtime.expr.special import desugar
from pmx.runtime.expr.tree import (
    FUNCTIONS,
    MAX_DEPTH,
    MAX_EXPR_LENGTH,
    at,
    call,
    describe_node_expr,
    inputs_used,
    parse,
    size,
    substitute,
    to_text,
)

__all__ = [
    "COMPARISONS",
    "FUNCTIONS",
    "MAX_DEPTH",
    "MAX_EXPR_LENGTH",
    "NUMPY_FUNCS",
    "TABLE",
    "at",
    "call",
    "compile_numexpr",
    "compile_numpy",
    "describe_node_expr",
    "desugar",
    "inputs_used",
    "names_with",
    "numexpr_supported",
    "numexpr_threads",
    "parse",
    "result_dtype",
    "size",
    "substitute",
    "to_text",
]
