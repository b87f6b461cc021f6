"""Activations, elementwise functions, and pooling/window ops against torch.

Each op runs as the compiler writes it: the canonicalization rule turns a pnnx node
(attributes drawn by hypothesis) into canonical nodes, which run through their
registered kernels one after another (both expression backends for elementwise
nodes). End-to-end tests export small modules with pnnx and compare the compiled model
with torch.
"""

import math
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_kernel
from hypothesis import assume, given, reject, settings
from hypothesis import strategies as st

from pmx.compiler.canon import RULES, Context, Forward
from pmx.compiler.canon.math_ops import pnnx_expression_tree
from pmx.compiler.ir import Node, Value
from pmx.runtime import PmxError
from pmx.runtime import expr as E

VARIANTS = ("numexpr", "numpy")


# --- running a pnnx node the way the compiler rewrites it --------------------------------


def run_rule(op, attrs, arrays, out_shapes, out_dtypes=None, input_names=None, variant="numpy"):
    """Outputs of pnnx node `op` over `arrays`: its canonical rule's nodes, each run by
    its kernel in order (elementwise nodes with `variant`)."""
    ins = [Value(f"in{i}", a.shape, str(a.dtype)) for i, a in enumerate(arrays)]
    out_dtypes = out_dtypes or [str(arrays[0].dtype)] * len(out_shapes)
    outs = [Value(f"out{i}", s, d) for i, (s, d) in enumerate(zip(out_shapes, out_dtypes))]
    names = input_names or ["input"] + [None] * (len(ins) - 1)
    node = Node(op, "n", ins, outs, attrs, input_names=names)
    result = RULES[op](node, Context(types.SimpleNamespace(outputs=outs)))
    values = {v.uid: a for v, a in zip(ins, arrays)}
    if isinstance(result, Forward):
        return [values[result.value.uid]]
    for new in result:
        inputs = [None if v is None else values.get(v.uid, v.data) for v in new.inputs]
        got = run_kernel(new.op, inputs, new.attrs, expr=new.expr, variant=variant if new.op == "elementwise" else "")
        for v, a in zip(new.outputs, got):
            values[v.uid] = a
    return [values[v.uid] for v in outs]


def run1(op, attrs, x, variant="numpy", shape=None):
    return run_rule(op, attrs, [x], [shape or x.shape], variant=variant)[0]


def assert_same(got, want, tol=0.0, signed_zeros=False):
    """Equal to torch within relative tolerance tol (NaN where torch has NaN, infinities
    equal), with -0.0 / +0.0 told apart when signed_zeros."""
    want = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got) & (got > 0), np.isinf(want) & (want > 0))
    np.testing.assert_array_equal(np.isinf(got) & (got < 0), np.isinf(want) & (want < 0))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol * 1e-3)
    if signed_zeros:
        np.testing.assert_array_equal(np.signbit(got[want == 0]), np.signbit(want[want == 0]))


@st.composite
def shapes(draw, min_rank=1, max_rank=4, max_dim=6):
    rank = draw(st.integers(min_rank, max_rank))
    return tuple(draw(st.integers(1, max_dim)) for _ in range(rank))


@st.composite
def special_floats(draw, shape=None, scale=2.0):
    """float32 data with exact zeros of both signs, NaN and infinities among normals."""
    shape = shape if shape is not None else draw(shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.asarray(rng.standard_normal(shape) * scale, np.float32)
    flat = x.reshape(-1)
    picks = rng.random(flat.size)
    specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 0.5, -0.5], np.float32)
    mask = picks < 0.25
    flat[mask] = specials[rng.integers(0, len(specials), int(mask.sum()))]
    return x


lambdas = st.sampled_from([0.0, 0.5, 0.1, 0.22, 1.0, 3.0]) | st.floats(0, 4, width=32)
numbers = st.floats(-4, 4, width=32) | st.sampled_from([0.0, -0.0, 20.0, -1e9])


