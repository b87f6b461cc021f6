"""Property tests for the transformer kernels (norm, attention, linalg families), each run
directly through the registry (helpers.run_kernel) and compared with torch at 1e-5
relative error (max-normalized). Inputs are float32 with negatives and exact zeros."""

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import rel_error, run_kernel
from hypothesis import assume, example, given, reject, settings
from hypothesis import strategies as st

TOL = 1e-5
FAST = settings(max_examples=30, deadline=None)


def arr(seed, shape, scale=1.0, zeros=0.1):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    a[rng.random(shape) < zeros] = 0.0
    return a


def close(got, want, tol=TOL, scale=None):
    """max|got - want| / max|want| <= tol. `scale` (attention): an attention output is a
    convex combination of v's rows, so its rounding error is relative to max|v|, not to
    an output that cancelled to nearly zero; the error is then taken relative to the
    larger of the two."""
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    err = rel_error(got, want)
    if scale is not None and want.size:
        err = float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), scale, 1e-12))
    assert err <= tol, f"relative error {err:.3g} > {tol}"


def normalization_tol(x, rows, eps):
    """TOL, or the float32 limit of normalizing `x` as `rows` rows where that is larger:
    the row mean's rounding (a few units in the last place of max|x|) divided by
    sqrt(var + eps). Rows of nearly equal values far from zero cancel: for a group norm
    of [-2.011, -2.029], torch's own float32 result was 1.8e-5 off its float64 one (pmx:
    1.3e-5), over TOL; on well-conditioned rows this stays TOL."""
    r = x.astype(np.float64).reshape(rows, -1)
    if r.size == 0:
        return TOL
    amplification = (np.abs(r).max(axis=1) / np.sqrt(r.var(axis=1) + eps)).max()
    return max(TOL, 4 * np.finfo(np.float32).epsneg * amplification)


@contextlib.contextmanager
def scratch_limit(small):
    """Force the attention kernel to slice its scores buffer row by row."""
    from pmx.runtime.kernels import attention

    old = attention.SCRATCH_ELEMENTS
    attention.SCRATCH_ELEMENTS = 1 if small else old
    try:
        yield
    finally:
        attention.SCRATCH_ELEMENTS = old


T = torch.from_numpy


def D(a):
    return torch.from_numpy(a).double()


seeds = st.integers(0, 2**31 - 1)
dims = st.integers(1, 6)


# --- normalization ---------------------------------------------------------------------
# The reference is torch in float64: torch's float32 CPU group/instance norm takes the
# variance as E[x^2] - E[x]^2, which alone can be off by more than the tolerance.


@contextlib.contextmanager
def every_split():
    """Every kernel split however small (layer norm splits its rows), over the threads
    run_kernel is given."""
    from unittest import mock

    from pmx.runtime import parallel

    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        yield


@FAST
@given(
    seed=seeds,
    shape=st.lists(dims, min_size=1, max_size=4),
    data=st.data(),
    affine=st.sampled_from(["none", "weight", "both"]),
    eps=st.sampled_from([1e-5, 1e-6, 0.1]),
    n_threads=st.sampled_from([1, 2, 3]),
)
def test_layer_norm(seed, shape, data, affine, eps, n_threads):
    k = data.draw(st.integers(1, len(shape)))
    x = arr(seed, shape, scale=3.0) + 1.5
    norm_shape = tuple(shape[len(shape) - k :])
    w = arr(seed + 1, norm_shape) if affine != "none" else None
    b = arr(seed + 2, norm_shape) if affine == "both" else None
    ins = [x] + [a for a in (w, b) if a is not None]
    with every_split():
        got = run_kernel("layer_norm", ins, dict(axes=k, eps=eps), threads=n_threads)[0]
    want = F.layer_norm(D(x), norm_shape, D(w) if w is not None else None, D(b) if b is not None else None, eps)
    close(got, want, normalization_tol(x, math.prod(shape[: len(shape) - k]), eps))


@FAST
@given(
    seed=seeds,
    shape=st.lists(dims, min_size=1, max_size=4),
    weighted=st.booleans(),
    n_threads=st.sampled_from([1, 2, 3]),
)
def test_rms_norm(seed, shape, weighted, n_threads):
    x = arr(seed, shape)
    w = arr(seed + 1, shape[-1:]) if weighted else None
    with every_split():
        got = run_kernel(
            "layer_norm", [x] + ([w] if weighted else []), dict(axes=1, eps=1e-6, rms=1), threads=n_threads
        )[0]
    close(got, F.rms_norm(D(x), (shape[-1],), D(w) if weighted else None, 1e-6))


