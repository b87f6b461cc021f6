"""Check every node's output shapes and dtypes against its kernel's shape rule.

pnnx records the traced shape of every operand; a disagreement means pmx would compute
something else than torch did, so it fails the compile naming the node and line. Values
pnnx left without a shape get the inferred one.
"""

import numpy as np

from pmx.runtime.errors import PmxCompileError
from pmx.runtime.kernels.registry import output_shapes


def infer_shapes(graph, ctx):
    for node in graph.nodes:
        shapes = [v.shape if v is not None else None for v in node.inputs]
        if any(s is None or any(d is None for d in s) for s, v in zip(shapes, node.inputs) if v is not None):
            raise PmxCompileError(
                f"{node.where()}: an input has no static shape: {[v.shape for v in node.inputs if v is not None]}"
            )
        dtypes = [np.dtype(v.dtype) if v is not None else None for v in node.inputs]
        try:
            results = output_shapes(node, shapes, dtypes)
        except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError) as e:
            names = [d.name for d in dtypes if d is not None]
            raise PmxCompileError(
                f"{node.where()}: cannot compute its output from inputs {shapes} of dtypes {names}: {e}"
            ) from None
        for out, (shape, dtype) in zip(node.outputs, results):
            recorded = out.shape
            if (
                recorded is not None
                and None in recorded
                and len(recorded) == len(shape)
                and all(r is None or r == d for r, d in zip(recorded, shape))
            ):
                out.shape = recorded = None  # a dynamic ('?') export: fill in the planned size
            if recorded is not None and tuple(recorded) != shape:
                raise PmxCompileError(
                    f"{node.where()}: output {out.name} would have shape {shape} but pnnx recorded {out.shape}"
                )
            if out.shape is None:
                out.shape = shape
            out.dtype = reconcile_dtype(graph, node, out, dtype, [d for d in dtypes if d is not None])


def reconcile_dtype(graph, node, out, dtype, input_dtypes) -> str:
    """The dtype an output gets: the op's, where pnnx wrote none for the operand (the
    frontend then assumed float32: pnnx writes no type for 0-d results and for scalar
    expressions, such as an integer arange bound or a select of an int32 tensor) or one
    of the same kind (pnnx says f32 where the op keeps f16). A recorded dtype of another
    kind contradicts what the op computes: no pnnx export in the tests or in pnnx's own
    op tests writes one, so the file was edited or damaged, and running it would write
    one kind into a buffer of another; the compile fails naming the node and both."""
    if dtype.kind not in "biufc":
        raise PmxCompileError(
            f"{graph.source}: {node.where()}: output {out.name} would be of dtype {dtype.name}, "
            f"not a number (inputs {[d.name for d in input_dtypes]}); check the op's parameters"
        )
    recorded = out.recorded_dtype
    if recorded is None or np.dtype(recorded).kind == dtype.kind:
        return dtype.name
    raise PmxCompileError(
        f"{graph.source}: {node.where()}: output {out.name} is recorded as {np.dtype(recorded).name} but the op "
        f"computes {dtype.name} from inputs {[d.name for d in input_dtypes]}; the .param contradicts itself "
        f"(edited or damaged?)"
    )
