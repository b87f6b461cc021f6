"""Indexing and shape ops pnnx writes: slice_copy, fill, index_put, reshape_as, t, diag,
cross, cumsum, cumprod, topk, masked_select, scatter_add, slice_scatter,
repeat_interleave, as_strided, arange, addcmul. Kernels against torch (hypothesis where
the op has parameters), then end-to-end through pnnx."""

import pathlib

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers import compare_with_torch, export_pnnx, run_kernel, torch_outputs
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from paramgraph import compile_lines

from pmx.runtime.errors import PmxCompileError, PmxInputError

shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5)


def _floats(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --- kernels -------------------------------------------------------------------------


@given(shape=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_cumsum_cumprod_match_torch(shape, data, seed):
    axis = data.draw(st.integers(0, len(shape) - 1))
    x = _floats(shape, seed) * 0.9
    for op, fn in (("cumsum", torch.cumsum), ("cumprod", torch.cumprod)):
        (got,) = run_kernel(op, [x], dict(axis=axis))
        np.testing.assert_allclose(got, fn(torch.from_numpy(x), axis).numpy(), rtol=1e-5, atol=1e-6)
    ints = np.random.default_rng(seed).integers(-5, 5, shape).astype(np.int32)
    (got,) = run_kernel("cumsum", [ints], dict(axis=axis, dtype="int64"))
    want = torch.cumsum(torch.from_numpy(ints), axis).numpy()
    assert got.dtype == want.dtype == np.int64
    np.testing.assert_array_equal(got, want)


@given(shape=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_topk_matches_torch_on_distinct_values(shape, data, seed):
    axis = data.draw(st.integers(0, len(shape) - 1))
    k = data.draw(st.integers(0, shape[axis]))
    largest = data.draw(st.booleans())
    dtype = data.draw(st.sampled_from([np.float32, np.int64]))
    n = int(np.prod(shape))
    x = np.random.default_rng(seed).permutation(n).reshape(shape).astype(dtype) - n // 2
    values, indices = run_kernel("topk", [x], dict(axis=axis, k=k, largest=largest, sorted=True))
    want = torch.topk(torch.from_numpy(x), k, dim=axis, largest=largest, sorted=True)
    np.testing.assert_array_equal(values, want.values.numpy())
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, want.indices.numpy())


@given(n=st.integers(1, 40), k=st.integers(0, 40), largest=st.booleans(), seed=st.integers(0, 2**16))
def test_topk_ties_values_match_and_indices_take_the_lowest_first(n, k, largest, seed):
    k = min(k, n)
    x = np.random.default_rng(seed).integers(0, 3, n).astype(np.float32)
    values, indices = run_kernel("topk", [x], dict(axis=0, k=k, largest=largest, sorted=True))
    want = torch.topk(torch.from_numpy(x), k, largest=largest, sorted=True)
    np.testing.assert_array_equal(values, want.values.numpy())
    np.testing.assert_array_equal(x[indices], values)
    # pmx's documented tie order (torch's depends on its selection algorithm)
    order = np.argsort(-x if largest else x, kind="stable")[:k]
    np.testing.assert_array_equal(indices, order)


def test_topk_nan_is_largest_as_in_torch():
    x = np.array([1.0, np.nan, 3.0, 2.0], np.float32)
    for largest in (True, False):
        values, indices = run_kernel("topk", [x], dict(axis=0, k=2, largest=largest, sorted=True))
        want = torch.topk(torch.from_numpy(x), 2, largest=largest)
        np.testing.assert_array_equal(values, want.values.numpy())
        np.testing.assert_array_equal(indices, want.indices.numpy())


@given(n=st.integers(1, 6), m=st.integers(1, 6), k=st.integers(-7, 7), vector=st.booleans(), seed=st.integers(0, 99))
def test_diag_matches_torch(n, m, k, vector, seed):
    x = _floats((n,) if vector else (n, m), seed)
    (got,) = run_kernel("diag", [x], dict(diagonal=k))
    np.testing.assert_array_equal(got, torch.diag(torch.from_numpy(x), k).numpy())


@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4), data=st.data(), seed=st.integers(0, 99))
def test_cross_matches_torch_with_broadcast(shape, data, seed):
    axis = data.draw(st.integers(0, len(shape) - 1))
    shape = shape[:axis] + (3,) + shape[axis + 1 :]
    b_shape = tuple(1 if data.draw(st.booleans()) and i != axis else d for i, d in enumerate(shape))
    a, b = _floats(shape, seed), _floats(b_shape, seed + 1)
    (got,) = run_kernel("cross", [a, b], dict(axis=axis))
    want = torch.linalg.cross(torch.from_numpy(a), torch.from_numpy(b), dim=axis).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@given(shape=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_scatter_add_matches_torch(shape, data, seed):
    axis = data.draw(st.integers(0, len(shape) - 1))
    ishape = tuple(data.draw(st.integers(1, d)) for d in shape)
    src_shape = tuple(d + data.draw(st.integers(0, 1)) for d in ishape)
    rng = np.random.default_rng(seed)
    x, src = _floats(shape, seed), _floats(src_shape, seed + 1)
    idx = rng.integers(-shape[axis], shape[axis], ishape)
    (got,) = run_kernel("scatter_add", [x, idx, src], dict(axis=axis))
    want = torch.scatter_add(torch.from_numpy(x), axis, torch.from_numpy(idx % shape[axis]), torch.from_numpy(src))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


@given(shape=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_index_put_matches_torch(shape, data, seed):
    rng = np.random.default_rng(seed)
    x = _floats(shape, seed)
    n_idx = data.draw(st.integers(1, len(shape)))
    axes = tuple(sorted(data.draw(st.permutations(range(len(shape))))[:n_idx]))
    count = data.draw(st.integers(0, 6))
    accumulate = data.draw(st.booleans())
    sizes = [shape[a] for a in axes]
    if accumulate:
        indices = [rng.integers(0, n, count) for n in sizes]
    else:  # torch leaves duplicate positions undefined without accumulate
        cells = rng.permutation(int(np.prod(sizes)))[:count]
        indices = [i.astype(np.int64) for i in np.unravel_index(cells, sizes)]
    # aten::index_put (what pnnx writes) with None for the whole dims
    key = [None] * (max(axes) + 1)
    for a, i in zip(axes, indices):
        key[a] = torch.from_numpy(i)
    picked_shape = torch.from_numpy(x)[tuple(slice(None) if k is None else k for k in key)].shape
    values = _floats(tuple(picked_shape), seed + 1)
    (got,) = run_kernel("index_put", [x, values] + indices, dict(axes=axes, accumulate=accumulate))
    want = torch.ops.aten.index_put(torch.from_numpy(x), key, torch.from_numpy(values), accumulate)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def test_index_put_boolean_mask_and_scalar_value():
    x = _floats((3, 4), 1)
    mask = x > 0
    (got,) = run_kernel("index_put", [x, None, mask], dict(axes=(0,), accumulate=False, value=2.5))
    want = torch.from_numpy(x.copy())
    want[torch.from_numpy(mask)] = 2.5
    np.testing.assert_array_equal(got, want.numpy())


@given(shape=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_slice_assign_matches_slice_scatter(shape, data, seed):
    axis = data.draw(st.integers(0, len(shape) - 1))
    n = shape[axis]
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    step = data.draw(st.integers(1, 3))
    x = _floats(shape, seed)
    part = tuple(len(range(start, end, step)) if d == axis else s for d, s in enumerate(shape))
    src = _floats(part, seed + 1)
    attrs = dict(axes=(axis,), starts=(start,), ends=(end,), steps=(step,), squeeze=())
    (got,) = run_kernel("slice_assign", [x, src], attrs)
    want = torch.slice_scatter(torch.from_numpy(x), torch.from_numpy(src), axis, start, end, step)
    np.testing.assert_array_equal(got, want.numpy())


@given(shape=shapes, data=st.data(), seed=st.integers(0, 99))
def test_repeat_interleave_matches_torch(shape, data, seed):
    axis = data.draw(st.integers(0, len(shape) - 1))
    r = data.draw(st.integers(0, 3))
    x = _floats(shape, seed)
    (got,) = run_kernel("repeat_interleave", [x], dict(axis=axis, repeats=r))
    np.testing.assert_array_equal(got, torch.repeat_interleave(torch.from_numpy(x), r, dim=axis).numpy())


@given(n=st.integers(1, 30), data=st.data(), seed=st.integers(0, 99))
def test_as_strided_matches_torch(n, data, seed):
    rank = data.draw(st.integers(1, 3))
    size = tuple(data.draw(st.integers(1, 4)) for _ in range(rank))
    stride = tuple(data.draw(st.integers(0, 4)) for _ in range(rank))
    reach = sum((a - 1) * b for a, b in zip(size, stride))
    if reach >= n:
        n = reach + 1
    offset = data.draw(st.integers(0, n - 1 - reach))
    x = _floats((n,), seed)
    (got,) = run_kernel("as_strided", [x], dict(size=size, stride=stride, offset=offset))
    np.testing.assert_array_equal(got, torch.as_strided(torch.from_numpy(x), size, stride, offset).numpy())


@given(shape=shapes, seed=st.integers(0, 99), value=st.floats(-10, 10, width=32))
def test_fill_matches_torch(shape, seed, value):
    x = _floats(shape, seed)
    (got,) = run_kernel("fill", [x], dict(value=value))
    np.testing.assert_array_equal(got, torch.from_numpy(x.copy()).fill_(value).numpy())
    (got,) = run_kernel("fill", [x, np.array([value], np.float32)])
    np.testing.assert_array_equal(got, torch.from_numpy(x.copy()).fill_(torch.tensor(value)).numpy())


@given(shape=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_masked_select_kernel_allocates_the_selected_elements(shape, data, seed):
    mshape = tuple(1 if data.draw(st.booleans()) else d for d in shape)
    x = _floats(shape, seed)
    mask = np.random.default_rng(seed).random(mshape) > 0.5
    (out,) = run_kernel("masked_select", [x, mask], dict(sized_at_run=True))
    want = torch.masked_select(torch.from_numpy(x), torch.from_numpy(mask)).numpy()
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(out, want)


# --- end to end through pnnx ---------------------------------------------------------


def _check(tmp_path, module, inputs, name="m"):
    prefix = _export(tmp_path / name, module, inputs)
    return compare_with_torch(prefix, module, inputs, tmp_path / f"{name}.pmx")


def _export(directory, module, inputs):
    """pnnx writes the .param and .bin, then imports the Python it generated; for aten::
    ops (addcmul, linalg_cross) that Python does not parse, which is pnnx's own problem."""
    try:
        return export_pnnx(directory, module, inputs)
    except SyntaxError:
        prefix = str(directory / "model")
        assert (directory / "model.pnnx.param").exists()
        return prefix


class SliceFillIndexPut(nn.Module):
    def forward(self, x, y, w):
        x = x.clone()
        y = y.clone()
        x[1:3, ::2] = x[0:2, 1::2] * 2
        x[:, 1] = 7.0
        y[:2].fill_(w[0])
        x = x.index_put((torch.tensor([0, 3]),), torch.tensor(5.0))
        x.index_put_((torch.tensor([1, 1, 2]), torch.tensor([0, 0, 4])), w[:3], accumulate=True)
        return x, y, torch.slice_scatter(y, x[:, :2], dim=1, start=1, end=5, step=2)


@pytest.mark.slow  # exports through pnnx
def test_e2e_slice_copy_fill_index_put_slice_scatter(tmp_path):
    _check(tmp_path, SliceFillIndexPut(), (torch.rand(4, 6), torch.rand(4, 6), torch.rand(4)))


class MaskAndListIndexPut(nn.Module):
    def forward(self, x, y):
        x = x.clone()
        x[x > 0.7] = 0.0
        x[:, torch.tensor([0, 2])] = y[:, :2]
        x[torch.tensor([1, 2]), 1:3] += 1
        return x, torch.topk(y.reshape(-1), 5)[1], torch.cumsum(y, -1, dtype=torch.float64)


@pytest.mark.slow  # exports through pnnx
def test_e2e_index_put_with_mask_none_entries_and_index_then_slice_copy(tmp_path):
    _check(tmp_path, MaskAndListIndexPut(), (torch.rand(4, 5), torch.rand(4, 3)))


class ShapeMath(nn.Module):
    def forward(self, x, y, a, b):
        out = [
            x.reshape_as(y),
            torch.t(x),
            torch.diag(x, 1),
            torch.diag(x[0], -2),
            torch.cumsum(x, 1),
            torch.cumprod(y, dim=0),
            torch.cumsum(x.long(), 0),
            torch.cross(a, b, dim=1),
            torch.linalg.cross(a, b),
            torch.repeat_interleave(x, 2),
            torch.repeat_interleave(x, 3, dim=1),
            torch.repeat_interleave(y, torch.tensor([1, 0, 3]), dim=0),
            torch.as_strided(x.reshape(-1) + 1, (3, 2), (2, 3)),
            torch.arange(5),
            torch.arange(2, 9),
            torch.arange(1, 2, 0.25),
            torch.arange(3, dtype=torch.float32),
            torch.arange(x.size(1)) * 2,
        ]
        return tuple(out)


@pytest.mark.slow  # exports through pnnx
def test_e2e_reshape_as_t_diag_cumulative_cross_repeat_as_strided_arange(tmp_path):
    _check(tmp_path, ShapeMath(), (torch.rand(4, 6), torch.rand(3, 8), torch.rand(5, 3), torch.rand(5, 3)))


class Addcmul(nn.Module):
    def forward(self, x, y, z):
        return torch.addcmul(x, y, z, value=0.5), x.addcmul(y, z), torch.addcmul(x, y, z[:1], value=-2)


@pytest.mark.slow  # exports through pnnx
def test_e2e_addcmul(tmp_path):
    _check(tmp_path, Addcmul(), (torch.rand(3, 5), torch.rand(3, 5), torch.rand(3, 5)))


class TopK(nn.Module):
    def forward(self, x, y):
        a, i = torch.topk(x, 3)
        b, j = torch.topk(y, k=2, dim=1, largest=False)
        return a, i, b, j


@pytest.mark.slow  # exports through pnnx
def test_e2e_topk_values_and_indices(tmp_path):
    x = torch.randperm(60).reshape(3, 4, 5).float()
    y = torch.randperm(60).reshape(3, 4, 5).float()
    _sess, got, _want = _check(tmp_path, TopK(), (x, y))
    assert got[1].dtype == np.int64


class TopKUnsorted(nn.Module):
    def forward(self, x, y, t):
        a, i = torch.topk(x, 4, sorted=False)
        b, j = torch.topk(y, k=5, dim=0, largest=False, sorted=False)
        c, m = torch.topk(t, 6, dim=1, sorted=False)
        return a, i, b, j, c, m


@pytest.mark.slow  # exports through pnnx
def test_e2e_topk_unsorted_gives_the_same_values_and_indices_as_a_set(tmp_path):
    """torch promises no order for sorted=False (on CPU its order is its selection
    algorithm's: sorted for k <= 2 or 64k <= n, mostly not otherwise), so torch's answer is
    compared as a set: pmx's values sorted along the axis equal torch's, pmx's indices are
    distinct, gather pmx's values from the input and, without ties, are torch's index set.
    pmx documents its own order: sorted, as with sorted=True."""
    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    module, gen = TopKUnsorted(), torch.Generator().manual_seed(7)
    x = torch.randperm(120, generator=gen).reshape(3, 4, 10).float()
    y = torch.randperm(60, generator=gen).reshape(10, 6).float() - 30
    t = torch.randint(0, 4, (5, 12), generator=gen).float()  # ties: which equal one is open too
    prefix = _export(tmp_path / "m", module, (x, y, t))
    out = str(tmp_path / "m.pmx")
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", out, verify=True)
    sess = InferenceSession(out, verify=True)
    got = sess.run(None, {a.name: v.numpy() for a, v in zip(sess.get_inputs(), (x, y, t))})
    want = torch_outputs(module, (x, y, t))
    cases = ((x, 4, 2, True), (y, 5, 0, False), (t, 6, 1, True))
    for n, (inp, k, axis, largest) in enumerate(cases):
        values, indices, want_values = got[2 * n], got[2 * n + 1], want[2 * n]
        assert values.shape == want_values.shape and indices.dtype == np.int64
        np.testing.assert_array_equal(np.sort(values, axis), np.sort(want_values, axis))
        np.testing.assert_array_equal(np.take_along_axis(inp.numpy(), indices, axis), values)
        assert (np.diff(np.sort(indices, axis), axis=axis) > 0).all()
        if inp is not t:  # distinct values: one index set is right
            np.testing.assert_array_equal(np.sort(indices, axis), np.sort(want[2 * n + 1], axis))
        ordered = torch.topk(inp, k, dim=axis, largest=largest, sorted=True).values.numpy()
        np.testing.assert_array_equal(values, ordered)


class MaskedSelect(nn.Module):
    def forward(self, x, y):
        return torch.masked_select(x, x > 0.5), y * 2, torch.masked_select(y, y < 0.2)


@pytest.mark.slow  # exports through pnnx
def test_e2e_masked_select_length_decided_at_run_time(tmp_path):
    module = MaskedSelect()
    x, y = torch.rand(2, 3, 4), torch.rand(5, 6)
    sess, _, _ = _check(tmp_path, module, (x, y))
    assert sess.get_outputs()[0].shape == [None]
    for seed in range(3):  # other data, same InferenceSession: other lengths
        g = torch.Generator().manual_seed(seed)
        x, y = torch.rand(2, 3, 4, generator=g), torch.rand(5, 6, generator=g)
        got = sess.run(None, {"in0": x.numpy(), "in1": y.numpy()})
        np.testing.assert_array_equal(got[0], torch.masked_select(x, x > 0.5).numpy())
        np.testing.assert_array_equal(got[1], (y * 2).numpy())
        np.testing.assert_array_equal(got[2], torch.masked_select(y, y < 0.2).numpy())
        (only,) = sess.run([sess.get_outputs()[2].name], {"in0": x.numpy(), "in1": y.numpy()})
        np.testing.assert_array_equal(only, got[2])
    x, y = torch.rand(4, 3, 4), torch.rand(7, 6)  # another batch: re-planned at the new bound
    got = sess.run(None, {"in0": x.numpy(), "in1": y.numpy()})
    np.testing.assert_array_equal(got[0], torch.masked_select(x, x > 0.5).numpy())
    np.testing.assert_array_equal(got[2], torch.masked_select(y, y < 0.2).numpy())


def test_masked_select_of_constants_computed_by_other_ops_stays_a_run_time_op(tmp_path):
    """pnnx folds such a subgraph itself; pmx's own folding (a weight -> gt ->
    masked_select, written here) must leave the run-sized op to run time."""
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    ops = [
        "pnnx.Input in 0 1 x #x=(2)f32",
        "pnnx.Attribute w 0 1 a @data=(3,4)f32 #a=(3,4)f32",
        "torch.gt gt 1 1 a m other=0.2 $input=a #a=(3,4)f32 #m=(3,4)bool",
        "torch.masked_select sel 2 1 a m s $input=a $mask=m #s=(12)f32",
        "pnnx.Expression add 1 1 x y expr=add(@0,1) #y=(2)f32",
        "pnnx.Output out 2 0 s y",
    ]
    sess = compile_lines(tmp_path, ops, {"w.data": w})
    got, _ = sess.run(None, {sess.get_inputs()[0].name: np.zeros(2, np.float32)})
    t = torch.from_numpy(w)
    np.testing.assert_array_equal(got, torch.masked_select(t, t > 0.2).numpy())


class MaskedSelectConsumed(nn.Module):
    def forward(self, x):
        return torch.exp(torch.masked_select(x, x > 0.5) * 2).to(torch.float64)


@pytest.fixture(scope="module")
def masked_select_consumed(tmp_path_factory):
    from pmx.runtime import InferenceSession

    tmp = tmp_path_factory.mktemp("masked_select_consumed")
    _check(tmp, MaskedSelectConsumed(), (torch.rand(2, 3),))
    return InferenceSession(str(tmp / "m.pmx"))


@settings(max_examples=25, deadline=None)
@given(x=hnp.arrays(np.float32, (2, 3), elements=st.floats(0, 1, width=32)))
def test_elementwise_ops_on_a_masked_select_follow_its_length_at_run(masked_select_consumed, x):
    (got,) = masked_select_consumed.run(None, {"in0": x})
    want = MaskedSelectConsumed()(torch.from_numpy(x)).numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


class MaskedSelectReshaped(nn.Module):
    def forward(self, x):
        return torch.masked_select(x, x > 0.5).reshape(-1, 1)


def test_a_shape_op_on_a_masked_select_is_refused_naming_the_reader(tmp_path):
    with pytest.raises(PmxCompileError, match=r"line \d+.*reads .*masked_select.*known only at run time"):
        _check(tmp_path, MaskedSelectReshaped(), (torch.tensor([[0.9, 0.1, 0.7, 0.8]]),))


class ArangeFromValues(nn.Module):
    """pnnx's upstream test_torch_arange: every bound read from tensor values."""

    def forward(self, x):
        return (
            torch.arange(x[0]),
            torch.arange(x[1], 33, dtype=None),
            torch.arange(x[3], x[4], x[6] * 0.1, dtype=torch.float),
        )


@pytest.fixture(scope="module")
def arange_from_values(tmp_path_factory):
    from pmx.runtime import InferenceSession

    tmp = tmp_path_factory.mktemp("arange_values")
    x = torch.tensor([5, 2, 0, 4, 8, 0, 3] + [0] * 9, dtype=torch.int32)
    _check(tmp, ArangeFromValues(), (x,))
    return InferenceSession(str(tmp / "m.pmx"))


def test_arange_with_bounds_from_values_is_sized_at_run_time(arange_from_values):
    sess = arange_from_values
    assert [o.shape for o in sess.get_outputs()] == [[None]] * 3
    assert [o.type for o in sess.get_outputs()] == ["tensor(int64)", "tensor(int64)", "tensor(float)"]


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.integers(0, 40), min_size=16, max_size=16))
def test_arange_with_bounds_from_values_matches_torch(arange_from_values, values):
    x = torch.tensor(values, dtype=torch.int32)
    try:
        want = ArangeFromValues()(x)
    except RuntimeError:  # bounds inconsistent with the step's sign: torch raises, so does pmx
        with pytest.raises(PmxInputError, match=r"torch.arange_\d+.*inconsistent with the step's sign"):
            arange_from_values.run(None, {"in0": x.numpy()})
        return
    got = arange_from_values.run(None, {"in0": x.numpy()})
    for g, w in zip(got, want):
        assert g.dtype == w.numpy().dtype and g.shape == tuple(w.shape)
        # torch's vectorized float arange adds the step in float32 within a SIMD chunk: 1 ulp apart
        np.testing.assert_allclose(g, w.numpy(), rtol=2e-7, atol=0)


class HannWindow(nn.Module):
    """A window of a length read from the input, as ONNX's HannWindow function body
    spells it: arange of a tensor bound, then elementwise math on its values."""

    def forward(self, n):
        k = torch.arange(n[0]).to(torch.float32)
        return 0.5 - 0.5 * torch.cos(2 * torch.pi * k / n[0].float()), k * 2 + 1


@pytest.fixture(scope="module")
def hann_window(tmp_path_factory):
    from pmx.runtime import InferenceSession

    tmp = tmp_path_factory.mktemp("hann_window")
    _check(tmp, HannWindow(), (torch.tensor([7, 1], dtype=torch.int32),))
    return InferenceSession(str(tmp / "m.pmx"))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300))
