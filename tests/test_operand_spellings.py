"""Operands read exactly as pnnx wrote them: a binary op, comparison or select takes a
number or a tensor in either position (pnnx's ONNX import writes `torch.lt input=2.0
$other=x`), and the answer is torch's for that spelling. Where an op cannot take what was
written, the compile refuses naming the line; it never reads another operand instead."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from paramgraph import run_one_op

from pmx.runtime.errors import PmxCompileError

# torch op -> how torch computes it on (a, b), either of which may be a 0-d tensor standing
# for the number (a dimensionless operand promotes like a Python number)
BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "atan2": torch.atan2,
    "fmod": torch.fmod,
    "remainder": torch.remainder,
    "floor_divide": torch.floor_divide,
    "gt": torch.gt,
    "ge": torch.ge,
    "lt": torch.lt,
    "le": torch.le,
    "eq": torch.eq,
    "ne": torch.ne,
    "logaddexp": torch.logaddexp,
}


def number_text(v):
    return repr(int(v)) if isinstance(v, int) else f"{v:e}"


def torch_number(v):
    return torch.tensor(v, dtype=torch.int64 if isinstance(v, int) else torch.float32)


def check(op, number, x, number_first):
    """pmx on `torch.<op>` with the number written first or second, against torch."""
    t = torch.from_numpy(x)
    a, b = (torch_number(number), t) if number_first else (t, torch_number(number))
    want = BINARY[op](a, b).numpy()
    if number_first:
        params, labels = f"input={number_text(number)}", ["other"]
    else:
        params, labels = f"other={number_text(number)}", ["input"]
    (got,) = run_one_op(f"torch.{op}", params, [x], [want], labels=labels)
    assert got.dtype == want.dtype, (op, number_first, got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("op", sorted(BINARY))
@given(
    number=st.one_of(st.integers(-3, 3), st.floats(-3, 3, allow_nan=False).map(lambda f: round(f, 3))),
    seed=st.integers(0, 2**16),
    number_first=st.booleans(),
)
def test_a_number_in_either_position(op, number, seed, number_first):
    if op in ("fmod", "remainder", "floor_divide", "div") and number == 0 and not number_first:
        number = 2  # x / 0: inf or an error by dtype, not what this test is about
    x = (np.random.default_rng(seed).standard_normal((3, 4)) * 2).astype(np.float32)
    if op in ("fmod", "remainder", "floor_divide") and number_first:
        x[np.abs(x) < 0.1] = 0.5  # keep divisors off zero
    check(op, number, x, number_first)


@pytest.mark.parametrize("number_first", [True, False])
def test_onnx_shrink_body_compares_the_number_with_the_tensor(number_first):
    """ONNX's Shrink and ThresholdedRelu bodies as pnnx writes them: `torch.lt
    input=2.0 $other=x` is 2.0 < x, never x < x."""
    x = np.linspace(-4, 4, 12, dtype=np.float32).reshape(3, 4)
    check("lt", 2.0, x, number_first)


def test_where_takes_a_number_in_either_branch():
    cond = np.array([[True, False, True]])
    x = np.arange(3, dtype=np.float32).reshape(1, 3)
    for params, labels, want in (
        ("input=5.0", ["condition", "other"], np.where(cond, 5.0, x)),
        ("other=5.0", ["condition", "input"], np.where(cond, x, 5.0)),
    ):
        (got,) = run_one_op("torch.where", params, [cond, x], [want.astype(np.float32)], labels=labels)
        np.testing.assert_array_equal(got, want)


def test_a_number_where_a_tensor_is_needed_is_refused_naming_the_line():
    """An op that takes tensors only, given a number: refused, and no other labelled
    operand is read in its place."""
    x = np.ones((2, 2), np.float32)
    with pytest.raises(PmxCompileError, match=r"torch.logical_and 'the_op' \(line \d+\): operand other=2.0"):
        run_one_op("torch.logical_and", "other=2.0", [x], [x.astype(bool)], labels=["input"])
    with pytest.raises(
        PmxCompileError, match=r"F.relu 'the_op' \(line \d+\): input=1.5 is a number where pmx reads a tensor"
    ):
        run_one_op("F.relu", "input=1.5", [x], [x], labels=["other"])


# --- reductions over no elements: torch's identity, or torch's refusal ------------------

REDUCTIONS = {
    "sum": lambda t: torch.sum(t, dim=1),
    "prod": lambda t: torch.prod(t, dim=1),
    "mean": lambda t: torch.mean(t, dim=1),
    "logsumexp": lambda t: torch.logsumexp(t, dim=1),
    "amax": lambda t: torch.amax(t, dim=1),
    "argmax": lambda t: torch.argmax(t, dim=1),
}
PARAMS = {"sum": "dim=(1) keepdim=False", "mean": "dim=(1) keepdim=False", "amax": "dim=(1) keepdim=False"}


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_a_reduction_over_no_elements_is_torchs(op):
    """sum 0, prod 1, mean nan, logsumexp -inf; max-like reductions have no identity and
    torch refuses them, so the compile refuses them naming the line."""
    x = np.zeros((2, 0, 3), np.float32)
    params = PARAMS.get(op, "dim=1 keepdim=False")
    try:
        want = REDUCTIONS[op](torch.from_numpy(x)).numpy()
    except (RuntimeError, IndexError):
        with pytest.raises(PmxCompileError, match=r"the_op' \(line \d+\).*no elements to reduce"):
            run_one_op(f"torch.{op}", params, [x], [np.zeros((2, 3), np.float32)], labels=["input"])
        return
    (got,) = run_one_op(f"torch.{op}", params, [x], [want], labels=["input"])
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_split_without_a_dim_is_refused_naming_the_line():
    """pnnx writes dim=None for ONNX's Split without an axis."""
    x = np.ones((4, 2), np.float32)
    with pytest.raises(
        PmxCompileError, match=r"torch.split 'the_op' \(line \d+\): dim=None: torch.split needs one int dim"
    ):
        run_one_op("torch.split", "dim=None split_size_or_sections=2", [x], [x[:2], x[2:]], labels=["tensor"])
