"""A conv or linear whose epilogue is hardswish, x * clip(x + 3, 0, 6) / 6, and whose
output only convs and linears read as their input (directly, or through ops that scale
with it: average pools, means, sums, reshapes, products with another value) writes
6 x hardswish instead, and those readers' weights are divided by 6: one numpy pass of
four fewer. Each reader is linear in that input; its bias and input scale stay."""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.rewrite import N, V, fits, match, rule, rule_pass
from pmx.runtime import expr as E

_RELU6_SHIFTED = E.call("minimum", E.call("maximum", E.call("add", E.at(0), 3), 0), 6)
HARDSWISH = E.call("mul", E.at(0), E.call("div", _RELU6_SHIFTED, 6))
SCALED_HARDSWISH = E.call("mul", E.at(0), _RELU6_SHIFTED)
SCALE = 6.0

# ops with op(6 x) = 6 op(x) on the way to the weights (MobileNetV3's SE pool, head pool, flatten)
THROUGH = frozenset({"adaptive_avg_pool", "avg_pool", "reduce_mean", "reduce_sum", "reshape"})
PRODUCT = N("elementwise", arity=2, expr=E.call("mul", E.at(0), E.at(1)))
OWN_WEIGHT = V(const=True, kind="f", sole=True)


def _weighted_readers(graph, v, depth=0):
    """Every conv or linear reading v as its input, directly or through THROUGH ops and
    products, when all of v's readers are such; else None."""
    if v in graph.outputs or v in graph.kept or not v.consumers or depth > 4:
        return None
    targets = []
    for reader in {c.uid: c for c in v.consumers}.values():
        positions = [i for i, x in enumerate(reader.inputs) if x is v]
        if reader.op in ("conv", "linear") and positions == [0]:
            targets.append(reader)
            continue
        onward = ((reader.op in THROUGH and positions == [0])
                  or (len(positions) == 1 and match(graph, PRODUCT, reader) is not None)) and len(reader.outputs) == 1
        further = _weighted_readers(graph, reader.outputs[0], depth + 1) if onward else None
        if further is None:
            return None
        targets += further
    return targets


@rule(N(("conv", "linear"), expr=HARDSWISH, name="gemm"))
def move_division_into_readers(graph, m):
    """Only where every reader's weights are its own (the file would hold them twice) and
    no reader is reached twice (x * mean(x) -> conv would take the 6 twice)."""
    y = m.gemm.outputs[0]
    readers = _weighted_readers(graph, y)
    if not readers or len({r.uid for r in readers}) != len(readers):
        return None
    weights = [r.inputs[1] if len(r.inputs) > 1 else None for r in readers]
    if not all(w is not None and w.dtype == y.dtype and fits(graph, OWN_WEIGHT, w, r) for w, r in zip(weights, readers)):
        return None
    for reader, w in zip(readers, weights):
        scaled = (np.asarray(w.data, np.float64) / SCALE).astype(w.dtype)
        graph.set_input(reader, 1, Value(f"{w.name}.div6", w.shape, w.dtype, data=scaled))
    m.gemm.expr = SCALED_HARDSWISH
    return True


fold_hardswish_scale = rule_pass("fold_hardswish_scale", [move_division_into_readers])
