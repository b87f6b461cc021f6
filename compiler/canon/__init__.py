"""Canonicalization rules: PNNX op spellings -> pmx's canonical op set.

Each family file registers rules with `@rule("nn.Conv2d", "F.conv2d", ...)`. A rule is
`fn(node, ctx) -> list[Node] | Forward`, where the returned nodes replace `node` and
together produce exactly `node.outputs`; `Forward(value)` means the node is an identity
and its single output is replaced by `value` (Dropout, Identity, contiguous).

Rules validate parameters and raise PmxCompileError naming the node and .param line.
"""

import math

import numpy as np

from pmx.compiler.ir import Node, Value
from pmx.runtime import expr as E
from pmx.runtime.errors import PmxCompileError
from pmx.runtime.kernels.shape import copy_dim, resolve_dyn_shape

RULES = {}
_MISSING = object()


def rule(*pnnx_types):
    def deco(fn):
        for t in pnnx_types:
            if t in RULES:
                raise RuntimeError(f"canonicalization rule for {t!r} registered twice")
            RULES[t] = fn
        return fn

    return deco


class Forward:
    """The node is an identity: its output is `value`."""

    __slots__ = ("value",)

    def __init__(self, value: Value):
        self.value = value


class Context:
    """What rules may use besides the node: constant creation and unique names."""

    def __init__(self, graph):
        self.graph = graph
        self._n = 0

    def const(self, name, array):
        array = np.ascontiguousarray(array)
        return Value(name, array.shape, str(array.dtype), data=array)

    def temp(self, node, shape, dtype="float32", suffix="t"):
        self._n += 1
        return Value(f"{node.name}.{suffix}{self._n}", shape, dtype)


def fail(node, msg):
    raise PmxCompileError(f"{node.where()}: {msg}")


def param(node, key, default=_MISSING):
    if key in node.attrs:
        return node.attrs[key]
    if default is _MISSING:
        fail(node, f"missing parameter {key!r}")
    return default


def ints(node, key, n, default=_MISSING):
    """A parameter as a tuple of n ints (a bare int is repeated n times)."""
    v = param(node, key, default)
    if isinstance(v, bool) or v is None:
        fail(node, f"parameter {key}={v!r} must be an int or a tuple of {n} ints")
    if isinstance(v, int):
        return (v,) * n
    if isinstance(v, tuple) and len(v) == 1 and n > 1 and isinstance(v[0], int):
        return v * n
    if not (isinstance(v, tuple) and len(v) == n and all(isinstance(e, int) and not isinstance(e, bool) for e in v)):
        fail(node, f"parameter {key}={v!r} must be an int or a tuple of {n} ints")
    return tuple(v)


# Other names pnnx gives an op's data operand (torch's argument names): torch.split's `tensor`
DATA_LABELS = {"input": ("input", "self", "tensor")}


def data_input(node, label="input", index=0):
    """The node's tensor operand `label`: the input pnnx labelled $label (or a name torch
    gives it, DATA_LABELS), else the index-th input pnnx left unlabelled (modules and
    pnnx.Expression label none). Never another labelled input: where pnnx wrote `label`
    as a number parameter, that is said, not guessed around."""
    v = next((x for x in map(node.named_input, DATA_LABELS.get(label, (label,))) if x is not None), None)
    if v is None:
        if label in node.attrs:
            fail(node, f"{label}={node.attrs[label]!r} is a number where pmx reads a tensor")
        unlabelled = [x for x, n in zip(node.inputs, node.input_names) if n is None]
        if len(unlabelled) <= index:
            fail(node, f"expected an input #{index} ({label})")
        v = unlabelled[index]
    return v


