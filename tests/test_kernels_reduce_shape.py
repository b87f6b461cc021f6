"""Property tests for the reduction and shape/indexing kernel families against torch:
reductions over random dims with and without keepdim (values and int64 index outputs),
softmax on any dim, roll/flip/expand/tile/take/gather/cast/slice/transpose/concat/split."""

import itertools

import numpy as np
import pytest
import torch
from helpers import bind_context, rel_error, run_kernel
from hypothesis import given
from hypothesis import strategies as st

TOL = 1e-5


@st.composite
def shapes(draw, min_rank=1, max_rank=4):
    rank = draw(st.integers(min_rank, max_rank))
    batch = draw(st.integers(1, 4))
    return (batch,) + tuple(draw(st.integers(1, 5)) for _ in range(rank - 1))


@st.composite
def floats(draw, shape=None, scale=3.0, zeros=True):
    """float32 data with negatives and (unless zeros=False) exact zeros."""
    shape = shape if shape is not None else draw(shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.asarray(rng.standard_normal(shape) * scale, np.float32)
    if zeros:
        x[rng.random(shape) < 0.15] = 0
    return x


@st.composite
def axes_of(draw, rank):
    return tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank))))


def close(got, want, tol=TOL, scale=None):
    """Exact for integers and bools; floats within tol of max|want| (or of `scale`: a float32
    sum can only be as exact as eps * sum|x|, however small the sum itself is)."""
    want = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} != torch {want.shape}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != torch {want.dtype}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        if scale is None:
            err = rel_error(got[ok], want[ok])
        else:
            err = float(np.abs(got[ok].astype(np.float64) - want[ok]).max(initial=0) / scale)
        assert err <= tol, f"rel error {err:.3g}"


# --- reductions -------------------------------------------------------------------------

_REDUCE = {
    "reduce_sum": lambda t, d, k: torch.sum(t, d, keepdim=k),
    "reduce_mean": lambda t, d, k: torch.mean(t, d, keepdim=k),
    "reduce_max": lambda t, d, k: torch.amax(t, d, keepdim=k),
    "reduce_min": lambda t, d, k: torch.amin(t, d, keepdim=k),
    "reduce_prod": lambda t, d, k: torch.prod(t, d[0], keepdim=k) if len(d) == 1 else None,
    "reduce_logsumexp": lambda t, d, k: torch.logsumexp(t, d, keepdim=k),
}


@pytest.mark.parametrize("op", sorted(_REDUCE))
@given(x=floats(), data=st.data(), keep=st.booleans())
def test_reduce(op, x, data, keep):
    axes = data.draw(axes_of(x.ndim))
    if op == "reduce_prod":
        axes = axes[:1]
    (got,) = run_kernel(op, [x], dict(axes=axes, keepdim=keep))
    want = _REDUCE[op](torch.from_numpy(x).double(), axes, keep)
    scale = None
    if op in ("reduce_sum", "reduce_mean"):  # conditioning of a sum: relative to sum|x|
        scale = max(float(_REDUCE[op](torch.from_numpy(np.abs(x)).double(), axes, keep).max()), 1e-30)
    close(got, want.float(), scale=scale)


@given(x=floats(), data=st.data(), keep=st.booleans())
def test_reduce_all_axes_and_int_sum(x, data, keep):
    (got,) = run_kernel("reduce_sum", [x], dict(axes=(), keepdim=False))
    close(got, torch.sum(torch.from_numpy(x).double()).float(), scale=max(float(np.abs(x).sum()), 1e-30))
    m = x > 0
    axes = data.draw(axes_of(x.ndim))
    (got,) = run_kernel("reduce_sum", [m], dict(axes=axes, keepdim=keep))
    close(got, torch.sum(torch.from_numpy(m), axes, keepdim=keep))  # bool -> int64 counts


@pytest.mark.parametrize("op", ["argmax", "argmin"])
@given(x=floats(zeros=False), data=st.data(), keep=st.booleans())
def test_argmax_argmin(op, x, data, keep):
    axis = data.draw(st.integers(0, x.ndim - 1))
    (got,) = run_kernel(op, [x], dict(axis=axis, keepdim=keep))
    close(got, getattr(torch, op)(torch.from_numpy(x), axis, keepdim=keep))