@FAST
@given(
    seed=seeds,
    n=st.integers(1, 4),
    groups=st.integers(1, 4),
    per_group=st.integers(1, 3),
    spatial=st.lists(dims, min_size=0, max_size=3),
    affine=st.booleans(),
    n_threads=st.sampled_from([1, 2, 3]),
)
@example(seed=0, n=1, groups=4, per_group=2, spatial=[3], affine=True, n_threads=3)  # one image, split by groups
@example(seed=8241013, n=1, groups=1, per_group=2, spatial=[], affine=False, n_threads=1)  # [-2.011, -2.029]: cancels
def test_group_norm(seed, n, groups, per_group, spatial, affine, n_threads):
    c = groups * per_group
    x = arr(seed, [n, c] + spatial, scale=2.0) - 0.7
    w, b = arr(seed + 1, (c,)), arr(seed + 2, (c,))
    assume(per_group * math.prod(spatial) > 1)  # torch refuses groups of a single value
    with every_split():  # one image: split by groups; more: by images
        got = run_kernel("group_norm", [x, w, b] if affine else [x], dict(groups=groups, eps=1e-5), threads=n_threads)[
            0
        ]
    close(
        got,
        F.group_norm(D(x), groups, D(w) if affine else None, D(b) if affine else None, 1e-5),
        normalization_tol(x, n * groups, 1e-5),
    )


@FAST
@given(
    seed=seeds, n=st.integers(1, 4), c=st.integers(1, 5), spatial=st.lists(st.integers(2, 6), min_size=1, max_size=3)
)
def test_instance_norm_as_group_norm(seed, n, c, spatial):
    x = arr(seed, [n, c] + spatial)
    w, b = arr(seed + 1, (c,)), arr(seed + 2, (c,))
    got = run_kernel("group_norm", [x, w, b], dict(groups=c, eps=1e-5))[0]
    close(got, F.instance_norm(D(x), weight=D(w), bias=D(b), eps=1e-5), normalization_tol(x, n * c, 1e-5))


@FAST
@given(
    seed=seeds,
    shape=st.lists(dims, min_size=1, max_size=4),
    data=st.data(),
    p=st.sampled_from([1.0, 2.0, 3.0, math.inf]),
)
def test_lp_normalize(seed, shape, data, p):
    axis = data.draw(st.integers(0, len(shape) - 1))
    x = arr(seed, shape, zeros=0.3)
    got = run_kernel("lp_normalize", [x], dict(axis=axis, p=p, eps=1e-12))[0]
    close(got, F.normalize(D(x), p=p, dim=axis, eps=1e-12))


@FAST
@given(seed=seeds, n=st.integers(1, 4), c=st.integers(1, 6), length=st.sampled_from([None, 1, 5]))
def test_batch_norm_1d(seed, n, c, length):
    shape = (n, c) if length is None else (n, c, length)
    x = arr(seed, shape)
    mean, var = arr(seed + 1, (c,)), np.abs(arr(seed + 2, (c,))) + 0.5
    w, b = arr(seed + 3, (c,)), arr(seed + 4, (c,))
    scale = (w / np.sqrt(var.astype(np.float64) + 1e-5)).astype(np.float32)
    shift = (b - mean * scale.astype(np.float64)).astype(np.float32)
    got = run_kernel("batch_norm", [x, scale, shift])[0]
    close(got, F.batch_norm(D(x), D(mean), D(var), D(w), D(b), False, 0.0, 1e-5))


# --- attention -------------------------------------------------------------------------


def _torch_masks(masks, modes):
    """Combine kernel-convention masks into one additive float mask for torch."""
    total = None
    for m, mode in zip(masks, modes):
        t = T(m)
        if mode == "add":
            add = t
        else:
            blocked = ~t if mode == "keep" else t
            add = torch.zeros(blocked.shape).masked_fill(blocked, -math.inf)
        total = add if total is None else total + add
    return total


