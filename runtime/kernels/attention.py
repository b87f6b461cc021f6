"""Attention: softmax(q k^T * scale + masks) v with batched matmuls and an in-place softmax.

`attention` inputs: (q, k, v, *masks), or (qkv, *masks) with attrs packed="qkv", or
(q, kv, *masks) with packed="kv" (the projections' outputs side by side on the last axis,
one GEMM instead of three; the kernel takes views).
attrs:
  heads      0: inputs are [..., L, E] / [..., S, E] / [..., S, Ev] with broadcasting batch
             dims (F.scaled_dot_product_attention). H > 0: inputs are [L, N, H*d] or
             [N, L, H*d] (nn.MultiheadAttention after its projections) and are split into
             heads by views, without copies.
  seq_axis   with heads > 0: 0 for [L, N, E], 1 for [N, L, E].
  gqa        with heads = 0, 1: grouped-query attention (SDPA enable_gqa): q [..., Hq, L, E]
             with k, v [..., Hkv, S, E]; query head h reads kv head h // (Hq / Hkv). The
             kernel views q as [..., Hkv, Hq/Hkv, L, E] and broadcasts k and v, no repeat.
  scale      multiplies the scores (1.0 when the compiler folded it into the q weights).
  causal     1: query i sees keys j <= i (torch's top-left aligned is_causal).
  masks      one string per mask input, each mask broadcastable to the scores [..., L, S]:
             "add" (float, added), "keep" (bool, True = may attend, as in SDPA),
             "drop" (bool, True = masked out, as in nn.MultiheadAttention).
  mask_roles with heads > 0, one string per mask: "attn" ([L, S], or [N*H, L, S] seen as
             [N, H, L, S]) or "key_padding" ([N, S] seen as [N, 1, 1, S]). The kernel
             takes these views itself, so no node bakes the batch size into a shape.
  tile_masks with heads > 0, 1: a constant [N*H, L, S] mask traced at a smaller batch is
             repeated along its first axis (set by the compiler for dynamic batch)
  weights    "none", "mean" (second output [N, L, S], averaged over heads) or "heads"
             (second output [N, H, L, S]).
  masked_rows "nan" (a fully masked row gives NaN, nn.MultiheadAttention) or "zero"
             (it gives 0, as F.scaled_dot_product_attention's safe softmax).
Output 0 has q's layout with v's feature size.

How it runs (tools/bench_kernels.py has the numbers): where BLAS runs on one thread
(BindContext.gemm_threads), each slice of the scores is shared out to the runtime's threads along
its first batch axis longer than 1 (the heads; the query rows when there is none), and
each thread runs every step on its share: q * scale (L*E multiplies, not L*S), QK^T,
masks, the softmax (row max, subtract, exp in place; row sums as a GEMV with a ones
vector), PV, then, unless the weights are an output, the division of PV by the row sums
(L*Ev divides, not L*S). The scores live in the binding's shared scratch. np.exp is most
of what separates this kernel from the throughput of its two GEMMs alone
(docs/performance.md, "Kernel measurements").
"""

import math

import numpy as np

from pmx.runtime import blas, parallel
from pmx.runtime.kernels.attr_specs import (
    FLAG,
    NON_NEGATIVE,
    NUMBER,
    defaulting,
    integer,
    one_of,
    optional,
    or_empty,
    words,
)
from pmx.runtime.kernels.bind import scratch_nbytes
from pmx.runtime.kernels.common import along, chain, expect_operand, view_as
from pmx.runtime.kernels.registry import register
from pmx.runtime.record import Record


def _mask_inputs(attrs, ranks):
    """How many mask inputs follow q, k and v (or the packed qkv, or q and kv)."""
    n = len(ranks) - {"qkv": 1, "kv": 2}.get(attrs.get("packed", ""), 3)
    return n if n >= 0 else None


