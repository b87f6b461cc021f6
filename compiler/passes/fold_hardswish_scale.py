"""A conv or linear whose fused activation is hardswish, x * clip(x + 3, 0, 6) / 6, and
whose output is read only by convs and linears taking it as their input (directly, or
through average pools, means, sums and reshapes, which scale with their input), writes
6 x hardswish instead: the division goes, and those readers' weights are divided by 6.
Each reader is linear in that input (a conv's padding, zero, reflected or replicated,
scales with it); its bias and input scale stay as they are. numpy runs hardswish as four
passes (add 3, clip, multiply, multiply by 1/6); three remain.

MobileNetV3-small has 19 hardswish epilogues and 16 fire: the stem, the 8 expand convs
before their depthwise convs, 5 depthwise convs read by a squeeze-and-excitation pool and
a 1x1 conv whose gate fold_channel_gate made its input scale, the last conv (through the
pool and flatten), and the first classifier layer. The 3 left feed an elementwise gate
(the 7x7 stages, whose gates stay unfolded). Removing the division from all 19 (wrong
results, an upper bound) took 2.5-3% off the model. Steady ms, untuned compiles
differing only in this pass, alternating fresh processes: 4.76-4.88 -> 4.65-4.82 with
the 10 direct readers (8 of 8 pairs); 5.94-6.00 -> 5.78-5.87 with all 16, in a slower
hour (6 of 6). Error against torch 7.9e-8 -> 1.1e-7 of the output's largest magnitude
(the readers' weights / 6 round once more).

Does not fire on weights another node reads (the file would hold them twice), on
non-constant or non-float weights, or where the output (or a pass-through op's output on
the way) is a graph output, kept, read by any other op, or read as a weight.
"""

import numpy as np

from pmx.compiler.ir import Value
from pmx.runtime import expr as E

HARDSWISH = "mul(@0,div(minimum(maximum(add(@0,3),0),6),6))"
SCALED_HARDSWISH = "mul(@0,minimum(maximum(add(@0,3),0),6))"
_HARDSWISH_TREES = {E.parse(HARDSWISH, 1), E.parse("mul(div(minimum(maximum(add(@0,3),0),6),6),@0)", 1)}
SCALE = 6.0


# Ops with op(6 x) = 6 op(x) that a 6 x hardswish may pass through on its way to the
# weights that absorb the 6: MobileNetV3's squeeze-and-excitation pool, its head's
# pool and flatten.
THROUGH = frozenset({"adaptive_avg_pool", "avg_pool", "reduce_mean", "reduce_sum", "reshape"})


def _readers_to_scale(graph, node):
    """The convs and linears whose weights take node's 1/6, else None."""
    if node.op not in ("conv", "linear") or not node.expr or E.parse(node.expr, 1) not in _HARDSWISH_TREES:
        return None
    y = node.outputs[0]
    targets = _weighted_readers(graph, y)
    if not targets:  # (each reached once: a target reads the value on its path as input 0 only)
        return None
    for reader in targets:
        w = reader.inputs[1] if len(reader.inputs) > 1 else None
        if (w is None or not w.is_constant or np.dtype(w.dtype).kind != "f" or w.dtype != y.dtype
                or graph.sole_reader(w) is not reader):
            return None
    return targets


def _weighted_readers(graph, v, depth=0):
    """Every conv or linear that reads v as its input, directly or through THROUGH ops,
    when all of v's readers are such; else None. v must not be a graph output or kept."""
    if v in graph.outputs or v in getattr(graph, "kept", ()) or not v.consumers or depth > 4:
        return None
    targets = []
    for reader in {c.uid: c for c in v.consumers}.values():
        if reader.inputs[0] is not v or any(x is v for x in reader.inputs[1:]):
            return None
        if reader.op in ("conv", "linear"):
            targets.append(reader)
        elif reader.op in THROUGH and len(reader.outputs) == 1:
            further = _weighted_readers(graph, reader.outputs[0], depth + 1)
            if further is None:
                return None
            targets += further
        else:
            return None
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
