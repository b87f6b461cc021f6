"""Property tests for the `elementwise` kernel against torch: every activation formula as
the canonicalization rules write it, unary math, broadcasting binary arithmetic, and
integer / bool dtypes (torch's result dtypes, exact values), on both backends (numexpr
and numpy)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import bind_context, kernel_pool, rel_error, run_kernel
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from pmx.compiler.canon import RULES, Context
from pmx.compiler.ir import Node, Value
from pmx.runtime import expr as E
from pmx.runtime.expr.dtypes import _keeps_float_dtype, _result_dtype
from pmx.runtime.expr.gelu import _gelu_operand
from pmx.runtime.expr.numpy_backend import _numpy_plan

VARIANTS = ("numexpr", "numpy")
TOL = 1e-5


@st.composite
def shapes(draw, min_rank=1, max_rank=4):
    rank = draw(st.integers(min_rank, max_rank))
    batch = draw(st.integers(1, 4))
    return (batch,) + tuple(draw(st.integers(1, 6)) for _ in range(rank - 1))


@st.composite
def floats(draw, shape=None, scale=4.0):
    """float32 data with negatives and exact zeros."""
    shape = shape if shape is not None else draw(shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.asarray(rng.standard_normal(shape) * scale, np.float32)
    x[rng.random(shape) < 0.15] = 0
    return x


def canon(op, attrs, *arrays, out_dtype="float32"):
    """The canonical elementwise node pnnx op `op` becomes: (expr, input arrays)."""
    ins = [Value(f"in{i}", a.shape, str(a.dtype)) for i, a in enumerate(arrays)]
    shape = np.broadcast_shapes(*[a.shape for a in arrays])
    node = Node(op, "n", ins, [Value("out", shape, out_dtype)], attrs, input_names=["input"] + [None] * (len(ins) - 1))
    (new,) = RULES[op](node, Context(None))
    assert new.op == "elementwise"
    data = {id(v): a for v, a in zip(ins, arrays)}
    return new.expr, [data.get(id(v), v.data) for v in new.inputs]


def check(expr, inputs, want, variant, tol=TOL):
    (got,) = run_kernel("elementwise", inputs, expr=expr, variant=variant)
    want = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.shape == want.shape
    assert got.dtype == want.dtype, f"{expr}: dtype {got.dtype}, torch {want.dtype}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=expr)
    else:
        assert np.array_equal(np.isnan(got), np.isnan(want)), expr
        finite = ~np.isnan(want)
        err = rel_error(got[finite], want[finite])
        assert err <= tol, f"{expr} ({variant}): rel error {err:.3g}"


ACTIVATIONS = [
    ("F.relu", {}, F.relu),
    ("F.relu6", {}, F.relu6),
    # F.gelu's definition, evaluated without the cancellation of 1 + erf in float64
    ("F.gelu", {}, lambda x: 0.5 * x * torch.special.erfc(-x / math.sqrt(2))),
    # 0.5 x (1 + tanh(u)) == x sigmoid(2u): torch's float64 tanh form is 0 for x < -6
    (
        "F.gelu",
        {"approximate": "tanh"},
        lambda x: x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)),
    ),
    ("F.mish", {}, F.mish),
    ("F.softplus", {"beta": 1.0, "threshold": 20.0}, F.softplus),
    ("F.softplus", {"beta": 2, "threshold": 5}, lambda x: F.softplus(x, beta=2, threshold=5)),
    ("F.softplus", {"beta": 0.5, "threshold": 1.0}, lambda x: F.softplus(x, beta=0.5, threshold=1.0)),
    ("F.softsign", {}, F.softsign),
    ("F.selu", {}, F.selu),
    ("F.celu", {"alpha": 1.0}, F.celu),
    ("F.celu", {"alpha": 0.5}, lambda x: F.celu(x, 0.5)),
    ("F.elu", {"alpha": 1.0}, F.elu),
    ("F.elu", {"alpha": 0.3}, lambda x: F.elu(x, 0.3)),
    ("F.hardtanh", {"min_val": -1.0, "max_val": 1.0}, F.hardtanh),
    ("F.hardtanh", {"min_val": -2, "max_val": 0.5}, lambda x: F.hardtanh(x, -2, 0.5)),
    ("F.logsigmoid", {}, F.logsigmoid),
    ("F.leaky_relu", {"negative_slope": 0.2}, lambda x: F.leaky_relu(x, 0.2)),
    ("F.hardswish", {}, F.hardswish),
    ("F.hardsigmoid", {}, F.hardsigmoid),
    ("F.silu", {}, F.silu),
    ("F.sigmoid", {}, torch.sigmoid),
    ("F.tanh", {}, torch.tanh),
    ("F.tanhshrink", {}, F.tanhshrink),
    ("torch.clamp", {"min": -0.5, "max": 0.75}, lambda x: torch.clamp(x, -0.5, 0.75)),
    ("torch.clamp", {"min": 0, "max": None}, lambda x: torch.clamp(x, min=0)),
    ("torch.clamp", {"min": None, "max": 1.5}, lambda x: torch.clamp(x, max=1.5)),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op,attrs,fn", ACTIVATIONS, ids=[f"{a[0]}{a[1]}" for a in ACTIVATIONS])
@given(x=floats())
def test_activation(op, attrs, fn, variant, x):
    # oracle: torch in float64, so torch's own float32 rounding (e.g. 1 + erf(x) for x << 0)
    # does not count against pmx; a tensor of one element makes the check elementwise
    expr, inputs = canon(op, attrs, x)
    check(expr, inputs, fn(torch.from_numpy(x).double()).float(), variant)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@given(x=floats(shape=(4, 64)))
def test_gelu_matches_torch_float32(approximate, x):
    expr, inputs = canon("F.gelu", {"approximate": approximate}, x)
    for variant in VARIANTS:
        check(expr, inputs, F.gelu(torch.from_numpy(x), approximate=approximate), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=floats(scale=1.0))
def test_erf_near_zero_and_tails(variant, x):
    x = np.concatenate([x.ravel(), np.float32([0, 1e-6, -1e-4, 0.5, -3.0, 4.0, 9.0, -9.0])])
    expr, inputs = canon("torch.erf", {}, x)
    check(expr, inputs, torch.erf(torch.from_numpy(x).double()).float(), variant)


_UNARY = {
    "abs": torch.abs,
    "exp": torch.exp,
    "neg": torch.neg,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "round": torch.round,
    "sign": torch.sign,
    "sin": torch.sin,
    "cos": torch.cos,
    "atan": torch.atan,
    "sinh": torch.sinh,
    "tanh": torch.tanh,
    "square": torch.square,
    "expm1": torch.expm1,
    "trunc": torch.trunc,
    "erf": torch.erf,
    "erfc": torch.erfc,
    # domain-restricted: applied to |x| + 0.5 below
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "log10": torch.log10,
    "log1p": torch.log1p,
}
_POSITIVE = {"log", "sqrt", "rsqrt", "reciprocal", "log10", "log1p"}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", sorted(_UNARY))
@given(x=floats(scale=2.0))
def test_unary_math(name, variant, x):
    if name in _POSITIVE:
        x = np.abs(x) + np.float32(0.5)
    expr, inputs = canon(f"torch.{name}", {}, x)
    check(expr, inputs, _UNARY[name](torch.from_numpy(x).double()).float(), variant)


@st.composite
def broadcast_pair(draw):
    shape = draw(shapes(min_rank=1, max_rank=4))
    other = list(shape)
    for i in range(len(other)):
        if draw(st.booleans()):
            other[i] = 1
    drop = draw(st.integers(0, len(other) - 1))
    other = tuple(other[drop:])
    if draw(st.booleans()):
        shape, other = other, shape
    return draw(floats(shape)), draw(floats(other))


_BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "atan2": torch.atan2,
    "gt": torch.gt,
    "ge": torch.ge,
    "lt": torch.lt,
    "le": torch.le,
    "eq": torch.eq,
    "ne": torch.ne,
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", sorted(_BINARY))
@given(pair=broadcast_pair())
def test_binary_broadcast(name, variant, pair):
    a, b = pair
    if name == "div":
        b = np.where(b == 0, np.float32(1.5), b)
    expr, inputs = canon(f"torch.{name}", {}, a, b)
    check(expr, inputs, _BINARY[name](torch.from_numpy(a), torch.from_numpy(b)), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@given(pair=broadcast_pair(), alpha=st.sampled_from([1, 2, -0.5]))
def test_add_sub_alpha_and_scalars(variant, pair, alpha):
    a, b = pair
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    for op, want in (("torch.add", torch.add(ta, tb, alpha=alpha)), ("torch.sub", torch.sub(ta, tb, alpha=alpha))):
        expr, inputs = canon(op, {"alpha": alpha}, a, b)
        check(expr, inputs, want, variant)
    expr, inputs = canon("torch.mul", {"other": 0.3}, a)
    check(expr, inputs, ta * 0.3, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=floats(), data=st.data())
def test_prelu_per_channel_and_single(variant, x, data):
    if x.ndim < 2:
        x = x.reshape(x.shape[0], 1)
    c = data.draw(st.sampled_from([1, x.shape[1]]))
    w = np.random.default_rng(c).uniform(-0.5, 0.5, c).astype(np.float32)
    ins = [Value("x", x.shape, "float32"), Value("w", w.shape, "float32", data=w)]
    node = Node(
        "nn.PReLU", "p", ins, [Value("y", x.shape, "float32")], {"num_parameters": c}, input_names=["input", "@weight"]
    )
    (new,) = RULES["nn.PReLU"](node, Context(None))
    inputs = [x if v is ins[0] else v.data for v in new.inputs]
    check(new.expr, inputs, F.prelu(torch.from_numpy(x), torch.from_numpy(w)), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=floats(), data=st.data())
def test_clamp_with_tensor_bounds(variant, x, data):
    lo = data.draw(floats(x.shape, scale=1.0)) - np.float32(0.5)
    hi = lo + np.abs(data.draw(floats(x.shape[1:], scale=1.0)))
    tx, tlo, thi = map(torch.from_numpy, (x, lo, hi))
    for attrs, arrays, labels, want in (
        ({}, (x, lo, hi), ["input", "min", "max"], torch.clamp(tx, tlo, thi)),
        ({"max": None}, (x, lo), ["input", "min"], torch.clamp(tx, min=tlo)),
        ({"min": None}, (x, hi), ["input", "max"], torch.clamp(tx, max=thi)),
    ):
        ins = [Value(f"i{i}", a.shape, "float32") for i, a in enumerate(arrays)]
        node = Node("torch.clamp", "c", ins, [Value("y", x.shape, "float32")], attrs, input_names=labels)
        (new,) = RULES["torch.clamp"](node, Context(None))
        data_of = {id(v): a for v, a in zip(ins, arrays)}
        check(new.expr, [data_of[id(v)] for v in new.inputs], want, variant)


# --- where / masked_fill ----------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@given(x=floats(), data=st.data(), fill=st.sampled_from([-1e9, 0.0, 2.5, -math.inf]))
def test_masked_fill_and_where(variant, x, data, fill):
    mask = data.draw(floats(x.shape[-1:])) > 0  # broadcast along leading dims
    other = data.draw(floats(x.shape))
    tx, tm, to = map(torch.from_numpy, (x, mask, other))
    ins = [Value("x", x.shape, "float32"), Value("m", mask.shape, "bool")]
    node = Node(
        "Tensor.masked_fill",
        "mf",
        ins,
        [Value("y", x.shape, "float32")],
        {"value": fill},
        input_names=["input", "mask"],
    )
    (new,) = RULES["Tensor.masked_fill"](node, Context(None))
    (got,) = run_kernel("elementwise", [x, mask], expr=new.expr, variant=variant)
    np.testing.assert_array_equal(got, tx.masked_fill(tm, fill).numpy())
    # torch.where with two tensors, and with a scalar branch on either side
    for labels, arrays, attrs, want in (
        (["condition", "input", "other"], (mask, x, other), {}, torch.where(tm, tx, to)),
        (["condition", "input"], (mask, x), {"other": 0.0}, torch.where(tm, tx, 0.0)),
        (["condition", "other"], (mask, x), {"input": 1.0}, torch.where(tm, 1.0, tx)),
    ):
        ins = [Value(f"i{i}", a.shape, str(a.dtype)) for i, a in enumerate(arrays)]
        node = Node("torch.where", "w", ins, [Value("y", x.shape, "float32")], attrs, input_names=labels)
        (new,) = RULES["torch.where"](node, Context(None))
        data_of = {id(v): a for v, a in zip(ins, arrays)}
        check(new.expr, [data_of[id(v)] for v in new.inputs], want, variant)


# --- integer and bool tensors: torch's result dtypes and exact values ---------------------


@st.composite
def int_pair(draw):
    shape = draw(shapes(max_rank=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    a = rng.integers(-20, 20, shape).astype(np.int64)
    b = rng.integers(-6, 7, shape[-1:]).astype(np.int64)
    b[b == 0] = 3
    return a, b


_INT_BINARY = {
    "add(@0,@1)": torch.add,
    "sub(@0,@1)": torch.sub,
    "mul(@0,@1)": torch.mul,
    "div(@0,@1)": torch.div,
    "floor_divide(@0,@1)": torch.floor_divide,
    "remainder(@0,@1)": torch.remainder,
    "fmod(@0,@1)": torch.fmod,
    "maximum(@0,@1)": torch.maximum,
    "minimum(@0,@1)": torch.minimum,
    "gt(@0,@1)": torch.gt,
    "le(@0,@1)": torch.le,
    "eq(@0,@1)": torch.eq,
    "ne(@0,@1)": torch.ne,
    "and(@0,@1)": torch.bitwise_and,
    "or(@0,@1)": torch.bitwise_or,
    "xor(@0,@1)": torch.bitwise_xor,
    "mul(@0,3)": lambda a, b: a * 3,
    "add(@0,1.5)": lambda a, b: a + 1.5,
    "div(@0,2)": lambda a, b: a / 2,
    "floor_divide(@0,-2)": lambda a, b: torch.floor_divide(a, -2),
    "mul(@0,sub(@1,1))": lambda a, b: a * (b - 1),
    "where(gt(@0,0),@0,@1)": lambda a, b: torch.where(a > 0, a, b),
    "where(gt(@0,0),@0,0.5)": lambda a, b: torch.where(a > 0, a, 0.5),
    # float results of integer operands, computed in float32 (numpy's reciprocal has an
    # integer loop: 1 / 2 == 0 there)
    "mul(@0,reciprocal(@1))": lambda a, b: a * torch.reciprocal(b),
    "add(@0,mul(reciprocal(@1),10))": lambda a, b: a + 10 / b,
    "sub(div(6,@1),@0)": lambda a, b: 6 / b - a,
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("expr", sorted(_INT_BINARY))
@given(pair=int_pair())
def test_int64_expressions(expr, variant, pair):
    a, b = pair
    want = _INT_BINARY[expr](torch.from_numpy(a), torch.from_numpy(b))
    check(expr, [a, b], want, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@given(pair=int_pair(), x=floats(scale=2.0))
def test_mixed_float_int_bool(variant, pair, x):
    a, b = pair
    x = x.reshape(-1)[:1].reshape(()) if x.size else np.float32(1)
    x = np.full(a.shape, x, np.float32)
    m = a > 0
    ta, tb, tx, tm = map(torch.from_numpy, (a, b, x, m))
    check("mul(@0,@1)", [x, a], tx * ta, variant)  # float32 * int64 -> float32
    check("add(@0,@1)", [m, a], tm + ta, variant)  # bool + int64 -> int64
    check("mul(@0,@1)", [x, m], tx * tm, variant)  # float32 * bool -> float32
    check("and(@0,gt(@1,0))", [m, b], tm & (tb > 0), variant)
    check("not(@0)", [m], ~tm, variant)
    check("sub(neg(@0),1)", [a], torch.bitwise_not(ta), variant)
    check("exp(div(@0,10))", [a], torch.exp(ta / 10), variant)  # int math -> float32
    for op in ("torch.logical_and", "torch.logical_or", "torch.logical_xor"):
        ins = [Value("a", a.shape, "int64"), Value("m", m.shape, "bool")]
        node = Node(op, "l", ins, [Value("y", a.shape, "bool")], {}, input_names=["input", "other"])
        (new,) = RULES[op](node, Context(None))
        check(new.expr, [a, m], getattr(torch, op.split(".")[1])(ta, tm), variant)


@pytest.mark.parametrize(
    "shapes_",
    [
        [(2, 64, 32, 32), (64, 1, 1), (1,)],  # split along batch; per-channel and scalar broadcast
        [(1, 96, 40, 40), (1, 96, 40, 40), (40,)],  # batch 1: split along channels; broadcast last axis
        [(1, 1, 300, 300), (1, 1, 1, 300), ()],  # split along the first long axis (rows)
    ],
)
def test_numpy_backend_split_over_threads(shapes_):
    """Tensors past parallel.SPLIT_MIN_ELEMENTS run as one slab per thread (two forced
    here, whatever this machine has); slabs must slice only the inputs that are not
    broadcast along the split axis, and relu6's clip fast path must keep NaN."""
    from pmx.runtime import parallel

    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in shapes_)
    a.flat[::97] = np.nan
    expr = "minimum(maximum(add(mul(@0,@1),@2),0),6)"
    assert parallel.worth_splitting(a.size, 2)
    for variant in ("numpy", "numpy_1t"):
        (got,) = run_kernel("elementwise", [a, b, c], expr=expr, variant=variant, threads=2)
        want = F.relu6(torch.from_numpy(a) * torch.from_numpy(b) + torch.from_numpy(c)).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert rel_error(np.nan_to_num(got), np.nan_to_num(want)) <= TOL


