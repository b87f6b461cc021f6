"""Large batches run in chunks of rows: which graphs allow it, and how many rows a chunk takes.

A batch of N images runs each node over all N before the next node starts. From a few
images up, a node's N outputs no longer stay in the caches until the next node reads
them, and per image a batch of 32 can run slower than a batch of 1 (docs/performance.md,
"Large batches in chunks of rows"), and a split GEMM hands parts between threads inside
every node. InferenceSession therefore runs a batch in chunks of at most CHUNK_ROWS rows:
with several threads, at most ceil(N / threads) rows each, the chunks running at once,
one per thread, each thread with its own bindings bound for one thread; with one
thread, one chunk after another. Each chunk writes its rows of the outputs into arrays
of the whole batch. That is the same computation only when the graph keeps the batch's
rows apart: output row i computed from row i of the inputs alone.

`rows_apart` decides that from the model, per non-batch shape: shapes inferred at two
batch sizes show which tensors carry the batch along dim 0 (dim 0 follows it, every other
dim stays), and each node reading such a tensor must be an op whose kernel registered that
it keeps rows apart (registry "Rows": convs, pools, elementwise, linear, reductions off
axis 0, ...), with every output it makes carrying the batch as well. Anything else (an op
that mixes rows, such as a softmax over dim 0, an output sized at run time, an input whose
dim 0 is not the batch) keeps the whole batch in one run.
"""

from __future__ import annotations

from pmx.runtime.kernels.registry import get
from pmx.runtime.options import BATCH_CHUNK_ROWS
from pmx.runtime.replan import infer_shapes

# Rows per chunk. Measured over the bench CNNs at batch 32 (docs/performance.md): 8 rows
# pay the per-node costs once per 8 images, and their activations, a few MB per image on
# those models, still come back from the caches for the next node.
CHUNK_ROWS = 8


def batch_rows(arrays):
    """N when every input of `arrays` ({tensor index: array}) has N rows along dim 0, else None."""
    sizes = {arr.shape[0] if arr.ndim else None for arr in arrays.values()}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def rows_apart(model, inner_shapes, wanted, run_sized):
    """None when the model, with inputs of `inner_shapes` ({tensor index: shape without dim
    0}), computes each row of the `wanted` outputs from the same row of its inputs alone;
    otherwise why not (for tests and docs). run_sized: outputs sized at run time."""
    sizes = (2, 3)
    try:
        shapes = [infer_shapes(model, {i: (n, *s) for i, s in inner_shapes.items()}) for n in sizes]
    except Exception:  # a batch of 1 or 2 not allowed by the model: nothing to chunk by
        return "the model does not take a batch of 2 and of 3"
    tensors = len(model.tensors)

    def carries_batch(i):
        return all(len(s[i]) > 0 and s[i][0] == n and s[i][1:] == shapes[0][i][1:] for n, s in zip(sizes, shapes))

    def constant_size(i):
        return shapes[0][i] == shapes[1][i]

    batched = [False] * tensors
    for i in model.inputs:
        if not carries_batch(i):
            return f"input {model.tensors[i].name!r} has no batch dim 0"
        batched[i] = True
    needed = _needed_tensors(model, wanted)
    for node in model.nodes:
        ins = [i if i >= 0 else None for i in node.inputs]
        if not any(i is not None and batched[i] for i in ins):
            if not all(constant_size(o) for o in node.outputs if o in needed):
                return f"node {node.name!r} ({node.op}) takes its size from the batch without reading it"
            continue
        ranks = [len(shapes[0][i]) if i is not None else None for i in ins]
        flags = [i is not None and batched[i] for i in ins]
        if not get(node.op).keeps_rows(node, ranks, flags):
            return f"node {node.name!r} ({node.op}) mixes the rows of a batch"
        for o in node.outputs:
            if o in run_sized:
                return f"node {node.name!r} ({node.op}) sizes its output at run time"
            if carries_batch(o):
                batched[o] = True
            elif o in needed:
                return f"node {node.name!r} ({node.op}) makes {model.tensors[o].name!r} without the batch in dim 0"
    for o in wanted:
        if not batched[o]:
            return f"output {model.tensors[o].name!r} does not carry the batch in dim 0"
    return None


def _needed_tensors(model, wanted):
    """Tensors some node reads, plus the wanted outputs."""
    needed = set(wanted)
    for node in model.nodes:
        needed.update(i for i in node.inputs if i >= 0)
    return needed


def chunks(rows, chunk_rows, least=1):
    """(start, stop) of each chunk of `rows` rows: chunk_rows each, the last one shorter,
    or longer where it would be under `least`, the fewest rows the model takes."""
    bounds = [(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < least:
        bounds[-2:] = [(bounds[-2][0], rows)]
    return bounds


def chunk_rows_option(sess_options):
    """Rows per chunk from SessionOptions' config entry pmx.batch_chunk_rows (0: none),
    else CHUNK_ROWS."""
    value = sess_options._config.get(BATCH_CHUNK_ROWS)
    return CHUNK_ROWS if value is None else int(value)
