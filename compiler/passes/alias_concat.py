"""Concat without copies: the producers of a concat write straight into their slice of
the concat output (DenseNet, Inception, SqueezeNet fire modules, ShuffleNet), recorded
as aliases (input -> concat output, byte offset); the concat kernel then skips every
input that is already in place, and does nothing when all are.

Only contiguous slices are aliased: all dims before the concat axis are 1 (batch 1 along
channels, or any concat on axis 0). A slice with gaps (batch > 1) would hand producers a
strided output, and GEMM kernels reshape their output without copying (view_as), which
strided memory does not allow.

An input keeps its own buffer (and is copied) when it is a graph input, a constant, a
graph output or kept (those must stay readable as themselves), when it already aliases
something (a reshape view, another concat), when it has no producer in the graph, or when
it appears twice in the concat. A tensor that feeds several concats goes into the first;
when the first concat's inputs are a prefix of a later one's (DenseNet), the first
concat's output itself becomes the leading part of the later one, so none of them copies.
"""

import numpy as np

from pmx.compiler.passes.plan_memory import resolve


def _contiguous_slices(node, aliases):
    out = node.outputs[0]
    if not out.shape:
        return False
    axis = node.attrs["axis"] % len(out.shape)
    return int(np.prod(out.shape[:axis], dtype=np.int64)) == 1 and not resolve(out, aliases)[2]


def _alias_prefixes(aliases, concats, fixed):
    """DenseNet: layer k concatenates [x0 .. xk-1], layer k+1 [x0 .. xk]. Each concat
    whose inputs are a prefix of a later concat's (same axis) becomes the leading part of
    that concat's output, so a block's features are written once into one buffer and no
    layer copies them again."""
    for i, a in enumerate(concats):
        out = a.outputs[0]
        if out.uid in fixed or out.uid in aliases or not _contiguous_slices(a, aliases):
            continue
        for b in concats[i + 1 :]:
            if not (_is_prefix(a, b) and _contiguous_slices(b, aliases)):
                continue
            if resolve(b.outputs[0], aliases)[0] is not out:
                aliases[out.uid] = (b.outputs[0], 0, None)
                break


def _is_prefix(a, b):
    """a's inputs are the leading inputs of b, concatenated along the same axis."""
    n = len(a.inputs)
    x, y = a.outputs[0], b.outputs[0]
    same_axis = a.attrs["axis"] % len(x.shape) == b.attrs["axis"] % len(y.shape)
    return len(b.inputs) > n and b.inputs[:n] == a.inputs and same_axis and x.dtype == y.dtype


def alias_concat(graph, ctx):
    aliases = ctx.aliases
    fixed = {v.uid for v in graph.inputs + graph.outputs + graph.kept}
    concats = [n for n in graph.nodes if n.op == "concat"]
    _alias_prefixes(aliases, concats, fixed)
    for node in concats:
        out = node.outputs[0]
        if not _contiguous_slices(node, aliases):
            continue
        axis = node.attrs["axis"] % len(out.shape)
        inner = int(np.prod(out.shape[axis + 1 :], dtype=np.int64)) * np.dtype(out.dtype).itemsize
        uids = [v.uid for v in node.inputs]
        offset = 0
        for v in node.inputs:
            ok = (
                not v.is_constant
                and v.uid not in fixed
                and v.uid not in aliases
                and v.producer is not None
                and v.dtype == out.dtype
                and uids.count(v.uid) == 1
                and resolve(out, aliases)[0] is not v
            )
            if ok:
                aliases[v.uid] = (out, offset, None)
            offset += v.shape[axis] * inner