# packed first: the number of mask inputs follows it; masks: one mode per mask input;
# mask_roles: () (all attention masks) or one role per mask
ATTENTION_ATTRS = dict(
    packed=optional(one_of("", "qkv", "kv")),
    heads=optional(NON_NEGATIVE),
    seq_axis=optional(integer(0, 1)),
    gqa=optional(FLAG),
    scale=optional(NUMBER),
    causal=optional(FLAG),
    masks=defaulting((), words("add", "keep", "drop", length=_mask_inputs)),
    mask_roles=optional(or_empty(words("attn", "key_padding", length=_mask_inputs))),
    tile_masks=optional(FLAG),
    weights=optional(one_of("none", "mean", "heads")),
    masked_rows=optional(one_of("nan", "zero")),
)


def _unpack_shapes(attrs, shapes):
    packed = attrs.get("packed", "")
    if packed == "qkv":
        e = shapes[0][-1] // 3
        q = tuple(shapes[0][:-1]) + (e,)
        return q, q, q, shapes[1:]
    if packed == "kv":
        e = shapes[1][-1] // 2
        k = tuple(shapes[1][:-1]) + (e,)
        return tuple(shapes[0]), k, k, shapes[2:]
    return tuple(shapes[0]), tuple(shapes[1]), tuple(shapes[2]), shapes[3:]


def _check_masks(node, masks, scores):
    """Masks must fit the scores at these shapes (a constant mask traced at another batch
    does not, which makes the compiler keep that batch fixed)."""
    roles = tuple(node.attrs.get("mask_roles", ())) or ("attn",) * len(masks)
    n, h, lq, s = scores if len(scores) == 4 else (None, None, None, None)
    tile = bool(node.attrs.get("tile_masks"))
    for m, role in zip(masks, roles):
        size = math.prod(m)
        if node.attrs.get("heads"):
            full = n * h * lq * s
            ok = (
                size == n * s
                if role == "key_padding"
                else (size in (lq * s, full) or (tile and len(m) == 3 and full % size == 0))
            )
        else:
            ok = tuple(np.broadcast_shapes(tuple(m), tuple(scores))) == tuple(scores)
        if not ok:
            raise ValueError(f"mask of shape {tuple(m)} does not fit scores {tuple(scores)}")


def _check_operands(node, shapes, dtypes, q, k, v):
    """q, k and v of one float dtype whose sizes meet (q and k one feature size, k and v
    one sequence length; with heads, [L, N, E] or [N, L, E] with one N); each mask of the
    dtype its kind takes. A packed input's last axis splits evenly."""
    a = node.attrs
    packed = a.get("packed", "")
    n_tensors = {"qkv": 1, "kv": 2}.get(packed, 3)
    for j in range(n_tensors):
        expect_operand(shapes, dtypes, j, "q, k and v", dtype=dtypes[0], kinds="fc")
    if packed and shapes[n_tensors - 1][-1] % (3 if packed == "qkv" else 2):
        raise ValueError(
            f"packed {packed} input {tuple(shapes[n_tensors - 1])} does not split in {len(packed)} equal parts"
        )
    if int(a.get("heads", 0)):
        sa = int(a.get("seq_axis", 0))
        if not (len(q) == len(k) == len(v) == 3) or not (q[1 - sa] == k[1 - sa] == v[1 - sa]) or k[sa] != v[sa]:
            raise ValueError(f"q {q}, k {k}, v {v} are not [L, N, E] / [N, L, E] with one N and one key length")
    elif len(q) < 2 or len(k) < 2 or len(v) < 2 or k[-2] != v[-2]:
        raise ValueError(f"k {k} and v {v} do not have one sequence length")
    if q[-1] != k[-1]:
        raise ValueError(f"q {q} and k {k} do not have one feature size")
    kinds = {"add": "fc", "keep": "b", "drop": "b"}
    for j, kind in enumerate(a.get("masks", ()), start=n_tensors):
        expect_operand(shapes, dtypes, j, f"{kind} mask", kinds=kinds.get(kind, "fcb"))


