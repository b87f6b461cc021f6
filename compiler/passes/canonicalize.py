"""PNNX spellings -> the canonical op set (rules in compiler/canon/)."""

from pmx.compiler.canon import RULES, Context, Forward
from pmx.runtime.errors import PmxUnsupportedOpError
from pmx.runtime.kernels import REGISTRY


def canonicalize(graph) -> bool:
    unknown = [n for n in graph.nodes if n.op not in REGISTRY and n.op not in RULES]
    if unknown:
        first = unknown[0]
        others = sorted({n.op for n in unknown[1:]} - {first.op})
        more = f"; also unsupported: {', '.join(others)}" if others else ""
        raise PmxUnsupportedOpError(
            f"{graph.source}: line {first.line}: unsupported op {first.op} (node '{first.name}'){more}. "
            f"`pmx compile --list-ops` prints the supported op types")
    ctx = Context(graph)
    changed = False
    for node in list(graph.nodes):
        if node.op in REGISTRY:
            continue
        result = RULES[node.op](node, ctx)
        index = graph.nodes.index(node)
        graph.remove_node(node)
        changed = True
        if isinstance(result, Forward):
            for out in node.outputs:
                graph.replace_uses(out, result.value)
            continue
        for offset, new in enumerate(result):
            graph.add_node(new, index + offset)
    return changed