@pytest.mark.parametrize("which", ["max", "min"])
@given(x=floats(zeros=False), data=st.data(), keep=st.booleans())
def test_max_min_with_dim_values_and_indices(which, x, data, keep):
    axis = data.draw(st.integers(0, x.ndim - 1))
    values, indices = getattr(torch, which)(torch.from_numpy(x), axis, keepdim=keep)
    (got_v,) = run_kernel(f"reduce_{which}", [x], dict(axes=(axis,), keepdim=keep))
    (got_i,) = run_kernel(f"arg{which}", [x], dict(axis=axis, keepdim=keep))
    close(got_v, values)
    close(got_i, indices)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("op", ["reduce_var", "reduce_std"])
@given(x=floats(), data=st.data(), keep=st.booleans(), correction=st.sampled_from([0, 1, 2]))
def test_var_std(op, x, data, keep, correction):
    axes = data.draw(axes_of(x.ndim))
    fn = torch.var if op == "reduce_var" else torch.std
    want = fn(torch.from_numpy(x).double(), axes, keepdim=keep, correction=correction).float()
    (got,) = run_kernel(op, [x], dict(axes=axes, keepdim=keep, correction=float(correction)))
    # torch gives inf or nan where the divisor N - correction is <= 0; compare finite ones
    finite = np.isfinite(want.numpy())
    assert got.shape == tuple(want.shape)
    close(got[finite], want.numpy()[finite])
    assert not np.isfinite(got[~finite]).any()


@given(x=floats(), data=st.data(), keep=st.booleans(), p=st.sampled_from([1.0, 2.0, 3.0, 0.5, float("inf"), 0.0]))
def test_norm(x, data, keep, p):
    axes = data.draw(axes_of(x.ndim))
    (got,) = run_kernel("reduce_norm", [x], dict(axes=axes, keepdim=keep, p=p))
    want = torch.linalg.vector_norm(torch.from_numpy(x).double(), p, axes, keepdim=keep).float()
    close(got, want)


@given(x=floats(), data=st.data(), keep=st.booleans())
def test_logsumexp_with_minus_inf(x, data, keep):
    x = x.copy()
    x[x == 0] = -np.inf  # whole slices of -inf must give -inf, not nan
    axes = data.draw(axes_of(x.ndim))
    (got,) = run_kernel("reduce_logsumexp", [x], dict(axes=axes, keepdim=keep))
    want = torch.logsumexp(torch.from_numpy(x).double(), axes, keepdim=keep).float().numpy()
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    ok = np.isfinite(want)
    close(got[ok], want[ok])


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@given(x=floats(), data=st.data())
def test_softmax_any_dim(op, x, data):
    """On 1-3 threads with every split forced: the parts run along the longest other
    axis."""
    from unittest import mock

    from pmx.runtime import parallel

    axis = data.draw(st.integers(0, x.ndim - 1))
    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        (got,) = run_kernel(op, [x], dict(axis=axis), threads=data.draw(st.sampled_from([1, 2, 3])))
    close(got, getattr(torch, op)(torch.from_numpy(x).double(), axis).float())


# --- shape and indexing -----------------------------------------------------------------


@given(x=floats(), data=st.data())
def test_roll(x, data):
    axes = data.draw(axes_of(x.ndim))
    shifts = tuple(data.draw(st.integers(-7, 7)) for _ in axes)
    (got,) = run_kernel("roll", [x], dict(axes=axes, shifts=shifts))
    close(got, torch.roll(torch.from_numpy(x), shifts, axes))


@given(x=floats(), data=st.data())
def test_flip(x, data):
    axes = data.draw(axes_of(x.ndim))
    (got,) = run_kernel("flip", [x], dict(axes=axes))
    close(got, torch.flip(torch.from_numpy(x), axes))


@given(x=floats(), data=st.data())
def test_expand(x, data):
    src = x[tuple(slice(0, 1) if data.draw(st.booleans()) else slice(None) for _ in x.shape)]
    lead = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2)))
    shape = lead + x.shape
    # -1 keeps the input's size (torch's spelling)
    sizes = lead + tuple(-1 if s == d and data.draw(st.booleans()) else d for s, d in zip(src.shape, x.shape))
    (got,) = run_kernel("expand", [np.ascontiguousarray(src)], dict(shape=sizes))
    close(got, torch.from_numpy(np.ascontiguousarray(src)).expand(*shape))
    close(got, torch.from_numpy(np.ascontiguousarray(src)).expand(*sizes))