# --- shrink, threshold, rrelu ---------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=special_floats(), lambd=lambdas)
def test_hardshrink_softshrink(variant, x, lambd):
    """Zeros' signs are compared for hardshrink only: torch's softshrink writes +0 in its
    vectorized loop and x * 0 (-0 for negative x) in the scalar tail."""
    t = torch.from_numpy(x)
    for op, fn in (
        ("F.hardshrink", F.hardshrink),
        ("nn.Hardshrink", F.hardshrink),
        ("F.softshrink", F.softshrink),
        ("nn.Softshrink", F.softshrink),
    ):
        assert_same(run1(op, {"lambd": lambd}, x, variant), fn(t, lambd), signed_zeros="hard" in op)


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=special_floats(), threshold=numbers, value=numbers)
def test_threshold(variant, x, threshold, value):
    want = F.threshold(torch.from_numpy(x), threshold, value)
    for op in ("F.threshold", "nn.Threshold"):
        assert_same(run1(op, {"threshold": threshold, "value": value}, x, variant), want, signed_zeros=True)


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=special_floats(), lower=st.floats(0, 1, width=32), width=st.floats(0, 1, width=32))
def test_rrelu_in_eval_is_leaky_relu_of_the_mean_slope(variant, x, lower, width):
    upper = lower + width
    want = F.rrelu(torch.from_numpy(x), lower, upper, training=False)
    for op in ("F.rrelu", "nn.RReLU"):
        assert_same(run1(op, {"lower": lower, "upper": upper}, x, variant), want, tol=1e-6, signed_zeros=True)


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=special_floats(), single=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_prelu_with_a_slope_tensor_input(variant, x, single, seed):
    """F.prelu(x, w) with w a graph input (not a weight): one slope, or one per channel
    (dim 1; torch gives a 1-d input one channel)."""
    channels = x.shape[1] if x.ndim > 1 else 1
    w = np.random.default_rng(seed).standard_normal(1 if single else channels).astype(np.float32)
    want = F.prelu(torch.from_numpy(x), torch.from_numpy(w))
    got = run_rule("F.prelu", {}, [x, w], [x.shape], input_names=["input", "weight"], variant=variant)[0]
    assert_same(got, want, tol=1e-6)


def test_shrink_refuses_negative_lambda():
    with pytest.raises(PmxError, match="lambd"):
        run1("F.softshrink", {"lambd": -0.5}, np.zeros(3, np.float32))


# --- glu, softmin, softmax2d, positive --------------------------------------------------


