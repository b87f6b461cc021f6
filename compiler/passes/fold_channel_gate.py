"""A squeeze-and-excitation gate, mul(gate, x) with gate (N or 1, C, 1, ...) and x
(N, C, H, ...), read only by a 1x1 conv with one group becomes that conv's `input_scale`
(runtime/kernels/conv.py): the conv scales its (Cout, C) weights per image instead of
the input, and the pass over x goes."""

import math

from pmx.compiler.rewrite import In, N, V, rule, rule_pass
from pmx.runtime import expr as E


def _per_channel(product, m):
    gate, x, y = m.gate, m.x, product.outputs[0]
    return (len(x.shape) >= 3 and len(gate.shape) == len(x.shape) and gate.shape[0] in (1, x.shape[0])
            and gate.shape[1] == x.shape[1] and all(d == 1 for d in gate.shape[2:])
            and y.shape == x.shape and gate.dtype == x.dtype == y.dtype)


GATE = N("elementwise", arity=2, expr=E.call("mul", In("gate"), In("x", V(kind="f"))), name="product",
         where=_per_channel)


def _small_pointwise(conv, m):
    """Unstrided, unpadded 1x1, one group, no input scale yet, and weights smaller than the
    gated tensor (Cout < H x W): else scaling x is the cheaper pass."""
    w, y, a = m.w, m.y, conv.attrs
    return (all(v is not y for v in conv.inputs[1:]) and w.dtype == y.dtype and len(w.shape) == len(y.shape)
            and int(a.get("groups", 1)) == 1 and all(k == 1 for k in w.shape[2:])
            and all(s == 1 for s in a.get("stride", ())) and not any(a.get("pads", ()))
            and (len(conv.inputs) <= 3 or conv.inputs[3] is None) and w.shape[0] < math.prod(y.shape[2:]))


@rule(N("conv", V("y", GATE, sole=True), V("w", const=True), name="conv", where=_small_pointwise))
def gate_as_input_scale(graph, m):
    """The gated tensor has no other reader, so the product need not exist."""
    graph.remove_node(m.product)
    graph.set_input(m.conv, 0, m.x)
    graph.set_input(m.conv, 3, m.gate)
    return True


fold_channel_gate = rule_pass("fold_channel_gate", [gate_as_input_scale])
