"""A pre-activation batch norm and ReLU, relu(x * s + b) with per-channel constants s and
b (DenseNet's norm -> relu before each 1x1 conv, after batch_norm_as_elementwise and
fuse_elementwise made them one expression), whose output only unpadded convs with one
group (or, on (N, C) tensors, linears) read, becomes max(x, t) with t = -b / s:

    relu(s x + b) = s max(x, t) + b        (s > 0)
                  = |s| max(-x, -t) + b    (s < 0: the ReLU then clips above t)

and each reader absorbs the rest: its weights are scaled by |s| along their input
channels, and its bias gains W . b (summed over the input channels and the kernel
window; without padding every output sees every tap). numpy ran the expression as
three passes (multiply, add, maximum); with every scale positive one remains,
np.maximum(x, t), and with some negative two, max(x * sign(s), t * sign(s)).

Does not fire when a scale is zero or not finite (the channel would be a constant),
when t overflows the dtype, on weights or biases another node reads (the file would
hold them twice), when a reader is padded, grouped, has an input scale or reads the
tensor in any other position, or when the output is a graph output or kept.

Numerically the reader's sum is regrouped, (W |s|) . max(...) + W . b instead of
W . relu(s x + b): where a channel is clipped, |s| t and b cancel to within an ulp of b
rather than exactly. The error stays at float32 rounding of the terms summed
(DenseNet-121 against torch: 4.7e-7 -> 5.7e-7 of the output's largest magnitude).
"""

import numpy as np

from pmx.compiler.ir import Value
from pmx.runtime import expr as E

FOLDED = E.call("maximum", E.at(0), E.at(1))
FOLDED_SIGNED = E.call("maximum", E.call("mul", E.at(0), E.at(1)), E.at(2))


def _affine_relu(node):
    """(x, scale, shift) of an elementwise relu(x * scale + shift) with constant
    per-channel scale and shift (any operand order), else None."""
    if node.op != "elementwise" or len(node.inputs) != 3 or len(node.outputs) != 1 or not node.expr:
        return None
    tree = node.expr
    zero = ("#", 0)
    if tree[0] != "maximum" or zero not in tree[1:]:
        return None
    affine = tree[2] if tree[1] == zero else tree[1]
    if affine[0] != "add":
        return None
    for product, shift in ((affine[1], affine[2]), (affine[2], affine[1])):
        if product[0] != "mul" or shift[0] != "@" or any(t[0] != "@" for t in product[1:]):
            continue
        for xi, si in ((product[1][1], product[2][1]), (product[2][1], product[1][1])):
            if len({xi, si, shift[1]}) == 3:
                x, scale, bias = (node.inputs[i] for i in (xi, si, shift[1]))
                if _per_channel(x, scale) and _per_channel(x, bias):
                    return x, scale, bias
    return None


def _per_channel(x, v):
    """Whether v is a float constant of x's dtype holding one value per channel of x (axis
    1): shaped (C, 1, ...) or (1, C, 1, ...)."""
    if x is None or v is None or x.is_constant or not v.is_constant or x.shape is None or len(x.shape) < 2:
        return False
    if np.dtype(x.dtype).kind != "f" or v.dtype != x.dtype:
        return False
    shape = tuple(np.shape(v.data))
    if len(shape) > len(x.shape):
        return False
    padded = (1,) * (len(x.shape) - len(shape)) + shape
    return padded == (1, x.shape[1]) + (1,) * (len(x.shape) - 2)


def readers_with_own_weights(graph, y):
    """The nodes reading y, each as its input 0, with constant weights (input 1) and an
    optional constant bias (input 2) of y's dtype that no other node reads, else None
    (also when y is a graph output, kept, or unread). y is not constant, so a reader
    taking it as weight or bias fails the checks. fold_norm_affine uses it too."""
    if y in graph.outputs or y in getattr(graph, "kept", ()) or not y.consumers:
        return None
    readers = list({c.uid: c for c in y.consumers}.values())
    for reader in readers:
        w = reader.inputs[1] if len(reader.inputs) > 1 else None
        b = reader.inputs[2] if len(reader.inputs) > 2 else None
        if (reader.inputs[0] is not y or w is None or not w.is_constant or w.dtype != y.dtype
                or graph.sole_reader(w) is not reader):
            return None
        if b is not None and (not b.is_constant or b.dtype != y.dtype or graph.sole_reader(b) is not reader):
            return None
    return readers


def _absorbing_readers(graph, y, channels):
    """The convs and linears that can absorb y's scale and shift, else None."""
    readers = readers_with_own_weights(graph, y)
    for reader in readers or ():
        w = reader.inputs[1]
        if reader.op == "conv":
            a = reader.attrs
            if (int(a.get("groups", 1)) != 1 or any(a.get("pads", ())) or len(w.shape) != len(y.shape)
                    or w.shape[1] != channels or (len(reader.inputs) > 3 and reader.inputs[3] is not None)):
                return None
        elif reader.op == "linear":
            if len(y.shape) != 2 or len(w.shape) != 2 or w.shape[1] != channels:
                return None
        else:
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
    does not fit the dtype."""
    if not (np.all(np.isfinite(scale)) and np.all(scale != 0) and np.all(np.isfinite(shift))):
        return None
    t = -shift / scale
    return t if np.all(np.abs(t) <= np.finfo(dtype).max) else None


def _rewrite(graph, node, x, like, sign, t):
    """node computes max(x, t), or max(x * sign, t * sign) when a sign is negative; the
    constants take the shape and dtype of `like` (the old scale)."""
    def constant(suffix, values):
        return Value(f"{node.name}.{suffix}", like.shape, like.dtype,
                     data=values.reshape(np.shape(like.data)).astype(like.dtype))

    inputs = [x, constant("threshold", t)] if np.all(sign > 0) else [
        x, constant("sign", sign), constant("signed_threshold", sign * t)]
    for i in range(len(node.inputs)):
        graph.set_input(node, i, None)
    del node.inputs[len(inputs):], node.input_names[len(inputs):]
    for i, v in enumerate(inputs):
        graph.set_input(node, i, v)
    node.expr = FOLDED if len(inputs) == 2 else FOLDED_SIGNED


def fold_affine_relu(graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        found = _affine_relu(node)
        if found is None:
            continue
        x, scale_v, shift_v = found
        scale = np.asarray(scale_v.data, np.float64).reshape(-1)
        shift = np.asarray(shift_v.data, np.float64).reshape(-1)
        t = _threshold(scale, shift, np.dtype(x.dtype))
        readers = _absorbing_readers(graph, node.outputs[0], x.shape[1]) if t is not None else None
        if readers is None:
            continue
        for reader in readers:
            _absorb(graph, reader, scale, shift)
        _rewrite(graph, node, x, scale_v, np.sign(scale), t)
        changed = True
    return changed