def test_elementwise_ops_on_an_arange_from_values_follow_its_length_at_run(hann_window, n):
    x = torch.tensor([n, 1], dtype=torch.int32)
    got = hann_window.run(None, {"in0": x.numpy()})
    for g, w in zip(got, HannWindow()(x)):
        assert g.dtype == w.numpy().dtype and g.shape == tuple(w.shape)
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-6)
    assert [o.shape for o in hann_window.get_outputs()] == [[None]] * 2


class ArangeFromValuesSummed(nn.Module):
    def forward(self, x):
        return torch.cumsum(torch.arange(x[0]) * 2, 0)


def test_a_non_elementwise_op_on_an_arange_from_values_is_refused_naming_both(tmp_path):
    with pytest.raises(PmxCompileError, match=r"cumsum.*line \d+.*reads .*elementwise.*known only at run time"):
        _check(tmp_path, ArangeFromValuesSummed(), (torch.tensor([3, 1], dtype=torch.int32),))


class RepeatsFromInput(nn.Module):
    def forward(self, x, r):
        return torch.repeat_interleave(x, r, dim=0)


def test_repeat_interleave_with_repeats_from_an_input_is_refused_naming_the_node(tmp_path):
    inputs = (torch.rand(3, 2), torch.tensor([1, 0, 2]))
    with pytest.raises(PmxCompileError, match=r"repeat_interleave.*line \d+.*repeats are computed from tensor values"):
        _check(tmp_path, RepeatsFromInput(), inputs)


