"""A layer norm (or RMS norm) over the last axis whose output only linear layers read
leaves its affine part to them: n * gamma + beta read by W x + b is (W gamma) n +
(W beta + b), so each reader's weights are scaled by gamma along their input features
and beta moves into its bias, and the norm keeps no weight or bias. Transformers put a
norm before their QKV projection and their first MLP layer (ViT-B/16: 24 of its 25);
numpy ran the affine part as two passes (multiply, add) after the normalization.

Does not fire on norms over more than the last axis (gamma then varies along axes the
linear does not contract), on non-constant or non-float parameters, on weights or
biases another node reads (the file would hold them twice), or when the output is a
graph output or kept, or anything but a linear layer's input reads it.
"""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.passes.fold_affine_relu import readers_with_own_weights


def _affine(graph, node):
    """(gamma, beta) of a layer_norm over the last axis (either may be None), else None."""
    if node.op != "layer_norm" or int(node.attrs.get("axes", 0)) != 1 or len(node.inputs) < 2:
        return None
    x = node.inputs[0]
    params = [node.inputs[i] if len(node.inputs) > i else None for i in (1, 2)]
    if x is None or x.shape is None or np.dtype(x.dtype).kind != "f" or all(p is None for p in params):
        return None
    for p in params:
        if p is not None and (not p.is_constant or p.dtype != x.dtype or tuple(np.shape(p.data)) != (x.shape[-1],)
                              or graph.sole_reader(p) is not node):
            return None
    return tuple(None if p is None else np.asarray(p.data, np.float64) for p in params)


def _linear_readers(graph, y):
    """The linear layers reading y (as their input only) when nothing else does, else None."""
    readers = readers_with_own_weights(graph, y)
    for reader in readers or ():
        w = reader.inputs[1]
        if reader.op != "linear" or len(w.shape) != 2 or w.shape[1] != y.shape[-1]:
            return None
    return readers


def _absorb(graph, reader, gamma, beta):
    w, b = reader.inputs[1], reader.inputs[2] if len(reader.inputs) > 2 else None
    weights = np.asarray(w.data, np.float64)
    if gamma is not None:
        graph.set_input(reader, 1, Value(f"{w.name}.normscaled", w.shape, w.dtype,
                                         data=(weights * gamma).astype(w.dtype)))
    if beta is not None:
        bias = weights @ beta + (0.0 if b is None else np.asarray(b.data, np.float64).reshape(-1))
        name, shape = (f"{reader.name}.bias.normshifted", (w.shape[0],)) if b is None else (f"{b.name}.normshifted", b.shape)
        graph.set_input(reader, 2, Value(name, shape, w.dtype, data=bias.reshape(shape).astype(w.dtype)))


def fold_norm_affine(graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        found = _affine(graph, node)
        readers = _linear_readers(graph, node.outputs[0]) if found is not None else None
        if readers is None:
            continue
        for reader in readers:
            _absorb(graph, reader, *found)
        for i in range(1, len(node.inputs)):
            graph.set_input(node, i, None)
        del node.inputs[1:], node.input_names[1:]
        changed = True
    return changed
