"""A pre-activation batch norm and ReLU, relu(x * s + b) with per-channel constants s and
b (DenseNet's norm -> relu, one expression after fuse_elementwise), whose output only
unpadded convs with one group (or, on (N, C) tensors, linears) read becomes max(x, t),
t = -b / s:

    relu(s x + b) = s max(x, t) + b        (s > 0)
                  = |s| max(-x, -t) + b    (s < 0: the ReLU then clips above t)

and each reader absorbs the rest: its weights are scaled by |s| along their input
channels, and its bias gains W . b (summed over the input channels and the kernel
window; without padding every output sees every tap). Three numpy passes become one
(two where some scale is negative). The reader's sum is regrouped, so where a channel
is clipped |s| t and b cancel to within an ulp of b rather than exactly."""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.rewrite import In, Lit, N, V, rewrite_rule, rule_pass
from pmx.runtime import expr as E

FOLDED = E.call("maximum", E.at(0), E.at(1))
FOLDED_SIGNED = E.call("maximum", E.call("mul", E.at(0), E.at(1)), E.at(2))
AFFINE_RELU = E.call(
    "maximum",
    E.call("add", E.call("mul", In("x", V(const=False, kind="f")), In("s", V(const=True))), In("b", V(const=True))),
    Lit(0, 0.0),
)


def _per_channel(x, v):
    """v holds one value of x's dtype per channel of x (axis 1): (C, 1, ...) or (1, C, 1, ...)."""
    shape = tuple(np.shape(v.data))
    padded = (1,) * (len(x.shape) - len(shape)) + shape
    return (
        v.dtype == x.dtype
        and len(x.shape) >= 2
        and len(shape) <= len(x.shape)
        and padded == (1, x.shape[1]) + (1,) * (len(x.shape) - 2)
    )


def _readers_with_own_weights(graph, y):
    """The nodes reading y, each as its input 0 only, with constant weights (input 1) and
    an optional constant bias (input 2) of y's dtype that no other node reads; else None
    (also when nothing reads y)."""
    readers = list({c.uid: c for c in y.consumers}.values())
    for reader in readers:
        w = reader.inputs[1] if len(reader.inputs) > 1 else None
        b = reader.inputs[2] if len(reader.inputs) > 2 else None
        if (
            reader.inputs[0] is not y
            or w is None
            or not w.is_constant
            or w.dtype != y.dtype
            or graph.sole_reader(w) is not reader
        ):
            return None
        if b is not None and (not b.is_constant or b.dtype != y.dtype or graph.sole_reader(b) is not reader):
            return None
    return readers or None


def _absorbing_readers(graph, y, channels):
    """The convs (one group, unpadded, no input scale) and linears (on (N, C)) that can take
    y's scale and shift, else None."""
    readers = _readers_with_own_weights(graph, y)
    for reader in readers or ():
        w, a = reader.inputs[1], reader.attrs
        if reader.op == "conv":
            if (
                int(a.get("groups", 1)) != 1
                or any(a.get("pads", ()))
                or len(w.shape) != len(y.shape)
                or w.shape[1] != channels
                or (len(reader.inputs) > 3 and reader.inputs[3] is not None)
            ):
                return None
        elif reader.op != "linear" or len(y.shape) != 2 or len(w.shape) != 2 or w.shape[1] != channels:
            return None
    return readers


def _absorb(graph, reader, scale, shift):
    """reader's weights times |scale| along their input channels; its bias plus W . shift."""
    w, b = reader.inputs[1], reader.inputs[2] if len(reader.inputs) > 2 else None
    weights = np.asarray(w.data, np.float64)
    along_inputs = (1, -1) + (1,) * (weights.ndim - 2)
    scaled = weights * np.abs(scale).reshape(along_inputs)
    added = (weights * shift.reshape(along_inputs)).sum(axis=tuple(range(1, weights.ndim)))
    bias = added if b is None else np.asarray(b.data, np.float64).reshape(-1) + added
    graph.set_input(reader, 1, Value(f"{w.name}.prescaled", w.shape, w.dtype, data=scaled.astype(w.dtype)))
    name = f"{reader.name}.bias.shifted" if b is None else f"{b.name}.shifted"
    shape = (weights.shape[0],) if b is None else b.shape
    graph.set_input(reader, 2, Value(name, shape, w.dtype, data=bias.reshape(shape).astype(w.dtype)))


def _threshold(scale, shift, dtype):
    """t = -shift / scale per channel, or None where a scale is zero or not finite or t
    does not fit the dtype (the channel would be a constant)."""
    if not (np.all(np.isfinite(scale)) and np.all(scale != 0) and np.all(np.isfinite(shift))):
        return None
    t = -shift / scale
    return t if np.all(np.abs(t) <= np.finfo(dtype).max) else None


@rewrite_rule(
    N(
        "elementwise",
        arity=3,
        expr=AFFINE_RELU,
        out=V("y", internal=True),
        name="node",
        where=lambda node, m: m.s is not m.b and _per_channel(m.x, m.s) and _per_channel(m.x, m.b),
    )
)
def fold_into_readers(graph, m):
    """Only where every reader can absorb the scale and shift into weights of its own."""
    node, x, like = m.node, m.x, m.s
    scale = np.asarray(m.s.data, np.float64).reshape(-1)
    shift = np.asarray(m.b.data, np.float64).reshape(-1)
    t = _threshold(scale, shift, np.dtype(x.dtype))
    readers = _absorbing_readers(graph, m.y, x.shape[1]) if t is not None else None
    if readers is None:
        return None
    for reader in readers:
        _absorb(graph, reader, scale, shift)

    def constant(suffix, values):  # shaped and typed as the old scale
        return Value(
            f"{node.name}.{suffix}", like.shape, like.dtype, data=values.reshape(np.shape(like.data)).astype(like.dtype)
        )

    sign = np.sign(scale)
    if np.all(sign > 0):
        graph.set_inputs(node, [x, constant("threshold", t)])
        node.expr = FOLDED
    else:
        graph.set_inputs(node, [x, constant("sign", sign), constant("signed_threshold", sign * t)])
        node.expr = FOLDED_SIGNED
    return True


fold_affine_relu = rule_pass("fold_affine_relu", [fold_into_readers])