@FAST
@given(
    seed=seeds,
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    lq=dims,
    s=dims,
    e=st.integers(1, 8),
    ev=st.integers(1, 8),
    mask=st.sampled_from(["none", "keep", "add", "causal"]),
    scale=st.sampled_from([None, 0.3]),
    broadcast_mask=st.booleans(),
    sliced=st.booleans(),
)
def test_sdpa(seed, batch, lq, s, e, ev, mask, scale, broadcast_mask, sliced):
    batch = tuple(batch)
    q, k, v = arr(seed, batch + (lq, e)), arr(seed + 1, batch + (s, e)), arr(seed + 2, batch + (s, ev))
    mshape = (lq, s) if broadcast_mask or not batch else batch[:-1] + (1, lq, s)
    masks, modes = [], ()
    kwargs = {}
    if mask == "keep":
        m = np.random.default_rng(seed).random(mshape) < 0.7  # rows may be fully masked: torch gives 0 there
        masks, modes = [m], ("keep",)
        kwargs["attn_mask"] = T(m)
    elif mask == "add":
        m = arr(seed + 3, mshape)
        masks, modes = [m], ("add",)
        kwargs["attn_mask"] = T(m)
    elif mask == "causal":
        kwargs["is_causal"] = True
    sc = scale if scale is not None else 1.0 / math.sqrt(e)
    attrs = dict(heads=0, scale=sc, causal=int(mask == "causal"), masks=modes, masked_rows="zero")
    with scratch_limit(sliced):
        got = run_kernel("attention", [q, k, v] + masks, attrs)[0]
    want = F.scaled_dot_product_attention(T(q), T(k), T(v), scale=scale, **kwargs)
    close(got, want, scale=float(np.abs(v).max()))


@FAST
@given(
    seed=seeds,
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    lq=dims,
    s=dims,
    e=st.integers(1, 6),
    mask=st.sampled_from(["none", "keep_heads", "add", "add_heads", "causal"]),
    sliced=st.booleans(),
)
def test_sdpa_grouped_query(seed, b, hkv, group, lq, s, e, mask, sliced):
    hq = hkv * group
    q, k, v = arr(seed, (b, hq, lq, e)), arr(seed + 1, (b, hkv, s, e)), arr(seed + 2, (b, hkv, s, e))
    masks, modes, kwargs = [], (), {}
    if mask == "keep_heads":
        m = np.random.default_rng(seed).random((b, hq, lq, s)) < 0.7
        masks, modes, kwargs = [m], ("keep",), dict(attn_mask=T(m))
    elif mask.startswith("add"):
        m = arr(seed + 3, (b, hq, lq, s) if mask == "add_heads" else (lq, s))
        masks, modes, kwargs = [m], ("add",), dict(attn_mask=T(m))
    elif mask == "causal":
        kwargs = dict(is_causal=True)
    attrs = dict(
        heads=0, scale=1.0 / math.sqrt(e), causal=int(mask == "causal"), masks=modes, masked_rows="zero", gqa=1
    )
    with scratch_limit(sliced):
        got = run_kernel("attention", [q, k, v] + masks, attrs)[0]
    want = F.scaled_dot_product_attention(T(q), T(k), T(v), enable_gqa=True, **kwargs)
    close(got, want, scale=float(np.abs(v).max()))


