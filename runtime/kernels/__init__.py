"""The kernel registry: one entry per canonical op.

A kernel is a factory `make(node, inputs, outputs) -> callable | None`:
    node     has .op .name .attrs (dict of plain values) .expr .variant
    inputs   numpy arrays (weights are read-only views of the mmap; None = absent input)
    outputs  numpy arrays, the node's planned arena views, written in place
It returns a zero-argument callable that computes outputs from inputs, or None when
there is nothing to do at run time (an output that is already a view of the input).
Factories do all the per-node work once (geometry, scratch buffers, weight views) so the
callable is a few numpy calls with out=.

A shape rule `infer(node, shapes, dtypes) -> [(shape, dtype), ...]` gives output shapes
and dtypes from input shapes and attributes; the compiler checks pnnx's declared shapes
against it and the runtime uses it to re-plan other input shapes.

Family files are imported explicitly below; registering a name twice is an error.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

from pmx.runtime.errors import PmxFormatError


@dataclass(frozen=True)
class Kernel:
    op: str
    make: Callable
    infer: Callable
    # the op's output may overwrite its first input when that input dies here
    inplace: bool = False
    # output is a reinterpretation of input 0's bytes (reshape-like): plannable as alias
    view: bool = False


REGISTRY: dict[str, Kernel] = {}


def register(op, *, infer, inplace=False, view=False):
    def deco(make):
        if op in REGISTRY:
            raise RuntimeError(f"kernel {op!r} registered twice")
        REGISTRY[op] = Kernel(op, make, infer, inplace, view)
        return make

    return deco


def get(op: str) -> Kernel:
    try:
        return REGISTRY[op]
    except KeyError:
        raise PmxFormatError(f"unknown op {op!r} in model (this runtime knows {len(REGISTRY)} ops)") from None


def output_shapes(node, shapes, dtypes):
    """The op's shape rule, normalized: [(shape as a tuple of ints, np.dtype)] per output.
    Whatever the rule raises when the inputs do not fit propagates (callers add context);
    a negative dim is a ValueError too. Used by the compiler's checks, the loader's
    verifier and run-time re-planning alike."""
    result = []
    for shape, dtype in get(node.op).infer(node, shapes, dtypes):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative output shape {shape}")
        result.append((shape, np.dtype(dtype)))
    return result


from pmx.runtime.kernels import (  # noqa: E402,F401  (registration side effects)
    attention,
    conv,
    conv_transpose,
    elementwise,
    indexing,
    linalg,
    norm,
    pool,
    recurrent,
    reduce,
    resample,
    shape,
)
