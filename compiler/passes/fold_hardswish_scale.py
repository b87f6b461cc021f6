"""A conv or linear whose fused activation is hardswish, x * clip(x + 3, 0, 6) / 6, and
whose output's only reader is a conv or linear taking it as its input, writes 6 x
hardswish instead: the division goes, and the reader's weights are divided by 6. The
reader is linear in that input (a conv's padding, zero, reflected or replicated, scales
with it); its bias and input scale stay as they are. numpy runs hardswish as four passes
(add 3, clip, multiply, multiply by 1/6); three remain.

MobileNetV3-small has 19 hardswish epilogues and 10 fire: the stem, the 8 expand convs
before their depthwise convs, and the first classifier layer. The other 9 feed a
squeeze-and-excitation pool and gate, or the last pool. Removing the division from all
19 (wrong results, an upper bound) took 2.5-3% off the model. Steady ms, untuned
compiles differing only in this pass, alternating fresh processes, 8 of 8 pairs:
4.76-4.88 -> 4.65-4.82. Error against torch 7.9e-8 -> 9.2e-8 of the output's largest
magnitude (the reader's weights / 6 round once more).

Does not fire on weights another node reads (the file would hold them twice), on
non-constant or non-float weights, or where the output is a graph output, kept, or read
by another node or as a weight.
"""

import numpy as np

from pmx.compiler.ir import Value
from pmx.runtime import expr as E

HARDSWISH = "mul(@0,div(minimum(maximum(add(@0,3),0),6),6))"
SCALED_HARDSWISH = "mul(@0,minimum(maximum(add(@0,3),0),6))"
_HARDSWISH_TREES = {E.parse(HARDSWISH, 1), E.parse("mul(div(minimum(maximum(add(@0,3),0),6),6),@0)", 1)}
SCALE = 6.0


def _reader_to_scale(graph, node):
    """The conv or linear whose weights take node's 1/6, else None."""
    if node.op not in ("conv", "linear") or not node.expr or E.parse(node.expr, 1) not in _HARDSWISH_TREES:
        return None
    y = node.outputs[0]
    reader = graph.sole_reader(y)
    if reader is None or reader.op not in ("conv", "linear") or reader.inputs[0] is not y:
        return None
    if any(v is y for v in reader.inputs[1:]):
        return None
    w = reader.inputs[1] if len(reader.inputs) > 1 else None
    if (w is None or not w.is_constant or np.dtype(w.dtype).kind != "f" or w.dtype != y.dtype
            or graph.sole_reader(w) is not reader):
        return None
    return reader


def fold_hardswish_scale(graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        reader = _reader_to_scale(graph, node)
        if reader is None:
            continue
        w = reader.inputs[1]
        scaled = (np.asarray(w.data, np.float64) / SCALE).astype(w.dtype)
        graph.set_input(reader, 1, Value(f"{w.name}.div6", w.shape, w.dtype, data=scaled))
        node.expr = SCALED_HARDSWISH
        changed = True
    return changed
