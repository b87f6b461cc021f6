"""Elementwise expressions: one grammar, two backends (numexpr and numpy ufuncs).

Grammar (the prefix form pnnx writes in `pnnx.Expression expr=`, which pmx also stores):

    expr    := call | input | literal
    call    := NAME "(" expr ("," expr)* ")"
    input   := "@" DIGITS                      -- the node's i-th input
    literal := number | "inf" | "-inf" | "nan" | "True" | "False"

Only the functions in FUNCTIONS are accepted; strings are parsed by this module and never
passed to eval. The same text is compiled either to one numexpr program or to a sequence
of numpy ufunc calls writing into preallocated buffers; which one runs is decided by the
compiler and stored per node (variant "numexpr" or "numpy").

Trees are nested tuples: ("@", i) for inputs, ("#", value) for literals, and
(name, arg, ...) for calls, so equal subtrees compare equal (used for CSE) and a tree is
immutable and hashable: the compiler's nodes and the loaded model's nodes hold trees
(built with at() and call()), and text exists only in files (parse, to_text).
"""

import functools
import math
import re

import numpy as np

from pmx.runtime.errors import PmxFormatError

# name -> arity
FUNCTIONS = {
    # pnnx binary spellings
    "add": 2,
    "sub": 2,
    "mul": 2,
    "div": 2,
    "pow": 2,
    "max": 2,
    "min": 2,
    "maximum": 2,
    "minimum": 2,
    "atan2": 2,
    "fmod": 2,
    "remainder": 2,
    "floor_divide": 2,
    "and": 2,
    "or": 2,
    "xor": 2,
    "lshift": 2,
    "rshift": 2,
    "logaddexp": 2,
    # comparisons (produce bool)
    "gt": 2,
    "ge": 2,
    "lt": 2,
    "le": 2,
    "eq": 2,
    "ne": 2,
    # unary
    "neg": 1,
    "abs": 1,
    "sqrt": 1,
    "rsqrt": 1,
    "exp": 1,
    "log": 1,
    "log10": 1,
    "log1p": 1,
    "expm1": 1,
    "sign": 1,
    "floor": 1,
    "ceil": 1,
    "round": 1,
    "trunc": 1,
    "sin": 1,
    "cos": 1,
    "tan": 1,
    "asin": 1,
    "acos": 1,
    "atan": 1,
    "sinh": 1,
    "cosh": 1,
    "tanh": 1,
    "asinh": 1,
    "acosh": 1,
    "atanh": 1,
    "reciprocal": 1,
    "square": 1,
    "sigmoid": 1,
    "erf": 1,
    "erfc": 1,
    "not": 1,
    "lgamma": 1,
    # ternary
    "where": 3,
}

MAX_EXPR_LENGTH = 1 << 16
MAX_DEPTH = 200

# a number, or a complex one as pnnx writes it: "%e+%ej", the "+" kept before a negative part
_TOKEN = re.compile(
    r"\s*(?:(@\d+)|([A-Za-z_][A-Za-z_0-9]*)"
    r"|([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:\+?[-+](?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?j)?)"
    r"|(-inf)|(\()|(\))|(,))"
)


def at(i):
    """The tree of the node's i-th input, @i."""
    return ("@", i)


def call(name, *args):
    """The tree name(args...): each arg a tree, or a Python number or bool (a literal)."""
    if FUNCTIONS.get(name) != len(args):
        raise ValueError(f"{name} takes {FUNCTIONS.get(name)} arguments, got {len(args)}")
    return (name, *(a if isinstance(a, tuple) else ("#", a) for a in args))


def parse(text: str, num_inputs: int | None = None):
    """Parse an expression string into a tree. Raises PmxFormatError on anything else.
    Only the file boundaries call it: the pnnx frontend, and the loader, once per
    distinct expression of a file; everything between holds trees."""
    if not isinstance(text, str) or not text or len(text) > MAX_EXPR_LENGTH:
        raise PmxFormatError(f"expression must be a non-empty string under {MAX_EXPR_LENGTH} chars")
    tokens = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise PmxFormatError(f"expression {text[:80]!r}: unexpected character at {pos}: {text[pos : pos + 10]!r}")
        tokens.append(m)
        pos = m.end()
    tree, i = _parse_at(tokens, 0, text, 0)
    if i != len(tokens):
        raise PmxFormatError(f"expression {text[:80]!r}: trailing text after a complete expression")
    if num_inputs is not None:
        for idx in sorted(inputs_used(tree)):
            if idx >= num_inputs:
                raise PmxFormatError(f"expression {text[:80]!r} uses @{idx} but the node has {num_inputs} inputs")
    return tree