@pytest.mark.parametrize("numexpr_threads", [1, 2, 8])
def test_numexpr_work_follows_the_sessions_thread_count(numexpr_threads, monkeypatch):
    """pmx never changes numexpr's (process-wide) thread count, and numexpr work follows
    the InferenceSession's (2 here). A numexpr node past SPLIT_MIN_ELEMENTS is split into
    slabs over pmx's threads when numexpr runs on one thread, each slab reading only its
    share of the inputs that are not broadcast; with numexpr's pool as strong as the
    InferenceSession, that pool shares the program out and pmx does not split it; with a
    pool of another size (numexpr sized for the machine, not a container), the node runs
    on numpy in slabs over pmx's threads, and numexpr is not called."""
    import numexpr

    from pmx.runtime import parallel

    rng = np.random.default_rng(1)
    a = rng.standard_normal((1, 96, 40, 40)).astype(np.float32)
    b = rng.standard_normal((96, 1, 1)).astype(np.float32)
    expr = "where(gt(@0,0),@0,mul(@0,@1))"  # a per-channel PReLU, which the rule gives numexpr
    pieces, programs = [], []
    real_split, real_numexpr = parallel.split, E.compile_numexpr
    monkeypatch.setattr(parallel, "split", lambda parts, pool: pieces.append(len(parts)) or real_split(parts, pool))
    monkeypatch.setattr(E, "compile_numexpr", lambda *args: programs.append(1) or real_numexpr(*args))
    before = numexpr.set_num_threads(numexpr_threads)
    try:
        (got,) = run_kernel("elementwise", [a, b], expr=expr, variant="numexpr", threads=2)
        assert numexpr.get_num_threads() == numexpr_threads
    finally:
        numexpr.set_num_threads(before)
    assert pieces == ([] if numexpr_threads == 2 else [2]), pieces
    assert bool(programs) == (numexpr_threads in (1, 2)), programs
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert rel_error(got, torch.where(ta > 0, ta, ta * tb).numpy()) <= TOL