# arange as pnnx writes it when a bound is an operand: pnnx folds what it can, so these
# .param texts are written here (the oracle is still torch.arange)
ARANGE_CASES = [
    ("end=5", None, torch.arange(5)),
    ("start=2 end=9 step=3", None, torch.arange(2, 9, 3)),
    ("start=1 end=2 step=0.25 dtype=None", None, torch.arange(1, 2, 0.25)),
    ("start=0 end=3 dtype=torch.float", None, torch.arange(0, 3, dtype=torch.float)),
    ("start=-1 $end=b", "expr=4", torch.arange(-1, 4)),
    ("start=0.5 $end=b dtype=torch.float", "expr=2.5", torch.arange(0.5, 2.5, dtype=torch.float)),
]


@pytest.mark.parametrize("params,end_expr,want", ARANGE_CASES)
def test_arange_spellings_fold_to_torch_values(tmp_path, params, end_expr, want):
    dt = {torch.int64: "i64", torch.float32: "f32"}[want.dtype]
    ops = ["pnnx.Input in 0 1 x #x=(2)f32"]
    ins = "1 1 b" if end_expr else "0 1"
    if end_expr:
        ops.append(f"pnnx.Expression e 0 1 b {end_expr}")
    ops += [
        f"torch.arange a {ins} r {params} #r=({len(want)}){dt}",
        "pnnx.Expression add 1 1 x y expr=add(@0,0) #y=(2)f32",
        "pnnx.Output out 2 0 y r",
    ]
    sess = compile_lines(tmp_path, ops)
    _, got = sess.run(None, {sess.get_inputs()[0].name: np.zeros(2, np.float32)})
    assert got.dtype == want.numpy().dtype
    np.testing.assert_array_equal(got, want.numpy())