def _parse_at(tokens, i, text, depth):
    if depth > MAX_DEPTH:
        raise PmxFormatError(f"expression {text[:80]!r} nests deeper than {MAX_DEPTH}")
    if i >= len(tokens):
        raise PmxFormatError(f"expression {text[:80]!r} ends early")
    inp, name, num, neginf = tokens[i].group(1), tokens[i].group(2), tokens[i].group(3), tokens[i].group(4)
    if inp:
        return ("@", int(inp[1:])), i + 1
    if num:
        if num.endswith("j"):
            return ("#", complex(num.replace("+-", "-"))), i + 1
        value = float(num) if any(c in num for c in ".eE") else int(num)
        return ("#", value), i + 1
    if neginf:
        return ("#", -math.inf), i + 1
    if name in ("inf", "nan"):
        return ("#", float(name)), i + 1
    if name in ("True", "False"):
        return ("#", name == "True"), i + 1
    if name is None:
        raise PmxFormatError(f"expression {text[:80]!r}: expected a value at token {i}")
    if name not in FUNCTIONS:
        raise PmxFormatError(f"expression {text[:80]!r}: unknown function {name!r}")
    if i + 1 >= len(tokens) or tokens[i + 1].group(5) is None:
        raise PmxFormatError(f"expression {text[:80]!r}: {name} must be followed by '('")
    i += 2
    args = []
    while True:
        arg, i = _parse_at(tokens, i, text, depth + 1)
        args.append(arg)
        if i < len(tokens) and tokens[i].group(7):
            i += 1
            continue
        if i < len(tokens) and tokens[i].group(6):
            i += 1
            break
        raise PmxFormatError(f"expression {text[:80]!r}: expected ',' or ')' after argument of {name}")
    if len(args) != FUNCTIONS[name]:
        raise PmxFormatError(f"expression {text[:80]!r}: {name} takes {FUNCTIONS[name]} arguments, got {len(args)}")
    return (name, *args), i


def to_text(tree) -> str:
    """Inverse of parse()."""
    kind = tree[0]
    if kind == "@":
        return f"@{tree[1]}"
    if kind == "#":
        v = tree[1]
        if isinstance(v, bool):
            return "True" if v else "False"
        if isinstance(v, float):
            if math.isnan(v):
                return "nan"
            if math.isinf(v):
                return "inf" if v > 0 else "-inf"
            return repr(float(np.float32(v))) if float(np.float32(v)) == v else repr(v)
        if isinstance(v, complex):
            return f"{v.real!r}{'+' if v.imag >= 0 else ''}{v.imag!r}j"
        return str(v)
    return kind + "(" + ",".join(to_text(a) for a in tree[1:]) + ")"


# Activations a conv/linear/matmul epilogue commonly holds, by the tree fuse_activation
# leaves (x = the GEMM's output, @0), for people reading profiles and `pmx inspect`.
_NAMED_EPILOGUES = {
    "maximum(@0,0)": "relu",
    "minimum(maximum(@0,0),6)": "relu6",
    "sigmoid(@0)": "sigmoid",
    "tanh(@0)": "tanh",
    "mul(@0,sigmoid(@0))": "silu",
    "mul(@0,div(minimum(maximum(add(@0,3),0),6),6))": "hardswish",
    "div(minimum(maximum(add(@0,3),0),6),6)": "hardsigmoid",
}


def describe_node_expr(op, tree) -> str:
    """What a node's expression does, for people: an elementwise node's whole
    expression; on other ops the fused epilogue after the kernel, by name where it is a
    common activation (relu, relu6, hardswish, ...), else as an expression of @0."""
    if tree is None:
        return ""
    text = to_text(tree)
    if op == "elementwise":
        return text
    return "+" + _NAMED_EPILOGUES.get(text, text)


def inputs_used(tree) -> set:
    if tree[0] == "@":
        return {tree[1]}
    if tree[0] == "#":
        return set()
    out = set()
    for a in tree[1:]:
        out |= inputs_used(a)
    return out


def substitute(tree, mapping):
    """Replace ("@", i) leaves by mapping[i] (trees). Used when fusing expressions."""
    if tree[0] == "@":
        return mapping[tree[1]]
    if tree[0] == "#":
        return tree
    return (tree[0], *(substitute(a, mapping) for a in tree[1:]))


def size(tree) -> int:
    if tree[0] in ("@", "#"):
        return 1
    return 1 + sum(size(a) for a in tree[1:])


# --- desugaring: composite functions in terms of primitives both backends share ---------

# erfc(a), a >= 0: t * exp(-a^2 + P(t)), t = 1 / (1 + a/2) (Numerical Recipes' erfcc,
# Chebyshev fit, relative error < 1.2e-7 for every a); P's coefficients, constant first.
_ERFC_P = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)
# erf(z) = 2/sqrt(pi) * z * S(z^2) for |z| < 0.5 (Taylor to z^11), where 1 - erfc loses
# relative accuracy
_ERF_TAYLOR = (1.0, -1 / 3, 1 / 10, -1 / 42, 1 / 216, -1 / 1320)


