"""Reshape-like nodes (reshape, view, flatten, squeeze, unsqueeze: every kernel registered
with view=True) become aliases of their input's bytes: no copy, no buffer. Dropout,
Identity and contiguous are already gone (canonicalization forwards them).

Not aliased, so the kernel copies:
- a reshape of a strided view (a slice with gaps cannot be reinterpreted in place);
- a reshape of a kept tensor: `--keep` is a debugging tap, and the user expects to read
  exactly the tensor the model computed there, in its own buffer, whatever later passes
  (in-place writes through a view) do downstream.
"""

from pmx.compiler.passes.plan_memory import resolve
from pmx.runtime.kernels.registry import get


def alias_views(graph, ctx):
    aliases = ctx.aliases
    kept = {v.uid for v in graph.kept}
    for node in graph.nodes:
        if not get(node.op).view:
            continue
        x, out = node.inputs[0], node.outputs[0]
        if x.is_constant or out.uid in aliases or x.uid in kept or x.nbytes != out.nbytes:
            continue
        if resolve(x, aliases)[2]:
            continue
        aliases[out.uid] = (x, 0, None)