class ArangeOfSize(nn.Module):
    def forward(self, x):
        return x + torch.arange(x.size(1)).float(), torch.arange(1, x.size(0), 2)


def _export_dynamic(tmp_path, module, inputs, inputs2):
    """pnnx export with a second example input, so dims that differ are written '?'."""
    prefix = export_pnnx(tmp_path, module, inputs, inputs2)
    return prefix + ".pnnx.param", prefix + ".pnnx.bin"


def test_arange_of_a_dynamic_size_follows_the_input_shape(tmp_path):
    """pnnx's dynamic-shape export writes arange(x.size(1)) as size(@0,1) -> arange."""
    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    module = ArangeOfSize().eval()
    param, bin_ = _export_dynamic(tmp_path, module, (torch.rand(4, 5),), (torch.rand(6, 7),))
    assert "size(@0,1)" in pathlib.Path(param).read_text()
    compile_model(param, bin_, str(tmp_path / "m.pmx"), plan_shapes={"in0": (4, 5)}, verify=True)
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    for shape in [(4, 5), (7, 3), (2, 9), (4, 5)]:
        x = torch.rand(*shape)
        got = sess.run(None, {"in0": x.numpy()})
        for g, w in zip(got, module(x)):
            assert g.dtype == w.numpy().dtype
            np.testing.assert_array_equal(g, w.numpy())