def attention_infer(node, shapes, dtypes):
    q, k, v, masks = _unpack_shapes(node.attrs, shapes)
    _check_operands(node, shapes, dtypes, q, k, v)
    heads = int(node.attrs.get("heads", 0))
    dtype = dtypes[0]
    if heads:
        sa = int(node.attrs.get("seq_axis", 0))
        n, lq, s = q[1 - sa], q[sa], k[sa]
        if q[-1] % heads or v[-1] % heads:
            raise ValueError(f"feature sizes {q[-1]}, {v[-1]} are not divisible by {heads} heads")
        result = [(q[:-1] + (v[-1],), dtype)]
        _check_masks(node, masks, (n, heads, lq, s))
        weights = node.attrs.get("weights", "none")
        if weights == "mean":
            result.append(((n, lq, s), dtype))
        elif weights == "heads":
            result.append(((n, heads, lq, s), dtype))
        return result
    if int(node.attrs.get("gqa", 0)):
        if len(q) < 3 or len(k) < 3 or k[-3] != v[-3] or q[-3] % k[-3]:
            raise ValueError(f"grouped-query attention needs q heads {q} to be a multiple of kv heads {k}")
        k = k[:-3] + (q[-3],) + k[-2:]
        v = v[:-3] + (q[-3],) + v[-2:]
    batch = np.broadcast_shapes(q[:-2], k[:-2], v[:-2])
    _check_masks(node, masks, tuple(batch) + (q[-2], k[-2]))
    return [(tuple(batch) + (q[-2], v[-1]), dtype)]


def _split_heads(a, heads, seq_axis):
    """[L, N, H*d] or [N, L, H*d] -> a [N, H, L, d] view (no copy)."""
    v = _split_last(a, heads)
    return v.transpose(1, 2, 0, 3) if seq_axis == 0 else v.transpose(0, 2, 1, 3)


def _split_last(a, heads):
    """Split the last axis of a (possibly sliced) array into (heads, d) as a view."""
    d = a.shape[-1] // heads
    st = a.strides
    return np.lib.stride_tricks.as_strided(
        a, a.shape[:-1] + (heads, d), st[:-1] + (d * st[-1], st[-1]), writeable=a.flags.writeable
    )


def _split_axis(a, axis, parts):
    """`a` with axis `axis` split into `parts` (p0, p1): always a view."""
    axis %= a.ndim
    st = a.strides
    shape = a.shape[:axis] + tuple(parts) + a.shape[axis + 1 :]
    strides = st[:axis] + (parts[1] * st[axis], st[axis]) + st[axis + 1 :]
    return np.lib.stride_tricks.as_strided(a, shape, strides, writeable=a.flags.writeable)


