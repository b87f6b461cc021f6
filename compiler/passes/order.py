"""Deterministic topological order: Kahn's algorithm, ties broken by original position.
The runtime executes this stored order and never sorts."""

import heapq


def order(graph, ctx):
    position = {n.uid: i for i, n in enumerate(graph.nodes)}
    indegree = {}
    for n in graph.nodes:
        producers = {v.producer.uid for v in n.inputs if v is not None and v.producer is not None}
        indegree[n.uid] = len(producers)
    by_uid = {n.uid: n for n in graph.nodes}
    ready = [(position[n.uid], n.uid) for n in graph.nodes if indegree[n.uid] == 0]
    heapq.heapify(ready)
    result = []
    while ready:
        _, uid = heapq.heappop(ready)
        n = by_uid[uid]
        result.append(n)
        seen = set()
        for v in n.outputs:
            for c in v.consumers:
                if c.uid in seen or c.uid not in indegree:
                    continue
                seen.add(c.uid)
                indegree[c.uid] -= 1
                if indegree[c.uid] == 0:
                    heapq.heappush(ready, (position[c.uid], c.uid))
    if len(result) != len(graph.nodes):
        from pmx.runtime.errors import PmxCompileError

        stuck = [n for n in graph.nodes if indegree[n.uid] > 0][:3]
        raise PmxCompileError(f"the graph has a cycle through {', '.join(n.where() for n in stuck)}")
    graph.set_order(result)