class ArangeFromSize(nn.Module):
    def forward(self, x):
        return x + torch.arange(x.size(0), 10)[:1].float()


def test_arange_starting_at_a_dynamic_size_is_refused_naming_the_node(tmp_path):
    from pmx.compiler.driver import compile_model

    param, bin_ = _export_dynamic(tmp_path, ArangeFromSize(), (torch.rand(2, 5),), (torch.rand(3, 7),))
    with pytest.raises(PmxCompileError, match=r"torch.arange.*line \d+.*start is a tensor's size"):
        compile_model(param, bin_, str(tmp_path / "m.pmx"), plan_shapes={"in0": (2, 5)})


def test_negative_indices_count_from_the_end_of_a_dynamic_dim(tmp_path):
    """x[-1], x.narrow(0, -2, 1), x[[-1, 0]] on the batch (dynamic by default) and x[:, -1]
    on a dynamic sequence dim, as pnnx writes them at the exported sizes: at other sizes
    they pick rows counted from the end, as torch does."""
    ops = [
        "pnnx.Input in0 0 1 x #x=(3,5,4)f32",
        "Tensor.select last 1 1 x a dim=0 index=-1 $input=x #x=(3,5,4)f32 #a=(5,4)f32",
        "torch.narrow second_last 1 1 x b dim=0 length=1 start=-2 $input=x #x=(3,5,4)f32 #b=(1,5,4)f32",
        "Tensor.index pair 1 1 x c expr=[[-1,0]] #x=(3,5,4)f32 #c=(2,5,4)f32",
        "Tensor.select last_step 1 1 x d dim=1 index=-1 $input=x #x=(3,5,4)f32 #d=(3,4)f32",
        "pnnx.Output out 4 0 a b c d",
    ]
    sess = compile_lines(tmp_path, ops, dynamic="in0:0,1")
    for shape in [(3, 5, 4), (6, 8, 4), (2, 1, 4)]:  # (narrow(0, -2, 1) needs two rows)
        x = torch.arange(float(np.prod(shape))).reshape(shape)
        want = [x[-1], x.narrow(0, -2, 1), x[[-1, 0]], x[:, -1]]
        got = sess.run(None, {"in0": x.numpy()})
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w.numpy())


