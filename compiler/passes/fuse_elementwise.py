"""Maximal regions of elementwise nodes become one node holding one expression: a
producer merges into its consumer. Inputs are deduplicated, so add(x, relu(x)) reads x
once; a region stays within numexpr's operand limit and the parser's depth limit."""

import numpy as np

from pmx.compiler.rewrite import N, V, rewrite_rule, rule_pass
from pmx.runtime import expr as E

MAX_INPUTS = 16
MAX_SIZE = 256
MAX_DEPTH = 64


def _depth(tree):
    if tree[0] in ("@", "#"):
        return 1
    return 1 + max(_depth(a) for a in tree[1:])


def _numel(v):
    return int(np.prod(v.shape, dtype=np.int64))


def _writes_as_computed(tree, inputs, out):
    try:
        dtype = E.result_dtype(tree, [np.dtype(v.dtype) for v in inputs])
    except (TypeError, ValueError):  # a combination numpy refuses: leave the nodes apart
        return False
    return np.dtype(dtype) == np.dtype(out.dtype)


def _merge(node, v):
    """(inputs, tree) of `node` with v's producer substituted in."""
    p = v.producer
    inputs = []
    index = {}

    def slot(x):
        if x.uid not in index:
            index[x.uid] = len(inputs)
            inputs.append(x)
        return ("@", index[x.uid])

    p_sub = E.substitute(p.expr, {i: slot(x) for i, x in enumerate(p.inputs)})
    tree = E.substitute(node.expr, {i: p_sub if x is v else slot(x) for i, x in enumerate(node.inputs)})
    return inputs, tree


@rewrite_rule(N("elementwise", some=V("v", N("elementwise", name="p"), sole=True), name="node"))
def merge_producer(graph, m):
    """Only where the producer's output has as many elements as the node's (a broadcast
    operand such as a squeeze-excite gate would be recomputed per element) and neither
    node changes dtype on write (numpy and numexpr then compute the same float32 values)."""
    node, v, p = m.node, m.v, m.p
    if _numel(v) != _numel(node.outputs[0]) or not _writes_as_computed(p.expr, p.inputs, v):
        return None
    inputs, tree = _merge(node, v)
    if (
        len(inputs) > MAX_INPUTS
        or E.size(tree) > MAX_SIZE
        or _depth(tree) > MAX_DEPTH
        or not _writes_as_computed(tree, inputs, node.outputs[0])
    ):
        return None
    graph.remove_node(p)
    graph.set_inputs(node, inputs)
    node.expr = tree
    return True


fuse_elementwise = rule_pass("fuse_elementwise", [merge_producer])
