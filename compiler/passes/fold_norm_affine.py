"""A layer norm (or RMS norm) over the last axis whose output only linear layers read
leaves its affine part to them: n * gamma + beta read by W x + b is (W gamma) n +
(W beta + b), so each reader's weights are scaled by gamma along their input features,
beta moves into its bias, and the numpy passes of the affine part (multiply, add) go."""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.passes.fold_affine_relu import readers_with_own_weights
from pmx.compiler.rewrite import N, V, rule, rule_pass

PARAM = {"const": True, "sole": True, "opt": True}


def _over_last_axis(norm, m):
    """Over the last axis only (else gamma varies along axes the linear does not
    contract), with gamma or beta of x's dtype, one value per feature."""
    params = [p for p in (m.gamma, m.beta) if p is not None]
    return (int(norm.attrs.get("axes", 0)) == 1 and m.x.shape is not None and params
            and all(p.dtype == m.x.dtype and tuple(np.shape(p.data)) == (m.x.shape[-1],) for p in params))


@rule(N("layer_norm", V("x", kind="f"), V("gamma", **PARAM), V("beta", **PARAM), out=V("y", internal=True),
        name="norm", where=_over_last_axis))
def fold_into_linears(graph, m):
    """Only where every reader is a linear taking y as input, with weights of its own."""
    readers = readers_with_own_weights(graph, m.y)
    if readers is None or any(r.op != "linear" or len(r.inputs[1].shape) != 2
                              or r.inputs[1].shape[1] != m.y.shape[-1] for r in readers):
        return None
    gamma, beta = (None if p is None else np.asarray(p.data, np.float64) for p in (m.gamma, m.beta))
    for reader in readers:
        w, b = reader.inputs[1], reader.inputs[2] if len(reader.inputs) > 2 else None
        weights = np.asarray(w.data, np.float64)
        if gamma is not None:
            graph.set_input(reader, 1, Value(f"{w.name}.normscaled", w.shape, w.dtype,
                                             data=(weights * gamma).astype(w.dtype)))
        if beta is not None:
            bias = weights @ beta + (0.0 if b is None else np.asarray(b.data, np.float64).reshape(-1))
            name, shape = ((f"{reader.name}.bias.normshifted", (w.shape[0],)) if b is None
                           else (f"{b.name}.normshifted", b.shape))
            graph.set_input(reader, 2, Value(name, shape, w.dtype, data=bias.reshape(shape).astype(w.dtype)))
    graph.set_inputs(m.norm, [m.x])
    return True


fold_norm_affine = rule_pass("fold_norm_affine", [fold_into_linears])
