"""Evaluate nodes whose inputs are all constants, with the runtime's own kernels, and
replace their outputs by constants (pnnx leaves shape arithmetic, pnnx.Attribute chains
and expression subtrees like this)."""

import numpy as np

from pmx.runtime.kernels.bind import BindContext
from pmx.runtime.kernels.registry import get

# Folding must not blow up the file: an expand of a small constant to a huge tensor is
# cheaper to compute at run time than to store.
MAX_FOLDED_BYTES = 16 << 20


def fold_constants(graph, ctx):
    bind = None  # the kernels' context (a pool of the default thread count), made when a first node folds
    for node in list(graph.nodes):
        ins = [v for v in node.inputs if v is not None]
        if not ins or not all(v.is_constant for v in ins) or "sized_at_run" in node.attrs:
            continue  # (a run-sized output gets its length at run time: runtime/session.py)
        out_bytes = sum(v.nbytes for v in node.outputs)
        if out_bytes > max(MAX_FOLDED_BYTES, sum(v.nbytes for v in ins)):
            continue
        outputs = [np.empty(v.shape, v.dtype) for v in node.outputs]
        inputs = [v.data if v is not None else None for v in node.inputs]
        bind = bind or BindContext()
        run = get(node.op).make(node, inputs, outputs, bind.begin_node())
        if run is not None:
            with np.errstate(all="ignore"):
                run()
        else:  # a view op: its output is its input's bytes
            outputs = [np.ascontiguousarray(inputs[0]).reshape(v.shape) for v in node.outputs]
        graph.remove_node(node)
        for v, data in zip(node.outputs, outputs):
            v.data = data
