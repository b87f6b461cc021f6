"""A conv or linear whose fused activation is hardswish, x * clip(x + 3, 0, 6) / 6, and
whose output is read only by convs and linears taking it as their input (directly, or
through average pools, means, sums, reshapes and products with another value, which all
scale with it), writes 6 x hardswish instead: the division goes, and those readers'
weights are divided by 6. Each reader is linear in that input (a conv's padding, zero,
reflected or replicated, scales with it); its bias and input scale stay as they are.
numpy runs hardswish as four passes (add 3, clip, multiply, multiply by 1/6); three
remain. A reader reached along two paths (x * mean(x) -> conv) would take the 6 twice:
then nothing folds.

MobileNetV3-small's 19 hardswish epilogues all fold: the stem, the 8 expand convs before
their depthwise convs, 8 depthwise convs read by a squeeze-and-excitation pool and by the
gated 1x1 conv after it (5 gates folded into the conv's input scale by
fold_channel_gate, 3 left as an elementwise product), the last conv (through the pool
and flatten), and the first classifier layer. Steady ms, untuned compiles differing
only in this pass, alternating fresh processes, 6 of 6 pairs: 4.73-4.89 -> 4.64-4.70,
as much as taking the division out without compensating (wrong results) had given.
With the 10 direct readers only (the pass's first form), 4.76-4.88 -> 4.65-4.82 (8 of
8). Error against torch 7.9e-8 -> 1.1e-7 of the output's largest magnitude (the
readers' weights / 6 round once more).

Does not fire on weights another node reads (the file would hold them twice), on
non-constant or non-float weights, or where the output (or a pass-through op's output on
the way) is a graph output, kept, read by any other op, or read as a weight.
"""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.passes.fold_channel_gate import PRODUCTS
from pmx.runtime import expr as E

_RELU6_SHIFTED = E.call("minimum", E.call("maximum", E.call("add", E.at(0), 3), 0), 6)
HARDSWISH = E.call("mul", E.at(0), E.call("div", _RELU6_SHIFTED, 6))
SCALED_HARDSWISH = E.call("mul", E.at(0), _RELU6_SHIFTED)
_HARDSWISH_TREES = {HARDSWISH, E.call("mul", E.call("div", _RELU6_SHIFTED, 6), E.at(0))}
SCALE = 6.0


# Ops with op(6 x) = 6 op(x) that a 6 x hardswish may pass through on its way to the
# weights that absorb the 6: MobileNetV3's squeeze-and-excitation pool, its head's
# pool and flatten.
THROUGH = frozenset({"adaptive_avg_pool", "avg_pool", "reduce_mean", "reduce_sum", "reshape"})


def _readers_to_scale(graph, node):
    """The convs and linears whose weights take node's 1/6, else None."""
    if node.op not in ("conv", "linear") or not node.expr or node.expr not in _HARDSWISH_TREES:
        return None
    y = node.outputs[0]
    targets = _weighted_readers(graph, y)
    # a target reached twice would take two factors of 6 (x * mean(x) -> conv): refuse
    if not targets or len({t.uid for t in targets}) != len(targets):
        return None
    for reader in targets:
        w = reader.inputs[1] if len(reader.inputs) > 1 else None
        if (w is None or not w.is_constant or np.dtype(w.dtype).kind != "f" or w.dtype != y.dtype
                or graph.sole_reader(w) is not reader):
            return None
    return targets


def _weighted_readers(graph, v, depth=0):
    """Every conv or linear that reads v as its input, directly or through THROUGH ops or
    products with another value (a squeeze-and-excitation gate), when all of v's readers
    are such; else None. v must not be a graph output or kept."""
    if v in graph.outputs or v in getattr(graph, "kept", ()) or not v.consumers or depth > 4:
        return None
    targets = []
    for reader in {c.uid: c for c in v.consumers}.values():
        positions = [i for i, x in enumerate(reader.inputs) if x is v]
        if reader.op in ("conv", "linear") and positions == [0]:
            targets.append(reader)
            continue
        through = reader.op in THROUGH and positions == [0]
        product = (reader.op == "elementwise" and len(reader.inputs) == 2 and len(positions) == 1
                   and reader.expr in PRODUCTS)
        further = _weighted_readers(graph, reader.outputs[0], depth + 1) if (
            (through or product) and len(reader.outputs) == 1) else None
        if further is None:
            return None
        targets += further
    return targets


def fold_hardswish_scale(graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        readers = _readers_to_scale(graph, node)
        if readers is None:
            continue
        for reader in readers:
            w = reader.inputs[1]
            scaled = (np.asarray(w.data, np.float64) / SCALE).astype(w.dtype)
            graph.set_input(reader, 1, Value(f"{w.name}.div6", w.shape, w.dtype, data=scaled))
        node.expr = SCALED_HARDSWISH
        changed = True
    return changed