# The numpy backend's table form of GELU and desugar's one-divide form of SiLU: the
# canonical spellings must keep reaching them, and they must hold on strided views, in
# place, on both sides of the table and on NaN/inf.
_SPECIAL = [("F.gelu", "gelu", lambda x: 0.5 * x * torch.special.erfc(-x / math.sqrt(2))), ("F.silu", "silu", F.silu)]


@pytest.mark.parametrize("op,kind,fn", _SPECIAL, ids=[s[1] for s in _SPECIAL])
def test_special_forms_are_reached_from_canonical_spelling(op, kind, fn):
    from pmx.runtime import expr as E

    x = np.zeros((2, 3), np.float32)
    expr, _ = canon(op, {}, x)
    tree = expr
    if kind == "gelu":
        assert _gelu_operand(tree, [x]) is x
    else:
        assert E.desugar(tree) == ("div", ("@", 0), ("add", ("exp", ("neg", ("@", 0))), ("#", 1.0)))


@pytest.mark.parametrize("op,kind,fn", _SPECIAL, ids=[s[1] for s in _SPECIAL])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "in_place"])
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1.0, 4.0, 12.0]))
def test_special_forms_elementwise_accuracy(op, kind, fn, layout, seed, scale):
    from pmx.runtime import expr as E

    rng = np.random.default_rng(seed)
    base = np.asarray(rng.standard_normal((6, 40)) * scale, np.float32)
    edges = [-8.0001, -8.0, -7.9999, 5.9995, 6.0, 100.0, -30.0, 0.0, -0.0, 1e-30, np.inf, -np.inf, np.nan]
    base[0, : len(edges)] = edges
    x = base[:, ::2] if layout == "strided" else base  # a column slice: neither C nor F contiguous
    expr, _ = canon(op, {}, x)
    out = x if layout == "in_place" else np.empty_like(x)
    x_in = x.copy()
    want = fn(torch.from_numpy(x_in).double()).numpy()  # float64
    with np.errstate(all="ignore"):
        E.compile_numpy(expr, [x], out)()
    assert np.array_equal(np.isnan(out), np.isnan(want))
    infinite = np.isinf(want)
    assert np.array_equal(out[infinite], want[infinite])
    finite = np.isfinite(want)
    # elementwise relative error: the tails (GELU(-7.9) ~ 1e-14) count as much as the
    # middle, down to float32's smallest normal number; below it (GELU(-13.5) ~ -2e-41)
    # float32's own spacing is 1.4e-45 absolute, so the error is measured against that
    floor = np.finfo(np.float32).tiny
    err = np.abs(out[finite].astype(np.float64) - want[finite]) / np.maximum(np.abs(want[finite]), floor)
    assert err.max() <= TOL, f"{kind}: rel error {err.max():.3g} at x={x_in[finite][err.argmax()]}"


