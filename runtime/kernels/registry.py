"""The kernel registry: one entry per canonical op.

A kernel is a factory `make(node, inputs, outputs, ctx) -> callable | None`:
    node     has .op .name .attrs (dict of plain values) .expr .variant
    inputs   numpy arrays (weights are read-only views of the mmap; None = absent input)
    outputs  numpy arrays, the node's planned arena views, written in place
    ctx      the bind.BindContext of the binding in progress: the shared scratch, the
             binding's persistent buffers and temporaries, and the worker pool the node's
             work splits over
It returns a zero-argument callable that computes outputs from inputs, or None when
there is nothing to do at run time (an output that is already a view of the input).
Factories do all the per-node work once (geometry, scratch buffers, weight views, the
pool a split runs on) so the callable is a few numpy calls with out=.

A shape rule `infer(node, shapes, dtypes) -> [(shape, dtype), ...]` gives output shapes
and dtypes from input shapes and attributes; shapes[k] and dtypes[k] are None where
optional input k is absent, so a rule reads its operands by position. It also checks
every operand it is given (a weight against the input's channels, a bias against the
output channels, an index's dtype): the loader runs it on each node of a file before any
kernel binds, so what a kernel reads is what its rule checked. The compiler checks pnnx's
declared shapes against it and the runtime uses it to re-plan other input shapes.

Rows: `rows` at registration says whether the op keeps the images of a batch apart:
each output row (index along dim 0) computed from the same row of every input whose dim 0
is the batch, whatever the other inputs (weights, broadcast constants) are. True for
every node of the op, a predicate `rows(node, ranks, batched)` (the inputs' ranks and
which of them carry the batch; None where absent) where it depends on the axes, and
False (the default) where the op mixes rows or its rule is not worth stating. The
session runs a large batch in chunks of rows only when every node of the graph between
the inputs and the outputs keeps rows apart (runtime/batch_chunks.py); shapes are checked
there, so a rule only states what shapes cannot show (an axis 0 softmax keeps its shape).

Tensors sized at run time: an op whose kernel reads a length from tensor values
(arange with tensor bounds, masked_select; attrs sized_at_run) makes an output whose
size is known only when it runs (RunSized). Another node may read such a tensor only if
its op is registered with `reads_run_sized=True`: its output shapes follow from its
inputs' shapes through its shape rule alone, with no size in its attributes (elementwise,
cast), so the session binds it at each run on the shapes its inputs then have, and its
outputs are sized at run time too. The compiler refuses any other reader.

Attributes: `attrs` at registration declares every attribute the op's rules and factory
read, as {name: spec} (attr_specs.py); the loader checks each node of a file against it
before anything reads them, and refuses attributes the op does not declare.

Work: `macs(node, in_shapes, out_shapes) -> int` at registration counts the multiply-adds
a node performs at these shapes, for the ops that carry a model's compute (convs, linear
layers); the session weighs a model by them (session._heavy_model).

Scratch: `scratch(node, inputs, outputs, ctx) -> bytes` at registration declares what
make() takes with ctx.scratch_array (bind.py; computed with bind.scratch_nbytes over the
same shapes, which may depend on the threads the node splits over: ctx as make() gets it,
less the buffer, which these rules size).

Families: each kernel family registers its ops when imported. A lookup (get, kernel_of)
imports the families in FAMILIES' order until one has registered the op, so a process
imports only the families its models use: a CNN's ops are in the first few, and importing
every family cost each start 3-5 ms (docs/performance.md, "Kernel families imported on
first need").
all_kernels() imports them all, for whatever lists every op. The families import this
module, never the reverse at import time, so there is no cycle.
"""

import importlib
import math

import numpy as np

from pmx.runtime.errors import PmxFormatError, PmxResourceError
from pmx.runtime.kernels.attr_specs import as_specs
from pmx.runtime.record import Record


class Kernel(Record):
    __slots__ = (
        "op",
        "make",
        "infer",
        "inplace",
        "view",
        "scratch",
        "attrs",
        "float_input",
        "rows",
        "variants",
        "format_version",
        "reads_run_sized",
        "macs",
    )

    def __init__(
        self,
        op,
        make,
        infer,
        inplace=False,
        view=False,
        scratch=None,
        attrs=None,
        float_input=False,
        rows=False,
        variants=None,
        format_version=None,
        reads_run_sized=False,
        macs=None,
    ):
        self.op, self.make, self.infer = op, make, infer
        # the op's output may overwrite its first input when that input dies here
        self.inplace = inplace
        # output is a reinterpretation of input 0's bytes (reshape-like): plannable as alias
        self.view = view
        # bytes of shared scratch make() takes, from (node, inputs, outputs, ctx); None = none
        self.scratch = scratch
        # {attribute name: attr_specs.Spec}: every attribute the op reads ({}: none)
        self.attrs = as_specs(attrs)
        # input 0 must be floating-point or complex: the kernel computes in floats, which
        # an integer or bool output (the dtype of input 0) cannot take; torch refuses
        # such inputs to these ops too
        self.float_input = float_input
        # True, False or rows(node, ranks, batched) -> bool: whether the op keeps a batch's
        # rows apart (module docstring, "Rows")
        self.rows = rows
        # variants(node, shapes) -> [variant]: the lowerings `pmx compile --tune` may time
        # for a node with these input shapes (None: one lowering, nothing to choose)
        self.variants = variants
        # format_version(node) -> int: the oldest .pmx format version that carries this
        # node's meaning (None: every version the runtime reads; compiler/write.py)
        self.format_version = format_version
        # may read a tensor sized at run time (module docstring, "Tensors sized at run time")
        self.reads_run_sized = reads_run_sized
        # macs(node, in_shapes, out_shapes) -> multiply-adds (module docstring, "Work")
        self.macs = macs

    def keeps_rows(self, node, ranks, batched):
        rows = self.rows
        return bool(rows(node, ranks, batched)) if callable(rows) else rows


