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

Attributes: `attrs` at registration declares every attribute the op's rules and factory
read, as {name: spec} (attr_specs.py); the loader checks each node of a file against it
before anything reads them, and refuses attributes the op does not declare.

Scratch: temporaries a callable needs only while it runs (im2col columns, depthwise
partial sums) come from one buffer per binding that every node reuses, instead of a
buffer per node: that keeps first-run page faults and peak memory to the largest single
need. A kernel declares its need with `scratch(node, inputs, outputs) -> bytes` at
registration (computed with `scratch_nbytes` over the same shapes it will request) and
takes the arrays in make() with `scratch_array`. A padded copy of the input in scratch
rewrites its border on every run (common.restore_stale); the padded copies that keep
their border from run to run instead (persistent_buffer) are shared by the nodes of
one geometry.

Family files are imported explicitly below; registering a name twice is an error.
"""

import contextlib
import math
import threading

import numpy as np

from pmx.runtime.errors import PmxFormatError
from pmx.runtime.kernels.attr_specs import as_specs
from pmx.runtime.record import Record


class Kernel(Record):
    __slots__ = ("op", "make", "infer", "inplace", "view", "scratch", "attrs", "float_input")

    def __init__(self, op, make, infer, inplace=False, view=False, scratch=None, attrs=None, float_input=False):
        self.op, self.make, self.infer = op, make, infer
        # the op's output may overwrite its first input when that input dies here
        self.inplace = inplace
        # output is a reinterpretation of input 0's bytes (reshape-like): plannable as alias
        self.view = view
        # bytes of shared scratch make() takes, from (node, inputs, outputs); None = none
        self.scratch = scratch
        # {attribute name: attr_specs.Spec}: every attribute the op reads ({}: none)
        self.attrs = as_specs(attrs)
        # input 0 must be floating-point or complex: the kernel computes in floats, which
        # an integer or bool output (the dtype of input 0) cannot take; torch refuses
        # such inputs to these ops too
        self.float_input = float_input


REGISTRY: dict[str, Kernel] = {}


class RunSized(Record):
    """What make() gets in place of an output array when the node declares attrs
    sized_at_run (a length read from tensor values, unknown until it runs): the callable
    stores a new array in .value each run, and the InferenceSession returns it."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


def register(op, *, infer, inplace=False, view=False, scratch=None, attrs=None, float_input=False):
    def deco(make):
        if op in REGISTRY:
            raise RuntimeError(f"kernel {op!r} registered twice")
        REGISTRY[op] = Kernel(op, make, infer, inplace, view, scratch, attrs, float_input)
        return make

    return deco


# --- shared scratch ------------------------------------------------------------------

SCRATCH_ALIGN = 64
_scratch = threading.local()


def _aligned(nbytes):
    return -(-int(nbytes) // SCRATCH_ALIGN) * SCRATCH_ALIGN


def scratch_nbytes(*arrays):
    """Bytes `scratch_array` takes for these (shape, dtype) requests, in order."""
    return sum(_aligned(math.prod(shape) * np.dtype(dtype).itemsize) for shape, dtype in arrays)


def node_scratch_nbytes(node, inputs, outputs) -> int:
    k = get(node.op)
    return int(k.scratch(node, inputs, outputs)) if k.scratch is not None else 0


class ScratchUse(Record):
    __slots__ = ("shortfall",)

    def __init__(self):
        self.shortfall = 0  # bytes scratch_array had to allocate past the buffer's end


@contextlib.contextmanager
def scratch_scope(buffer, persistent=None, temporaries=None):
    """While make() runs inside this scope, scratch_array carves arrays out of `buffer`
    (a uint8 array, 64-byte aligned), starting at its beginning for every node,
    persistent_buffer shares buffers through the dict `persistent`, and
    temporary_array through the list `temporaries` (both one per binding). Yields a
    ScratchUse whose `shortfall` counts requests the buffer could not hold (a kernel
    whose scratch rule declares too little: correct, but memory of its own)."""
    _scratch.buffer, _scratch.used, _scratch.persistent = buffer, 0, persistent
    _scratch.temporaries, _scratch.temporaries_taken = temporaries, 0
    _scratch.use = ScratchUse()
    try:
        yield _scratch.use
    finally:
        _scratch.buffer = _scratch.persistent = _scratch.temporaries = None


def temporary_array(shape, dtype):
    """A temporary valid only while this node's callable runs (an expression step's
    intermediate), from a pool that needs no size declared in advance: the k-th request
    of every node of a binding gets the k-th buffer of the pool, made larger when a node
    needs more (nodes that already hold the smaller one keep it). Nodes run one after
    another and split parts of one node take different buffers, so no two live
    temporaries share bytes. EfficientNet-B0's SiLU epilogues had held 24.7 MB of
    temporaries of their own. Outside a scratch scope with a pool, a plain array."""
    pool = getattr(_scratch, "temporaries", None)
    dtype = np.dtype(dtype)
    if pool is None:
        return np.empty(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    k = _scratch.temporaries_taken
    _scratch.temporaries_taken += 1
    if k == len(pool):
        pool.append(None)
    if pool[k] is None or pool[k].size < nbytes:
        pool[k] = np.empty(max(nbytes, 1), np.uint8)
    return pool[k][:nbytes].view(dtype).reshape(shape)


def persistent_buffer(key, shape, dtype, fill=0):
    """A buffer created full of `fill` whose contents last from run to run: a padded input
    whose border stays `fill` while each run writes its interior. Nodes of one binding
    asking with equal keys get the same buffer, so `key` must name everything that
    decides which positions a node writes (its input geometry, pads, padding mode): two
    such nodes write the same positions and leave the same ones alone, and nodes run
    one after another. DenseNet-121 held 61 of these (23.6 MB) in 7 shapes (6.3 MB).
    With key None, or outside a scratch scope with a dict, a buffer of its own."""
    dtype = np.dtype(dtype)
    shared = getattr(_scratch, "persistent", None) if key is not None else None
    full_key = (key, tuple(shape), dtype.str, fill)
    buf = shared.get(full_key) if shared is not None else None
    if buf is None:
        # np.zeros gets already-zero pages from the OS: no fill pass, no first touch here
        buf = np.zeros(shape, dtype) if fill == 0 else np.full(shape, fill, dtype)
        if shared is not None:
            shared[full_key] = buf
    return buf


def scratch_array(shape, dtype):
    """A temporary valid only inside this node's callable (the next node reuses the
    bytes). Outside a scratch scope, or past the declared size, it is a plain array."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = getattr(_scratch, "buffer", None)
    if buf is None or _scratch.used + nbytes > buf.size:
        if buf is not None:
            _scratch.use.shortfall += nbytes
        return np.empty(shape, dtype)
    start = _scratch.used
    _scratch.used += _aligned(nbytes)
    return buf[start:start + nbytes].view(dtype).reshape(shape)


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
    kernel = get(node.op)
    if kernel.float_input and dtypes and np.dtype(dtypes[0]).kind not in "fc":
        raise ValueError(f"input of dtype {np.dtype(dtypes[0]).name}: {node.op} takes floating-point inputs")
    result = []
    for shape, dtype in kernel.infer(node, shapes, dtypes):
        shape = tuple(map(int, shape))
        if shape and min(shape) < 0:
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
    sampling,
    shape,
    spectral,
    windows,
    winograd,
)
