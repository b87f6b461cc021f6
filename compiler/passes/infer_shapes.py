"""Check every node's output shapes and dtypes against its kernel's shape rule.

pnnx records the traced shape of every operand; a disagreement means pmx would compute
something else than torch did, so it fails the compile naming the node and line. Values
pnnx left without a shape get the inferred one.
"""

import numpy as np

from pmx.runtime.errors import PmxCompileError
from pmx.runtime.kernels import output_shapes


def infer_shapes(graph) -> bool:
    changed = False
    for node in graph.nodes:
        shapes = [v.shape if v is not None else None for v in node.inputs]
        if any(s is None or any(d is None for d in s) for s, v in zip(shapes, node.inputs) if v is not None):
            raise PmxCompileError(f"{node.where()}: an input has no static shape: {[v.shape for v in node.inputs if v is not None]}")
        dtypes = [np.dtype(v.dtype) if v is not None else None for v in node.inputs]
        try:
            results = output_shapes(node, [s for s in shapes if s is not None], [d for d in dtypes if d is not None])
        except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError) as e:
            raise PmxCompileError(f"{node.where()}: cannot compute output shape from inputs {shapes}: {e}") from None
        for out, (shape, dtype) in zip(node.outputs, results):
            recorded = out.shape
            if recorded is not None and None in recorded and len(recorded) == len(shape) and all(
                    r is None or r == d for r, d in zip(recorded, shape)):
                out.shape = recorded = None  # a dynamic ('?') export: fill in the planned size
            if recorded is not None and tuple(recorded) != shape:
                raise PmxCompileError(
                    f"{node.where()}: output {out.name} would have shape {shape} but pnnx recorded {out.shape}")
            if out.shape is None:
                out.shape = shape
                changed = True
            # unknown or same kind (pnnx says f32 where the op keeps f16): the op's dtype;
            # another kind: pnnx's, and the kernel casts on write
            if out.dtype is None or (out.dtype != dtype.name and np.dtype(out.dtype).kind == dtype.kind):
                out.dtype = dtype.name
    return changed
