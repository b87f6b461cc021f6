"""Lifetimes over the stored order, then one arena planned greedy-by-size
(runtime/plan.py, shared with run-time re-planning), checked by its own checker.

Every non-constant tensor gets either an arena offset or an alias: a view into another
tensor's bytes (reshape-like ops, and whatever fusion passes recorded in graph.aliases,
e.g. concat inputs written straight into their slice of the output). Aliases resolve to
a root buffer whose lifetime covers all its views. Graph inputs are planned too (run()
copies them in); graph outputs and kept tensors live to the end.
"""

from pmx.runtime.kernels import get
from pmx.runtime.plan import check_plan, lower_bound, plan_arena


def _decide_view_aliases(graph):
    aliases = dict(getattr(graph, "aliases", {}))
    for node in graph.nodes:
        if not get(node.op).view:
            continue
        x, out = node.inputs[0], node.outputs[0]
        if x.is_constant or out.uid in aliases:
            continue
        target = aliases.get(x.uid)
        if target is not None and target[2] is not None:
            continue  # x is a strided view: a reshape of it is not a view, the kernel copies
        aliases[out.uid] = (x, 0, None)
    return aliases


def _root(v, aliases):
    offset = 0
    strides = None
    while v.uid in aliases:
        target, off, st = aliases[v.uid]
        offset += off
        strides = strides if strides is not None else st
        v = target
    return v, offset


def plan_memory(graph) -> bool:
    aliases = _decide_view_aliases(graph)
    n = len(graph.nodes)
    first, last = {}, {}
    for v in graph.inputs:
        first[v.uid] = -1
        last[v.uid] = -1
    for i, node in enumerate(graph.nodes):
        for v in node.outputs:
            first.setdefault(v.uid, i)
            last[v.uid] = max(last.get(v.uid, i), i)
        for v in node.inputs:
            if v is not None and not v.is_constant:
                last[v.uid] = max(last.get(v.uid, i), i)
    for v in graph.outputs + list(getattr(graph, "kept", [])):
        if not v.is_constant:
            last[v.uid] = n

    roots = {}
    for v in graph.values():
        if v.is_constant:
            continue
        r, _ = _root(v, aliases)
        lo, hi = first.get(v.uid, -1), last.get(v.uid, -1)
        if r.uid in roots:
            _, a, b = roots[r.uid]
            roots[r.uid] = (r, min(a, lo), max(b, hi))
        else:
            roots[r.uid] = (r, lo, hi)
    root_list = sorted(roots.values(), key=lambda t: (t[1], t[0].uid))
    buffers = [(r.nbytes, lo, hi) for r, lo, hi in root_list]
    offsets, arena = plan_arena(buffers)
    check_plan(buffers, offsets, arena)

    graph.offsets = {r.uid: off for (r, _, _), off in zip(root_list, offsets)}
    graph.aliases = aliases
    graph.arena_size = arena
    graph.lower_bound = lower_bound(buffers)
    graph.naive_bytes = sum(v.nbytes for v in graph.values() if not v.is_constant and v.uid not in aliases)
    return True