def _c(v):
    return ("#", v)


def _horner(coeffs, t):
    poly = _c(coeffs[-1])
    for a in reversed(coeffs[:-1]):
        poly = ("add", ("mul", poly, t), _c(a))
    return poly


def _erfc_abs(a):
    t = ("reciprocal", ("add", _c(1.0), ("mul", _c(0.5), a)))
    return ("mul", t, ("exp", ("sub", _horner(_ERFC_P, t), ("mul", a, a))))


# Branches are blended arithmetically, not with where(): numpy's masked copies cost
# ~4 ns per element on a sign that changes at random (GELU's input), ~20x an add; a
# 0/1 mask from a saturated scale costs two cheap passes. 2^100 saturates every float32
# difference that matters here (the smallest nonzero |z| - 0.5 is 2^-25).
_SATURATE = 2.0**100


def _mask_negative(z):
    """1 where z < 0, else 0 (a fraction only for -2^-100 < z < 0, where both branches
    it selects between agree to float32 anyway); NaN stays NaN."""
    return ("minimum", ("maximum", ("mul", z, _c(-_SATURATE)), _c(0.0)), _c(1.0))


def _blend(mask, if_zero, if_one):
    """if_zero + mask * (if_one - if_zero): the branch the 0/1 mask selects (both finite)."""
    return ("add", if_zero, ("mul", mask, ("sub", if_one, if_zero)))


def _erf(z):
    a = ("abs", z)
    zc = ("minimum", ("maximum", z, _c(-0.5)), _c(0.5))  # the Taylor branch's range: stays finite
    small = ("mul", ("mul", _c(2 / math.sqrt(math.pi)), zc), _horner(_ERF_TAYLOR, ("mul", zc, zc)))
    sign = ("sub", _c(1.0), ("mul", _mask_negative(z), _c(2.0)))
    large = ("mul", sign, ("sub", _c(1.0), _erfc_abs(a)))
    beyond_half = (
        "minimum",
        ("maximum", ("add", ("mul", ("sub", a, _c(0.5)), _c(_SATURATE)), _c(1.0)), _c(0.0)),
        _c(1.0),
    )
    return _blend(beyond_half, small, large)


def _erfc(z):
    e = _erfc_abs(("abs", z))
    return _blend(_mask_negative(z), e, ("sub", _c(2.0), e))


def desugar(tree):
    """Rewrite spellings to the primitive set (erf and erfc to float32 accuracy, relative
    error < 4e-7 everywhere: a Taylor series near 0, erfc's Chebyshev fit elsewhere; pnnx's
    binary max/min are elementwise maximum/minimum), and SiLU, x * sigmoid(x), to
    x / (1 + exp(-x)): four numpy passes instead of five (the reciprocal and the multiply
    become one divide; EfficientNet has one after every conv). For x << 0, exp(-x)
    overflows to inf and x / inf is -0."""
    if tree[0] in ("@", "#"):
        return tree
    name, args = tree[0], [desugar(a) for a in tree[1:]]
    if name == "mul":
        a, b = args
        x = a if b == ("sigmoid", a) else b if a == ("sigmoid", b) else None
        if x is not None:
            return ("div", x, ("add", ("exp", ("neg", x)), _c(1.0)))
    if name == "max":
        name = "maximum"
    elif name == "min":
        name = "minimum"
    elif name == "erf":
        return _erf(args[0])
    elif name == "erfc":
        return _erfc(args[0])
    return (name, *args)


# --- numexpr backend -------------------------------------------------------------------

_NE_BINOP = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "pow": "**",
    "gt": ">",
    "ge": ">=",
    "lt": "<",
    "le": "<=",
    "eq": "==",
    "ne": "!=",
    "and": "&",
    "or": "|",
    "xor": "^",
}
_NE_UNARY = {
    "abs": "abs",
    "sqrt": "sqrt",
    "exp": "exp",
    "log": "log",
    "log10": "log10",
    "log1p": "log1p",
    "expm1": "expm1",
    "floor": "floor",
    "ceil": "ceil",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "asin": "arcsin",
    "acos": "arccos",
    "atan": "arctan",
    "sinh": "sinh",
    "cosh": "cosh",
    "tanh": "tanh",
    "asinh": "arcsinh",
    "acosh": "arccosh",
    "atanh": "arctanh",
}
# numexpr computes these in float64 or lacks them; such expressions run on numpy.
_NE_UNSUPPORTED = {
    "sign",
    "round",
    "trunc",
    "remainder",
    "floor_divide",
    "fmod",
    "not",
    "lshift",
    "rshift",
    "logaddexp",
    "lgamma",
}


