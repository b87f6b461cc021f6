"""Linear algebra: nn.Linear / F.linear -> linear; matmul spellings -> matmul;
addmm / baddbmm / addmv -> matmul + an elementwise beta * input + alpha * product;
torch.einsum -> einsum; nn.Embedding / F.embedding -> embedding."""

import numpy as np

from pmx.compiler.canon import data_input, elementwise, fail, in_shape, make, operands, out_shape, param, rule, weight
from pmx.runtime import expr as E


@rule("nn.Linear", "F.linear")
def linear(node, ctx):
    x = data_input(node)
    w = weight(node, "weight")
    b = weight(node, "bias", required=False)
    if w.shape is None or len(w.shape) != 2 or x.shape is None or x.shape[-1] != w.shape[1]:
        fail(
            node,
            f"input {x.shape} does not match weight {w.shape} (expected input [..., {w.shape[1] if w.shape else '?'}])",
        )
    if b is None:
        return [make(node, "linear", [x, w])]
    b, steps = _bias_as_vector(node, ctx, b, w.shape[0], len(x.shape))
    return [*steps, make(node, "linear", [x, w, b])]


def _bias_as_vector(node, ctx, b, features, rank):
    """torch's linear adds its bias by broadcasting: one of (1, ..., 1, N) or (1, ..., 1, 1)
    (ONNX Gemm's C of (1, N)), no longer than the output's rank, is the vector (N,) or
    (1,). Returns (bias, nodes that make it); any other shape fails naming the node."""
    shape = tuple(in_shape(node, b))
    if len(shape) <= 1:
        return b, []
    if any(d != 1 for d in shape[:-1]) or shape[-1] not in (1, features) or len(shape) > rank:
        fail(node, f"bias {b.name} of shape {list(shape)} does not broadcast over the output's {features} features")
    if b.is_constant:
        return ctx.const(f"{node.name}.bias", b.data.reshape(shape[-1:])), []
    vector = ctx.temp(node, shape[-1:], b.dtype, "bias")
    return vector, [make(node, "reshape", [b], dict(shape=shape[-1:]), outputs=[vector], name=f"{node.name}.bias")]


@rule("torch.matmul", "torch.mm", "torch.bmm", "Tensor.matmul", "Tensor.mm", "Tensor.bmm", "torch.mv", "Tensor.mv")
def matmul(node, ctx):
    a, b = operands(node, ("input", "self"), ("other", "mat2", "vec"), numbers=())
    for v in (a, b):
        if len(in_shape(node, v)) == 0:
            fail(node, f"{v.name} is 0-d; matmul needs at least 1-d operands")
    return [make(node, "matmul", [a, b])]


def _number(node, key, default):
    v = param(node, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(node, f"{key}={v!r} must be a number")
    return float(v)


@rule("torch.addmm", "Tensor.addmm", "torch.baddbmm", "Tensor.baddbmm", "torch.addmv", "Tensor.addmv")
def addmm(node, ctx):
    second = ("mat1", "batch1", "mat") if "mv" not in node.op else ("mat",)
    third = ("mat2", "batch2") if "mv" not in node.op else ("vec",)
    c, a, b = operands(node, ("input", "self"), second, third, numbers=())
    beta, alpha = _number(node, "beta", 1), _number(node, "alpha", 1)
    shape = out_shape(node)
    product = ctx.temp(node, shape, node.outputs[0].dtype, suffix="mm")
    mm = make(node, "matmul", [a, b], outputs=[product], name=f"{node.name}.mm")
    if beta == 0:  # torch ignores input then, even its NaNs
        return [mm, elementwise(node, _scaled(E.at(0), alpha), [product])]
    return [mm, elementwise(node, E.call("add", _scaled(E.at(0), beta), _scaled(E.at(1), alpha)), [c, product])]


def _scaled(x, factor):
    return x if factor == 1 else E.call("mul", x, factor)


@rule("torch.einsum")
def einsum(node, ctx):
    equation = param(node, "equation")
    if not isinstance(equation, str):  # "" is one: the equation of 0-d operands (torch.einsum("", x))
        fail(node, f"equation={equation!r} must be a string")
    operands = [v for v in node.inputs if v is not None]
    for v in operands:
        in_shape(node, v)
    return [make(node, "einsum", operands, dict(equation=equation))]


@rule("nn.Embedding", "F.embedding")
def embedding(node, ctx):
    ids = data_input(node)
    w = weight(node, "weight")
    if np.dtype(ids.dtype).kind not in "iu":
        fail(node, f"indices {ids.name} have dtype {ids.dtype}; embedding needs integer ids")
    if len(in_shape(node, w)) != 2:
        fail(node, f"weight {w.shape} must be [num_embeddings, embedding_dim]")
    if param(node, "max_norm", None) is not None:
        fail(node, "max_norm renormalizes the weight during lookup; pmx supports max_norm=None only")
    return [make(node, "embedding", [ids, w])]