@given(x=floats(), data=st.data())
def test_tile_and_repeat(x, data):
    reps = tuple(data.draw(st.lists(st.integers(1, 3), min_size=x.ndim, max_size=x.ndim + 2)))
    (got,) = run_kernel("tile", [x], dict(reps=reps))
    close(got, torch.from_numpy(x).repeat(*reps))
    short = reps[len(reps) - 1 :]  # torch.tile pads the repeats with leading 1s
    (got,) = run_kernel("tile", [x], dict(reps=short))
    close(got, torch.tile(torch.from_numpy(x), short))


@given(x=floats(), data=st.data())
def test_take_index_select_and_embedding(x, data):
    axis = data.draw(st.integers(0, x.ndim - 1))
    n = x.shape[axis]
    idx_shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    idx = np.random.default_rng(data.draw(st.integers(0, 999))).integers(-n, n, idx_shape).astype(np.int64)
    (got,) = run_kernel("take", [x, idx], dict(axis=axis))
    tx = torch.from_numpy(x)
    want = tx[(slice(None),) * axis + (torch.from_numpy(idx),)]  # x[:, ..., ids] (negatives allowed)
    close(got, want)
    flat = idx.reshape(-1) % n
    (got,) = run_kernel("take", [x, flat], dict(axis=axis))
    close(got, torch.index_select(tx, axis, torch.from_numpy(flat)))


@given(x=floats(), data=st.data())
def test_gather(x, data):
    axis = data.draw(st.integers(0, x.ndim - 1))
    shape = tuple(
        data.draw(st.integers(1, d)) if i != axis else data.draw(st.integers(1, 6)) for i, d in enumerate(x.shape)
    )
    idx = np.random.default_rng(data.draw(st.integers(0, 999))).integers(0, x.shape[axis], shape).astype(np.int64)
    (got,) = run_kernel("gather", [x, idx], dict(axis=axis))
    close(got, torch.gather(torch.from_numpy(x), axis, torch.from_numpy(idx)))


@given(x=floats(scale=40.0), dtype=st.sampled_from(["int64", "int32", "bool", "float32", "uint8"]))
def test_cast(x, dtype):
    tx = torch.from_numpy(x)
    if dtype == "uint8":
        tx, x = tx.abs(), np.abs(x)
    (got,) = run_kernel("cast", [x], dict(dtype=dtype))
    close(got, tx.to(getattr(torch, dtype)))
    ints = got.astype(np.int64)
    (back,) = run_kernel("cast", [ints], dict(dtype="float32"))
    close(back, torch.from_numpy(ints).float())


@given(x=floats(), data=st.data())
def test_slice_and_select(x, data):
    axes = data.draw(axes_of(x.ndim))
    starts, ends, steps, index = [], [], [], [slice(None)] * x.ndim
    for a in axes:
        n = x.shape[a]
        s, e, p = data.draw(st.integers(-n - 1, n)), data.draw(st.integers(-n - 1, n + 2)), data.draw(st.integers(1, 3))
        starts.append(s), ends.append(e), steps.append(p)
        index[a] = slice(s, e, p)
    (got,) = run_kernel(
        "slice", [x], dict(axes=axes, starts=tuple(starts), ends=tuple(ends), steps=tuple(steps), squeeze=())
    )
    want = x[tuple(index)]  # python slicing clips like torch's
    close(got, want)
    a = axes[0]
    i = data.draw(st.integers(-x.shape[a], x.shape[a] - 1))
    (got,) = run_kernel(
        "slice", [x], dict(axes=(a,), starts=(i % x.shape[a],), ends=(i % x.shape[a] + 1,), steps=(1,), squeeze=(a,))
    )
    close(got, torch.from_numpy(x).select(a, i))


@given(shape=shapes(min_rank=2, max_rank=5), dtype=st.sampled_from([np.float32, np.float64]), data=st.data())
def test_transposes_trading_two_runs_of_axes_go_through_blas(shape, dtype, data):
    """A permutation that keeps the leading axes and trades two runs of the others
    (NCHW -> NHWC, NHWC -> NCHW, .T) is a batch of matrix transposes: BLAS's blocked
    transpose runs them on 1-3 threads and copies every value bit for bit (NaN, inf,
    -0.0, subnormals). Other permutations keep numpy's strided copy."""
    from unittest import mock

    from pmx.runtime import blas, parallel

    rank = len(shape)
    k = data.draw(st.integers(0, rank - 2))
    m = data.draw(st.integers(k + 1, rank - 1))
    perm = tuple(range(k)) + tuple(range(m, rank)) + tuple(range(k, m))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal(shape).astype(dtype)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, np.finfo(dtype).smallest_subnormal], dtype)
    x.flat[rng.integers(0, x.size, x.size // 2)] = rng.choice(specials, x.size // 2)
    made = []
    real = blas.transposed_copy
    with (
        mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1),
        mock.patch.object(blas, "transposed_copy", lambda s, d: made.append(real(s, d)) or made[-1]),
    ):
        (got,) = run_kernel("transpose", [x], dict(perm=perm), threads=data.draw(st.sampled_from([1, 2, 3])))
    assert made and all(c is not None for c in made), perm
    want = x.transpose(perm)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(f"u{got.itemsize}"), want[~nan].view(f"u{got.itemsize}"))