@pytest.mark.parametrize(
    "expr,want",
    [
        ("mul(@0,sigmoid(@0))", lambda x: x / (1 + np.exp(-x))),
        ("mul(@0,div(minimum(maximum(add(@0,3),0),6),6))", lambda x: x * np.clip(x + 3, 0, 6) / 6),
    ],
)
@pytest.mark.parametrize("in_place", [False, True])
def test_numpy_backend_writes_dying_operands_in_place(monkeypatch, expr, want, in_place):
    """A chain of ufunc steps over one tensor needs one temporary: each step may write
    into the buffer of the operand it reads for the last time. With an output that no
    input overlaps it needs none: the chain runs in the output itself."""
    from pmx.runtime import expr as E

    x = np.linspace(-8, 8, 1001, dtype=np.float32)
    x64 = x.astype(np.float64)
    out = x if in_place else np.empty_like(x)
    made, empty = [], np.empty
    monkeypatch.setattr(np, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    run = E.compile_numpy(E.parse(expr, 1), [x], out)
    monkeypatch.undo()
    run()
    # the backend's temporaries: np.empty(shape, dtype) of x's shape and dtype
    temporaries = [
        a for a in made if len(a) == 2 and tuple(np.atleast_1d(a[0])) == x.shape and np.dtype(a[1]) == x.dtype
    ]
    assert len(temporaries) == (1 if in_place else 0), f"{expr}: {len(temporaries)} temporaries"
    np.testing.assert_allclose(out, want(x64), rtol=1e-6, atol=1e-7)


def test_a_custom_last_step_reads_no_temporary_from_the_output():
    """where, a custom step, writes its output before it has read both branches: a
    branch kept in the output would be overwritten, so the output holds temporaries only
    when the last step is a ufunc or clip."""
    from pmx.runtime import expr as E

    x = np.linspace(-3, 3, 61, dtype=np.float32)
    out = np.empty_like(x)
    E.compile_numpy(E.parse("where(gt(@0,0),exp(@0),neg(@0))", 1), [x], out)()
    np.testing.assert_allclose(out, np.where(x > 0, np.exp(x), -x), rtol=1e-6)


_FLOAT_FUNCTIONS = ["add", "sub", "mul", "div", "maximum", "minimum", "exp", "neg", "abs", "tanh", "sigmoid", "square"]


def _float_trees(num_inputs):
    """Float-keeping expressions over every input, several reading it in separate
    branches (what needs two temporaries at once)."""
    leaves = st.one_of(
        st.integers(0, num_inputs - 1).map(lambda i: ("@", i)),
        st.sampled_from([0.5, -2.0, 3.0]).map(lambda v: ("#", v)),
    )
    return st.recursive(
        leaves,
        lambda kids: st.sampled_from(_FLOAT_FUNCTIONS).flatmap(
            lambda name: st.tuples(*[kids] * E.FUNCTIONS[name]).map(lambda args: (name, *args))
        ),
        max_leaves=10,
    ).filter(lambda t: t[0] not in ("@", "#"))


@settings(deadline=None)
@given(
    data=st.data(),
    shapes=st.sampled_from(
        [[(3, 4, 5)], [(3, 4, 5), (3, 4, 5)], [(3, 4, 5), (4, 1)], [(4, 1), (3, 4, 5)], [(1, 5), (3, 1, 1)]]
    ),
)
def test_temporaries_in_the_output_compute_what_separate_buffers_compute(data, shapes):
    """Random float32 expressions, the output free to hold temporaries or not (as if an
    input overlapped it): the same bits, and no step ever reads an output element a
    previous step overwrote before its time (the broadcast shapes make the output larger
    than some operands)."""
    from pmx.runtime import expr as E

    tree = data.draw(_float_trees(len(shapes)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    inputs = [np.asarray(rng.standard_normal(s) * 3, np.float32) for s in shapes]
    try:
        dtype = E.result_dtype(tree, [x.dtype for x in inputs])
    except Exception:  # trees numpy refuses
        reject()
    out_shape = np.broadcast_shapes(*shapes)
    results = []
    for free in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not free:
                mp.setattr(np, "may_share_memory", lambda *a, **k: True)
            out = np.full(out_shape, np.nan, dtype)
            with np.errstate(all="ignore"):
                E.compile_numpy(tree, inputs, out)()
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])


def test_numpy_plan_is_shared_but_temporaries_are_not(monkeypatch):
    """compile_numpy memoizes an expression's plan per shapes and dtypes (binding
    EfficientNet-B0 compiles SiLU for every conv and every split part of it), but each
    callable gets temporaries of its own: split parts run at the same time, so their
    steps interleave. The steps of two callables are run interleaved here."""
    from pmx.runtime import expr as E

    rng = np.random.default_rng(0)
    originals = [np.asarray(rng.standard_normal((64, 100)) * 4, np.float32) for _ in range(2)]
    # in place (out is the input, as write_inplace makes it): SiLU's four steps then need
    # one temporary
    xs = [x.copy() for x in originals]
    outs = xs
    tree = E.parse("mul(@0,sigmoid(@0))", 1)
    _numpy_plan.cache_clear()
    made, empty = [], np.empty
    monkeypatch.setattr(np, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    runs = [E.compile_numpy(tree, [x], out) for x, out in zip(xs, outs)]
    monkeypatch.undo()
    assert _numpy_plan.cache_info().hits == 1, "the second callable did not reuse the plan"
    temporaries = [a for a in made if len(a) == 2 and tuple(np.atleast_1d(a[0])) == xs[0].shape]
    assert len(temporaries) == 2, f"{len(temporaries)} temporaries for two callables"
    steps = [next(c.cell_contents for c in run.__closure__ if isinstance(c.cell_contents, list)) for run in runs]
    assert len(steps[0]) > 1
    with np.errstate(over="ignore"):
        for pair in zip(*steps):
            for step in pair:
                step()
    for x, out in zip(originals, outs):
        np.testing.assert_allclose(out, x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6, atol=1e-7)


_LITERALS = st.one_of(
    st.integers(-5, 5),
    st.sampled_from([2**53, 2**53 + 1, -(2**60), 10**30]),
    st.floats(-4, 4, width=32),
    st.sampled_from([math.inf, -math.inf, 0.5]),
    st.booleans(),
)


def _trees(num_inputs):
    leaves = st.one_of(st.integers(0, num_inputs - 1).map(lambda i: ("@", i)), _LITERALS.map(lambda v: ("#", v)))
    names = sorted(E.FUNCTIONS)
    return st.recursive(
        leaves,
        lambda kids: st.sampled_from(names).flatmap(
            lambda name: st.tuples(*[kids] * E.FUNCTIONS[name]).map(lambda args: (name, *args))
        ),
        max_leaves=8,
    )


@given(
    data=st.data(),
    num_inputs=st.integers(1, 2),
    dtypes=st.lists(st.sampled_from(["float16", "float32", "float64", "int64", "bool"]), min_size=2, max_size=2),
    same=st.booleans(),
)
def test_result_dtype_without_evaluation_agrees_with_evaluation(data, num_inputs, dtypes, same):
    """result_dtype answers float-keeping expressions over inputs of one float dtype
    without evaluating them; the evaluation on samples (_result_dtype) is the oracle,
    over random trees of every function, literal kind and dtype mix."""
    tree = data.draw(_trees(num_inputs))
    dtypes = [np.dtype(dtypes[0])] * num_inputs if same else [np.dtype(d) for d in dtypes[:num_inputs]]
    try:
        want = _result_dtype(tree, tuple(dtypes))
    except Exception:  # trees numpy refuses (logic on floats, overflowing ints)
        assert not (dtypes[0].kind == "f" and dtypes.count(dtypes[0]) == len(dtypes) and _keeps_float_dtype(tree))
        return
    assert E.result_dtype(tree, dtypes) == want, (tree, dtypes)


def test_expression_temporaries_are_shared_by_nodes_not_by_split_parts():
    """Inside a binding (a context with a pool of temporaries), an expression's
    temporaries come from BindContext.temporary_array: the k-th request of every node
    gets the pool's k-th buffer, so nodes share them while the split parts of one node,
    which run at the same time, each get their own. Both nodes still compute SiLU
    exactly."""
    from pmx.runtime.kernels.common import split_expression

    rng = np.random.default_rng(0)
    tree = E.parse("mul(@0,sigmoid(@0))", 1)  # in place: one temporary per part
    originals = [np.asarray(rng.standard_normal((512, 1024)) * 4, np.float32) for _ in range(2)]
    xs = [x.copy() for x in originals]
    pool, runs = [], []
    ctx = bind_context(kernel_pool(2, splits_gemms=None), np.empty(0, np.uint8), {}, pool)
    for x in xs:  # two nodes, bound one after the other
        runs.append(split_expression(ctx.begin_node(), tree, [x], x, threads=2))
    assert len(pool) == 2, f"{len(pool)} pooled temporaries for two nodes of two parts each"
    assert not np.shares_memory(pool[0], pool[1])
    with np.errstate(over="ignore"):
        for run in runs:
            run()
    for x, out in zip(originals, xs):
        np.testing.assert_allclose(out, x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6, atol=1e-7)


def test_aten_clamp_and_zero_spellings(tmp_path):
    """pnnx writes F.normalize's clamp (torchvision's SwinV2) as aten::clamp_min with the
    bound as a second input, and zero_() as aten::zero: they compile to the clamp and
    zeros torch computes, in the input's dtype."""
    from ziputil import build_zip

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    ops = [
        "pnnx.Input in 0 1 0 #0=(2,3)f32",
        "pnnx.Expression lo_bound 0 1 1 expr=-5.000000e-01",
        "pnnx.Expression hi_bound 0 1 2 expr=2.500000e-01",
        "aten::clamp_min lo 2 1 0 1 3 #0=(2,3)f32 #3=(2,3)f32",
        "aten::clamp_max hi 2 1 3 2 4 #3=(2,3)f32 #4=(2,3)f32",
        "aten::zero z 1 1 0 5 #0=(2,3)f32 #5=(2,3)f32",
        "pnnx.Expression sum 2 1 4 5 6 expr=add(@0,@1) #4=(2,3)f32 #5=(2,3)f32 #6=(2,3)f32",
        "pnnx.Output out 1 0 6",
    ]
    param = tmp_path / "m.pnnx.param"
    param.write_text("\n".join(["7767517", f"{len(ops)} 7", *ops]) + "\n")
    (tmp_path / "m.pnnx.bin").write_bytes(build_zip([]).data)
    compile_model(str(param), output=str(tmp_path / "m.pmx"))
    session = InferenceSession(str(tmp_path / "m.pmx"))
    x = np.array([[-2.0, -0.5, 0.0], [0.1, 0.25, 3.0]], np.float32)
    (y,) = session.run(None, {session.get_inputs()[0].name: x})
    want = torch.clamp_max(torch.clamp_min(torch.from_numpy(x), -0.5), 0.25) + torch.zeros(2, 3)
    np.testing.assert_array_equal(y, want.numpy())
    assert y.dtype == np.float32  # a number bound keeps float32, as torch (a 0-d float64 operand would not)
