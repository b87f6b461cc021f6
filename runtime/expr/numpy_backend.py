"""The numpy backend: an expression compiled to a sequence of numpy ufunc (or clip, or
custom) calls writing into buffers allocated once at compile time (compile_numpy). The
plan (steps, temporaries and which buffer each shares) depends only on the tree, shapes
and dtypes and is memoized (_numpy_plan); buffer planning reuses a temporary once its
last reader has run, in place where the step is elementwise-safe.
"""

import functools

import numpy as np

from pmx.runtime.expr.dtypes import result_dtype
from pmx.runtime.expr.functions import NUMPY_FUNCS
from pmx.runtime.expr.gelu import _special_numpy_step
from pmx.runtime.expr.special import desugar
from pmx.runtime.expr.tree import Exact, inputs_used, substitute


def _literal(v, float_dtype):
    # Python scalars are "weak" under NEP 50, so float32 arrays stay float32.
    if isinstance(v, float):
        return float(np.dtype(float_dtype).type(v)) if float_dtype else v
    return v


def compile_numpy(tree, inputs, out, empty=None):
    """Return a zero-argument callable evaluating `tree` over `inputs` into `out` with numpy
    ufuncs. Temporaries are allocated once here, never on the hot path; equal subtrees
    are computed once; a temporary whose last reader has run is reused by later steps of
    the same shape and dtype (exact GELU's ~30 steps on a ViT MLP tensor needed 73 MB
    of temporaries without reuse, 4 buffers with it). A ufunc or clip step may write
    into the buffer of an operand it reads for the last time (same shape and dtype:
    elementwise, so in place is safe; SiLU's four steps need one buffer, not two);
    custom steps such as where are not in-place safe and never do. `empty(shape, dtype)`
    makes the temporaries (default np.empty; kernels pass BindContext.temporary_array, whose
    buffers the nodes of a binding share)."""
    special = _special_numpy_step(tree, inputs, out)
    if special is not None:
        return special
    tree = _desugared(tree)
    final_into_out = not _needs_temp(tree, inputs, out)
    # out may hold temporaries when no input can overlap it (may_share_memory: a bounds
    # check, conservative)
    out_free = final_into_out and not any(np.may_share_memory(out, x) for x in inputs if isinstance(x, np.ndarray))
    program, slot_shapes, slot_of, result = _numpy_plan(
        Exact(tree),
        tuple(np.shape(x) for x in inputs),
        tuple(x.dtype for x in inputs),
        out.dtype,
        final_into_out,
        out.shape if out_free else None,
    )
    slots = [(empty or np.empty)(shape, dtype) for shape, dtype in slot_shapes]

    def array(ref):
        kind, v = ref
        if kind == "tmp":
            return out if slot_of[v] == OUT_SLOT else slots[slot_of[v]]
        return out if kind == "out" else inputs[v] if kind == "in" else v

    steps = []
    for t, operands, target, bounds in program:
        args, dst = [array(r) for r in operands], array(target)
        if bounds is not None:
            steps.append(_clip_step(args[0], bounds, dst))
        elif isinstance(NUMPY_FUNCS[t[0]], np.ufunc):
            steps.append(_ufunc_step(NUMPY_FUNCS[t[0]], args, dst))
        else:
            steps.append(_custom_step(NUMPY_FUNCS[t[0]], args, dst))
    if result[0] != "out":
        src = array(result)
        steps.append(lambda: np.copyto(out, src, casting="unsafe"))

    if len(steps) == 1:
        return steps[0]

    def run():
        for s in steps:
            s()

    return run


def _desugared(tree):
    """desugar(tree), memoized: trees are immutable tuples."""
    return _desugared_exact(Exact(tree))


@functools.lru_cache(maxsize=1024)
def _desugared_exact(key):
    return desugar(key.tree)


@functools.lru_cache(maxsize=1024)
def _numpy_plan(key, input_shapes, input_dtypes, out_dtype, final_into_out, free_out_shape=None):
    """The part of compile_numpy that depends on shapes and dtypes, not on the arrays
    (key: the tree as an Exact):
    (program, temporary buffer slots as (shape, dtype), slot of each temporary, result
    ref). Memoized: a model binds the same activation for every conv and every split
    part of it (SiLU after each of EfficientNet-B0's 81 convs), and planning it cost
    about half of binding that model. The program's literal operands are read-only
    arrays shared by the callables built from it. free_out_shape (out's shape, when no
    input overlaps out) lets a temporary of out's shape and dtype live in out itself
    (slot OUT_SLOT) while out is not yet written: an affine + ReLU chain then runs in
    out with no temporary (DenseNet-121's 62 BN + ReLU nodes had held 38 MB of them)."""
    tree = key.tree
    float_dtype = out_dtype if out_dtype.kind in "fc" else None
    program = []  # (tree, operand refs, target ref, clip bounds or None)
    temps = []  # (shape, dtype) per temporary
    memo = {}  # Exact(subtree) -> its temporary: equal subtrees are computed once

    def shape_of(ref):
        kind, v = ref
        return temps[v][0] if kind == "tmp" else input_shapes[v] if kind == "in" else np.shape(v)

    def emit(t, final=False):
        if t[0] == "@":
            return ("in", t[1])
        if t[0] == "#":
            return ("lit", _literal(t[1], float_dtype))
        exact = Exact(t)
        if exact in memo and not final:
            return memo[exact]
        clip = _as_clip(t) if float_dtype is not None else None
        if clip is not None and result_dtype(_relabel(t), _leaf_dtypes(t, input_dtypes)).kind != "f":
            clip = None  # integer max/min: infinite bounds do not exist there
        operands = [emit(a) for a in (clip[0] if clip else t)[1:]]
        if final:
            target = ("out", None)
        else:
            shape = np.broadcast_shapes(*[shape_of(r) for r in operands])
            dtype = result_dtype(_relabel(t), _leaf_dtypes(t, input_dtypes))
            if float_dtype is not None and dtype.kind == "f" and dtype.itemsize > float_dtype.itemsize:
                dtype = float_dtype
            target = ("tmp", len(temps))
            temps.append((shape, dtype))
            memo[exact] = target
        program.append((t, operands, target, clip[1] if clip else None))
        return target

    result = emit(tree, final=final_into_out)
    out_key = None
    if free_out_shape is not None and program and _in_place_safe(program[-1]):
        # the last step reads a temporary in out and writes out: safe element by element
        out_key = _key((free_out_shape, out_dtype))
    slot_shapes, slot_of = _buffer_slots(program, temps, out_key)
    return program, slot_shapes, slot_of, result


