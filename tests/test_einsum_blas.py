"""Property tests for the einsum kernel (kernels/linalg.make_einsum) against torch.einsum:
random equations of 1-3 operands (diagonals, implicit outputs, dims of 1 broadcast
against longer ones, operands given as transposed or strided views) and the classic
forms, each kernel run twice with new input values written in place between runs (the
factory binds addresses once). And the rule the kernel exists for: no einsum reaches
numpy's BLAS, every GEMM goes through pmx's own (runtime/blas.py).

Float inputs are small multiples of 1/8, so float32 products and sums are exact in any
order; the tolerances (rtol 1e-4, atol 1e-5 for float32) only absorb what that leaves."""

import importlib
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import KernelNode, bind_context
from hypothesis import given, settings
from hypothesis import strategies as st

from pmx.runtime import blas

ALPHABET = "abcd"
LAYOUTS = ("contiguous", "transposed", "strided")
DTYPES = ("float32", "float32", "float64", "int64")
CLASSIC = [
    "bij,jk->bik",
    "ij,jk->ik",
    "bhid,bhjd->bhij",
    "i,i->",
    "ij,ij->i",
    "ijk,ikl,ilm->jm",
    "ii->i",
    "bi,bi->b",
    "i,j->ij",
]
# every GEMM a float einsum does runs pmx's BLAS: none is left for numpy's
NUMPY_BLAS_ENTRY_POINTS = ("dot", "tensordot", "matmul", "vdot", "inner")


def values(rng, shape, dtype):
    if np.dtype(dtype).kind == "i":
        return np.asarray(rng.integers(-3, 4, shape), dtype)
    return np.asarray(rng.integers(-8, 9, shape) / 8, dtype)


def laid_out(x, layout):
    """x's values in an array of the given memory layout: C order, reversed strides (a
    transposed view), or every other element of a wider buffer along the last axis."""
    if layout == "transposed":
        return np.array(x.T, order="C").T
    if layout == "strided" and x.ndim:
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x.copy()