REGISTRY: dict[str, Kernel] = {}


class RunSized(Record):
    """What make() gets in place of an output array when the node declares attrs
    sized_at_run (a length read from tensor values, unknown until it runs): the callable
    stores a new array in .value each run, and the InferenceSession returns it."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


# What one output sized at run time may take: the default arena limit (load.py), since the
# size comes from input values, which may ask for anything.
RUN_SIZED_MAX_BYTES = 8 << 30


def check_run_sized(node, shape, dtype):
    """Refuses a run-sized output of `shape` beyond RUN_SIZED_MAX_BYTES before it is allocated."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > RUN_SIZED_MAX_BYTES:
        raise PmxResourceError(
            f"node {node.name[:40]!r} ({node.op}): the inputs' values ask for an output of {list(shape)} "
            f"({nbytes} bytes), over the limit of {RUN_SIZED_MAX_BYTES}"
        )


def register(op, *, infer, **traits):
    """Decorator registering `make` as op's kernel factory with shape rule `infer`;
    `traits` are Kernel's keywords (inplace, view, scratch, attrs, float_input, rows,
    variants, format_version, reads_run_sized, macs), each described there."""

    def deco(make):
        if op in REGISTRY:
            raise RuntimeError(f"kernel {op!r} registered twice")
        REGISTRY[op] = Kernel(op, make, infer, **traits)
        return make

    return deco


def _axes_of(value, rank):
    """The axes an attribute names, normalized to [0, rank) (None: every axis)."""
    if value is None:
        return range(rank)
    return [int(a) % rank for a in (value if isinstance(value, (list, tuple)) else [value])]


def rows_off_axis(*names):
    """rows= for an op that mixes elements only along the axes its attributes `names`
    give (of input 0; absent or None: every axis): it keeps rows apart unless axis 0 is
    among them."""

    def rows(node, ranks, batched):
        return ranks[0] > 0 and all(0 not in _axes_of(node.attrs.get(n), ranks[0]) for n in names)

    return rows


def rows_below_rank(name):
    """rows= for a window op (a pool) whose attribute `name` lists one size per trailing
    dim it works on: rows stay apart unless that list reaches dim 0."""

    def rows(node, ranks, batched):
        return len(node.attrs[name]) < ranks[0]

    return rows


def weight_macs(node, in_shapes, out_shapes):
    """macs= for an op whose weight (input 1) holds, per output channel, one multiply-add
    per output element: a conv's (Cout, Cin / groups, *k), a linear layer's (out, in)."""
    return math.prod(out_shapes[0]) * math.prod(in_shapes[1][1:])


def version_with(attr, version=3, when=None):
    """format_version= for an op whose attribute `attr`, where present (and where
    when(value) says so), an older runtime would misread rather than refuse."""

    def format_version(node):
        present = attr in node.attrs and (when is None or when(node.attrs[attr]))
        return version if present else None

    return format_version


# Every module of runtime/kernels that registers ops, the common ones first: the order in
# which a lookup imports them.
FAMILIES = (
    "conv",
    "elementwise",
    "shape",
    "pool",
    "linalg",
    "winograd",
    "reduce",
    "norm",
    "resample",
    "conv_transpose",
    "attention",
    "indexing",
    "recurrent",
    "sampling",
    "spectral",
    "windows",
)


def kernel_of(op: str) -> Kernel | None:
    """op's Kernel, importing families until one registers it; None for an unknown op."""
    kernel = REGISTRY.get(op)
    if kernel is None:
        for family in FAMILIES:  # an imported family is a dict lookup in sys.modules
            importlib.import_module(f"pmx.runtime.kernels.{family}")
            if op in REGISTRY:
                return REGISTRY[op]
    return kernel


def all_kernels() -> dict[str, Kernel]:
    """Every op's Kernel, by op (every family imported)."""
    for family in FAMILIES:
        importlib.import_module(f"pmx.runtime.kernels.{family}")
    return REGISTRY


def get(op: str) -> Kernel:
    kernel = kernel_of(op)
    if kernel is None:
        raise PmxFormatError(f"unknown op {op!r} in model (this runtime knows {len(all_kernels())} ops)")
    return kernel


def node_scratch_nbytes(node, inputs, outputs, ctx) -> int:
    """Bytes of shared scratch the node's make() takes with this ctx (its kernel's scratch
    rule; 0: none)."""
    k = get(node.op)
    return int(k.scratch(node, inputs, outputs, ctx)) if k.scratch is not None else 0


def checked_infer(kernel, node, shapes, dtypes):
    """kernel.infer after the check float_input asks for: the rule's own results."""
    if kernel.float_input and dtypes and np.dtype(dtypes[0]).kind not in "fc":
        raise ValueError(f"input of dtype {np.dtype(dtypes[0]).name}: {node.op} takes floating-point inputs")
    return kernel.infer(node, shapes, dtypes)


def output_shapes(node, shapes, dtypes):
    """The op's shape rule, normalized: [(shape as a tuple of ints, np.dtype)] per output.
    Whatever the rule raises when the inputs do not fit propagates (callers add context);
    a negative dim is a ValueError too. Used by the compiler's checks, the loader's
    verifier and run-time re-planning alike."""
    kernel = get(node.op)
    result = []
    for shape, dtype in checked_infer(kernel, node, shapes, dtypes):
        shape = tuple(map(int, shape))
        if shape and min(shape) < 0:
            raise ValueError(f"negative output shape {shape}")
        result.append((shape, np.dtype(dtype)))
    return result
