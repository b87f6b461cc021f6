"""The one table of elementwise functions: every function the expression grammar takes,
with its arity, its numpy function, its numexpr form and its traits. The grammar, both
backends, the dtype rules, the compiler's kernel choice, the epilogue placement and the
rewrite engine all read this table, so a new function is one line here (plus its numpy
helper in numpy_funcs.py if it is not a ufunc).

Each entry is _f(arity, numpy, numexpr, flags):
    numpy     the callable f(*args, out=) the numpy backend runs (None: desugared to other
              functions before any backend sees it, special.desugar)
    numexpr   a str.format template over the arguments' numexpr sources (None: numexpr
              lacks it or computes it in float64, so expressions using it run on numpy)
    flags     "compare"        the result is bool
              "bits"           takes integers or bools (logic, shifts): not float-keeping
              "select"         where(cond, a, b): not float-keeping
              "transcendental" a libm call per element (numexpr's threads pay off sooner)
              "cheap"          arithmetic or a clamp: cheap enough to run once after a
                               split's parts rather than inside each (kernels/common.py)
              "commutative"    f(a, b) == f(b, a) (the rewrite engine matches both orders)
"""

from collections import namedtuple

import numpy as np

from pmx.runtime.expr.numpy_funcs import _floor_divide, _lgamma, _rsqrt, _sigmoid, _where

Function = namedtuple("Function", "arity numpy numexpr flags")


def _f(arity, numpy, numexpr, flags):
    return Function(arity, numpy, numexpr, frozenset(flags.split()))


TABLE = {
    "add": _f(2, np.add, "({0} + {1})", "cheap commutative"),
    "sub": _f(2, np.subtract, "({0} - {1})", "cheap"),
    "mul": _f(2, np.multiply, "({0} * {1})", "cheap commutative"),
    "div": _f(2, np.divide, "({0} / {1})", "cheap"),
    "pow": _f(2, np.power, "({0} ** {1})", "transcendental"),
    "max": _f(2, None, None, ""),
    "min": _f(2, None, None, ""),
    "maximum": _f(2, np.maximum, "where({0} > {1}, {0}, {1})", "cheap commutative"),
    "minimum": _f(2, np.minimum, "where({0} < {1}, {0}, {1})", "cheap commutative"),
    "atan2": _f(2, np.arctan2, "arctan2({0}, {1})", "transcendental"),
    "fmod": _f(2, np.fmod, None, ""),
    "remainder": _f(2, np.remainder, None, ""),
    "floor_divide": _f(2, _floor_divide, None, ""),
    "and": _f(2, np.bitwise_and, "({0} & {1})", "bits commutative"),
    "or": _f(2, np.bitwise_or, "({0} | {1})", "bits commutative"),
    "xor": _f(2, np.bitwise_xor, "({0} ^ {1})", "bits commutative"),
    "lshift": _f(2, np.left_shift, None, "bits"),
    "rshift": _f(2, np.right_shift, None, "bits"),
    "logaddexp": _f(2, np.logaddexp, None, ""),
    "gt": _f(2, np.greater, "({0} > {1})", "compare cheap"),
    "ge": _f(2, np.greater_equal, "({0} >= {1})", "compare cheap"),
    "lt": _f(2, np.less, "({0} < {1})", "compare cheap"),
    "le": _f(2, np.less_equal, "({0} <= {1})", "compare cheap"),
    "eq": _f(2, np.equal, "({0} == {1})", "compare cheap commutative"),
    "ne": _f(2, np.not_equal, "({0} != {1})", "compare cheap commutative"),
    "neg": _f(1, np.negative, "(-{0})", "cheap"),
    "abs": _f(1, np.absolute, "abs({0})", "cheap"),
    "sqrt": _f(1, np.sqrt, "sqrt({0})", ""),
    "rsqrt": _f(1, _rsqrt, "(1 / sqrt({0}))", ""),
    "exp": _f(1, np.exp, "exp({0})", "transcendental"),
    "log": _f(1, np.log, "log({0})", "transcendental"),
    "log10": _f(1, np.log10, "log10({0})", "transcendental"),
    "log1p": _f(1, np.log1p, "log1p({0})", "transcendental"),
    "expm1": _f(1, np.expm1, "expm1({0})", "transcendental"),
    "sign": _f(1, np.sign, None, ""),
    "floor": _f(1, np.floor, "floor({0})", ""),
    "ceil": _f(1, np.ceil, "ceil({0})", ""),
    "round": _f(1, np.rint, None, ""),
    "trunc": _f(1, np.trunc, None, ""),
    "sin": _f(1, np.sin, "sin({0})", "transcendental"),
    "cos": _f(1, np.cos, "cos({0})", "transcendental"),
    "tan": _f(1, np.tan, "tan({0})", "transcendental"),
    "asin": _f(1, np.arcsin, "arcsin({0})", "transcendental"),
    "acos": _f(1, np.arccos, "arccos({0})", "transcendental"),
    "atan": _f(1, np.arctan, "arctan({0})", "transcendental"),
    "sinh": _f(1, np.sinh, "sinh({0})", "transcendental"),
    "cosh": _f(1, np.cosh, "cosh({0})", "transcendental"),
    "tanh": _f(1, np.tanh, "tanh({0})", "transcendental"),
    "asinh": _f(1, np.arcsinh, "arcsinh({0})", "transcendental"),
    "acosh": _f(1, np.arccosh, "arccosh({0})", "transcendental"),
    "atanh": _f(1, np.arctanh, "arctanh({0})", "transcendental"),
    "reciprocal": _f(1, np.reciprocal, "(1 / {0})", ""),
    "square": _f(1, np.square, "({0} * {0})", ""),
    "sigmoid": _f(1, _sigmoid, "(1 / (1 + exp(-{0})))", ""),
    "erf": _f(1, None, None, ""),
    "erfc": _f(1, None, None, ""),
    "not": _f(1, np.logical_not, None, "bits"),
    "lgamma": _f(1, _lgamma, None, ""),
    "where": _f(3, _where, "where({0}, {1}, {2})", "select cheap"),
}


def names_with(flag):
    """The functions whose flags include `flag`."""
    return frozenset(name for name, f in TABLE.items() if flag in f.flags)


FUNCTIONS = {name: f.arity for name, f in TABLE.items()}  # name -> arity
NUMPY_FUNCS = {name: f.numpy for name, f in TABLE.items() if f.numpy is not None}
COMPARISONS = names_with("compare")
# functions that map floats of one dtype (with int or float literals) to that dtype
FLOAT_KEEPING = frozenset(TABLE) - COMPARISONS - names_with("bits") - names_with("select")