def bound_einsum(eq, ops):
    """(the einsum kernel bound to `ops` as given, in any layout, and its output): as
    helpers.run_kernel binds kernels, over NaN-filled scratch, without making the operands
    contiguous first."""
    from pmx.runtime.kernels.registry import get, node_scratch_nbytes

    node = KernelNode("einsum", dict(equation=eq))
    kernel = get("einsum")
    ((shape, dtype),) = kernel.infer(node, [x.shape for x in ops], [x.dtype for x in ops])
    out = np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype)
    ctx = bind_context(None, None, {}, [])
    ctx.scratch = np.full(-(-node_scratch_nbytes(node, list(ops), [out], ctx) // 4), np.nan, np.float32).view(np.uint8)
    fn = kernel.make(node, list(ops), [out], ctx)
    assert ctx.shortfall == 0
    return fn, out


def oracle(eq, ops):
    wide = np.int64 if ops[0].dtype.kind == "i" else np.float64
    return torch.einsum(eq, *[torch.from_numpy(np.array(o, dtype=wide)) for o in ops]).numpy()


def assert_matches(got, want):
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    if got.dtype.kind == "i":
        np.testing.assert_array_equal(got, want)
    elif got.dtype == np.float32:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def check_einsum(eq, shapes, layouts, dtype, seed):
    """Bind the kernel to operands of `shapes` in `layouts`, run it, write new values into
    the operands in place, run it again; both results must match torch's."""
    rng = np.random.default_rng(seed)
    ops = [laid_out(values(rng, s, dtype), lay) for s, lay in zip(shapes, layouts)]
    fn, out = bound_einsum(eq, ops)
    for run in range(2):
        if run:
            for op in ops:
                op[...] = values(rng, op.shape, dtype)
        fn()
        assert_matches(out, oracle(eq, ops))


@st.composite
def shapes_for(draw, terms):
    """Shapes for `terms`: each index 1..5 long, and in an operand sometimes 1 (broadcast
    against the others; both dims of a diagonal alike)."""
    sizes = {c: draw(st.integers(1, 5)) for c in sorted(set("".join(terms)))}
    shapes = []
    for term in terms:
        own = {c: 1 if draw(st.integers(0, 5)) == 0 else sizes[c] for c in sorted(set(term))}
        shapes.append(tuple(own[c] for c in term))
    return shapes


@st.composite
def random_einsums(draw):
    """(equation, shapes, layouts, dtype, seed) of 1-3 operands of rank 0-4 over a small
    alphabet, so that operands share indices; the output drops a shared index (a
    contraction) more often than an index of one operand (summed out of it alone)."""
    n_ops = draw(st.sampled_from([1, 2, 2, 3, 3]))
    terms = ["".join(draw(st.lists(st.sampled_from(ALPHABET), max_size=4, unique=True))) for _ in range(n_ops)]
    i = draw(st.integers(0, n_ops - 1))
    if terms[i] and draw(st.integers(0, 4)) == 0:  # a diagonal: one index twice in one term
        c, at = draw(st.sampled_from(terms[i])), draw(st.integers(0, len(terms[i])))
        terms[i] = terms[i][:at] + c + terms[i][at:]
    used = sorted(set("".join(terms)))
    if draw(st.integers(0, 4)) == 0:
        eq = ",".join(terms)  # implicit output: the indices seen once, in order
    else:
        shared = {c for c in used if sum(c in t for t in terms) > 1}
        kept = [c for c in draw(st.permutations(used)) if draw(st.integers(0, 2)) < (1 if c in shared else 2)]
        eq = ",".join(terms) + "->" + "".join(kept)
    layouts = [draw(st.sampled_from(LAYOUTS)) for _ in terms]
    return eq, draw(shapes_for(terms)), layouts, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None)
@given(case=random_einsums())
def test_einsum_random_equations(case):
    check_einsum(*case)


@pytest.mark.parametrize("eq", CLASSIC)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_einsum_classic_forms(eq, data):
    terms = eq.split("->")[0].split(",")
    layouts = [data.draw(st.sampled_from(LAYOUTS)) for _ in terms]
    dtype = data.draw(st.sampled_from(DTYPES))
    check_einsum(eq, data.draw(shapes_for(terms)), layouts, dtype, data.draw(st.integers(0, 2**32 - 1)))


def _refuse(name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"numpy's {name} called: its BLAS")

    return refuse


@pytest.mark.parametrize(
    "eq,shapes",
    [
        ("bij,jk->bik", [(2, 3, 4), (4, 5)]),
        ("bik,bjk", [(2, 3, 4), (2, 5, 4)]),
        ("ijk,ikl,ilm->jm", [(2, 3, 4), (2, 4, 5), (2, 5, 3)]),
        ("ij,jk,kl,lm->im", [(6, 7), (7, 8), (8, 9), (9, 5)]),
        ("bhid,bhjd->bhij", [(2, 2, 3, 4), (2, 2, 5, 4)]),
        ("iij,jk->ik", [(3, 3, 4), (4, 2)]),
        ("i,j->ij", [(3,), (4,)]),
    ],
)
def test_einsum_never_calls_numpy_blas(eq, shapes):
    """Building and running the kernel works with numpy's BLAS entry points refusing to
    run: np.dot/tensordot/matmul/..., and the matmul np.einsum's optimized path has bound
    in its own module; every np.einsum call the kernel makes passes optimize=False."""
    rng = np.random.default_rng(0)
    ops = [values(rng, s, np.float32) for s in shapes]
    real_einsum = np.einsum

    def einsum_unoptimized(*args, **kwargs):
        assert kwargs.get("optimize") is False, f"np.einsum called with optimize={kwargs.get('optimize')!r}"
        return real_einsum(*args, **kwargs)

    einsumfunc = importlib.import_module("numpy._core.einsumfunc")
    with mock.patch.object(np, "einsum", einsum_unoptimized):
        patches = [mock.patch.object(np, name, _refuse(name)) for name in NUMPY_BLAS_ENTRY_POINTS]
        patches += [
            mock.patch.object(einsumfunc, name, _refuse(name))
            for name in NUMPY_BLAS_ENTRY_POINTS
            if hasattr(einsumfunc, name)
        ]
        for p in patches:
            p.start()
        try:
            fn, out = bound_einsum(eq, ops)
            fn()
        finally:
            for p in reversed(patches):
                p.stop()
    assert_matches(out, oracle(eq, ops))


@pytest.mark.parametrize(
    "eq,shapes,gemms",
    [
        ("bij,jk->bik", [(2, 3, 4), (4, 5)], 1),
        ("bik,bjk", [(2, 3, 4), (2, 5, 4)], 1),
        ("ijk,ikl,ilm->jm", [(2, 3, 4), (2, 4, 5), (2, 5, 3)], 2),
        ("ij,jk,kl,lm->im", [(6, 7), (7, 8), (8, 9), (9, 5)], 3),
        ("i,j->ij", [(3,), (4,)], 0),  # no index contracted: an elementwise product
        ("ii->i", [(3, 3)], 0),
    ],
)
def test_einsum_contractions_are_blas_matmuls(eq, shapes, gemms):
    """Each pairwise contraction of a float einsum is one blas.matmul, made in the factory."""
    rng = np.random.default_rng(1)
    ops = [values(rng, s, np.float32) for s in shapes]
    made = []
    real = blas.matmul
    with mock.patch.object(blas, "matmul", lambda *a: made.append(a) or real(*a)):
        fn, out = bound_einsum(eq, ops)
    assert len(made) == gemms, eq
    fn()
    assert_matches(out, oracle(eq, ops))