def operands(node, *labels, numbers=(int, float)):
    """Each operand in `labels` exactly as pnnx wrote it, in either position: the input
    labelled $label (a label may be a tuple of spellings: ("other", "exponent")), or a
    number parameter label=..., else the next input pnnx left unlabelled (modules and
    pnnx.Expression label none). A list of Values and Python numbers (of `numbers`'
    types); an operand that is none of these fails naming the line."""
    unlabelled = [v for v, n in zip(node.inputs, node.input_names) if n is None]
    found = []
    for label in labels:
        names = label if isinstance(label, tuple) else (label,)
        value = next((v for v in map(node.named_input, names) if v is not None), None)
        if value is None:
            name = next((k for k in names if k in node.attrs), None)
            if name is not None:
                value = node.attrs[name]
                if type(value) not in numbers:
                    fail(node, f"operand {name}={value!r} must be a tensor or a number")
            elif unlabelled:
                value = unlabelled.pop(0)
            else:
                fail(node, f"missing operand {names[0]!r}: a tensor ${names[0]} or a number {names[0]}=...")
        found.append(value)
    return found


def as_terms(values):
    """(expression arguments, tensors) for operands from operands(): each tensor an
    E.at(k) of the node's k-th input, each number itself."""
    args, tensors = [], []
    for v in values:
        if isinstance(v, Value):
            args.append(E.at(len(tensors)))
            tensors.append(v)
        else:
            args.append(v)
    return args, tensors


def weight(node, key, required=True):
    """A weight from @key, or from an input operand labelled $key."""
    v = node.named_input("@" + key)
    if v is None:
        v = node.named_input(key)
    if v is None and required:
        fail(node, f"missing weight {key!r}")
    return v


def make(node, op, inputs, attrs=None, outputs=None, expr=None, name=None):
    """A node replacing `node` (its outputs unless given); expr: an expression tree
    (runtime/expr/tree.py at() and call()) or None."""
    return Node(
        op,
        name or node.name,
        inputs,
        node.outputs if outputs is None else outputs,
        attrs or {},
        line=node.line,
        expr=expr,
    )


def elementwise(node, expr, inputs, outputs=None, name=None):
    return make(node, "elementwise", inputs, outputs=outputs, expr=expr, name=name)


def out_shape(node, i=0):
    """The output shape pnnx recorded; for exports with dynamic ('?') dims, computed from
    the op's parameters and its (by then concrete) input shape where the op allows."""
    s = node.outputs[i].shape
    if s is None or any(d is None for d in s):
        computed = _shape_from_params(node, i)
        if computed is None or (s is not None and any(a is not None and a != b for a, b in zip(s, computed))):
            fail(
                node,
                f"output {node.outputs[i].name} has no static shape {s}; pmx cannot derive it from the "
                f"op's parameters (export with a fixed input shape)",
            )
        return computed
    return s


# pnnx's "to the end of the dim" for a slice's end (and its "no select" for select)
TO_END = 2**31 - 1


def slice_end(start, length=1):
    """The end of a slice of `length` from `start` as a slice node takes it: a negative
    start stays one (counting from the end of the dim's size at run time), so a slice
    that reaches the dim's end (x[-1], narrow(0, -2, 2)) ends at TO_END, not at 0."""
    end = start + length
    return TO_END if start < 0 <= end else end


# resize ops whose output size follows from scale_factor (torch: floor(size * scale))
_RESIZES = {
    "interpolate",
    "upsample",
    "Upsample",
    "upsample_nearest",
    "UpsamplingNearest2d",
    "upsample_bilinear",
    "UpsamplingBilinear2d",
}