def numexpr_supported(tree) -> bool:
    return _ne_ok(desugar(tree))


def _ne_ok(tree) -> bool:
    if tree[0] == "#":
        return not isinstance(tree[1], complex)  # to_numexpr makes float32 constants
    if tree[0] == "@":
        return True
    if tree[0] in _NE_UNSUPPORTED:
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
        if kind in _NE_BINOP:
            return f"({a[0]} {_NE_BINOP[kind]} {a[1]})"
        if kind in _NE_UNARY:
            return f"{_NE_UNARY[kind]}({a[0]})"
        if kind == "neg":
            return f"(-{a[0]})"
        if kind == "reciprocal":
            return f"(1 / {a[0]})"
        if kind == "rsqrt":
            return f"(1 / sqrt({a[0]}))"
        if kind == "square":
            return f"({a[0]} * {a[0]})"
        if kind == "sigmoid":
            return f"(1 / (1 + exp(-{a[0]})))"
        if kind == "maximum":
            return f"where({a[0]} > {a[1]}, {a[0]}, {a[1]})"
        if kind == "minimum":
            return f"where({a[0]} < {a[1]}, {a[0]}, {a[1]})"
        if kind == "where":
            return f"where({a[0]}, {a[1]}, {a[2]})"
        if kind == "atan2":
            return f"arctan2({a[0]}, {a[1]})"
        raise PmxFormatError(f"function {kind!r} has no numexpr form")

    return emit(desugar(tree)), constants


# --- numpy backend ---------------------------------------------------------------------


def _sigmoid(x, out):
    np.negative(x, out=out)
    np.exp(out, out=out)
    np.add(out, 1, out=out)
    np.reciprocal(out, out=out)


def _rsqrt(x, out):
    np.sqrt(x, out=out)
    np.reciprocal(out, out=out)


def _floor_divide(a, b, out):
    if out.dtype.kind in "iu":  # integer floor division rounds toward -inf, as torch's
        np.floor_divide(a, b, out=out, casting="unsafe")
        return
    np.true_divide(a, b, out=out)
    np.floor(out, out=out)


def _where(c, a, b, out):
    np.copyto(out, b, casting="unsafe")
    np.copyto(out, a, where=c, casting="unsafe")


# Lanczos' approximation of the gamma function, g = 7 with 9 coefficients (the widely
# published set): relative error about 1e-15 in float64 for x >= 0.5.
_LANCZOS_G = 7.0
_LANCZOS = (
    0.99999999999980993,
    676.5203681218851,
    -1259.1392167224028,
    771.32342877765313,
    -176.61502916214059,
    12.507343278686905,
    -0.13857109526572012,
    9.9843695780195716e-6,
    1.5056327351493116e-7,
)
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _lgamma(x, out=None):
    """log|Gamma(x)| as torch.lgamma: Lanczos' series in float64 for x >= 0.5, the
    reflection log(pi / |sin(pi x)|) - lgamma(1 - x) below (sin's argument reduced to
    [-0.5, 0.5] first, exact for float32 x), +inf at the poles 0, -1, -2, ... and at
    +-inf. Error ~1e-14, absolute below 1 and relative above, far below float32's
    rounding; numpy has no lgamma, and math.lgamma per element is ~3x slower. Its
    float64 temporaries are allocated per call: lgamma is rare in models."""
    x = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        reflect = x < 0.5
        z = np.where(reflect, -x, x - 1.0)  # for the reflected, 1 - x = z + 1
        series, tmp = np.full_like(z, _LANCZOS[0]), np.empty_like(z)
        for i, c in enumerate(_LANCZOS[1:], 1):
            np.add(z, i, out=tmp)
            np.divide(c, tmp, out=tmp)
            series += tmp
        np.add(z, _LANCZOS_G + 0.5, out=tmp)  # t
        z += 0.5
        z *= np.log(tmp)
        z -= tmp
        np.log(series, out=series)
        z += series
        z += _HALF_LOG_2PI  # lgamma(z + 1)
        if reflect.any():
            np.round(x, out=tmp)
            np.subtract(x, tmp, out=tmp)
            tmp *= np.pi
            np.sin(tmp, out=tmp)
            np.abs(tmp, out=tmp)
            np.divide(np.pi, tmp, out=tmp)
            np.log(tmp, out=tmp)
            tmp -= z
            np.copyto(z, tmp, where=reflect)
        z[np.isinf(x)] = np.inf
    if out is None:
        return z
    np.copyto(out, z, casting="unsafe")
    return out