def test_only_batches_of_matrix_transposes_go_through_blas():
    """(batch, rows, cols) for permutations that keep leading axes and trade two runs of
    the rest; None for the others, which keep numpy's strided copy."""
    from unittest import mock

    from pmx.runtime import blas
    from pmx.runtime.kernels.shape import _matrix_swap

    shape = (2, 3, 4, 5)
    assert _matrix_swap(shape, (0, 2, 3, 1)) == (2, 3, 20)  # NCHW -> NHWC
    assert _matrix_swap(shape, (0, 3, 1, 2)) == (2, 12, 5)  # NHWC -> NCHW
    assert _matrix_swap(shape, (2, 3, 0, 1)) == (1, 6, 20)
    assert _matrix_swap((3, 4), (1, 0)) == (1, 3, 4)
    x = np.arange(120, dtype=np.float32).reshape(shape)
    # a BLAS without ?omatcopy (MKL, BLIS) leaves matrix transposes to numpy too
    with mock.patch.object(blas, "_entry_point", lambda routine: None):
        (got,) = run_kernel("transpose", [x], dict(perm=(0, 2, 3, 1)))
    np.testing.assert_array_equal(got, x.transpose(0, 2, 3, 1))
    for perm in [(0, 1, 2, 3), (1, 0, 2, 3), (0, 2, 1, 3), (3, 2, 1, 0), (0, 3, 2, 1), (2, 0, 3, 1)]:
        assert _matrix_swap(shape, perm) is None, perm
        with mock.patch.object(blas, "transposed_copy", lambda s, d, perm=perm: pytest.fail(f"BLAS for {perm}")):
            (got,) = run_kernel("transpose", [x], dict(perm=perm))
        np.testing.assert_array_equal(got, x.transpose(perm))


@given(x=floats(), data=st.data())
def test_transpose_concat_split(x, data):
    """Transposes split along their output's first axis with a part per thread: run on
    1-3 threads with every split forced."""
    from unittest import mock

    from pmx.runtime import parallel

    perm = tuple(data.draw(st.permutations(range(x.ndim))))
    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        (got,) = run_kernel("transpose", [x], dict(perm=perm), threads=data.draw(st.sampled_from([1, 2, 3])))
    np.testing.assert_array_equal(got, torch.from_numpy(x).permute(perm).numpy())
    axis = data.draw(st.integers(0, x.ndim - 1))
    y = data.draw(floats(x.shape[:axis] + (data.draw(st.integers(1, 3)),) + x.shape[axis + 1 :]))
    (got,) = run_kernel("concat", [x, y], dict(axis=axis))
    close(got, torch.cat([torch.from_numpy(x), torch.from_numpy(y)], axis))
    sizes = (x.shape[axis], y.shape[axis])
    parts = run_kernel("split", [got], dict(axis=axis, sizes=sizes))
    close(parts[0], x)
    close(parts[1], y)


