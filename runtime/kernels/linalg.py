"""Linear algebra.

`linear`: inputs (x[..., in], weight[out, in], bias[out]?); y = x @ weight.T + bias. The
transposed weight is a view, BLAS reads it without a copy. node.expr: fused activation.
`matmul`: inputs (a, b) with numpy/torch broadcasting (1-d operands as in torch.matmul);
node.expr: fused activation.
Both go through `common.gemm`: one BLAS call on BLAS's own threads, or, where BLAS runs
on one thread, parts split over the InferenceSession's threads, each with its share of the bias
(BLAS accumulating onto it: runtime/blas.py) and followed by the activation while it is
still in cache.
`einsum`: inputs (operands...); attrs equation (numpy/torch einsum syntax, '...' allowed).
No einsum reaches numpy's BLAS (np.einsum's optimized path calls it, via matmul/tensordot):
each pairwise contraction, in an order found once in the factory, is one blas.matmul;
diagonals, one-operand einsums and non-float dtypes run np.einsum(optimize=False).
`embedding`: inputs (ids[...] int, weight[V, D]); output [..., D]. Ids outside [0, V) raise
PmxInputError at run time (torch raises IndexError); they are never clipped or wrapped,
so a bad id cannot silently read another row. padding_idx only matters for training.
"""

import functools
import math

import numpy as np

from pmx.runtime import blas
from pmx.runtime.errors import PmxInputError
from pmx.runtime.kernels.attr_specs import STRING
from pmx.runtime.kernels.common import chain, expect_operand, gemm, view_as
from pmx.runtime.kernels.registry import register, weight_macs


def linear_infer(node, shapes, dtypes):
    expect_operand(shapes, dtypes, 1, "weight", dtype=dtypes[0])
    if len(shapes[1]) != 2:
        raise ValueError(f"weight {tuple(shapes[1])} is not a (features out, features in) matrix")
    if len(shapes) > 2 and shapes[2] is not None:
        expect_operand(shapes, dtypes, 2, "bias", dtype=dtypes[0])
    if not shapes[0] or shapes[0][-1] != shapes[1][1]:
        raise ValueError(f"input {tuple(shapes[0])} does not end in the weight's {shapes[1][1]} features")
    features = shapes[1][0]
    # torch's linear adds a bias of (features,), (1,) or a number; the compiler's shape
    # pass runs this rule too, so a file with any other is refused naming the node
    if len(shapes) > 2 and not (len(shapes[2]) <= 1 and (not shapes[2] or shapes[2][0] in (1, features))):
        raise ValueError(f"bias {tuple(shapes[2])} does not fit the weight's {features} output features")
    return [(tuple(shapes[0][:-1]) + (features,), dtypes[0])]


@register("linear", infer=linear_infer, float_input=True, rows=True, macs=weight_macs)
def make_linear(node, inputs, outputs, ctx):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    wt = w.T
    if x.ndim > 2 and x.flags.c_contiguous and out.flags.c_contiguous:
        # one GEMM over all leading dims instead of a batch of small ones
        x2, out2 = (
            view_as(x, (math.prod(x.shape[:-1]), x.shape[-1])),
            view_as(out, (math.prod(out.shape[:-1]), out.shape[-1])),
        )
    else:
        x2, out2 = x, out
    return gemm(ctx, x2, wt, out2, activation=node, bias=b)


def matmul_infer(node, shapes, dtypes):
    a, b = shapes
    a2 = (1,) + tuple(a) if len(a) == 1 else tuple(a)
    b2 = tuple(b) + (1,) if len(b) == 1 else tuple(b)
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul of {tuple(a)} and {tuple(b)}: inner dims {a2[-1]} and {b2[-2]} differ")
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    shape = tuple(batch) + (a2[-2], b2[-1])
    if len(a) == 1:
        shape = shape[:-2] + shape[-1:]
    if len(b) == 1:
        shape = shape[:-1]
    return [(shape, np.result_type(dtypes[0], dtypes[1]))]


@register("matmul", infer=matmul_infer, rows=True)
def make_matmul(node, inputs, outputs, ctx):
    a, b = inputs
    out = outputs[0]
    return gemm(ctx, a, b, out, activation=node)


