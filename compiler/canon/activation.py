"""Activations -> elementwise expressions over @0 (runtime/expr/tree.py grammar).

Every activation becomes an `elementwise` node, so fuse_elementwise and fuse_activation
treat them uniformly; torch's exact formulas are kept (GELU uses erfc, hardswish is
x * relu6(x + 3) / 6).
"""

import math

import numpy as np

from pmx.compiler.canon import data_input, elementwise, fail, make, param, rule, weight
from pmx.compiler.canon.math_ops import compile_time_number
from pmx.runtime.expr import at, call

SELU_ALPHA = 1.6732632423543772
SELU_SCALE = 1.0507009873554805


X = at(0)  # the activation's input


def gelu_expr(approximate="none"):
    if approximate == "tanh":
        c = math.sqrt(2.0 / math.pi)
        # 0.5 (1 + tanh(u)) == sigmoid(2u): same function, no cancellation for x < 0
        cubic = call("add", X, call("mul", 0.044715, call("mul", X, call("mul", X, X))))
        return call("mul", X, call("sigmoid", call("mul", float(2 * c), cubic)))
    # 0.5 x erfc(-x/sqrt2) == 0.5 x (1 + erf(x/sqrt2)) without the cancellation of 1 + erf
    # for x < 0, so the negative tail keeps float32 relative accuracy
    return call("mul", call("mul", X, 0.5), call("erfc", call("mul", X, float(-1 / math.sqrt(2)))))


# x - tanh(x) = x^3 (1/3 - 2/15 x^2 + 17/315 x^4 - ...): the series for |x| < 0.5, where
# the subtraction cancels (at x = 0.1 it kept 2 significant digits fewer than float32
# holds: relative error 1.0e-5); truncated after x^13, it is within 1.2e-6 at 0.5
_TANHSHRINK_SERIES = (1 / 3, -2 / 15, 17 / 315, -62 / 2835, 1382 / 155925, -21844 / 6081075)


def tanhshrink_expr():
    x2 = call("mul", X, X)
    poly = ("#", float(_TANHSHRINK_SERIES[-1]))
    for c in reversed(_TANHSHRINK_SERIES[:-1]):
        poly = call("add", float(c), call("mul", x2, poly))
    return call(
        "where", call("lt", call("abs", X), 0.5), call("mul", call("mul", X, x2), poly), call("sub", X, call("tanh", X))
    )


def softplus_expr(beta=1.0, threshold=20.0, x=X):
    beta = float(beta)
    return call(
        "where",
        call("gt", call("mul", x, beta), float(threshold)),
        x,
        call("div", call("log1p", call("exp", call("mul", x, beta))), beta),
    )