@FAST
@given(
    seed=seeds,
    n=st.integers(1, 4),
    lq=dims,
    s=dims,
    heads=st.integers(1, 3),
    d=st.integers(1, 4),
    seq_first=st.booleans(),
    packed=st.sampled_from(["", "kv", "qkv"]),
    weights=st.sampled_from(["none", "mean", "heads"]),
    masks=st.sampled_from([(), ("drop",), ("add",), ("drop", "drop"), ("add", "drop")]),
    attn3d=st.booleans(),
    sliced=st.booleans(),
)
def test_multihead_attention_core(seed, n, lq, s, heads, d, seq_first, packed, weights, masks, attn3d, sliced):
    e = heads * d
    if packed == "qkv":
        s = lq
    sa = 0 if seq_first else 1

    def layout(b, length, width):
        return (length, b, width) if seq_first else (b, length, width)

    q, k, v = arr(seed, layout(n, lq, e)), arr(seed + 1, layout(n, s, e)), arr(seed + 2, layout(n, s, e))
    if packed == "qkv":
        tensors = [np.concatenate([q, k, v], -1)]
    elif packed == "kv":
        tensors = [q, np.concatenate([k, v], -1)]
    else:
        tensors = [q, k, v]
    rng = np.random.default_rng(seed)
    mask_arrays = []
    for i, mode in enumerate(masks):
        # attn_mask [L, S] or [N*H, L, S], key_padding_mask [N, S]
        shape = ((n * heads, lq, s) if attn3d else (lq, s)) if i == 0 else (n, s)
        if mode == "drop":
            m = rng.random(shape) < 0.3
            m[..., 0] = False  # no fully masked rows (NaN in torch and here)
        else:
            m = arr(seed + 10 + i, shape)
        mask_arrays.append(m)
    roles = ("attn", "key_padding")[: len(masks)]
    attrs = dict(
        heads=heads,
        seq_axis=sa,
        scale=1.0 / math.sqrt(d),
        masks=masks,
        mask_roles=roles,
        weights=weights,
        masked_rows="nan",
    )
    if packed:
        attrs["packed"] = packed
    with scratch_limit(sliced):
        got = run_kernel("attention", tensors + mask_arrays, attrs)

    def split(a, length):
        a = T(a).transpose(0, 1) if seq_first else T(a)
        return a.reshape(n, length, heads, d).transpose(1, 2)

    qh, kh, vh = split(q, lq), split(k, s), split(v, s)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
    views = [(n, heads, lq, s) if attn3d else (lq, s), (n, 1, 1, s)]
    add = _torch_masks([m.reshape(views[i]) for i, m in enumerate(mask_arrays)], masks)
    if add is not None:
        scores = scores + add
    probs = scores.softmax(-1)
    out = (probs @ vh).transpose(1, 2).reshape(n, lq, e)
    if seq_first:
        out = out.transpose(0, 1)
    close(got[0], out, scale=float(np.abs(v).max()))
    if weights == "mean":
        close(got[1], probs.mean(1))
    elif weights == "heads":
        close(got[1], probs)


# --- linear algebra --------------------------------------------------------------------


@FAST
@given(
    seed=seeds,
    a_batch=st.lists(st.integers(1, 3), max_size=2),
    b_batch=st.lists(st.integers(1, 3), max_size=2),
    m=dims,
    k=dims,
    n=dims,
    a_vec=st.booleans(),
    b_vec=st.booleans(),
)
def test_matmul_broadcasting(seed, a_batch, b_batch, m, k, n, a_vec, b_vec):
    a_shape = (k,) if a_vec else tuple(a_batch) + (m, k)
    b_shape = (k,) if b_vec else tuple(b_batch) + (k, n)
    try:
        np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        reject()
    a, b = arr(seed, a_shape), arr(seed + 1, b_shape)
    close(run_kernel("matmul", [a, b])[0], torch.matmul(T(a), T(b)))


EINSUMS = [
    "bhid,bhjd->bhij",
    "bhij,bhjd->bhid",
    "bij,bjk->bik",
    "bchw,bkc->bkhw",
    "ij->ji",
    "ii->i",
    "bij->b",
    "i,j->ij",
    "...ij,...jk->...ik",
    "bik,bjk",
    "ijk,jl,lk->i",
    "bhcid,bhcjd->bhcij",
    "bhjd,bhid->bhij",
    "bhid,bhdj->bhji",
    "bhid,bhjd->hbij",
]
# the batched matmuls among them (linalg._batched_matmul_axes), which run through gemm
BATCHED_MATMULS = {
    "bhid,bhjd->bhij",
    "bhij,bhjd->bhid",
    "bij,bjk->bik",
    "...ij,...jk->...ik",
    "bhcid,bhcjd->bhcij",
    "bhjd,bhid->bhij",
    "bhid,bhdj->bhji",
    "bhid,bhjd->hbij",
}