def _einsum_parts(equation, ranks):
    """Split an einsum equation into per-operand subscripts (with '...' expanded to
    upper-case letters, which torch does not allow in subscripts) and the output's."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"einsum {equation!r} has {len(terms)} operands, got {len(ranks)} inputs")
    n_ell = 0
    for t, r in zip(terms, ranks):
        if "..." in t:
            n_ell = max(n_ell, r - (len(t) - 3))
    ell = "".join(chr(ord("A") + i) for i in range(n_ell))
    expanded = []
    for t, r in zip(terms, ranks):
        if "..." in t:
            k = r - (len(t) - 3)
            t = t.replace("...", ell[n_ell - k :])
        if len(t) != r:
            raise ValueError(f"einsum term {t!r} does not match an operand of rank {r}")
        expanded.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(expanded)
        out = ell + "".join(sorted(c for c in set(letters) if c.islower() and letters.count(c) == 1))
    return expanded, out


def _index_sizes(terms, shapes):
    """Each index's size over all terms: a dim of 1 broadcasts against any other size."""
    sizes = {}
    for t, s in zip(terms, shapes):
        for c, d in zip(t, s):
            if d != 1 or c not in sizes:
                if sizes.get(c, 1) not in (1, d):
                    raise ValueError(f"einsum index {c!r} has sizes {sizes[c]} and {d}")
                sizes[c] = d
    return sizes


def einsum_infer(node, shapes, dtypes):
    terms, out = _einsum_parts(node.attrs["equation"], [len(s) for s in shapes])
    sizes = _index_sizes(terms, shapes)
    return [(tuple(sizes[c] for c in out), np.result_type(*dtypes))]


def _batched_matmul_axes(terms, out_term):
    """(axes of a, of b, of out) that make a two-operand einsum one batched matmul,
    (batch..., m, k) @ (batch..., k, n) -> (batch..., m, n), on transposed views: each
    index appears once per term, one index is contracted (in both operands, not the
    output), each operand has one index of its own (also in the output), and the rest
    are in all three. Attention written as einsum ("bhid,bhjd->bhij", MaxViT's
    "ijkln,ijkmn->ijklm") is. None otherwise."""
    a, b = terms
    if any(len(set(t)) != len(t) for t in (a, b, out_term)):
        return None
    m, n = [c for c in a if c not in b], [c for c in b if c not in a]
    k = [c for c in a if c in b and c not in out_term]
    batch = [c for c in out_term if c in a and c in b]
    if len(m) != 1 or len(n) != 1 or len(k) != 1 or sorted(out_term) != sorted(batch + m + n):
        return None
    return (
        [a.index(c) for c in batch + m + k],
        [b.index(c) for c in batch + k + n],
        [out_term.index(c) for c in batch + m + n],
    )


# the dtypes BLAS multiplies; einsums of any other run numpy's own loops
_BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@register("einsum", infer=einsum_infer, attrs=dict(equation=STRING))
def make_einsum(node, inputs, outputs, ctx):
    """A batched matmul in einsum's spelling runs as one (gemm: BLAS, split over the
    threads); np.einsum, even with an optimized path, falls back to its own loops when
    indices are kept as batch dims: MaxViT-T's (1,64,2,49,32) x (1,64,2,49,32) ->
    (1,64,2,49,49) measured faster as one GEMM, one thread (docs/performance.md, "Kernel
    measurements"). Any other float einsum of two operands or more: pairwise contractions
    (_contractions), each one blas.matmul. One operand, or a dtype BLAS lacks: np.einsum
    without optimize, which never calls BLAS."""
    terms, out_term = _einsum_parts(node.attrs["equation"], [a.ndim for a in inputs])
    out = outputs[0]
    operands = tuple(inputs)
    fast = _batched_matmul(ctx, terms, out_term, operands, out)
    if fast is not None:
        return fast
    if len(operands) == 1 or out.dtype not in _BLAS_DTYPES:
        return _numpy_einsum(terms, out_term, operands, out)
    return _contractions(terms, out_term, operands, out)


