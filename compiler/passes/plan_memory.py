"""Lifetimes over the stored order, then one arena planned greedy-by-size
(runtime/plan.py, shared with run-time re-planning), checked by its own checker.

Every non-constant tensor gets either an arena offset or an alias: a view into another
tensor's bytes, recorded in graph.aliases by the passes before this one (alias_views,
alias_concat, write_inplace). Aliases resolve to a root buffer whose lifetime covers all
its views. Graph inputs are planned too (run() copies them in, step -1); graph outputs
and kept tensors live to the end.

`lifetimes` and `resolve` are shared with write_inplace, which must see the same
lifetimes the planner will.
"""

from pmx.runtime.plan import check_plan, lower_bound, plan_arena


def resolve(v, aliases):
    """(root Value, byte offset into it, strided?) of v through the alias chain."""
    offset = 0
    strided = False
    while v.uid in aliases:
        target, off, strides = aliases[v.uid]
        offset += off
        strided = strided or strides is not None
        v = target
    return v, offset, strided


def lifetimes(graph):
    """{value uid: (first step, last step)} for non-constant values over graph.nodes;
    graph inputs start at -1, graph outputs and kept tensors end at len(nodes)."""
    n = len(graph.nodes)
    first, last = {}, {}
    for v in graph.inputs:
        first[v.uid] = last[v.uid] = -1
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
    return {uid: (first.get(uid, last[uid]), last[uid]) for uid in last}


def root_lifetimes(graph, aliases):
    """{root uid: [root, first, last]} with each root's span covering all its views."""
    spans = lifetimes(graph)
    roots = {}
    for v in graph.values():
        if v.is_constant or v.uid not in spans:
            continue
        r, _, _ = resolve(v, aliases)
        lo, hi = spans[v.uid]
        if r.uid in roots:
            entry = roots[r.uid]
            entry[1], entry[2] = min(entry[1], lo), max(entry[2], hi)
        else:
            roots[r.uid] = [r, lo, hi]
    return roots


def plan_memory(graph) -> bool:
    aliases = getattr(graph, "aliases", {})
    roots = root_lifetimes(graph, aliases)
    root_list = sorted(roots.values(), key=lambda t: (t[1], t[0].uid))
    buffers = [(r.nbytes, lo, hi) for r, lo, hi in root_list]
    offsets, arena = plan_arena(buffers)
    check_plan(buffers, offsets, arena)

    graph.offsets = {r.uid: off for (r, _, _), off in zip(root_list, offsets)}
    graph.aliases = aliases
    graph.arena_size = arena
    graph.lower_bound = lower_bound(buffers)
    # what one buffer per tensor (no reuse over time, no views, no in-place) would take
    spans = lifetimes(graph)
    graph.naive_bytes = sum(v.nbytes for v in graph.values()
                            if not v.is_constant and v.uid in spans)
    return True
