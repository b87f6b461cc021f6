"""What a binding gives the kernel factories it calls: BindContext, passed to every
`make(node, inputs, outputs, ctx)` (registry.py).

Scratch: temporaries a callable needs only while it runs (im2col columns, depthwise
partial sums) come from one buffer per binding that every node reuses, instead of a
buffer per node: that keeps first-run page faults and peak memory to the largest single
need. A kernel declares its need with a scratch rule at registration (computed with
`scratch_nbytes` over the same shapes it will request) and takes the arrays in make()
with `ctx.scratch_array`. A padded copy of the input in scratch rewrites its border on
every run (common.restore_stale); the padded copies that keep their border from run to
run instead (`ctx.persistent_buffer`) are shared by the nodes of one geometry.

Threads: the callables a factory makes split their work over `ctx.pool`, the worker
pool of the InferenceSession and calling thread that bind (runtime/parallel.py); a
factory reads the pool and its thread counts from ctx when it makes its callables, and
the callables keep what they were given. Nothing here is thread-local: a binding's
context is its own, so bindings on several threads at once never see each other's.
"""

import math

import numpy as np

from pmx.runtime import parallel
from pmx.runtime.options import default_thread_count

SCRATCH_ALIGN = 64


def _aligned(nbytes):
    return -(-int(nbytes) // SCRATCH_ALIGN) * SCRATCH_ALIGN


def scratch_nbytes(*arrays):
    """Bytes `BindContext.scratch_array` takes for these (shape, dtype) requests, in order."""
    return sum(_aligned(math.prod(shape) * np.dtype(dtype).itemsize) for shape, dtype in arrays)


class BindContext:
    """One binding's resources for the factories it calls, one node after another:

    pool          the parallel.Pool the node's work splits over (None: a new pool of the
                  default thread count, as compile-time folding and tuning use)
    scratch       a uint8 array, 64-byte aligned, that scratch_array carves arrays out of,
                  from its beginning again for every node (begin_node); None: none
    persistent    the dict persistent_buffer shares buffers through (None: none)
    temporaries   the list temporary_array pools buffers in (None: none)

    `threads` and `gemm_threads` are the pool's, read once here. `shortfall` counts the
    bytes of scratch requests the buffer could not hold (a kernel whose scratch rule
    declares too little: correct, but memory of its own)."""

    __slots__ = (
        "pool",
        "threads",
        "gemm_threads",
        "scratch",
        "used",
        "persistent",
        "temporaries",
        "temporaries_taken",
        "shortfall",
    )

    def __init__(self, pool=None, scratch=None, persistent=None, temporaries=None):
        self.pool = parallel.Pool(default_thread_count()) if pool is None else pool
        self.threads = self.pool.threads
        # threads a kernel may split BLAS calls over: the pool's when BLAS runs on one
        # thread, else 1 (BLAS's own threads share the GEMM out)
        self.gemm_threads = self.pool.threads if self.pool.splits_gemms else 1
        self.scratch, self.persistent, self.temporaries = scratch, persistent, temporaries
        self.used = self.temporaries_taken = self.shortfall = 0

    def begin_node(self):
        """Start binding the next node: its scratch starts at the buffer's beginning and its
        temporaries at the pool's first (nodes run one after another)."""
        self.used = self.temporaries_taken = 0
        return self

    def mark(self):
        """Where this node's scratch and temporaries stand; `rewind(mark)` hands later
        requests the same bytes again, for parts of one node that run one after another."""
        return self.used, self.temporaries_taken

    def rewind(self, mark):
        self.used, self.temporaries_taken = mark

    # --- splitting work ---------------------------------------------------------------

    def worth_splitting(self, elements: int) -> bool:
        """Whether work touching `elements` pays for a split over the pool's threads."""
        return parallel.worth_splitting(elements, self.threads)

    def split(self, parts):
        """parallel.split of `parts` over this binding's pool."""
        return parallel.split(parts, self.pool)

    # --- memory -------------------------------------------------------------------------

    def scratch_array(self, shape, dtype):
        """A temporary valid only inside this node's callable (the next node reuses the
        bytes). Without a scratch buffer, or past its size, a plain array."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self.scratch
        if buf is None or self.used + nbytes > buf.size:
            if buf is not None:
                self.shortfall += nbytes
            return np.empty(shape, dtype)
        start = self.used
        self.used += _aligned(nbytes)
        return buf[start : start + nbytes].view(dtype).reshape(shape)

    def temporary_array(self, shape, dtype):
        """A temporary valid only while this node's callable runs (an expression step's
        intermediate), from a pool that needs no size declared in advance: the k-th request
        of every node of a binding gets the k-th buffer of the pool, made larger when a node
        needs more (nodes that already hold the smaller one keep it). Nodes run one after
        another and split parts of one node take different buffers, so no two live
        temporaries share bytes. Without a pool, a plain array."""
        pool = self.temporaries
        dtype = np.dtype(dtype)
        if pool is None:
            return np.empty(shape, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        k = self.temporaries_taken
        self.temporaries_taken += 1
        if k == len(pool):
            pool.append(None)
        if pool[k] is None or pool[k].size < nbytes:
            pool[k] = np.empty(max(nbytes, 1), np.uint8)
        return pool[k][:nbytes].view(dtype).reshape(shape)

    def persistent_buffer(self, key, shape, dtype, fill=0):
        """A buffer created full of `fill` whose contents last from run to run: a padded input
        whose border stays `fill` while each run writes its interior. Nodes of one binding
        asking with equal keys get the same buffer, so `key` must name everything that
        decides which positions a node writes (its input geometry, pads, padding mode): two
        such nodes write the same positions and leave the same ones alone, and nodes run
        one after another. With key None, or without a dict, a buffer of its own."""
        dtype = np.dtype(dtype)
        shared = self.persistent if key is not None else None
        full_key = (key, tuple(shape), dtype.str, fill)
        buf = shared.get(full_key) if shared is not None else None
        if buf is None:
            # np.zeros gets already-zero pages from the OS: no fill pass, no first touch here
            buf = np.zeros(shape, dtype) if fill == 0 else np.full(shape, fill, dtype)
            if shared is not None:
                shared[full_key] = buf
        return buf
