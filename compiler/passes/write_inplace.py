"""In-place: a node whose kernel may overwrite an input (elementwise: any input of the
output's shape and dtype; batch_norm, softmax, log_softmax: the first) writes its output
over that input when the input's buffer dies at this node. Recorded as an alias
(output -> input, offset 0), so the planner gives the pair one buffer.

"Dies here" is decided on root buffers over the stored order: the input's root (with all
its views, e.g. a reshape of it or the concat it is a slice of) has no later reader. The
input must not be a graph input, graph output or kept tensor, nor any alias of one, nor a
strided view; another input of the node that shares its root (a different slice of the
same concat) blocks the rewrite unless it is the very same tensor. The output may be a
graph output or kept: the shared buffer then lives to the end and is never overwritten.
"""

from pmx.compiler.passes.plan_memory import resolve, root_lifetimes
from pmx.runtime.kernels.registry import get


def write_inplace(graph, ctx):
    aliases = ctx.aliases
    fixed = {v.uid for v in graph.inputs + graph.outputs + graph.kept}
    roots = root_lifetimes(graph, aliases)
    # roots holding an input, output or kept tensor (directly or through a view)
    pinned = {resolve(v, aliases)[0].uid for v in graph.values() if v.uid in fixed}
    for step, node in enumerate(graph.nodes):
        if not get(node.op).inplace or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if out.uid in aliases or out in graph.inputs:
            continue
        candidates = node.inputs if node.op == "elementwise" else node.inputs[:1]
        for x in candidates:
            if x is None or x.is_constant or x.uid in fixed:
                continue
            if x.shape != out.shape or x.dtype != out.dtype:
                continue
            root, _offset, strided = resolve(x, aliases)
            if strided or root.uid in pinned or roots[root.uid][2] != step:
                continue
            others = [y for y in node.inputs if y is not None and y is not x and not y.is_constant]
            if any(resolve(y, aliases)[0] is root for y in others):
                continue
            aliases[out.uid] = (x, 0, None)
            entry = roots[root.uid]
            entry[2] = max(entry[2], roots.pop(out.uid)[2])
            if out.uid in pinned:
                pinned.add(root.uid)
            break