def _group_heads(q, k, v, out, masks):
    """Views for grouped-query attention: q/out [..., Hkv, g, L, *], k/v [..., Hkv, 1, S, *],
    head-indexed masks split the same way, others get a broadcast group axis."""
    hq, hkv = q.shape[-3], k.shape[-3]
    parts = (hkv, hq // hkv)
    grouped = []
    for m in masks:
        if m.ndim >= 3 and m.shape[-3] == hq and hq > 1:
            m = _split_axis(m, -3, parts)
        elif m.ndim >= 3:
            m = m[..., None, :, :]
        grouped.append(m)
    return (
        _split_axis(q, -3, parts),
        k[..., None, :, :],
        v[..., None, :, :],
        _split_axis(out, -3, parts),
        tuple(grouped),
    )


def _viewed(a, shape):
    """`a` as `shape` without a copy, or a buffer plus the run-time step filling it."""
    try:
        return view_as(a, shape), None
    except AttributeError:
        buf = np.empty(shape, a.dtype)
        return buf, lambda: np.copyto(buf, a.reshape(shape))


# Scores are computed in slices of the leading batch axis so the shared scratch stays
# near this size however long the sequence.
SCRATCH_ELEMENTS = 1 << 20


class _Block(Record):
    """The arrays one block of attention reads and writes: views of the node's operands,
    of the scores scratch and of the outputs."""

    __slots__ = ("q", "q_scaled", "kt", "v", "out", "scores", "row_max", "row_sum", "masks", "weights")

    def __init__(self, q, q_scaled, kt, v, out, scores, row_max, row_sum, masks, weights):
        self.q = q  # [..., L, E]
        self.q_scaled = q_scaled  # scratch for q * scale; None when the scale is 1
        self.kt = kt  # k transposed, [..., E, S]
        self.v = v  # [..., S, Ev]
        self.out = out  # [..., L, Ev]
        self.scores = scores  # [..., L, S]
        self.row_max = row_max  # [..., L, 1]
        self.row_sum = row_sum  # [..., L, 1]
        self.masks = masks  # ((mask broadcasting against the scores, mode), ...)
        self.weights = weights  # the attention-weights output, if any


def _thread_axis(b, mean_weights):
    """The axis of the scores (counted from the end) along which block `b` is shared out
    to the threads: its first batch axis longer than 1 (heads, usually), where k and v
    are cut too, so no thread packs the other's share for BLAS; else the query rows,
    where every thread reads all of k and v. Averaged weights are a sum over the heads,
    so they keep the rows."""
    if not mean_weights:
        for i, d in enumerate(b.scores.shape[:-2]):
            if d > 1:
                return i - b.scores.ndim
    return -2


def _block_part(b, axis, lo, hi):
    """Block `b` restricted to lo:hi along `axis` of its scores (see `_thread_axis`);
    operands that broadcast along it are used whole."""

    def cut(a):
        return along(a, axis, lo, hi)

    # query rows: k and v are whole (their axis -2 is not the query axis)
    kt, v = (b.kt, b.v) if axis == -2 else (cut(b.kt), cut(b.v))
    masks = tuple((cut(m), mode) for m, mode in b.masks)
    return _Block(
        cut(b.q),
        cut(b.q_scaled),
        kt,
        v,
        cut(b.out),
        cut(b.scores),
        cut(b.row_max),
        cut(b.row_sum),
        masks,
        cut(b.weights),
    )


def _over_threads(ctx, b, attend, mean_weights):
    """attend(part of block b) for each thread's share, when the block is big enough to
    pay for the dispatch, where BLAS runs on one thread (ctx.gemm_threads): then
    this is how both GEMMs and the softmax between them get the other cores."""
    axis = _thread_axis(b, mean_weights)
    parts = ctx.gemm_threads if ctx.worth_splitting(b.scores.size) else 1
    return ctx.split([attend(_block_part(b, axis, lo, hi)) for lo, hi in parallel.ranges(b.scores.shape[axis], parts)])


def _attend(b, scale, safe, weights, heads, ones):
    """The steps of one block: q * scale (L*E multiplies where scaling the scores would
    take L*S), QK^T, masks, softmax, PV, then the division by the softmax row sums or the
    weights output."""
    q = b.q
    steps = []
    if b.q_scaled is not None:
        steps.append(lambda: np.multiply(b.q, scale, out=b.q_scaled))
        q = b.q_scaled
    steps.append(blas.matmul(q, b.kt, b.scores))
    steps += [_mask_step(m, mode, b.scores) for m, mode in b.masks]
    normalize = weights != "none"
    steps.append(_softmax_step(b.scores, b.row_max, b.row_sum, ones, safe, normalize))
    steps.append(blas.matmul(b.scores, b.v, b.out))
    if weights == "none":
        steps.append(lambda: np.divide(b.out, b.row_sum, out=b.out))
    elif weights == "mean":
        inv = 1.0 / heads
        steps.append(lambda: (np.sum(b.scores, axis=1, out=b.weights), np.multiply(b.weights, inv, out=b.weights)))
    else:
        steps.append(lambda: np.copyto(b.weights, b.scores))
    return chain(*steps)


def _mask_step(mask, mode, scores):
    if mode == "add":
        return lambda: np.add(scores, mask, out=scores)
    if mode == "drop":
        return lambda: np.copyto(scores, -np.inf, where=mask)
    raise ValueError(f"unknown mask mode {mode!r}")


def _softmax_step(scores, row_max, row_sum, ones, safe, normalize):
    """exp(scores - row max) in place and its row sums; the rows are divided by their
    sums only when `normalize` (the weights are an output). Otherwise the PV product is
    divided instead, which has Ev columns where the scores have S. The row sums are a
    (batched) GEMV with `ones` [S, 1], measured faster than np.sum on ViT-B/16's
    [12, 197, 197] scores on one core (docs/performance.md, "Kernel measurements")."""
    lowest, tiny = np.finfo(scores.dtype).min, np.finfo(scores.dtype).tiny
    sum_rows = blas.matmul(scores, ones, row_sum)

    def softmax():
        np.max(scores, axis=-1, keepdims=True, out=row_max)
        if safe:  # a fully masked row: exp(-inf - lowest) = 0 and 0 / tiny = 0
            np.maximum(row_max, lowest, out=row_max)
        np.subtract(scores, row_max, out=scores)
        np.exp(scores, out=scores)
        sum_rows()
        if safe:
            np.maximum(row_sum, tiny, out=row_sum)
        if normalize:
            np.divide(scores, row_sum, out=scores)

    return softmax


def _views(attrs, inputs, out):
    """(qh, kh, vh, oh, masks): q/k/v/output as [..., L|S, d] arrays (views, no copies)."""
    packed = attrs.get("packed", "")
    if packed == "qkv":
        e = inputs[0].shape[-1] // 3
        q, k, v = inputs[0][..., :e], inputs[0][..., e : 2 * e], inputs[0][..., 2 * e :]
        masks = inputs[1:]
    elif packed == "kv":
        e = inputs[1].shape[-1] // 2
        q, k, v = inputs[0], inputs[1][..., :e], inputs[1][..., e:]
        masks = inputs[2:]
    else:
        q, k, v = inputs[0], inputs[1], inputs[2]
        masks = inputs[3:]
    heads = int(attrs.get("heads", 0))
    if heads:
        sa = int(attrs.get("seq_axis", 0))
        return tuple(_split_heads(a, heads, sa) for a in (q, k, v, out)) + (masks,)
    if int(attrs.get("gqa", 0)):
        return _group_heads(q, k, v, out, masks)
    return q, k, v, out, masks


def _prepare_masks(attrs, masks, full, dt):
    """(steps run once per call, [(mask broadcasting against the scores `full`, mode)])."""
    heads = int(attrs.get("heads", 0))
    lq, s = full[-2], full[-1]
    modes = tuple(attrs.get("masks", ()))
    if len(modes) != len(masks):
        raise ValueError(f"{len(masks)} mask inputs but masks={modes!r}")
    pre, adds = [], []
    if int(attrs.get("causal", 0)):
        adds.append((np.where(np.triu(np.ones((lq, s), bool), 1), -np.inf, 0).astype(dt), "add"))
    roles = tuple(attrs.get("mask_roles", ())) or ("attn",) * len(masks)
    for m, mode, role in zip(masks, modes, roles):
        if (
            heads
            and role == "attn"
            and m.ndim == 3
            and int(attrs.get("tile_masks", 0))
            and m.shape[0] != full[0] * heads
        ):
            # a constant [N*H, L, S] mask traced at batch 1: torch repeated it per batch
            m = np.tile(m, (full[0] * heads // m.shape[0], 1, 1))
        if heads and (role == "key_padding" or m.ndim == 3):
            n = full[0]
            m, copy = _viewed(m, (n, 1, 1, m.shape[-1]) if role == "key_padding" else (n, heads) + m.shape[1:])
            pre += [copy] if copy is not None else []
        if mode == "keep":  # one logical_not of the mask, then it is a "drop" mask
            blocked = np.empty(m.shape, bool)
            pre.append(lambda m=m, blocked=blocked: np.logical_not(m, out=blocked))
            m, mode = blocked, "drop"
        adds.append((m, mode))
    return pre, adds


def _layout(attrs, inputs, out):
    """(q, k, v, output views and masks; full scores shape; rows of its axis 0 per slice;
    the slice's shape): the geometry make() and the scratch rule share."""
    views = _views(attrs, inputs, out)
    qh, kh, vh = views[:3]
    # v's batch dims count: a v batched where q and k broadcast needs each batch's scores
    batch = np.broadcast_shapes(qh.shape[:-2], kh.shape[:-2], vh.shape[:-2])
    full = tuple(batch) + (qh.shape[-2], kh.shape[-2])
    if len(full) == 2:
        return views, full, 1, full
    chunk = max(1, min(full[0], SCRATCH_ELEMENTS // max(math.prod(full[1:]), 1)))
    return views, full, chunk, (chunk,) + full[1:]


def _scratch_requests(q_shape, slab, dtype, scale):
    """Scores of one slice, their row maxima and row sums, and q times the scale unless
    the scale is 1."""
    rows = slab[:-1] + (1,)
    scaled_q = [(q_shape, dtype)] if scale != 1.0 else []
    return [(slab, dtype), (rows, dtype), (rows, dtype)] + scaled_q


def attention_scratch(node, inputs, outputs, ctx):
    views, _, _, slab = _layout(node.attrs, inputs, outputs[0])
    scale = float(node.attrs.get("scale", 1.0))
    return scratch_nbytes(*_scratch_requests(views[0].shape, slab, outputs[0].dtype, scale))


def _attention_rows(node, ranks, batched):
    """Batch first: [N, L, E] with heads, or a batch dim before [L, E] without, on every
    batched operand (keys of rank 2 that are the batch make it the key sequence)."""
    if int(node.attrs.get("heads", 0)):
        return int(node.attrs.get("seq_axis", 0)) == 1
    return all(r is not None and r >= 3 for r, b in zip(ranks, batched) if b)


@register(
    "attention",
    infer=attention_infer,
    scratch=attention_scratch,
    attrs=ATTENTION_ATTRS,
    float_input=True,
    rows=_attention_rows,
)
def make_attention(node, inputs, outputs, ctx):
    attrs = node.attrs
    out = outputs[0]
    (qh, kh, vh, oh, masks), full, chunk, slab = _layout(attrs, inputs, out)
    dt = out.dtype
    scale = float(attrs.get("scale", 1.0))
    pre, adds = _prepare_masks(attrs, masks, full, dt)
    safe = attrs.get("masked_rows", "nan") == "zero" and bool(adds)
    weights = attrs.get("weights", "none")
    w = outputs[1] if weights != "none" else None
    requests = _scratch_requests(qh.shape, slab, dt, scale)
    buf, max_buf, sum_buf, *scaled = (ctx.scratch_array(shape, dtype) for shape, dtype in requests)
    whole = _Block(
        qh, scaled[0] if scaled else None, np.swapaxes(kh, -1, -2), vh, oh, buf, max_buf, sum_buf, tuple(adds), w
    )
    ones = np.ones((full[-1], 1), dt)

    def attend(block):
        return _attend(block, scale, safe, weights, int(attrs.get("heads", 0)), ones)

    mean_weights = weights == "mean"
    nd = len(full)
    if nd == 2:
        steps = pre + [_over_threads(ctx, whole, attend, mean_weights)]
    else:
        steps = list(pre)
        for r0 in range(0, full[0], chunk):
            block = _slice(whole, nd, r0, min(full[0], r0 + chunk))
            steps.append(_over_threads(ctx, block, attend, mean_weights))
    return chain(*steps)


def _slice(b, nd, r0, r1):
    """Block `b` restricted to rows r0:r1 of the scores' axis 0 (`nd` dims), as
    `_block_part` cuts it, but with its scores in the first r1 - r0 rows of the scratch
    slab and the weights output cut along its own axis 0 (N, when the weights are
    averaged over the heads)."""
    n = r1 - r0
    weights = None if b.weights is None else along(b.weights, -b.weights.ndim, r0, r1)
    return _block_part(b, -nd, r0, r1).replace(
        scores=b.scores[:n], row_max=b.row_max[:n], row_sum=b.row_sum[:n], weights=weights
    )
