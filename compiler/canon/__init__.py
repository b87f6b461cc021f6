"""Canonicalization rules: PNNX op spellings -> pmx's canonical op set.

Each family file registers rules with `@rule("nn.Conv2d", "F.conv2d", ...)`. A rule is
`fn(node, ctx) -> list[Node] | Forward`, where the returned nodes replace `node` and
together produce exactly `node.outputs`; `Forward(value)` means the node is an identity
and its single output is replaced by `value` (Dropout, Identity, contiguous).

Rules validate parameters and raise PmxCompileError naming the node and .param line.
"""

from dataclasses import dataclass

import numpy as np

from pmx.compiler.ir import Node, Value
from pmx.runtime.errors import PmxCompileError

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


@dataclass
class Forward:
    value: Value


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


def data_input(node, label="input", index=0):
    """The node's activation input: named $input if pnnx labelled it, else position."""
    v = node.named_input(label)
    if v is None:
        unnamed = [x for x, n in zip(node.inputs, node.input_names) if n is None or not n.startswith("@")]
        if len(unnamed) <= index:
            fail(node, f"expected an input #{index} ({label})")
        v = unnamed[index]
    return v


def weight(node, key, required=True):
    """A weight from @key, or from an input operand labelled $key."""
    v = node.named_input("@" + key)
    if v is None:
        v = node.named_input(key)
    if v is None and required:
        fail(node, f"missing weight {key!r}")
    return v


def make(node, op, inputs, attrs=None, outputs=None, expr="", name=None):
    return Node(op, name or node.name, inputs, node.outputs if outputs is None else outputs,
                attrs or {}, line=node.line, expr=expr)


def elementwise(node, expr, inputs, outputs=None, name=None):
    return make(node, "elementwise", inputs, outputs=outputs, expr=expr, name=name)


def out_shape(node, i=0):
    s = node.outputs[i].shape
    if s is None or any(d is None for d in s):
        fail(node, f"output {node.outputs[i].name} has no static shape; pmx needs the shapes pnnx records (export with a fixed input shape)")
    return s


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
    shape_ops,
)