@given(
    rank=st.integers(1, 4),
    n=st.integers(1, 12),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
)
def test_concat_shape_rule_matches_torch_cat(rank, n, data, dtype):
    """The concat shape rule (which the loader runs on every concat of a file) against
    torch.cat on empty tensors: output shape and dtype, and refusing what torch refuses
    (a differing dim, a differing rank). With broadcast=True, size-1 dims stretch: the
    oracle is torch.cat of the inputs expanded to the other inputs' size."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import output_shapes

    axis = data.draw(st.integers(-rank, rank - 1))
    base = [data.draw(st.integers(1, 4)) for _ in range(rank)]
    shapes = [
        tuple(data.draw(st.integers(0, 3)) if d == axis % rank else base[d] for d in range(rank)) for _ in range(n)
    ]
    fault = data.draw(st.sampled_from(["none", "dim", "rank", "ones"]))
    if fault == "dim" and rank > 1:
        i, d = (
            data.draw(st.integers(0, n - 1)),
            data.draw(st.sampled_from([d for d in range(rank) if d != axis % rank])),
        )
        shapes[i] = shapes[i][:d] + (shapes[i][d] + 1,) + shapes[i][d + 1 :]
    elif fault == "rank":
        i = data.draw(st.integers(0, n - 1))
        shapes[i] = shapes[i] + (1,)
    elif fault == "ones":  # some non-axis dims of some inputs become 1
        for i in data.draw(st.sets(st.integers(0, n - 1))):
            shapes[i] = tuple(
                1 if d != axis % rank and data.draw(st.booleans()) else s for d, s in enumerate(shapes[i])
            )
    broadcast = data.draw(st.booleans())
    tensors = [torch.empty(s, dtype=dtype) for s in shapes]
    if broadcast and len({len(s) for s in shapes}) == 1:
        target = [max(s[d] for s in shapes) for d in range(rank)]
        try:
            tensors = [t.expand(*[-1 if d == axis % rank else target[d] for d in range(rank)]) for t in tensors]
        except RuntimeError:
            pass  # two sizes above 1: torch.cat refuses below
    try:
        want = torch.cat(tensors, axis)
    except RuntimeError:
        want = None
    node = KernelNode("concat", dict(axis=axis, broadcast=True) if broadcast else dict(axis=axis))
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    if want is None:
        with pytest.raises(ValueError):
            output_shapes(node, shapes, [np_dtype] * n)
    else:
        assert output_shapes(node, shapes, [np_dtype] * n) == [(tuple(want.shape), np_dtype)]


@given(
    batch=st.integers(1, 3),
    groups=st.integers(1, 4),
    per_group=st.integers(1, 4),
    spatial=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel_shuffle_matches_torch(batch, groups, per_group, spatial, seed):
    """channel_shuffle on contiguous operands, and into a channel slice of a wider buffer
    (a concat slice: strided across images, the fallback copy)."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get

    shape = (batch, groups * per_group) + tuple(spatial)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    want = torch.nn.functional.channel_shuffle(torch.from_numpy(x.reshape(shape + (1,) * (3 - len(shape)))), groups)
    want = want.reshape(shape)
    (got,) = run_kernel("channel_shuffle", [x], dict(groups=groups))
    close(got, want)
    wide = np.full((batch, shape[1] + 2) + shape[2:], np.nan, np.float32)
    out = wide[:, 1:-1]
    get("channel_shuffle").make(KernelNode("channel_shuffle", dict(groups=groups)), [x], [out], bind_context())()
    close(out, want)
    assert np.isnan(wide[:, [0, -1]]).all(), "wrote outside its slice"


