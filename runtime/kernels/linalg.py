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
The contraction order is found once in the factory (np.einsum_path) and reused.
`embedding`: inputs (ids[...] int, weight[V, D]); output [..., D]. Ids outside [0, V) raise
PmxInputError at run time (torch raises IndexError); they are never clipped or wrapped,
so a bad id cannot silently read another row. padding_idx only matters for training.
"""

import math

import numpy as np

from pmx.runtime.errors import PmxInputError
from pmx.runtime.kernels import register
from pmx.runtime.kernels.common import gemm, view_as


def linear_infer(node, shapes, dtypes):
    if not shapes[0] or shapes[0][-1] != shapes[1][1]:
        raise ValueError(f"input {tuple(shapes[0])} does not end in the weight's {shapes[1][1]} features")
    features = shapes[1][0]
    # torch's linear adds a bias of (features,), (1,) or a number; the compiler's shape
    # pass runs this rule too, so a file with any other is refused naming the node
    if len(shapes) > 2 and not (len(shapes[2]) <= 1 and (not shapes[2] or shapes[2][0] in (1, features))):
        raise ValueError(f"bias {tuple(shapes[2])} does not fit the weight's {features} output features")
    return [(tuple(shapes[0][:-1]) + (features,), dtypes[0])]


@register("linear", infer=linear_infer)
def make_linear(node, inputs, outputs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    wt = w.T
    if x.ndim > 2 and x.flags.c_contiguous and out.flags.c_contiguous:
        # one GEMM over all leading dims instead of a batch of small ones
        x2, out2 = view_as(x, (math.prod(x.shape[:-1]), x.shape[-1])), view_as(out, (math.prod(out.shape[:-1]), out.shape[-1]))
    else:
        x2, out2 = x, out
    return gemm(x2, wt, out2, activation=node, bias=b)


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


@register("matmul", infer=matmul_infer)
def make_matmul(node, inputs, outputs):
    a, b = inputs
    out = outputs[0]
    return gemm(a, b, out, activation=node)


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
            t = t.replace("...", ell[n_ell - k:])
        if len(t) != r:
            raise ValueError(f"einsum term {t!r} does not match an operand of rank {r}")
        expanded.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(expanded)
        out = ell + "".join(sorted(c for c in set(letters) if c.islower() and letters.count(c) == 1))
    return expanded, out


def einsum_infer(node, shapes, dtypes):
    terms, out = _einsum_parts(node.attrs["equation"], [len(s) for s in shapes])
    sizes = {}
    for t, s in zip(terms, shapes):
        for c, d in zip(t, s):
            if d != 1 or c not in sizes:
                if sizes.get(c, 1) not in (1, d):
                    raise ValueError(f"einsum index {c!r} has sizes {sizes[c]} and {d}")
                sizes[c] = d
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
    return ([a.index(c) for c in batch + m + k], [b.index(c) for c in batch + k + n],
            [out_term.index(c) for c in batch + m + n])


@register("einsum", infer=einsum_infer)
def make_einsum(node, inputs, outputs):
    """A batched matmul in einsum's spelling runs as one (gemm: BLAS, split over the
    threads); np.einsum, even with an optimized path, falls back to its own loops when
    indices are kept as batch dims: MaxViT-T's (1,64,2,49,32) x (1,64,2,49,32) ->
    (1,64,2,49,49), one thread, 0.71 -> 0.37 ms. Anything else: np.einsum, with the
    contraction order found once."""
    terms, out_terms = _einsum_parts(node.attrs["equation"], [a.ndim for a in inputs])
    eq = ",".join(terms) + "->" + out_terms
    out = outputs[0]
    operands = tuple(inputs)
    axes = _batched_matmul_axes(terms, out_terms) if len(operands) == 2 else None
    if axes is not None:
        a, b = (x.transpose(p) for x, p in zip(operands, axes[:2]))
        return gemm(a, b, out.transpose(axes[2]))
    if len(operands) == 1:
        return lambda: np.einsum(eq, operands[0], out=out)
    path = np.einsum_path(eq, *operands, optimize="optimal")[0]
    return lambda: np.einsum(eq, *operands, out=out, optimize=path)


def embedding_infer(node, shapes, dtypes):
    return [(tuple(shapes[0]) + (shapes[1][1],), dtypes[1])]


@register("embedding", infer=embedding_infer)
def make_embedding(node, inputs, outputs):
    ids, weight = inputs
    out = outputs[0]
    rows = weight.shape[0]

    def run():
        if ids.size:
            lo, hi = ids.min(), ids.max()
            if lo < 0 or hi >= rows:
                bad = lo if lo < 0 else hi
                raise PmxInputError(f"embedding {node.name!r}: index {int(bad)} is out of range for a table of {rows} rows")
        np.take(weight, ids, axis=0, out=out, mode="clip")

    return run