def test_roll_and_flip_follow_a_dynamic_dim(tmp_path):
    """Exported at batch 1 and width 8, a flip or roll along the batch and a roll by -2
    along the width are no-ops or whole turns only at those sizes: at others they move
    elements as torch does (and a batch is not cut into chunks across them)."""
    ops = [
        "pnnx.Input in0 0 1 x #x=(1,1,2,8)f32",
        "torch.flip flip_batch 1 1 x a dims=(0) $input=x #x=(1,1,2,8)f32 #a=(1,1,2,8)f32",
        "torch.roll roll_batch 1 1 x b dims=(0) shifts=(1) $input=x #x=(1,1,2,8)f32 #b=(1,1,2,8)f32",
        "torch.roll roll_width 1 1 x c dims=(3) shifts=(-2) $input=x #x=(1,1,2,8)f32 #c=(1,1,2,8)f32",
        "torch.roll roll_turn 1 1 x d dims=(3) shifts=(8) $input=x #x=(1,1,2,8)f32 #d=(1,1,2,8)f32",
        "pnnx.Output out 4 0 a b c d",
    ]
    sess = compile_lines(tmp_path, ops, dynamic="in0:0,3")
    for shape in [(1, 1, 2, 8), (3, 1, 2, 16), (20, 1, 2, 5)]:
        x = torch.arange(float(np.prod(shape))).reshape(shape)
        want = [x.flip(0), x.roll(1, 0), x.roll(-2, 3), x.roll(8, 3)]
        for g, w in zip(sess.run(None, {"in0": x.numpy()}), want):
            np.testing.assert_array_equal(g, w.numpy())