@st.composite
def glu_case(draw):
    shape = list(draw(shapes(max_rank=4)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    shape[dim] = 2 * draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return np.asarray(rng.standard_normal(shape) * 4, np.float32), dim


@pytest.mark.parametrize("variant", VARIANTS)
@given(case=glu_case())
def test_glu(variant, case):
    x, dim = case
    want = F.glu(torch.from_numpy(x), dim)
    for op in ("F.glu", "nn.GLU"):
        assert_same(run1(op, {"dim": dim}, x, variant, shape=tuple(want.shape)), want, tol=1e-6)


def test_glu_refuses_an_odd_dim():
    with pytest.raises(PmxError, match="even"):
        run1("F.glu", {"dim": 1}, np.zeros((2, 3), np.float32), shape=(2, 1))


@st.composite
def with_dim(draw, min_rank=1):
    shape = draw(shapes(min_rank=min_rank))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.asarray(rng.standard_normal(shape) * 5, np.float32)
    return x, draw(st.integers(-len(shape), len(shape) - 1))


@pytest.mark.parametrize("variant", VARIANTS)
@given(case=with_dim())
def test_softmin(variant, case):
    x, dim = case
    want = F.softmin(torch.from_numpy(x), dim)
    for op in ("F.softmin", "nn.Softmin"):
        assert_same(run1(op, {"dim": dim}, x, variant), want, tol=1e-5)


@given(
    x=st.builds(
        lambda s, seed: np.asarray(np.random.default_rng(seed).standard_normal(s) * 4, np.float32),
        shapes(min_rank=3, max_rank=4),
        st.integers(0, 2**32 - 1),
    )
)
def test_softmax2d(x):
    assert_same(run1("nn.Softmax2d", {}, x), nn.Softmax2d()(torch.from_numpy(x)), tol=1e-5)


def test_softmax2d_refuses_other_ranks():
    with pytest.raises(PmxError, match="3-d or 4-d"):
        run1("nn.Softmax2d", {}, np.zeros((2, 3), np.float32))


def test_positive_is_the_input():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (got,) = run_rule("torch.positive", {}, [x], [x.shape])
    assert got is x


# --- lgamma, logaddexp, expm1, log1p, shifts -------------------------------------------------


@st.composite
def lgamma_inputs(draw):
    """Normals of several scales, negative non-integers near the poles, the poles
    themselves, lgamma's zeros 1 and 2 and their neighbours, tiny and huge values."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([0.5, 3.0, 30.0, 1e4, 1e30]))
    n = draw(st.integers(1, 300))
    x = rng.standard_normal(n) * scale
    near_poles = -rng.integers(0, 40, n) + rng.choice([0.0, 1e-3, -1e-3, 0.5, 1e-6], n)
    fixed = [
        0.0,
        -0.0,
        -1.0,
        -2.0,
        1.0,
        2.0,
        1 + 1e-6,
        2 - 1e-6,
        np.inf,
        -np.inf,
        np.nan,
        1e-30,
        -1e-30,
        3e38,
        -3e38,
        0.5,
        -0.5,
        -2.4570825,
        1e-45,
        171.5,
        35.0,
    ]
    return np.concatenate([x, near_poles, fixed]).astype(np.float32)


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=lgamma_inputs())
def test_lgamma(variant, x):
    """Within 1e-6 of torch: absolute where |lgamma| < 1 (near its zeros 1 and 2 and the
    negative ones torch's own float32 result rounds there too), relative above."""
    got = run1("torch.lgamma", {}, x, variant)
    want = torch.lgamma(torch.from_numpy(x)).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    fin = np.isfinite(want)
    err = np.abs(got[fin].astype(np.float64) - want[fin]) / np.maximum(1.0, np.abs(want[fin]))
    assert err.max(initial=0) < 1e-6, (x[fin][err.argmax()], err.max())


def test_lgamma_of_integers_is_float32():
    x = np.arange(-3, 8, dtype=np.int64)
    got = run1("torch.lgamma", {}, x)
    assert_same(got, torch.lgamma(torch.from_numpy(x)), tol=1e-6)


@st.composite
def broadcast_floats(draw):
    shape = draw(shapes(max_rank=3))
    other = tuple(d if draw(st.booleans()) else 1 for d in shape)[draw(st.integers(0, len(shape))) :]
    a = draw(special_floats(shape=shape, scale=30.0))
    b = draw(special_floats(shape=other, scale=30.0))
    return a, b


@pytest.mark.parametrize("variant", VARIANTS)
@given(pair=broadcast_floats())
def test_logaddexp(variant, pair):
    a, b = pair
    want = torch.logaddexp(torch.from_numpy(a), torch.from_numpy(b))
    got = run_rule("torch.logaddexp", {}, [a, b], [tuple(want.shape)], input_names=["input", "other"], variant=variant)[
        0
    ]
    assert_same(got, want, tol=1e-6)
    (got,) = run_kernel("elementwise", [a, b], expr="logaddexp(@0,@1)", variant=variant)
    assert_same(got, want, tol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["expm1", "log1p"])
@given(x=special_floats(scale=1e-3) | special_floats(scale=3.0))
def test_expm1_log1p_keep_small_arguments_exact(variant, name, x):
    want = getattr(torch, name)(torch.from_numpy(x))
    assert_same(run1(f"torch.{name}", {}, x, variant), want, tol=1e-6)
    tree = pnnx_expression_tree(f"{name},@0", 1)  # as pnnx writes the call
    (got,) = run_kernel("elementwise", [x], expr=E.to_text(tree), variant=variant)
    assert_same(got, want, tol=1e-6)


INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8]


@st.composite
def shift_case(draw):
    dtype = np.dtype(draw(st.sampled_from(INT_DTYPES)))
    bits = 8 * dtype.itemsize
    shape = draw(shapes(max_rank=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    # shift amounts inside the width and past it (torch and numpy give 0 / the sign there)
    b = rng.integers(0, bits + 4, shape[-1:]).astype(dtype)
    return a, b, int(draw(st.integers(0, bits - 1)))


@pytest.mark.parametrize("variant", VARIANTS)
@given(case=shift_case())
def test_bitwise_shifts(variant, case):
    a, b, k = case
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    for op, fn, sym in (
        ("torch.bitwise_left_shift", torch.bitwise_left_shift, "lshift"),
        ("torch.bitwise_right_shift", torch.bitwise_right_shift, "rshift"),
    ):
        want = fn(ta, tb)
        got = run_rule(op, {}, [a, b], [tuple(want.shape)], input_names=["input", "other"], variant=variant)[0]
        assert_same(got, want)
        # a number as the second operand, and the expression pnnx writes for `x << k`
        want = fn(ta, k)
        assert_same(run1(op, {"other": k}, a, variant), want)
        (got,) = run_kernel("elementwise", [a], expr=f"{sym}(@0,{k})", variant=variant)
        assert_same(got, want)


# --- pnnx's expression spelling ------------------------------------------------------------


@pytest.mark.parametrize(
    "text,canonical",
    [
        ("expm1,sub(@0,0.5)", "expm1(sub(@0,0.5))"),
        ("log1p,@0", "log1p(@0)"),
        ("add(neg,@0,exp,@1)", "add(neg(@0),exp(@1))"),
        ("logaddexp(@0,@1)", "logaddexp(@0,@1)"),
        ("sub(add(mul(@0,10),1.0),1.2)", "sub(add(mul(@0,10),1.0),1.2)"),
        ("lshift(@0,3)", "lshift(@0,3)"),
    ],
)
def test_pnnx_prefix_spelling(text, canonical):
    assert pnnx_expression_tree(text, 2) == E.parse(canonical, 2)


@pytest.mark.parametrize(
    "text",
    [
        "expm1,",
        "add(@0)",
        "@0,@1",
        "bogus,@0",
        "add(@0,@3)",
        "",
        "exp(@0x)",
        "neg," * 5000 + "@0",
        "neg(" * 5000 + "@0" + ")" * 5000,
        "@0" * 40000,
    ],
)
def test_pnnx_prefix_spelling_refuses_malformed_text(text):
    with pytest.raises(PmxError):
        pnnx_expression_tree(text, 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_literals_equal_in_python_stay_apart(variant):
    """1, 1.0 and True, or 0.0 and -0.0, compare equal as tree leaves; memoized dtypes,
    plans and desugared trees must still tell them apart (whichever is asked first)."""
    i = np.array([3, -4], np.int32)
    for first, second in (("add(@0,1)", "add(@0,1.0)"), ("add(@0,1.0)", "add(@0,1)")):
        for text in (first, second):
            (got,) = run_kernel("elementwise", [i], expr=text, variant=variant)
            want = torch.from_numpy(i) + (1.0 if "1.0" in text else 1)
            assert_same(got, want)
    x = np.array([-0.0, 0.0, 2.0], np.float32)
    for value in (0.0, -0.0, 0.0):
        (got,) = run_kernel("elementwise", [x], expr=f"where(le(@0,0.0),{value!r},@0)", variant=variant)
        assert_same(got, F.threshold(torch.from_numpy(x), 0.0, value), signed_zeros=True)
    assert E.result_dtype(E.parse("mul(@0,2)"), [np.int64]) == np.int64
    assert E.result_dtype(E.parse("mul(@0,2.0)"), [np.int64]) == np.float32


# --- end to end ------------------------------------------------------------------------------


class Activations(nn.Module):
    def __init__(self):
        super().__init__()
        self.glu = nn.GLU(dim=1)
        self.hard = nn.Hardshrink(0.3)
        self.soft = nn.Softshrink(0.2)
        self.thr = nn.Threshold(0.1, 20.0)
        self.rrelu = nn.RReLU(0.1, 0.3)
        self.softmin = nn.Softmin(dim=2)
        self.softmax2d = nn.Softmax2d()

    def forward(self, x, y):
        a = self.glu(x) + F.glu(x, dim=-1).sum()
        b = self.hard(x) + F.hardshrink(x, 0.5) + self.soft(x) + F.softshrink(x, 1.0)
        c = self.thr(x) + F.threshold(x, -0.2, -3.0) + self.rrelu(x) + F.rrelu(x, 0.2, 0.4)
        d = self.softmin(x) + F.softmin(x, dim=0) + self.softmax2d(x) + torch.positive(x)
        e = torch.lgamma(y + 0.5) + torch.expm1(x - 0.5) + torch.log1p(y) + torch.logaddexp(x, y * 3)
        return a, b, c, d, e


class IntegerShifts(nn.Module):
    def forward(self, x, s):
        return x << 3, x >> 2, torch.bitwise_left_shift(x, s), torch.bitwise_right_shift(x, s), (x * 2) >> s


@pytest.mark.slow  # exports through pnnx
def test_end_to_end_activations(check_model):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 8) * 2
    y = torch.rand(2, 4, 6, 8) * 5
    check_model("activations_elementwise", Activations(), (x, y))


@pytest.mark.slow  # exports through pnnx
def test_end_to_end_shifts(check_model):
    torch.manual_seed(0)
    x = torch.randint(-1000, 1000, (3, 16), dtype=torch.int32)
    s = torch.randint(0, 12, (3, 16), dtype=torch.int32)
    check_model("integer_shifts", IntegerShifts(), (x, s))


# --- pooling with indices, LP pools, local response norm, unfold / fold ----------------------

POOL_F = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


@st.composite
def pool_data(draw, nd, batched=True, max_side=9):
    """(x, torch tensor): float32 with ties (few distinct values), and sometimes NaN and
    -inf, so the index rules for ties and NaN are exercised."""
    lead = (draw(st.integers(1, 2)), draw(st.integers(1, 3))) if batched else (draw(st.integers(1, 3)),)
    shape = lead + tuple(draw(st.integers(1, max_side)) for _ in range(nd))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (
        rng.integers(-3, 4, shape).astype(np.float32)
        if draw(st.booleans())
        else rng.standard_normal(shape).astype(np.float32)
    )
    if draw(st.booleans()):
        flat = x.reshape(-1)
        flat[rng.random(flat.size) < 0.1] = -np.inf
        flat[rng.random(flat.size) < 0.05] = np.nan
    return x, torch.from_numpy(x.copy())


def _torch_or_reject(fn):
    """torch's result, or None for parameter combinations torch refuses."""
    try:
        return fn()
    except (RuntimeError, ValueError):
        return None


@pytest.mark.parametrize("nd", [1, 2, 3])
@given(data=st.data())
def test_max_pool_with_indices(nd, data):
    x, t = data.draw(pool_data(nd, batched=data.draw(st.booleans()), max_side=8 if nd < 3 else 5))
    k = tuple(data.draw(st.integers(1, 4)) for _ in range(nd))
    stride = tuple(data.draw(st.integers(1, 3)) for _ in range(nd))
    pad = tuple(data.draw(st.integers(0, ki // 2)) for ki in k)
    dil = tuple(data.draw(st.integers(1, 2)) for _ in range(nd))
    ceil = data.draw(st.booleans())
    want = _torch_or_reject(lambda: POOL_F[nd](t, k, stride, pad, dil, ceil_mode=ceil, return_indices=True))
    assume(want is not None)  # parameters torch refuses
    values, indices = want
    # a window wholly in the padding (dilation can step over the one element it reaches):
    # torch gives -inf and the index of a position past the input, which names no element
    empty = (POOL_F[nd](torch.ones_like(t), k, stride, pad, dil, ceil_mode=ceil) == -math.inf).numpy()
    attrs = {
        "kernel_size": k,
        "stride": stride,
        "padding": pad,
        "dilation": dil,
        "ceil_mode": ceil,
        "return_indices": True,
    }
    for op in (f"F.max_pool{nd}d", f"nn.MaxPool{nd}d"):
        got_v, got_i = run_rule(op, attrs, [x], [tuple(values.shape)] * 2, ["float32", "int64"])
        assert_same(got_v, values)
        np.testing.assert_array_equal(np.where(empty, 0, got_i), np.where(empty, 0, indices.numpy()))
        assert got_i.dtype == np.int64


ADAPTIVE_F = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}


@pytest.mark.parametrize("nd", [1, 2, 3])
@given(data=st.data())
def test_adaptive_max_pool_with_indices(nd, data):
    x, t = data.draw(pool_data(nd, batched=data.draw(st.booleans()), max_side=9 if nd < 3 else 6))
    size = tuple(data.draw(st.integers(0 if nd > 1 else 1, x.shape[-nd + i] + 2)) for i in range(nd))
    torch_size = tuple(s or None for s in size)  # pnnx writes None (keep the size) as 0
    values, indices = ADAPTIVE_F[nd](t, torch_size if nd > 1 else torch_size[0], return_indices=True)
    for op in (f"F.adaptive_max_pool{nd}d", f"nn.AdaptiveMaxPool{nd}d"):
        got_v, got_i = run_rule(
            op, {"output_size": size, "return_indices": True}, [x], [tuple(values.shape)] * 2, ["float32", "int64"]
        )
        assert_same(got_v, values)
        assert_same(got_i, indices)


@pytest.mark.parametrize("nd", [1, 2])
@given(data=st.data(), p=st.sampled_from([1, 2, 3, 0.5, 1.2, 4.0, math.inf, -math.inf]))
def test_lp_pool(nd, data, p):
    shape = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))) + tuple(
        data.draw(st.integers(1, 9)) for _ in range(nd)
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    if data.draw(st.booleans()):
        x = np.abs(x)  # fractional powers of negatives are NaN on both sides: mostly positive data
    k = tuple(data.draw(st.integers(1, 4)) for _ in range(nd))
    stride = data.draw(st.none() | st.tuples(*[st.integers(1, 3)] * nd))
    ceil = data.draw(st.booleans())
    fn = F.lp_pool1d if nd == 1 else F.lp_pool2d
    want = _torch_or_reject(
        lambda: fn(
            torch.from_numpy(x), p, k if nd > 1 else k[0], stride if nd > 1 or stride is None else stride[0], ceil
        )
    )
    if want is None:
        reject()
    attrs = {"norm_type": p, "kernel_size": k, "stride": stride, "ceil_mode": ceil}
    for op in (f"F.lp_pool{nd}d", f"nn.LPPool{nd}d"):
        assert_same(run1(op, attrs, x, shape=tuple(want.shape)), want, tol=2e-5)


@given(
    data=st.data(),
    size=st.integers(1, 7),
    alpha=st.sampled_from([1e-4, 1e-2, 0.5]),
    beta=st.sampled_from([0.75, 0.2, 1.0, 2.0]),
    k=st.sampled_from([1.0, 0.2, 2.0]),
)
def test_local_response_norm(data, size, alpha, beta, k):
    rank = data.draw(st.integers(3, 5))
    shape = tuple(data.draw(st.integers(1, 6)) for _ in range(rank))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    want = F.local_response_norm(torch.from_numpy(x), size, alpha, beta, k)
    attrs = {"size": size, "alpha": alpha, "beta": beta, "k": k}
    for op in ("F.local_response_norm", "nn.LocalResponseNorm"):
        assert_same(run1(op, attrs, x), want, tol=1e-5)


@st.composite
def window_geometry(draw):
    k = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    return dict(
        kernel_size=k,
        stride=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        padding=(draw(st.integers(0, 3)), draw(st.integers(0, 3))),
        dilation=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
    )


@given(data=st.data(), geometry=window_geometry(), batched=st.booleans())
def test_unfold(data, geometry, batched):
    shape = (
        ((data.draw(st.integers(1, 2)),) if batched else ())
        + (data.draw(st.integers(1, 3)),)
        + (data.draw(st.integers(1, 10)), data.draw(st.integers(1, 10)))
    )
    x = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).standard_normal(shape).astype(np.float32)
    want = _torch_or_reject(lambda: F.unfold(torch.from_numpy(x), **geometry))
    if want is None:
        reject()
    for op in ("F.unfold", "nn.Unfold"):
        assert_same(run1(op, geometry, x, shape=tuple(want.shape)), want)


@given(data=st.data(), geometry=window_geometry(), batched=st.booleans())
def test_fold(data, geometry, batched):
    size = (data.draw(st.integers(1, 10)), data.draw(st.integers(1, 10)))
    k, s, p, d = (geometry[key] for key in ("kernel_size", "stride", "padding", "dilation"))
    blocks = [(size[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(2)]
    if min(blocks) < 1:
        reject()
    c = data.draw(st.integers(1, 3))
    shape = ((data.draw(st.integers(1, 2)),) if batched else ()) + (c * k[0] * k[1], blocks[0] * blocks[1])
    x = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).standard_normal(shape).astype(np.float32)
    want = F.fold(torch.from_numpy(x), size, **geometry)
    for op in ("F.fold", "nn.Fold"):
        assert_same(run1(op, dict(geometry, output_size=size), x, shape=tuple(want.shape)), want, tol=1e-6)


def test_fold_refuses_a_block_count_that_does_not_fit():
    with pytest.raises(ValueError, match="blocks"):  # the shape rule (infer_shapes names the node)
        run1(
            "F.fold",
            dict(kernel_size=(2, 2), stride=(1, 1), padding=(0, 0), dilation=(1, 1), output_size=(4, 4)),
            np.zeros((1, 4, 8), np.float32),
            shape=(1, 1, 4, 4),
        )


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.adaptive = nn.AdaptiveMaxPool2d((3, 2), return_indices=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1, return_indices=True, ceil_mode=True)
        self.unused = nn.AdaptiveMaxPool2d(2, return_indices=True)
        self.lp = nn.LPPool2d(2, (2, 3), stride=(1, 2))
        self.lrn = nn.LocalResponseNorm(3)
        self.unfold = nn.Unfold((2, 3), dilation=(1, 2), padding=1, stride=2)
        self.fold = nn.Fold((9, 10), (2, 3), dilation=(1, 2), padding=1, stride=2)

    def forward(self, x):
        a, ai = self.adaptive(x)
        b, bi = self.maxpool(x)
        c, _ = self.unused(x)
        d, di = F.max_pool1d(x.flatten(2), 4, return_indices=True)
        cols = self.unfold(x)
        return (
            a,
            ai,
            b,
            bi,
            c,
            d,
            di,
            F.lp_pool1d(x.flatten(2).abs(), 3, 4),
            self.lp(x),
            self.lrn(x),
            cols,
            self.fold(cols),
        )


@pytest.mark.slow  # exports through pnnx
def test_end_to_end_pools_and_windows(check_model):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 10)
    sess, got, _ = check_model("pools_windows", Pools(), (x,))
    ops = {n.op for n in sess.model.nodes}
    assert {"max_pool_indices", "adaptive_max_pool_indices", "unfold", "fold"} <= ops, ops
    assert got[1].dtype == np.int64 and got[3].dtype == np.int64


@pytest.mark.parametrize("op", ["aten::exp2", "torch.exp2", "aten::frac", "torch.frac"])
@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_exp2_and_frac_match_torch(op, data):
    """exp2 and frac, which pnnx leaves as aten:: ops: 2 ** x and x - trunc(x)."""
    from paramgraph import run_one_op

    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    seed = data.draw(st.integers(0, 2**32 - 1))
    x = torch.from_numpy((np.random.default_rng(seed).standard_normal(shape) * 8).astype(np.float32))
    want = torch.exp2(x) if "exp2" in op else torch.frac(x)
    labels = None if op.startswith("aten::") else ["input"]
    (got,) = run_one_op(op, "", [x.numpy()], [want.numpy()], labels)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)


class Exp2AndFrac(nn.Module):
    def forward(self, x):
        return torch.exp2(x), torch.frac(x * 3)


@pytest.mark.slow  # exports through pnnx
def test_exp2_and_frac_through_pnnx(tmp_path):
    from helpers import compare_with_torch, export_pnnx

    x = torch.randn(2, 3, 5) * 4
    prefix = export_pnnx(tmp_path, Exp2AndFrac(), (x,))
    compare_with_torch(prefix, Exp2AndFrac(), (x,), tmp_path / "m.pmx", tol=1e-6)


def test_adaptive_pools_keep_a_dynamic_dim_given_as_none(tmp_path):
    """AdaptiveAvgPool2d((1, None)) (a text recognizer's column pooling) and
    AdaptiveMaxPool2d((None, 3)), as pnnx writes them (None as 0): the None dim follows
    the input's size at run time, and only such files carry format version 4."""
    from paramgraph import compile_lines

    from pmx.runtime import fileformat as ff

    ops = [
        "pnnx.Input in0 0 1 x #x=(1,8,8,20)f32",
        "nn.AdaptiveAvgPool2d cols 1 1 x a output_size=(1,0) #x=(1,8,8,20)f32 #a=(1,8,1,20)f32",
        "nn.AdaptiveMaxPool2d rows 1 1 x b output_size=(0,3) return_indices=False #x=(1,8,8,20)f32 #b=(1,8,8,3)f32",
        "pnnx.Output out 2 0 a b",
    ]
    sess = compile_lines(tmp_path, ops, dynamic="in0:2,3")
    assert ff.unpack_preamble((tmp_path / "m.pmx").read_bytes()[: ff.PREAMBLE_SIZE])["version"] == 4
    for shape in [(1, 8, 8, 20), (2, 8, 12, 33), (1, 8, 5, 7)]:
        x = torch.rand(*shape)
        want = [F.adaptive_avg_pool2d(x, (1, None)), F.adaptive_max_pool2d(x, (None, 3))]
        for g, w in zip(sess.run(None, {"in0": x.numpy()}), want):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-6, atol=1e-7)
    plain = ["pnnx.Input in0 0 1 x #x=(1,8,8,20)f32", ops[1].replace("(1,0)", "(1,1)").replace("1,20)", "1,1)")]
    compile_lines(tmp_path, plain + ["pnnx.Output out 1 0 a"])
    assert ff.unpack_preamble((tmp_path / "m.pmx").read_bytes()[: ff.PREAMBLE_SIZE])["version"] == 2


def test_instance_norm_follows_a_dynamic_channel_dim(tmp_path):
    """F.instance_norm without weights normalizes each channel, however many a run has:
    a group per channel, not the exported channel count as groups."""
    from paramgraph import compile_lines

    ops = [
        "pnnx.Input in0 0 1 x #x=(1,2,5)f32",
        "F.instance_norm n 1 1 x y bias=None eps=1.000000e-5 running_mean=None running_var=None weight=None "
        "$input=x #x=(1,2,5)f32 #y=(1,2,5)f32",
        "pnnx.Output out 1 0 y",
    ]
    sess = compile_lines(tmp_path, ops, dynamic="in0:1,2")
    for shape in [(1, 2, 5), (2, 4, 5), (3, 6, 9)]:
        x = torch.rand(*shape)
        (got,) = sess.run(None, {"in0": x.numpy()})
        np.testing.assert_allclose(got, F.instance_norm(x).numpy(), rtol=1e-5, atol=1e-5)