# slot_of value of a temporary kept in the output array itself
OUT_SLOT = -1


def _in_place_safe(step):
    """A ufunc or clip step may write where an operand it reads lies."""
    t, _, _, bounds = step
    return bounds is not None or isinstance(NUMPY_FUNCS[t[0]], np.ufunc)


def _buffer_slots(program, temps, out_key=None):
    """(slots as (shape, dtype), slot of each temporary): temporaries whose lifetimes do
    not overlap share a slot; with out_key, out is one more slot (OUT_SLOT) for
    temporaries of that shape and dtype."""
    last_read = {}
    for k, (_, operands, _, _) in enumerate(program):
        for kind, v in operands:
            if kind == "tmp":
                last_read[v] = k
    free, slot_of, dying, slots = {}, {}, {}, []
    if out_key is not None:
        free[out_key] = [OUT_SLOT]
    for k, step in enumerate(program):
        _t, operands, target, _bounds = step
        for v in dying.pop(k - 1, ()):  # read for the last time by an earlier step
            free.setdefault(_key(temps[v]), []).append(slot_of[v])
        if _in_place_safe(step):
            for v in dying.pop(k, ()):  # read for the last time by this step
                free.setdefault(_key(temps[v]), []).append(slot_of[v])
        kind, v = target
        if kind == "tmp":
            pool = free.get(_key(temps[v]))
            if pool:
                slot_of[v] = pool.pop()
            else:
                slot_of[v] = len(slots)
                slots.append(temps[v])
            dying.setdefault(last_read.get(v, k), []).append(v)
    return slots, slot_of


def _key(temp):
    shape, dtype = temp
    return tuple(shape), np.dtype(dtype)


def _as_clip(t):
    """(subtree with the clipped operand as its only argument, (lo, hi)) when t is
    maximum/minimum against literals (relu, relu6, clamp), else None. np.clip with two
    finite-or-infinite float bounds measured faster than np.maximum here (numpy 2.4,
    float32; docs/performance.md, "Kernel measurements"), and relu6 becomes one pass
    instead of two; NaN propagates in both."""
    lo, hi = -np.inf, np.inf
    node = t
    while node[0] in ("maximum", "minimum"):
        a, b = node[1], node[2]
        if b[0] != "#" and a[0] == "#":
            a, b = b, a
        if b[0] != "#" or not isinstance(b[1], (int, float)) or isinstance(b[1], bool):
            break
        if node[0] == "maximum" and lo == -np.inf and float(b[1]) <= hi:
            lo = float(b[1])
        elif node[0] == "minimum" and hi == np.inf and float(b[1]) >= lo:
            hi = float(b[1])
        else:
            break
        node = a
    if node is t:
        return None
    return ("clip", node), (lo, hi)


# np.clip is a Python wrapper around this ufunc that costs ~2-3 us per call, most of a
# small relu (squeeze-and-excitation vectors); the ufunc itself is not public API.
try:
    from numpy._core.umath import clip as _CLIP
except ImportError:  # another numpy layout: the public wrapper
    _CLIP = np.clip


def _clip_step(x, bounds, target):
    lo, hi = (np.asarray(v, target.dtype) for v in bounds)
    return lambda: _CLIP(x, lo, hi, out=target, casting="unsafe")


def _needs_temp(tree, inputs, out):
    """Write the final step straight into `out` unless the tree is a bare leaf or a
    custom function that would read an input `out` overlaps."""
    if tree[0] in ("@", "#"):
        return True
    fn = NUMPY_FUNCS.get(tree[0])
    if not isinstance(fn, np.ufunc):
        return any(np.shares_memory(out, x) for x in inputs if isinstance(x, np.ndarray))
    return False


def _ufunc_step(fn, args, target):
    a = tuple(args)
    if target.dtype.kind == "f" and all(np.asarray(v).dtype.kind in "biu" for v in a):
        # a float result of integer operands (1 / x): torch computes in the float dtype,
        # where numpy would pick the ufunc's integer loop (np.reciprocal(2) == 0)
        loop = target.dtype
        if len(a) == 1:
            x = a[0]
            return lambda: fn(x, out=target, casting="unsafe", dtype=loop)
        x, y = a
        return lambda: fn(x, y, out=target, casting="unsafe", dtype=loop)
    if len(a) == 1:
        x = a[0]
        return lambda: fn(x, out=target, casting="unsafe")
    x, y = a
    return lambda: fn(x, y, out=target, casting="unsafe")


def _custom_step(fn, args, target):
    a = tuple(args)
    return lambda: fn(*a, out=target)


def _relabel(t):
    """Renumber the inputs of subtree t as 0..k-1 (for result_dtype on a subtree)."""
    order = sorted(inputs_used(t))
    return substitute(t, {i: ("@", j) for j, i in enumerate(order)}) if order else t


def _leaf_dtypes(t, dtypes):
    return [dtypes[i] for i in sorted(inputs_used(t))]