NUMPY_FUNCS = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.true_divide,
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "atan2": np.arctan2,
    "fmod": np.fmod,
    "remainder": np.remainder,
    "floor_divide": _floor_divide,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "gt": np.greater,
    "ge": np.greater_equal,
    "lt": np.less,
    "le": np.less_equal,
    "eq": np.equal,
    "ne": np.not_equal,
    "not": np.logical_not,
    "neg": np.negative,
    "abs": np.absolute,
    "sqrt": np.sqrt,
    "rsqrt": _rsqrt,
    "exp": np.exp,
    "log": np.log,
    "log10": np.log10,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sign": np.sign,
    "floor": np.floor,
    "ceil": np.ceil,
    "round": np.rint,
    "trunc": np.trunc,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tanh": np.tanh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "reciprocal": np.reciprocal,
    "square": np.square,
    "sigmoid": _sigmoid,
    "where": _where,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
    "logaddexp": np.logaddexp,
    "lgamma": _lgamma,
}


def _literal(v, float_dtype):
    # Python scalars are "weak" under NEP 50, so float32 arrays stay float32.
    if isinstance(v, float):
        return float(np.dtype(float_dtype).type(v)) if float_dtype else v
    return v


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
    costs ~50 us per expression in a fresh process (each ufunc's first call), a sixth
    of a small CNN's load. Otherwise it evaluates the tree on samples, memoized: the
    loader's shape-rule check asks for every elementwise node."""
    dtypes = tuple(np.dtype(d) for d in input_dtypes)
    if dtypes and dtypes[0].kind == "f" and dtypes.count(dtypes[0]) == len(dtypes) and _keeps_float_dtype(tree):
        return dtypes[0]
    return _result_dtype(tree, dtypes)


COMPARISONS = frozenset({"gt", "ge", "lt", "le", "eq", "ne"})

# Functions that map floats of one dtype (with int or float literals) to that dtype.
_FLOAT_KEEPING = (
    frozenset(FUNCTIONS)
    - COMPARISONS
    - {
        "and",
        "or",
        "xor",
        "not",
        "where",
        "lshift",
        "rshift",
    }
)  # shifts take integers only


@functools.lru_cache(maxsize=4096)
def _keeps_float_dtype(tree):
    """Only _FLOAT_KEEPING functions, each reading an input somewhere below it, over
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
        elif t[0] not in _FLOAT_KEEPING:
            return False
        elif ready:
            if not any(reads_input[id(a)] for a in t[1:]):
                return False
            reads_input[id(t)] = True
        else:
            stack.append((t, True))
            stack.extend((a, False) for a in t[1:])
    return reads_input[id(tree)]


class Exact:
    """A tree as a memo key that tells its literals apart: trees are tuples, and Python
    has 1 == 1.0 == True and 0.0 == -0.0, so add(@0,1) and add(@0,1.0) (an integer and a
    float result for an integer input) or where(c,0.0,@0) and where(c,-0.0,@0) compare
    equal and would share a memoized dtype, plan or desugared tree. repr keeps each
    literal's type and sign."""

    __slots__ = ("tree", "text", "_hash")

    def __init__(self, tree):
        self.tree, self.text = tree, repr(tree)
        self._hash = hash(self.text)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Exact) and self.text == other.text


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


def compile_numpy(tree, inputs, out, empty=None):
    """Return a zero-argument callable evaluating `tree` over `inputs` into `out` with numpy
    ufuncs. Temporaries are allocated once here, never on the hot path; equal subtrees
    are computed once; a temporary whose last reader has run is reused by later steps of
    the same shape and dtype (exact GELU's ~30 steps on a ViT MLP tensor needed 73 MB
    of temporaries without reuse, 4 buffers with it). A ufunc or clip step may write
    into the buffer of an operand it reads for the last time (same shape and dtype:
    elementwise, so in place is safe; SiLU's four steps need one buffer, not two);
    custom steps such as where are not in-place safe and never do. `empty(shape, dtype)`
    makes the temporaries (default np.empty; kernels pass BindContext.temporary_array, whose
    buffers the nodes of a binding share)."""
    special = _special_numpy_step(tree, inputs, out)
    if special is not None:
        return special
    tree = _desugared(tree)
    final_into_out = not _needs_temp(tree, inputs, out)
    # out may hold temporaries when no input can overlap it (may_share_memory: a bounds
    # check, conservative)
    out_free = final_into_out and not any(np.may_share_memory(out, x) for x in inputs if isinstance(x, np.ndarray))
    program, slot_shapes, slot_of, result = _numpy_plan(
        Exact(tree),
        tuple(np.shape(x) for x in inputs),
        tuple(x.dtype for x in inputs),
        out.dtype,
        final_into_out,
        out.shape if out_free else None,
    )
    slots = [(empty or np.empty)(shape, dtype) for shape, dtype in slot_shapes]

    def array(ref):
        kind, v = ref
        if kind == "tmp":
            return out if slot_of[v] == OUT_SLOT else slots[slot_of[v]]
        return out if kind == "out" else inputs[v] if kind == "in" else v

    steps = []
    for t, operands, target, bounds in program:
        args, dst = [array(r) for r in operands], array(target)
        if bounds is not None:
            steps.append(_clip_step(args[0], bounds, dst))
        elif isinstance(NUMPY_FUNCS[t[0]], np.ufunc):
            steps.append(_ufunc_step(NUMPY_FUNCS[t[0]], args, dst))
        else:
            steps.append(_custom_step(NUMPY_FUNCS[t[0]], args, dst))
    if result[0] != "out":
        src = array(result)
        steps.append(lambda: np.copyto(out, src, casting="unsafe"))

    if len(steps) == 1:
        return steps[0]

    def run():
        for s in steps:
            s()

    return run