@FAST
@given(
    seed=seeds,
    eq=st.sampled_from(EINSUMS),
    sizes=st.lists(st.integers(1, 4), min_size=12, max_size=12),
    ellipsis=st.lists(st.integers(1, 3), max_size=2),
)
def test_einsum(seed, eq, sizes, ellipsis):
    lhs = eq.split("->")[0].split(",")
    size = {c: sizes[i] for i, c in enumerate("bhijdkcwl")}
    size["j"] = size["i"] if "ii" in eq else size["j"]
    shapes = []
    for term in lhs:
        shape = tuple(ellipsis) if "..." in term else ()
        shapes.append(shape + tuple(size[c] for c in term.replace("...", "")))
    ops = [arr(seed + i, s) for i, s in enumerate(shapes)]
    from unittest import mock

    from pmx.runtime.kernels import linalg

    products = []
    real_gemm = linalg.gemm
    from pmx.runtime.kernels import common

    # every product split over two threads, along a batch axis or out's rows or columns
    with (
        mock.patch.object(common, "gemm_split_minimum", lambda v: 0),
        mock.patch.object(common, "GEMM_SPLIT_MIN_ROWS", 1),
        mock.patch.object(common, "GEMM_SPLIT_MIN_COLUMNS", 1),
        mock.patch.object(linalg, "gemm", lambda *a, **k: products.append(a) or real_gemm(*a, threads=2)),
    ):
        got = run_kernel("einsum", ops, dict(equation=eq), threads=2)[0]
    close(got, torch.einsum(eq, *[T(o) for o in ops]))
    assert bool(products) == (eq in BATCHED_MATMULS), eq


@FAST
@given(
    seed=seeds,
    vocab=st.integers(1, 20),
    dim=st.integers(1, 8),
    ids_shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    dtype=st.sampled_from([np.int64, np.int32]),
)
def test_embedding(seed, vocab, dim, ids_shape, dtype):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, ids_shape).astype(dtype)
    w = arr(seed, (vocab, dim))
    got = run_kernel("embedding", [ids, w])[0]
    np.testing.assert_array_equal(got, F.embedding(T(ids.astype(np.int64)), T(w)).numpy())


@pytest.mark.parametrize("bad", [-1, 7])
def test_embedding_out_of_range_raises(bad):
    from pmx.runtime.errors import PmxInputError

    with pytest.raises(PmxInputError, match="out of range"):
        run_kernel("embedding", [np.array([[0, bad]]), arr(0, (7, 3))])


@pytest.mark.parametrize(
    "q_batch,k_batch,v_batch,lq,s",
    [
        ((1,), (1,), (3,), 5, 4),  # v alone carries the batch
        ((2, 1), (1, 1), (2, 3), 4, 6),  # batch dims broadcast from different operands
        ((1, 12), (1, 12), (2, 12), 197, 197),  # big enough for the per-head thread split
    ],
)
def test_sdpa_v_batch_dims_broadcast_by_q_and_k(q_batch, k_batch, v_batch, lq, s):
    """Every batch of the output is written when v has batch dims q and k broadcast over
    (only the first was, before the fix)."""
    e = ev = 8
    q, k, v = arr(1, q_batch + (lq, e)), arr(2, k_batch + (s, e)), arr(3, v_batch + (s, ev))
    attrs = dict(heads=0, scale=1.0 / math.sqrt(e), causal=0, masks=(), masked_rows="zero")
    got = run_kernel("attention", [q, k, v], attrs, threads=2)[0]
    want = F.scaled_dot_product_attention(T(q), T(k), T(v))
    assert got.shape == tuple(want.shape)
    close(got, want, scale=float(np.abs(v).max()))


@pytest.mark.parametrize("kind", ["linear_columns", "linear_rows", "matmul_batch", "matmul_broadcast_b"])
def test_gemms_split_over_threads(kind):
    """Products past common.GEMM_SPLIT_MIN_MACS run in parts on two threads (forced): by
    batch, by output columns or by rows, each part adding its slice of the bias and
    applying the activation."""
    from pmx.runtime.kernels import common

    if kind.startswith("linear"):
        rows, fin, fout = (197, 256, 1024) if kind == "linear_columns" else (4096, 256, 64)
        x, w, b = arr(1, (1, rows, fin)), arr(2, (fout, fin)), arr(3, (fout,))
        got = run_kernel("linear", [x, w, b], expr="maximum(@0,0)", threads=2)[0]
        want = F.relu(F.linear(T(x), T(w), T(b)))
    else:
        a = arr(1, (12, 197, 64))
        bm = arr(2, (12, 64, 197) if kind == "matmul_batch" else (64, 1024))
        got = run_kernel("matmul", [a, bm], threads=2)[0]
        want = torch.matmul(T(a), T(bm))
    assert got.size * (x.shape[-1] if kind.startswith("linear") else 64) >= common.GEMM_SPLIT_MIN_MACS
    close(got, want, scale=float(np.abs(want.numpy()).max()))