@given(
    batch=st.integers(1, 3),
    groups=st.integers(1, 4),
    per_group=st.integers(1, 5),
    spatial=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    cuts=st.lists(st.integers(0, 20), max_size=3),
    strided=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel_shuffle_into_split_parts_matches_torch(batch, groups, per_group, spatial, cuts, strided, seed):
    """channel_shuffle with attrs sizes (a shuffle fused with the split after it): each
    part equals torch's shuffle then split, for any cut points (parts that are not whole
    groups, empty parts), each part written into a channel slice of a wider buffer when
    `strided` (a concat slice) and nothing outside it."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get, output_shapes

    c = groups * per_group
    shape = (batch, c) + tuple(spatial)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    bounds = sorted({0, c} | {k % (c + 1) for k in cuts})
    sizes = tuple(b - a for a, b in itertools.pairwise(bounds)) or (c,)
    want = torch.nn.functional.channel_shuffle(torch.from_numpy(x.reshape(shape + (1,) * (3 - len(shape)))), groups)
    want = torch.split(want.reshape(shape), list(sizes), dim=1)
    node = KernelNode("channel_shuffle", dict(groups=groups, sizes=sizes))
    assert [s for s, _ in output_shapes(node, [shape], [np.float32])] == [tuple(w.shape) for w in want]
    wides = [np.full((batch, k + 2 * strided) + shape[2:], np.nan, np.float32) for k in sizes]
    outs = [w[:, 1:-1] if strided else w for w in wides]
    get("channel_shuffle").make(node, [x], outs, bind_context())()
    for got, w, wide in zip(outs, want, wides):
        close(got, w)
        if strided:
            assert np.isnan(wide[:, [0, -1]]).all(), "wrote outside its slice"


def test_channel_shuffle_sizes_must_split_the_channels():
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import output_shapes

    for sizes in ((3, 4), (), (8, -1, 1), (4.0, 4)):
        with pytest.raises(ValueError, match="must split the 8 channels"):
            output_shapes(KernelNode("channel_shuffle", dict(groups=2, sizes=sizes)), [(1, 8, 2, 2)], [np.float32])


def test_channel_shuffle_refuses_groups_that_do_not_divide():
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import output_shapes

    with pytest.raises(ValueError, match="must divide the channels"):
        output_shapes(KernelNode("channel_shuffle", dict(groups=3)), [(1, 8, 2, 2)], [np.float32])


def test_constant_inputs_fold_away():
    """Every op of these families on constant inputs becomes a constant (fold_constants runs
    the same kernels), so models whose shape/index arithmetic pnnx left unfolded lose it."""
    from pmx.compiler.ir import Graph, Node, Value
    from pmx.compiler.passes.fold_constants import fold_constants
    from pmx.compiler.passes.infer_shapes import infer_shapes
    from pmx.compiler.plan import PassContext

    rng = np.random.default_rng(0)
    w = Value("w", (5, 4), "float32", data=rng.standard_normal((5, 4)).astype(np.float32))
    ids = Value("ids", (3,), "int64", data=np.array([4, 0, 2], np.int64))
    gidx = Value("gidx", (5, 2), "int64", data=rng.integers(0, 4, (5, 2)).astype(np.int64))
    specs = [
        ("roll", [w], dict(axes=(0, 1), shifts=(1, 3)), lambda t: torch.roll(t, (1, 3), (0, 1))),
        ("flip", [w], dict(axes=(1,)), lambda t: torch.flip(t, [1])),
        ("expand", [w], dict(shape=(2, 5, 4)), lambda t: t.expand(2, 5, 4)),
        ("tile", [w], dict(reps=(2, 1)), lambda t: t.repeat(2, 1)),
        ("take", [w, ids], dict(axis=0), lambda t: t[torch.tensor([4, 0, 2])]),
        ("gather", [w, gidx], dict(axis=1), lambda t: torch.gather(t, 1, torch.from_numpy(gidx.data))),
        ("cast", [w], dict(dtype="int64"), lambda t: t.long()),
        ("reduce_std", [w], dict(axes=(0,), keepdim=False, correction=1.0), lambda t: t.std(0)),
        ("reduce_norm", [w], dict(axes=(1,), keepdim=True, p=2.0), lambda t: t.norm(dim=1, keepdim=True)),
        ("argmax", [w], dict(axis=1, keepdim=False), lambda t: t.argmax(1)),
        ("reduce_logsumexp", [w], dict(axes=(0, 1), keepdim=False), lambda t: torch.logsumexp(t, (0, 1))),
    ]
    graph = Graph("fold-test")
    outs = []
    for i, (op, ins, attrs, _) in enumerate(specs):
        out = Value(f"o{i}", None, None)  # shape and dtype come from the shape rules
        graph.add_node(Node(op, f"n{i}", ins, [out], attrs))
        outs.append(out)
    graph.outputs = outs
    infer_shapes(graph, PassContext())
    fold_constants(graph, PassContext())
    assert graph.nodes == []
    for out, (op, _, _, fn) in zip(outs, specs):
        assert out.is_constant, op
        close(np.asarray(out.data, dtype=out.dtype), fn(torch.from_numpy(w.data)))


@given(x=floats(), data=st.data())
def test_advanced_index_several_tensors(x, data):
    if x.ndim < 2:
        x = x.reshape(x.shape + (1,))
    axes = data.draw(axes_of(x.ndim).filter(lambda a: len(a) >= 2))
    rng = np.random.default_rng(data.draw(st.integers(0, 999)))
    shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    idx = []
    for a in axes:  # broadcastable index shapes, negatives allowed
        s = tuple(1 if data.draw(st.booleans()) else d for d in shape)
        idx.append(rng.integers(-x.shape[a], x.shape[a], s).astype(np.int64))
    (got,) = run_kernel("index", [x] + idx, dict(axes=axes))
    key = [slice(None)] * x.ndim
    for a, i in zip(axes, idx):
        key[a] = torch.from_numpy(i)
    close(got, torch.from_numpy(x)[tuple(key)])


def test_concat_skips_empty_vectors_as_torch_cat_does():
    a, empty = np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros(0, np.float32)
    for inputs in ([a, empty], [empty, a, empty, a]):
        (got,) = run_kernel("concat", inputs, dict(axis=0))
        np.testing.assert_array_equal(got, torch.cat([torch.from_numpy(x) for x in inputs], 0).numpy())
