"""Remove every node that no graph output or kept tensor depends on: one reachability
walk back from them. Unused constants then have no consumer and are not written."""


def eliminate_dead_code(graph, ctx):
    live_values = set()
    stack = [v for v in graph.outputs + graph.kept if v is not None]
    live_nodes = set()
    while stack:
        v = stack.pop()
        if v.uid in live_values:
            continue
        live_values.add(v.uid)
        p = v.producer
        if p is not None and p.uid not in live_nodes:
            live_nodes.add(p.uid)
            stack.extend(x for x in p.inputs if x is not None)
    dead = [n for n in graph.nodes if n.uid not in live_nodes]
    for n in dead:
        graph.remove_node(n)
