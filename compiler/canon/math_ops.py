"""pnnx.Expression, binary arithmetic spellings, reductions and softmax."""

from pmx.compiler.canon import data_input, elementwise, fail, make, param, rule
from pmx.runtime import expr as E
from pmx.runtime.errors import PmxFormatError


@rule("pnnx.Expression")
def expression(node, ctx):
    text = param(node, "expr")
    if not isinstance(text, str):
        fail(node, f"expr={text!r} is not an expression string")
    if "size(" in text or "[" in text or "int(" in text:
        fail(node, f"expression {text!r} computes on tensor shapes (dynamic-shape export); export with a fixed input shape")
    try:
        tree = E.parse(text, len(node.inputs))
    except PmxFormatError as e:
        fail(node, str(e))
    return [elementwise(node, E.to_text(tree), list(node.inputs))]


_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow",
           "maximum": "maximum", "minimum": "minimum", "atan2": "atan2", "fmod": "fmod",
           "remainder": "remainder", "floor_divide": "floor_divide",
           "gt": "gt", "ge": "ge", "lt": "lt", "le": "le", "eq": "eq", "ne": "ne"}


def _binary(fn_name):
    def fn(node, ctx):
        a = data_input(node, "input", 0)
        b = node.named_input("other")
        tensors = [a]
        if b is None:
            unnamed = [v for v, n in zip(node.inputs, node.input_names) if v is not a and (n is None or n in ("other", "exponent"))]
            b = unnamed[0] if unnamed else None
        if b is not None:
            tensors.append(b)
            rhs = "@1"
        else:
            other = param(node, "other", param(node, "exponent", None))
            if not isinstance(other, (int, float)) or isinstance(other, bool):
                fail(node, f"second operand {other!r} must be a tensor or a number")
            rhs = repr(other)
        alpha = param(node, "alpha", 1)
        if alpha != 1 and fn_name in ("add", "sub"):
            rhs = f"mul({rhs},{alpha!r})"
        return [elementwise(node, f"{fn_name}(@0,{rhs})", tensors)]
    return fn


for _name, _fn in _BINARY.items():
    rule(f"torch.{_name}", f"Tensor.{_name}")(_binary(_fn))


_REDUCE = {"mean": "reduce_mean", "sum": "reduce_sum", "amax": "reduce_max", "amin": "reduce_min",
           "prod": "reduce_prod"}


def _reduce(op):
    def fn(node, ctx):
        x = data_input(node)
        dim = param(node, "dim", None)
        if dim is None or dim == ():
            axes = ()
        elif isinstance(dim, int):
            axes = (dim,)
        else:
            axes = tuple(dim)
        rank = len(x.shape)
        if any(not -rank <= a < rank for a in axes):
            fail(node, f"dim={dim} out of range for input of rank {rank}")
        return [make(node, op, [x], dict(axes=tuple(a % rank for a in axes), keepdim=bool(param(node, "keepdim", False))))]
    return fn


for _name, _op in _REDUCE.items():
    rule(f"torch.{_name}", f"Tensor.{_name}")(_reduce(_op))


def _softmax(op):
    def fn(node, ctx):
        x = data_input(node)
        dim = param(node, "dim", None)
        if not isinstance(dim, int):
            fail(node, f"dim={dim!r} must be an int")
        if not -len(x.shape) <= dim < len(x.shape):
            fail(node, f"dim={dim} out of range for input of rank {len(x.shape)}")
        return [make(node, op, [x], dict(axis=dim % len(x.shape)))]
    return fn


rule("F.softmax", "nn.Softmax", "torch.softmax", "Tensor.softmax")(_softmax("softmax"))
rule("F.log_softmax", "nn.LogSoftmax", "torch.log_softmax", "Tensor.log_softmax")(_softmax("log_softmax"))
