"""Activations -> elementwise expressions over @0 (runtime/expr.py grammar).

Every activation becomes an `elementwise` node, so fuse_elementwise and fuse_activation
treat them uniformly; torch's exact formulas are kept (GELU uses erfc, hardswish is
x * relu6(x + 3) / 6).
"""

import math

import numpy as np

from pmx.compiler.canon import data_input, elementwise, fail, in_shape, param, rule, weight
from pmx.compiler.canon.norm import per_channel

SELU_ALPHA = 1.6732632423543772
SELU_SCALE = 1.0507009873554805


def _f(v):
    return repr(float(v))


def gelu_expr(approximate="none"):
    if approximate == "tanh":
        c = math.sqrt(2.0 / math.pi)
        # 0.5 (1 + tanh(u)) == sigmoid(2u): same function, no cancellation for x < 0
        return f"mul(@0,sigmoid(mul({_f(2 * c)},add(@0,mul(0.044715,mul(@0,mul(@0,@0)))))))"
    # 0.5 x erfc(-x/sqrt2) == 0.5 x (1 + erf(x/sqrt2)) without the cancellation of 1 + erf
    # for x < 0, so the negative tail keeps float32 relative accuracy
    return f"mul(mul(@0,0.5),erfc(mul(@0,{_f(-1 / math.sqrt(2))})))"


# x - tanh(x) = x^3 (1/3 - 2/15 x^2 + 17/315 x^4 - ...): the series for |x| < 0.5, where
# the subtraction cancels (at x = 0.1 it kept 2 significant digits fewer than float32
# holds: relative error 1.0e-5); truncated after x^13, it is within 1.2e-6 at 0.5
_TANHSHRINK_SERIES = (1 / 3, -2 / 15, 17 / 315, -62 / 2835, 1382 / 155925, -21844 / 6081075)


def tanhshrink_expr():
    x2 = "mul(@0,@0)"
    poly = _f(_TANHSHRINK_SERIES[-1])
    for c in reversed(_TANHSHRINK_SERIES[:-1]):
        poly = f"add({_f(c)},mul({x2},{poly}))"
    return f"where(lt(abs(@0),0.5),mul(mul(@0,{x2}),{poly}),sub(@0,tanh(@0)))"


def softplus_expr(beta=1.0, threshold=20.0):
    return (f"where(gt(mul(@0,{_f(beta)}),{_f(threshold)}),@0,"
            f"div(log1p(exp(mul(@0,{_f(beta)}))),{_f(beta)}))")


def _unary(expr_fn):
    def fn(node, ctx):
        return [elementwise(node, expr_fn(node), [data_input(node)])]
    return fn


def _clamp_expr(lo, hi):
    e = "@0"
    if lo is not None:
        e = f"maximum({e},{_f(lo)})"
    if hi is not None:
        e = f"minimum({e},{_f(hi)})"
    return e


_SIMPLE = {
    ("F.relu", "nn.ReLU", "torch.relu", "Tensor.relu"): lambda n: "maximum(@0,0)",
    ("F.relu6", "nn.ReLU6"): lambda n: "minimum(maximum(@0,0),6)",
    ("F.hardtanh", "nn.Hardtanh"): lambda n: _clamp_expr(param(n, "min_val", -1.0), param(n, "max_val", 1.0)),
    ("F.leaky_relu", "nn.LeakyReLU"): lambda n: f"where(gt(@0,0),@0,mul(@0,{_f(param(n, 'negative_slope', 0.01))}))",
    ("F.sigmoid", "nn.Sigmoid", "torch.sigmoid", "Tensor.sigmoid"): lambda n: "sigmoid(@0)",
    ("F.silu", "nn.SiLU"): lambda n: "mul(@0,sigmoid(@0))",
    ("F.hardswish", "nn.Hardswish"): lambda n: "mul(@0,div(minimum(maximum(add(@0,3),0),6),6))",
    ("F.hardsigmoid", "nn.Hardsigmoid"): lambda n: "div(minimum(maximum(add(@0,3),0),6),6)",
    ("F.tanh", "nn.Tanh", "torch.tanh", "Tensor.tanh"): lambda n: "tanh(@0)",
    ("F.gelu", "nn.GELU"): lambda n: gelu_expr(param(n, "approximate", "none")),
    ("F.elu", "nn.ELU"): lambda n: f"where(gt(@0,0),@0,mul({_f(param(n, 'alpha', 1.0))},expm1(@0)))",
    ("F.celu", "nn.CELU"): lambda n: f"where(gt(@0,0),@0,mul({_f(param(n, 'alpha', 1.0))},expm1(div(@0,{_f(param(n, 'alpha', 1.0))}))))",
    ("F.selu", "nn.SELU", "torch.selu"): lambda n: f"mul({_f(SELU_SCALE)},where(gt(@0,0),@0,mul({_f(SELU_ALPHA)},expm1(@0))))",
    ("F.softplus", "nn.Softplus"): lambda n: softplus_expr(param(n, "beta", 1.0), param(n, "threshold", 20.0)),
    ("F.mish", "nn.Mish"): lambda n: "mul(@0,tanh(" + softplus_expr().replace("@0", "@0") + "))",
    ("F.softsign", "nn.Softsign"): lambda n: "div(@0,add(abs(@0),1))",
    ("F.logsigmoid", "nn.LogSigmoid"): lambda n: "neg(" + softplus_expr().replace("@0", "neg(@0)") + ")",
    ("F.tanhshrink", "nn.Tanhshrink"): lambda n: tanhshrink_expr(),
}

