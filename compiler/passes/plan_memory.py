"""Lifetimes over the stored order, then one arena planned greedy-by-size
(runtime/plan.py, shared with run-time re-planning), checked by its own checker.

Every non-constant tensor gets either an arena offset or an alias: a view into another
tensor's bytes, recorded in the compile's PassContext (ctx.aliases) by the passes before
this one (alias_views, alias_concat, write_inplace). Aliases resolve to a root buffer
whose lifetime covers all its views. Graph inputs are planned too (run() copies them in,
step -1); graph outputs and kept tensors live to the end. The offsets, the arena size,
its lower bound and the unplanned sum go into the context too; the pipeline makes the
Plan (compiler/plan.py) from it.

`root_lifetimes` and `resolve` are shared with write_inplace, which must see the same
lifetimes the planner will; the lifetime and span computations themselves live in
runtime/plan.py, shared with run-time re-planning.
"""

from pmx.runtime.plan import check_plan, lifetimes, lower_bound, naive_bytes, plan_arena, root_spans


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


def value_lifetimes(graph):
    """{value uid: (first step, last step)} over graph.nodes (runtime/plan.lifetimes)."""
    constants = {v.uid for v in graph.values() if v.is_constant}
    steps = [([v.uid if v is not None else None for v in n.inputs], [v.uid for v in n.outputs]) for n in graph.nodes]
    return lifetimes(
        steps, [v.uid for v in graph.inputs], [v.uid for v in graph.outputs + graph.kept], constants.__contains__
    )


def root_lifetimes(graph, aliases):
    """{root uid: [root Value, first, last]}, each root's span covering all its views."""
    by_uid = {v.uid: v for v in graph.values()}
    per_root = root_spans(value_lifetimes(graph), lambda uid: resolve(by_uid[uid], aliases)[0].uid)
    return {uid: [by_uid[uid], lo, hi] for uid, (lo, hi) in per_root.items()}


def plan_memory(graph, ctx):
    roots = root_lifetimes(graph, ctx.aliases)
    root_list = sorted(roots.values(), key=lambda t: (t[1], t[0].uid))
    buffers = [(r.nbytes, lo, hi) for r, lo, hi in root_list]
    offsets, arena = plan_arena(buffers)
    check_plan(buffers, offsets, arena)

    ctx.offsets = {r.uid: off for (r, _, _), off in zip(root_list, offsets)}
    ctx.arena_size = arena
    ctx.lower_bound = lower_bound(buffers)
    by_uid = {v.uid: v for v in graph.values()}
    ctx.naive_bytes = naive_bytes(value_lifetimes(graph), lambda uid: by_uid[uid].nbytes)