def _batched_matmul(ctx, terms, out_term, operands, out):
    """gemm over transposed views when the einsum is one batched matmul
    (_batched_matmul_axes), else None."""
    axes = _batched_matmul_axes(terms, out_term) if len(operands) == 2 else None
    if axes is None:
        return None
    a, b = (x.transpose(p) for x, p in zip(operands, axes[:2]))
    # matmul broadcasts batch dims only, not a contracted dim of 1 against k as einsum does;
    # other dtypes, or mixed ones, would reach np.matmul (numpy's BLAS for complex numbers)
    if a.shape[-1] != b.shape[-2] or out.dtype not in _BLAS_DTYPES or not a.dtype == b.dtype == out.dtype:
        return None
    return gemm(ctx, a, b, out.transpose(axes[2]))


def _numpy_einsum(terms, out_term, operands, out):
    """np.einsum with optimize=False: numpy's own C loops, which never call BLAS (its
    optimized path multiplies through matmul or tensordot, that is numpy's BLAS)."""
    eq = ",".join(terms) + "->" + out_term
    return lambda: np.einsum(eq, *operands, out=out, optimize=False)


def _contractions(terms, out_term, operands, out):
    """Callable for an einsum of two operands or more as pairwise contractions in the
    order np.einsum_path finds (once, here), each into an intermediate buffer made here;
    the last writes out. An intermediate keeps the indices still needed by the remaining
    operands or the output, batch ones first so that its GEMM writes it as it lies."""
    if len(operands) == 2:
        path = [(0, 1)]
    else:
        eq = ",".join(terms) + "->" + out_term
        path = np.einsum_path(eq, *operands, optimize="optimal")[0][1:]
    terms, arrays, steps = list(terms), list(operands), []
    for n, positions in enumerate(path):
        picked_terms, picked = [terms[i] for i in positions], [arrays[i] for i in positions]
        for i in sorted(positions, reverse=True):
            del terms[i], arrays[i]
        if n == len(path) - 1:
            result_term, result = out_term, out
        else:
            result_term = _kept_term(picked_terms, "".join(terms) + out_term)
            sizes = _index_sizes(picked_terms, [x.shape for x in picked])
            result = np.empty([sizes[c] for c in result_term], out.dtype)
        steps.append(_contraction(picked_terms, result_term, picked, result))
        terms.append(result_term)
        arrays.append(result)
    return chain(*steps)


def _kept_term(picked_terms, needed):
    """The term of an intermediate: the picked terms' indices found in `needed`, each
    once, those in every picked term first (a GEMM's batch), then the first term's own,
    then the second's."""
    kept = dict.fromkeys(c for c in "".join(picked_terms) if c in needed)
    return "".join(sorted(kept, key=lambda c: not all(c in t for t in picked_terms)))


def _contraction(terms, out_term, operands, out):
    """Callable for one step of _contractions: two operands without repeated indices as
    a GEMM (_pair); anything else (a diagonal, one operand) by numpy's own loops."""
    if len(operands) == 2 and all(len(set(t)) == len(t) for t in (*terms, out_term)):
        return _pair(*terms, out_term, *operands, out)
    return _numpy_einsum(terms, out_term, operands, out)


def _pair(a_term, b_term, out_term, a, b, out):
    """Callable for out = einsum(a_term,b_term->out_term)(a, b), distinct indices per term.
    Indices of one operand alone that the output drops are summed out of it first; then
    with an index in both operands and not the output, one blas.matmul of (batch, M, K) @
    (batch, K, N), where M merges a's indices kept in the output, N b's, K the contracted
    ones; without one, an elementwise product (an outer product needs no GEMM)."""
    a, a_term, sum_a = _summed(a, a_term, b_term + out_term, out.dtype)
    b, b_term, sum_b = _summed(b, b_term, a_term + out_term, out.dtype)
    if not any(c in b_term and c not in out_term for c in a_term):
        av, bv = (
            view_as(
                x.transpose(sorted(range(len(t)), key=lambda i: out_term.index(t[i]))),
                [x.shape[t.index(c)] if c in t else 1 for c in out_term],
            )
            for x, t in ((a, a_term), (b, b_term))
        )
        return chain(sum_a, sum_b, lambda: np.multiply(av, bv, out=out))
    return chain(sum_a, sum_b, _pair_matmul(a_term, b_term, out_term, a, b, out))


def _summed(x, term, needed, dtype):
    """(x with the indices of `term` not in `needed` summed out, its term, the step doing
    it into a buffer made here), or (x, term, None) when there are none."""
    gone = tuple(i for i, c in enumerate(term) if c not in needed)
    if not gone:
        return x, term, None
    buffer = np.empty([d for c, d in zip(term, x.shape) if c in needed], dtype)
    step = functools.partial(np.sum, x, axis=gone, dtype=dtype, out=buffer)
    return buffer, "".join(c for c in term if c in needed), step