def _desugared(tree):
    """desugar(tree), memoized: trees are immutable tuples."""
    return _desugared_exact(Exact(tree))


@functools.lru_cache(maxsize=1024)
def _desugared_exact(key):
    return desugar(key.tree)


@functools.lru_cache(maxsize=1024)
def _numpy_plan(key, input_shapes, input_dtypes, out_dtype, final_into_out, free_out_shape=None):
    """The part of compile_numpy that depends on shapes and dtypes, not on the arrays
    (key: the tree as an Exact):
    (program, temporary buffer slots as (shape, dtype), slot of each temporary, result
    ref). Memoized: a model binds the same activation for every conv and every split
    part of it (SiLU after each of EfficientNet-B0's 81 convs), and planning it cost
    about half of binding that model. The program's literal operands are read-only
    arrays shared by the callables built from it. free_out_shape (out's shape, when no
    input overlaps out) lets a temporary of out's shape and dtype live in out itself
    (slot OUT_SLOT) while out is not yet written: an affine + ReLU chain then runs in
    out with no temporary (DenseNet-121's 62 BN + ReLU nodes had held 38 MB of them)."""
    tree = key.tree
    float_dtype = out_dtype if out_dtype.kind in "fc" else None
    program = []  # (tree, operand refs, target ref, clip bounds or None)
    temps = []  # (shape, dtype) per temporary
    memo = {}  # Exact(subtree) -> its temporary: equal subtrees are computed once

    def shape_of(ref):
        kind, v = ref
        return temps[v][0] if kind == "tmp" else input_shapes[v] if kind == "in" else np.shape(v)

    def emit(t, final=False):
        if t[0] == "@":
            return ("in", t[1])
        if t[0] == "#":
            return ("lit", _literal(t[1], float_dtype))
        exact = Exact(t)
        if exact in memo and not final:
            return memo[exact]
        clip = _as_clip(t) if float_dtype is not None else None
        if clip is not None and result_dtype(_relabel(t), _leaf_dtypes(t, input_dtypes)).kind != "f":
            clip = None  # integer max/min: infinite bounds do not exist there
        operands = [emit(a) for a in (clip[0] if clip else t)[1:]]
        if final:
            target = ("out", None)
        else:
            shape = np.broadcast_shapes(*[shape_of(r) for r in operands])
            dtype = result_dtype(_relabel(t), _leaf_dtypes(t, input_dtypes))
            if float_dtype is not None and dtype.kind == "f" and dtype.itemsize > float_dtype.itemsize:
                dtype = float_dtype
            target = ("tmp", len(temps))
            temps.append((shape, dtype))
            memo[exact] = target
        program.append((t, operands, target, clip[1] if clip else None))
        return target

    result = emit(tree, final=final_into_out)
    out_key = None
    if free_out_shape is not None and program and _in_place_safe(program[-1]):
        # the last step reads a temporary in out and writes out: safe element by element
        out_key = _key((free_out_shape, out_dtype))
    slot_shapes, slot_of = _buffer_slots(program, temps, out_key)
    return program, slot_shapes, slot_of, result


def _special_numpy_step(tree, inputs, out):
    """The table form of exact GELU (ViT's MLPs: the generic erfc form is ~30 ufunc
    passes plus an exp per element) when `tree` is GELU over one float32 input of out's
    shape, else None. Its gathers and float64 tail have no place in the generic program
    of ufunc steps, hence a step of its own."""
    x = _gelu_operand(tree, inputs)
    if x is None or out.dtype != np.float32 or x.dtype != np.float32 or x.shape != out.shape:
        return None
    return _gelu_table_step(x, out)


