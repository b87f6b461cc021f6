"""Maximal regions of elementwise nodes become one node holding one expression.

A producer is absorbed into its consumer when its output has that single consumer, is
not a graph output or kept, has as many elements as the consumer's output (absorbing a
small broadcast operand, e.g. a squeeze-excite gate, would recompute it per element of
the big tensor), and when neither the absorbed node nor the fused one changes dtype on
write (numpy and numexpr then compute the same float32 values as the separate nodes).
Inputs are deduplicated, so add(x, relu(x)) reads x once. Region size is bounded so
expressions stay within numexpr's operand limit and the parser's depth limit.
"""

import numpy as np

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


def _absorbable(graph, node, v):
    p = v.producer
    if p is None or p.op != "elementwise" or len(p.outputs) != 1 or p is node:
        return False
    if graph.sole_reader(v) is not node:
        return False
    if _numel(v) != _numel(node.outputs[0]):
        return False
    return _writes_as_computed(p.expr, p.inputs, v)


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
    mapping = {}
    for i, x in enumerate(node.inputs):
        mapping[i] = p_sub if x is v else slot(x)
    tree = E.substitute(node.expr, mapping)
    return inputs, tree


def _rewire(graph, node, inputs):
    for x in node.inputs:
        if x is not None and node in x.consumers:
            x.consumers.remove(node)
    node.inputs = list(inputs)
    node.input_names = [None] * len(inputs)
    for x in inputs:
        x.consumers.append(node)


def fuse_elementwise(graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        if node.op != "elementwise" or node not in graph.nodes:
            continue
        progress = True
        while progress:
            progress = False
            for v in list(node.inputs):
                if v is None or not _absorbable(graph, node, v):
                    continue
                inputs, tree = _merge(node, v)
                if len(inputs) > MAX_INPUTS or E.size(tree) > MAX_SIZE or _depth(tree) > MAX_DEPTH:
                    continue
                if not _writes_as_computed(tree, inputs, node.outputs[0]):
                    continue
                p = v.producer
                graph.remove_node(p)
                _rewire(graph, node, inputs)
                node.expr = tree
                changed = True
                progress = True
                break
    return changed