def test_zeros_like_and_upsampling_by_a_factor_follow_the_input(tmp_path):
    """zeros_like(x) takes x's shape at run time (the default batch), and an upsampling by
    scale_factor of a '?'-dim export gets its output shape from the factor."""
    import torch.nn.functional as F

    ops = [
        "pnnx.Input in0 0 1 x #x=(?,3,?,?)f32",
        "F.upsample_nearest up 1 1 x a scale_factor=(2.0,2.0) $input=x #x=(?,3,?,?)f32 #a=(?,3,?,?)f32",
        "F.upsample bi 1 1 x b align_corners=False mode=bilinear scale_factor=(1.5,1.5) $input=x "
        "#x=(?,3,?,?)f32 #b=(?,3,?,?)f32",
        "torch.ones_like ones 1 1 x c $input=x #x=(?,3,?,?)f32 #c=(?,3,?,?)f32",
        "pnnx.Output out 3 0 a b c",
    ]
    sess = compile_lines(tmp_path, ops)
    for shape in [(1, 3, 8, 8), (2, 3, 12, 10), (3, 3, 5, 7)]:
        x = torch.rand(*shape)
        want = [
            F.interpolate(x, scale_factor=2.0, mode="nearest"),
            F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=False),
            torch.ones_like(x),
        ]
        for g, w in zip(sess.run(None, {"in0": x.numpy()}), want):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-6)
    static = compile_lines(
        tmp_path,
        [
            "pnnx.Input in0 0 1 x #x=(1,3)f32",
            "torch.zeros_like z 1 1 x y $input=x #x=(1,3)f32 #y=(1,3)f32",
            "pnnx.Output out 1 0 y",
        ],
    )
    (got,) = static.run(None, {"in0": np.ones((4, 3), np.float32)})
    np.testing.assert_array_equal(got, np.zeros((4, 3), np.float32))