def _pair_matmul(a_term, b_term, out_term, a, b, out):
    """_pair's GEMM: each operand transposed to (batch, own, contracted) order, merged to
    three dims by a view where its strides allow, else copied into a buffer made here
    each run (also when its dtype is not out's); out likewise, through a buffer when it
    cannot be viewed so or overlaps an operand. Batch dims of 1 broadcast as in matmul;
    a contracted dim of 1 against a longer one is broadcast before the copy."""
    batch = [c for c in out_term if c in a_term and c in b_term]
    free_a = [c for c in a_term if c in out_term and c not in b_term]
    free_b = [c for c in b_term if c in out_term and c not in a_term]
    contracted = [c for c in a_term if c in b_term and c not in out_term]
    sizes = _index_sizes((a_term, b_term), (a.shape, b.shape))
    m, n, k = (math.prod(sizes[c] for c in group) for group in (free_a, free_b, contracted))
    a_view = _arranged(a, a_term, batch + free_a + contracted, contracted, sizes)
    b_view = _arranged(b, b_term, batch + contracted + free_b, contracted, sizes)
    nb = len(batch)
    a_mat, copy_a = _as_shape(a_view, a_view.shape[:nb] + (m, k), out.dtype)
    b_mat, copy_b = _as_shape(b_view, b_view.shape[:nb] + (k, n), out.dtype)
    out_view = out.transpose([out_term.index(c) for c in batch + free_a + free_b])
    target = out_view.shape[:nb] + (m, n)
    out_mat = _view_or_none(out_view, target)
    copy_out = None
    if out_mat is None or np.may_share_memory(out, a) or np.may_share_memory(out, b):
        out_mat = np.empty(target, out.dtype)
        copy_out = functools.partial(np.copyto, out_view, view_as(out_mat, out_view.shape))
    return chain(copy_a, copy_b, blas.matmul(a_mat, b_mat, out_mat), copy_out)


def _arranged(x, term, order, broadcast, sizes):
    """x transposed to `order`, its dims of 1 among the indices `broadcast` stretched
    (stride 0, a view) to the size they take in the product."""
    xt = x.transpose([term.index(c) for c in order])
    return np.broadcast_to(xt, [sizes[c] if c in broadcast else d for c, d in zip(order, xt.shape)])


def _view_or_none(x, shape):
    """x viewed as `shape` without a copy, or None when its strides do not allow it."""
    try:
        return view_as(x, shape)
    except AttributeError:
        return None


def _as_shape(x, shape, dtype):
    """(x as `shape` and dtype, the step filling it, or None): a view where strides and
    dtype allow, else a buffer made here that the step copies x into each run."""
    view = _view_or_none(x, shape) if x.dtype == dtype else None
    if view is not None:
        return view, None
    buffer = np.empty(shape, dtype)
    return buffer, functools.partial(np.copyto, view_as(buffer, x.shape), x)


def embedding_infer(node, shapes, dtypes):
    expect_operand(shapes, dtypes, 0, "ids", kinds="iu")
    if len(shapes[1]) != 2:
        raise ValueError(f"weight {tuple(shapes[1])} is not a (rows, features) table")
    return [(tuple(shapes[0]) + (shapes[1][1],), dtypes[1])]


# rows apart when the table is not the batch: out[i] = table[ids[i]], and a table with
# the batch in dim 0 (F.embedding(ids, x)) would be looked up in each chunk's rows only
@register("embedding", infer=embedding_infer, rows=lambda node, ranks, batched: not batched[1])
def make_embedding(node, inputs, outputs, ctx):
    ids, weight = inputs
    out = outputs[0]
    rows = weight.shape[0]

    def run():
        if ids.size:
            lo, hi = ids.min(), ids.max()
            if lo < 0 or hi >= rows:
                bad = lo if lo < 0 else hi
                raise PmxInputError(
                    f"embedding {node.name!r}: index {int(bad)} is out of range for a table of {rows} rows"
                )
        np.take(weight, ids, axis=0, out=out, mode="clip")

    return run