def _number(node, key, default):
    v = param(node, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(node, f"{key}={v!r} must be a number")
    return float(v)


def hardshrink_expr(lambd):
    # torch zeroes -lambd <= x <= lambd and keeps everything else (NaN too)
    return call("where", call("le", call("abs", X), float(lambd)), 0.0, X)


def softshrink_expr(lambd):
    # the middle is x - x: +0 (torch's vectorized loop writes +0 there, its scalar tail
    # x * 0) and NaN for NaN
    lambd = float(lambd)
    return call(
        "where",
        call("gt", X, lambd),
        call("sub", X, lambd),
        call("where", call("lt", X, -lambd), call("add", X, lambd), call("sub", X, X)),
    )


def threshold_expr(threshold, value):
    return call("where", call("le", X, float(threshold)), float(value), X)


def rrelu_expr(lower, upper):
    """Eval-mode RReLU: a leaky ReLU of slope (lower + upper) / 2 (pnnx records no
    training flag, and a training-mode RReLU draws random slopes)."""
    return call("where", call("gt", X, 0), X, call("mul", X, float((lower + upper) / 2)))


def _shrink_lambda(node):
    lambd = _number(node, "lambd", 0.5)
    if lambd < 0:
        fail(node, f"lambd={lambd} must be >= 0 (as in torch)")
    return lambd


def _unary(expr_fn):
    def fn(node, ctx):
        return [elementwise(node, expr_fn(node), [data_input(node)])]

    return fn


def _clamp_expr(lo, hi):
    e = X
    if lo is not None:
        e = call("maximum", e, float(lo))
    if hi is not None:
        e = call("minimum", e, float(hi))
    return e


def _where_positive(negative):
    return call("where", call("gt", X, 0), X, negative)


_RELU = call("maximum", X, 0)
_HARDSIGMOID = call("div", call("minimum", call("maximum", call("add", X, 3), 0), 6), 6)

_SIMPLE = {
    ("F.relu", "nn.ReLU", "torch.relu", "Tensor.relu"): lambda n: _RELU,
    ("F.relu6", "nn.ReLU6"): lambda n: call("minimum", _RELU, 6),
    ("F.hardtanh", "nn.Hardtanh"): lambda n: _clamp_expr(param(n, "min_val", -1.0), param(n, "max_val", 1.0)),
    ("F.leaky_relu", "nn.LeakyReLU"): lambda n: _where_positive(
        call("mul", X, float(param(n, "negative_slope", 0.01)))
    ),
    ("F.sigmoid", "nn.Sigmoid", "torch.sigmoid", "Tensor.sigmoid"): lambda n: call("sigmoid", X),
    ("F.silu", "nn.SiLU"): lambda n: call("mul", X, call("sigmoid", X)),
    ("F.hardswish", "nn.Hardswish"): lambda n: call("mul", X, _HARDSIGMOID),
    ("F.hardsigmoid", "nn.Hardsigmoid"): lambda n: _HARDSIGMOID,
    ("F.tanh", "nn.Tanh", "torch.tanh", "Tensor.tanh"): lambda n: call("tanh", X),
    ("F.gelu", "nn.GELU"): lambda n: gelu_expr(param(n, "approximate", "none")),
    ("F.elu", "nn.ELU"): lambda n: _where_positive(call("mul", float(param(n, "alpha", 1.0)), call("expm1", X))),
    ("F.celu", "nn.CELU"): lambda n: _where_positive(
        call("mul", float(param(n, "alpha", 1.0)), call("expm1", call("div", X, float(param(n, "alpha", 1.0)))))
    ),
    ("F.selu", "nn.SELU", "torch.selu"): lambda n: call(
        "mul", SELU_SCALE, _where_positive(call("mul", SELU_ALPHA, call("expm1", X)))
    ),
    ("F.softplus", "nn.Softplus"): lambda n: softplus_expr(param(n, "beta", 1.0), param(n, "threshold", 20.0)),
    ("F.mish", "nn.Mish"): lambda n: call("mul", X, call("tanh", softplus_expr())),
    ("F.softsign", "nn.Softsign"): lambda n: call("div", X, call("add", call("abs", X), 1)),
    ("F.logsigmoid", "nn.LogSigmoid"): lambda n: call("neg", softplus_expr(x=call("neg", X))),
    ("F.tanhshrink", "nn.Tanhshrink"): lambda n: tanhshrink_expr(),
    ("F.hardshrink", "nn.Hardshrink"): lambda n: hardshrink_expr(_shrink_lambda(n)),
    ("F.softshrink", "nn.Softshrink"): lambda n: softshrink_expr(_shrink_lambda(n)),
    ("F.threshold", "nn.Threshold"): lambda n: threshold_expr(_number(n, "threshold", None), _number(n, "value", None)),
    ("F.rrelu", "nn.RReLU"): lambda n: rrelu_expr(_number(n, "lower", 1 / 8), _number(n, "upper", 1 / 3)),
    # pnnx leaves these as aten:: ops (positional operands)
    ("torch.exp2", "Tensor.exp2", "torch.special.exp2", "aten::exp2"): lambda n: call("pow", 2.0, X),
    ("torch.frac", "Tensor.frac", "aten::frac"): lambda n: call("sub", X, call("trunc", X)),
}

# torch.<fn> / Tensor.<fn> unary math that maps one-to-one onto the expression grammar
_MATH = {
    "abs": "abs",
    "exp": "exp",
    "log": "log",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "neg": "neg",
    "floor": "floor",
    "ceil": "ceil",
    "round": "round",
    "sign": "sign",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "asin": "asin",
    "acos": "acos",
    "atan": "atan",
    "sinh": "sinh",
    "cosh": "cosh",
    "reciprocal": "reciprocal",
    "square": "square",
    "log10": "log10",
    "log1p": "log1p",
    "expm1": "expm1",
    "trunc": "trunc",
    "erf": "erf",
    "erfc": "erfc",
    "lgamma": "lgamma",
}

for _types, _fn in _SIMPLE.items():
    rule(*_types)(_unary(_fn))

for _name, _f_name in _MATH.items():
    rule(f"torch.{_name}", f"Tensor.{_name}")(_unary(lambda n, f=_f_name: call(f, X)))


@rule("nn.PReLU", "F.prelu")
def prelu(node, ctx):
    """x where x > 0, else x times its channel's slope (channels on dim 1; a 1-d input
    has one, as in torch; or one slope for all). A slope tensor that is a graph input
    (F.prelu(x, w)) is reshaped at run time to broadcast the same way."""
    x = data_input(node)
    w = weight(node, "weight")
    c = int(np.prod(w.shape)) if w.shape is not None else None
    channels = (x.shape[1] if len(x.shape) > 1 else 1) if x.shape is not None else None
    if c is None or (c != 1 and channels != c):
        fail(
            node,
            f"PReLU has {c} slopes but the input {x.shape} has {channels if channels is not None else '?'} channels",
        )
    shape = (c,) + (1,) * (len(x.shape) - 2) if c != 1 else ()
    expr = _where_positive(call("mul", X, at(1)))
    if w.is_constant:
        slopes = ctx.const(f"{node.name}.slope", w.data.reshape(shape).astype(np.float32))
        return [elementwise(node, expr, [x, slopes])]
    slopes = ctx.temp(node, shape, w.dtype, "slope")
    return [
        make(node, "reshape", [w], dict(shape=shape), outputs=[slopes], name=node.name + ".slope"),
        elementwise(node, expr, [x, slopes]),
    ]


@rule(
    "torch.clamp",
    "Tensor.clamp",
    "torch.clip",
    "Tensor.clip",
    "torch.clamp_min",
    "Tensor.clamp_min",
    "torch.clamp_max",
    "Tensor.clamp_max",
    "aten::clamp_min",
    "aten::clamp_max",
)
def clamp(node, ctx):
    """Bounds are numbers (params) or tensors ($min / $max inputs, or the second input of
    aten::clamp_min / aten::clamp_max, as pnnx writes F.normalize's clamp); an integer
    bound on an integer tensor stays integer, as in torch."""
    x = data_input(node)
    tensors, e = [x], X
    names = (node.op[-3:],) if node.op.endswith(("clamp_min", "clamp_max")) else ("min", "max")
    for key, fn in (("min", "maximum"), ("max", "minimum")):
        if key not in names:
            continue
        v = node.named_input(key)
        if v is None and node.op.startswith("aten::"):
            v = data_input(node, key, 1)
        bound = _scalar_bound(v) if v is not None else param(node, key, None)
        if v is not None and bound is None:
            tensors.append(v)
            e = call(fn, e, at(len(tensors) - 1))
            continue
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            fail(node, f"{key}={bound!r} must be a number or a tensor")
        e = call(fn, e, bound if isinstance(bound, int) and x.dtype[0] in "iu" else float(bound))
    return [elementwise(node, e, tensors)]


def _scalar_bound(v):
    """A 0-d bound known at compile time (a Python number pnnx wrote as an expression, as
    in x.clamp_min(1e-6)) as a number: torch lets a 0-d bound change no tensor's float
    dtype, so it is a literal of the expression, not a float64 operand."""
    if v.shape not in (None, ()):
        return None
    return compile_time_number(v)


@rule("F.glu", "nn.GLU")
def glu(node, ctx):
    """a * sigmoid(b) for the halves a, b of the input along dim: a split (two views
    once aliased) and one elementwise node."""
    x = data_input(node)
    dim = param(node, "dim", -1)
    rank = len(x.shape) if x.shape is not None else 0
    if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
        fail(node, f"dim={dim!r} must be an int in range for an input of rank {rank}")
    axis = dim % rank
    if x.shape[axis] is None or x.shape[axis] % 2:
        fail(node, f"GLU halves dim {dim}, of size {x.shape[axis]}: it must be even")
    half = list(x.shape)
    half[axis] //= 2
    a, b = (ctx.temp(node, tuple(half), x.dtype, s) for s in ("a", "b"))
    return [
        make(node, "split", [x], dict(axis=axis, sizes=(half[axis],) * 2), outputs=[a, b], name=node.name + ".split"),
        elementwise(node, call("mul", X, call("sigmoid", at(1))), [a, b]),
    ]