# torch.<fn> / Tensor.<fn> unary math that maps one-to-one onto the expression grammar
_MATH = {"abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
         "neg": "neg", "floor": "floor", "ceil": "ceil", "round": "round", "sign": "sign",
         "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin", "acos": "acos",
         "atan": "atan", "sinh": "sinh", "cosh": "cosh", "reciprocal": "reciprocal",
         "square": "square", "log10": "log10", "log1p": "log1p", "expm1": "expm1",
         "trunc": "trunc", "erf": "erf", "erfc": "erfc"}

for _types, _fn in _SIMPLE.items():
    rule(*_types)(_unary(_fn))

for _name, _f_name in _MATH.items():
    rule(f"torch.{_name}", f"Tensor.{_name}")(_unary(lambda n, f=_f_name: f"{f}(@0)"))


@rule("nn.PReLU", "F.prelu")
def prelu(node, ctx):
    x = data_input(node)
    w = weight(node, "weight")
    if not w.is_constant:  # F.prelu on a graph tensor: the slopes are known at run time only
        if x.shape is None or len(x.shape) < 2 or len(in_shape(node, w)) != 1:
            fail(node, f"PReLU weight {w.shape} on input {x.shape}: expected [C] slopes and an input [N, C, ...]")
        slopes = per_channel(node, ctx, w, x, "slope")
        return [slopes, elementwise(node, "where(gt(@0,0),@0,mul(@0,@1))", [x, slopes.outputs[0]])]
    c = w.data.size
    if c != 1 and (x.shape is None or len(x.shape) < 2 or x.shape[1] != c):
        fail(node, f"PReLU has {c} slopes but the input {x.shape} has {x.shape[1] if x.shape and len(x.shape) > 1 else '?'} channels")
    shape = (c,) + (1,) * (len(x.shape) - 2) if c != 1 else ()
    slopes = ctx.const(f"{node.name}.slope", w.data.reshape(shape).astype(np.float32))
    return [elementwise(node, "where(gt(@0,0),@0,mul(@0,@1))", [x, slopes])]


@rule("torch.clamp", "Tensor.clamp", "torch.clip", "Tensor.clip", "torch.clamp_min", "Tensor.clamp_min",
      "torch.clamp_max", "Tensor.clamp_max", "aten::clamp_min", "aten::clamp_max")
def clamp(node, ctx):
    """Bounds are numbers (params) or tensors ($min / $max inputs, or the second input of
    aten::clamp_min / aten::clamp_max, as pnnx writes F.normalize's clamp); an integer
    bound on an integer tensor stays integer, as in torch."""
    x = data_input(node)
    tensors, e = [x], "@0"
    names = (node.op[-3:],) if node.op.endswith(("clamp_min", "clamp_max")) else ("min", "max")
    for key, fn in (("min", "maximum"), ("max", "minimum")):
        if key not in names:
            continue
        v = node.named_input(key)
        if v is None and node.op.startswith("aten::"):
            v = data_input(node, key, 1)
        if v is not None:
            tensors.append(v)
            e = f"{fn}({e},@{len(tensors) - 1})"
            continue
        bound = param(node, key, None)
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            fail(node, f"{key}={bound!r} must be a number or a tensor")
        lit = str(bound) if isinstance(bound, int) and x.dtype[0] in "iu" else _f(bound)
        e = f"{fn}({e},{lit})"
    return [elementwise(node, e, tensors)]