def _gelu_operand(tree, inputs):
    """The input array when tree is GELU as canonicalization writes it,
    mul(mul(@i,0.5),erfc(mul(@i,-1/sqrt(2)))), else None."""
    if tree[0] != "mul":
        return None
    a, b = tree[1], tree[2]
    if not (
        a[0] == "mul"
        and a[1][0] == "@"
        and a[2] == ("#", 0.5)
        and b[0] == "erfc"
        and b[1][0] == "mul"
        and b[1][1] == a[1]
        and b[1][2][0] == "#"
        and isinstance(b[1][2][1], float)
        and abs(b[1][2][1] + math.sqrt(0.5)) < 1e-12
    ):
        return None
    x = inputs[a[1][1]]
    return x if isinstance(x, np.ndarray) else None


# Exact GELU, x * Phi(x) (Phi the normal CDF), by a table: Phi at the multiples k * step
# of step = 2^-GELU_TABLE_BITS in [GELU_TABLE_LO, GELU_TABLE_HI), interpolated linearly
# from the exact offset of x in its step. Relative error <= ~2e-6 (the interpolation's
# h^2/8 * x^2 at x = -8, measured 2.0e-6), against ~6e-6 for the generic erfc form. x
# below the table (GELU(x) < 5e-15 in magnitude) takes erfc in float64 on those elements
# only; x above it has Phi = 1 to float32. ms for ViT-B/16's 197x3072 MLP tensor, one
# thread: generic 6.3, table 3.4 (two np.take gathers are ~1.5 of it; a complex64 table
# gathered once and read through .real/.imag took 4.1).
GELU_TABLE_LO, GELU_TABLE_HI, GELU_TABLE_BITS = -8.0, 6.0, 11


@functools.cache
def _gelu_tables():
    """(Phi at each step's left end, Phi's rise over the step), float32, row i for the
    step starting at GELU_TABLE_LO + i * step; ~1 ms, once per process."""
    step = 2.0**-GELU_TABLE_BITS
    xs = GELU_TABLE_LO + step * np.arange(int((GELU_TABLE_HI - GELU_TABLE_LO) / step) + 1)
    phi = 0.5 * _erfc_float64(-xs / math.sqrt(2))
    return phi[:-1].astype(np.float32), np.diff(phi).astype(np.float32)


def _erfc_float64(z):
    """erfc of a float64 array: the fit _erfc_abs writes as a tree (relative error
    < 1.2e-7), evaluated directly. The tail's size changes from run to run, and compiling
    the tree for each size cost ~2 ms per call (14K elements)."""
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = np.zeros_like(t)
    for c in reversed(_ERFC_P):
        poly = poly * t + c
    e = t * np.exp(poly - a * a)
    return np.where(z < 0, 2.0 - e, e)


def _gelu_table_step(x, out):
    """x is scaled to steps first (a power of two: exact), so the floor is the step's
    integer left end and the offset in the step is the difference, both exact, in three
    passes; the row is the left end less the table's first step, and int64 rows spare
    np.take a conversion of its own. The form before it offset x by GELU_TABLE_LO
    first, which rounds for |x| < 4, and took int32 rows: same accuracy (max relative
    error 1.97e-6 over [-13, 8], 1.39e-6 on N(0, 1.5^2) samples), ms, one thread,
    medians of 3 alternating rounds: 3136x384 8.42 -> 7.26 (ConvNeXt-tiny's first MLP),
    197x3072 3.89 -> 3.40 (ViT-B/16's). Splitting the passes into blocks that stay in
    cache gained nothing (6.23-7.57 against 7.32, over blocks of 16K-256K elements)."""
    phi_at, rise = _gelu_tables()
    inv_step = np.float32(2.0**GELU_TABLE_BITS)
    first = np.float32(GELU_TABLE_LO * inv_step)  # in steps, as the scaled x below
    last = np.float32(GELU_TABLE_HI * inv_step - 1)
    lo = np.float32(GELU_TABLE_LO)
    steps, left, phi = (np.empty_like(out) for _ in range(3))
    row = np.empty(out.shape, np.intp)
    below = np.empty(out.shape, bool)

    def run():
        np.multiply(x, inv_step, out=steps)
        np.clip(steps, first, last, out=steps)  # NaN stays NaN, and its row is clipped by take
        np.floor(steps, out=left)
        np.subtract(steps, left, out=steps)  # x's offset in its step, in steps
        np.subtract(left, first, out=left)
        with np.errstate(invalid="ignore"):  # NaN to int
            np.copyto(row, left, casting="unsafe")
        np.take(phi_at, row, out=phi, mode="clip")
        np.take(rise, row, out=left, mode="clip")
        np.multiply(steps, left, out=steps)
        np.add(phi, steps, out=phi)
        np.less(x, lo, out=below)
        # index arrays (x and out may be strided views), read before out (maybe x) is written
        tail = np.unravel_index(np.flatnonzero(below), below.shape) if below.any() else None
        tail_x = x[tail].astype(np.float64) if tail is not None else None
        np.multiply(x, phi, out=out)
        if tail is not None:
            out[tail] = 0.5 * tail_x * _erfc_float64(-tail_x / math.sqrt(2))

    return run