def exact_target(node, shape):
    """The dyn_shape (runtime/kernels/shape.py resolve_dyn_shape) of a reshape-like op
    whose parameters define its target in terms of its input of `shape` (unsqueeze,
    squeeze of named dims, flatten, ravel): every kept dim copied, a merged run inferred
    (-1), so the target follows dynamic dims and mark_dynamic_dims has nothing to guess
    (a '?' planned at 1 and a literal 1 look alike). None for other ops, and for targets
    given as numbers (view, reshape)."""
    kind, a, rank = node.op.split(".")[-1], node.attrs, len(shape)
    try:
        if kind == "unsqueeze":
            d = a["dim"] % (rank + 1)
            return _copies(range(d)) + (1,) + _copies(range(d, rank))
        if kind == "squeeze" and a.get("dim") is not None:
            named = a["dim"] if isinstance(a["dim"], tuple) else (a["dim"],)
            gone = {d % rank for d in named if shape[d % rank] == 1}  # torch keeps a named dim that is not 1
            return _copies(d for d in range(rank) if d not in gone)
        if kind in ("flatten", "Flatten", "ravel"):
            if rank == 0:
                return (1,)
            start = a.get("start_dim", 1 if node.op == "nn.Flatten" else 0) % rank
            end = a.get("end_dim", -1) % rank
            merged = (-1,) if end > start else _copies([start])
            return _copies(range(start)) + merged + _copies(range(end + 1, rank))
    except (KeyError, TypeError, IndexError):
        return None
    return None


def _copies(dims):
    return tuple(copy_dim(d) for d in dims)


def _shape_from_params(node, i):
    """Output shape of reshape/flatten/squeeze/unsqueeze/unbind/select/expand/chunk/split,
    of a resize by scale_factor, and of nn.MultiheadAttention's output (not its
    weights), from parameters."""
    x = next((v for v, n in zip(node.inputs, node.input_names) if n is None or not n.startswith("@")), None)
    if x is None or x.shape is None or any(d is None for d in x.shape):
        return None
    shape, rank, a = list(x.shape), len(x.shape), node.attrs
    kind = node.op.split(".")[-1]
    try:
        codes = exact_target(node, shape)
        if codes is not None:
            return resolve_dyn_shape(codes, shape)
        if kind in ("reshape", "view") and isinstance(a.get("shape"), tuple):
            if all(isinstance(d, int) for d in a["shape"]):
                return resolve_dyn_shape(a["shape"], shape)
        if kind == "squeeze" and a.get("dim") is None:  # of every size-1 dim
            return tuple(d for d in shape if d != 1)
        if kind == "MultiheadAttention" and i == 0 and rank == 3:  # the query's shape, embed_dim wide
            return tuple(shape[:-1] + [a["embed_dim"]])
        if kind in _RESIZES and a.get("size") is None and a.get("scale_factor") is not None:
            scales = a["scale_factor"] if isinstance(a["scale_factor"], tuple) else (a["scale_factor"],) * (rank - 2)
            return tuple(shape[:2] + [math.floor(d * float(f)) for d, f in zip(shape[2:], scales)])
        if kind in ("unbind", "select"):  # the dim is taken out
            d = a.get("dim", 0) % rank
            return tuple(shape[:d] + shape[d + 1 :])
        if kind == "expand" and isinstance(a.get("sizes"), tuple) and all(isinstance(d, int) for d in a["sizes"]):
            sizes = list(a["sizes"])
            lead = len(sizes) - rank  # torch: new leading dims first, -1 keeps the input's dim
            return tuple(shape[j - lead] if d == -1 and j >= lead else d for j, d in enumerate(sizes))
        if kind in ("chunk", "split"):
            dim = a.get("dim", 0) % rank
            n = shape[dim]
            if kind == "chunk":
                step = -(-n // a["chunks"])
                sizes = [min(step, n - k) for k in range(0, n, step)]
            else:
                sec = a.get("split_size_or_sections", a.get("split_size"))
                sizes = list(sec) if isinstance(sec, tuple) else [min(sec, n - k) for k in range(0, n, sec)]
            out = list(shape)
            out[dim] = sizes[i]
            return tuple(out)
    except (KeyError, TypeError, ZeroDivisionError, IndexError, ValueError):
        return None
    return None


def in_shape(node, v):
    if v.shape is None or any(d is None for d in v.shape):
        fail(node, f"input {v.name} has no static shape")
    return v.shape


from pmx.compiler.canon import (  # noqa: E402,F401  (registration side effects)
    activation,
    attention,
    conv,
    conv_transpose,
    indexing,
    linalg,
    math_ops,
    norm,
    pool,
    recurrent,
    resample,
    sampling,
    shape_ops,
    spectral,
)