# slot_of value of a temporary kept in the output array itself
OUT_SLOT = -1


def _in_place_safe(step):
    """A ufunc or clip step may write where an operand it reads lies."""
    t, _, _, bounds = step
    return bounds is not None or isinstance(NUMPY_FUNCS[t[0]], np.ufunc)


def _buffer_slots(program, temps, out_key=None):
    """(slots as (shape, dtype), slot of each temporary): temporaries whose lifetimes do
    not overlap share a slot; with out_key, out is one more slot (OUT_SLOT) for
    temporaries of that shape and dtype."""
    last_read = {}
    for k, (_, operands, _, _) in enumerate(program):
        for kind, v in operands:
            if kind == "tmp":
                last_read[v] = k
    free, slot_of, dying, slots = {}, {}, {}, []
    if out_key is not None:
        free[out_key] = [OUT_SLOT]
    for k, step in enumerate(program):
        _t, operands, target, _bounds = step
        for v in dying.pop(k - 1, ()):  # read for the last time by an earlier step
            free.setdefault(_key(temps[v]), []).append(slot_of[v])
        if _in_place_safe(step):
            for v in dying.pop(k, ()):  # read for the last time by this step
                free.setdefault(_key(temps[v]), []).append(slot_of[v])
        kind, v = target
        if kind == "tmp":
            pool = free.get(_key(temps[v]))
            if pool:
                slot_of[v] = pool.pop()
            else:
                slot_of[v] = len(slots)
                slots.append(temps[v])
            dying.setdefault(last_read.get(v, k), []).append(v)
    return slots, slot_of


def _key(temp):
    shape, dtype = temp
    return tuple(shape), np.dtype(dtype)


def _as_clip(t):
    """(subtree with the clipped operand as its only argument, (lo, hi)) when t is
    maximum/minimum against literals (relu, relu6, clamp), else None. np.clip with two
    finite-or-infinite float bounds runs ~3x faster than np.maximum here (numpy 2.4,
    float32), and relu6 becomes one pass instead of two; NaN propagates in both."""
    lo, hi = -np.inf, np.inf
    node = t
    while node[0] in ("maximum", "minimum"):
        a, b = node[1], node[2]
        if b[0] != "#" and a[0] == "#":
            a, b = b, a
        if b[0] != "#" or not isinstance(b[1], (int, float)) or isinstance(b[1], bool):
            break
        if node[0] == "maximum" and lo == -np.inf and float(b[1]) <= hi:
            lo = float(b[1])
        elif node[0] == "minimum" and hi == np.inf and float(b[1]) >= lo:
            hi = float(b[1])
        else:
            break
        node = a
    if node is t:
        return None
    return ("clip", node), (lo, hi)


# np.clip is a Python wrapper around this ufunc that costs ~2-3 us per call, most of a
# small relu (squeeze-and-excitation vectors); the ufunc itself is not public API.
try:
    from numpy._core.umath import clip as _CLIP
except ImportError:  # another numpy layout: the public wrapper
    _CLIP = np.clip


def _clip_step(x, bounds, target):
    lo, hi = (np.asarray(v, target.dtype) for v in bounds)
    return lambda: _CLIP(x, lo, hi, out=target, casting="unsafe")


def _needs_temp(tree, inputs, out):
    """Write the final step straight into `out` unless the tree is a bare leaf or a
    custom function that would read an input `out` overlaps."""
    if tree[0] in ("@", "#"):
        return True
    fn = NUMPY_FUNCS.get(tree[0])
    if not isinstance(fn, np.ufunc):
        return any(np.shares_memory(out, x) for x in inputs if isinstance(x, np.ndarray))
    return False


def _ufunc_step(fn, args, target):
    a = tuple(args)
    if len(a) == 1:
        x = a[0]
        return lambda: fn(x, out=target, casting="unsafe")
    x, y = a
    return lambda: fn(x, y, out=target, casting="unsafe")


def _custom_step(fn, args, target):
    a = tuple(args)
    return lambda: fn(*a, out=target)


def _relabel(t):
    """Renumber the inputs of subtree t as 0..k-1 (for result_dtype on a subtree)."""
    order = sorted(inputs_used(t))
    return substitute(t, {i: ("@", j) for j, i in enumerate(order)}) if order else t


def _leaf_dtypes(t, dtypes):
    return [dtypes[i] for i in sorted(inputs_used(t))]


@functools.cache
def _numexpr_compiler():
    """numexpr is imported only when a model uses it (it costs ~10 ms)."""
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
