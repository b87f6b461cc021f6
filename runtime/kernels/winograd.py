"""3x3 stride-1 convolution by Winograd's minimal filtering F(2x2, 3x3) (Lavin & Gray,
"Fast Algorithms for Convolutional Neural Networks", 2015).

Op `conv_winograd`: inputs (x[N, C, H, W], u[4, 4, K, C], bias[K]?), attrs pads
(top, left, bottom, right; zeros padding); node.expr an optional fused activation.
The compiler's prepack_weights pass rewrites a `conv` that choose_kernels (or --tune)
gave the variant "winograd" into this op and stores u = G g G^T of each 3x3 filter g
(computed in float64), so the runtime never transforms or copies weights.

Each 2x2 block of outputs comes from a 4x4 tile of the padded input (tiles overlap by
two): V = B^T d B per tile and channel, then 16 GEMMs M[r, s] = u[r, s] @ V[r, s]
(K x C times C x tiles: 16 multiplies per 4 outputs instead of 36), then Y = A^T M A.
The transforms are additions only. They run over "wide" flat arrays: the padded input
is stored as its four (row parity, column parity) phases, each flattened per channel
and image, so every term of a transform is one contiguous slice at a fixed offset of
the whole tensor and each numpy call covers all channels at once (rows of 7-56 elements
would cost more in per-row overhead than in arithmetic). Positions past a plane's last
tile are computed and discarded. The bias is added to M[1, 1], which A^T M A adds to
every output of the tile. Images are columns of the same GEMMs.

Threads: the input transform is split by channels, then the GEMMs, output transform,
the copy out and the activation by output channels (two dispatches per conv).
Measured against the im2col GEMM (kernels/conv.py), one thread, ResNet-18 and
DenseNet shapes: faster from 32 input channels and 14x14 outputs up; slower on 7x7
outputs (few tiles: the GEMMs are narrow) and on few input channels (the transforms cost
more than the GEMM saves) (docs/performance.md, "Kernel measurements"). choose_kernels'
rule picks accordingly.
"""

import math

import numpy as np

from pmx.runtime import blas, parallel
from pmx.runtime.kernels.attr_specs import ints
from pmx.runtime.kernels.bind import scratch_nbytes
from pmx.runtime.kernels.common import chain, copy_strided, gemm_node_threads, split_activated
from pmx.runtime.kernels.registry import register

# Split over threads only from this many multiply-adds: the two dispatches and the ~40
# numpy calls per part cost more than they save below it (measured: 4-11M lose, 14M
# breaks even, 44M gains 1.3x on two cores).
SPLIT_MIN_MACS = 1 << 24

# G of F(2x2, 3x3): u = G g G^T (4x4 per 3x3 filter)
G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def transform_weights(w):
    """u[4, 4, K, C] = G g G^T for every 3x3 filter g of w[K, C, 3, 3], in float64,
    returned in w's dtype (the compiler stores it; tune times with it)."""
    u = np.einsum("ai,kcij,bj->abkc", G, np.asarray(w, dtype=np.float64), G)
    return np.ascontiguousarray(u.astype(w.dtype))


def winograd_infer(node, shapes, dtypes):
    x, u = shapes[0], shapes[1]
    pt, pl, pb, pr = node.attrs["pads"]
    if len(x) != 4 or len(u) != 4 or tuple(u[:2]) != (4, 4) or u[3] != x[1]:
        raise ValueError(
            f"input {tuple(x)} and transformed weight {tuple(u)} do not fit (expected x[N, C, H, W] and u[4, 4, K, C])"
        )
    if len(shapes) > 2 and shapes[2] is not None and tuple(shapes[2]) != (u[2],):
        raise ValueError(f"bias {tuple(shapes[2])} does not match {u[2]} output channels")
    ho, wo = x[2] + pt + pb - 2, x[3] + pl + pr - 2
    if ho < 1 or wo < 1:
        raise ValueError(f"input {tuple(x)} with pads {tuple(node.attrs['pads'])} is smaller than the 3x3 kernel")
    return [((x[0], u[2], ho, wo), dtypes[0])]


class _Geometry:
    """Tile counts and the wide layout for one (x, out) shape pair."""

    def __init__(self, x_shape, out_shape):
        self.n, self.c = x_shape[:2]
        self.k = out_shape[1]
        ho, wo = out_shape[2:]
        self.th, self.tw = -(-ho // 2), -(-wo // 2)  # tiles per column, per row
        self.rows, self.cols = self.th + 1, self.tw + 1  # phase plane (tile origins + 1)
        self.plane = self.rows * self.cols
        self.columns = self.n * self.plane  # GEMM columns per channel
        self.span = self.c * self.columns  # wide positions of the transformed input
        self.margin = self.cols + 1  # the largest shift a transform term reads past span


# Images are transformed and multiplied in chunks whose scratch (rows combined, V, M)
# stays under this: the GEMM columns span a chunk's images (wider GEMMs for small maps),
# but a whole batch of 32 at 56x56 would need ~280 MB.
CHUNK_SCRATCH_BYTES = 32 << 20


def _chunk(x_shape, out_shape, dtype):
    """Images per chunk: as many as fit CHUNK_SCRATCH_BYTES, at least one."""
    one = _Geometry((1,) + tuple(x_shape[1:]), (1,) + tuple(out_shape[1:]))
    per_image = scratch_nbytes(*_scratch_shapes(one, dtype))
    return max(1, min(x_shape[0], CHUNK_SCRATCH_BYTES // per_image))


def winograd_scratch(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    n = _chunk(x.shape, out.shape, out.dtype)
    return scratch_nbytes(*_scratch_shapes(_Geometry((n,) + x.shape[1:], (n,) + out.shape[1:]), out.dtype))


def _scratch_shapes(g, dtype):
    return [
        ((2, 4, g.span + 1), dtype),  # input rows combined, per column parity
        ((4, 4, g.c, g.columns), dtype),  # V
        ((4, 4, g.k, g.columns), dtype),
    ]  # M, then Y, then the output tiles, in place


@register(
    "conv_winograd",
    infer=winograd_infer,
    scratch=winograd_scratch,
    attrs=dict(pads=ints(4, lo=0)),
    float_input=True,
    rows=True,
    macs=lambda node, in_shapes, out_shapes: math.prod(out_shapes[0]) * 4 * in_shapes[1][3],  # 16 per 2x2 tile
)
def make_conv_winograd(node, inputs, outputs, ctx):
    x, u, out = inputs[0], inputs[1], outputs[0]
    bias = inputs[2] if len(inputs) > 2 else None
    n = _chunk(x.shape, out.shape, out.dtype)
    full = _Geometry((n,) + x.shape[1:], (n,) + out.shape[1:])
    # one scratch carve for the largest chunk; a smaller last chunk uses the front of it
    buffers = [ctx.scratch_array((math.prod(shape),), dtype) for shape, dtype in _scratch_shapes(full, out.dtype)]
    phases = {}  # chunk size -> its phase buffer, shared by the chunks of that size
    steps = []
    for i0 in range(0, x.shape[0], n):
        i1 = min(x.shape[0], i0 + n)
        steps.append(_images(ctx, node, x[i0:i1], u, bias, out[i0:i1], buffers, phases))
    return chain(*steps)


def _images(ctx, node, x, u, bias, out, buffers, phase_buffers):
    """The conv of one chunk of images: two dispatches (input transform by channels,
    then GEMMs and output by output channels)."""
    g = _Geometry(x.shape, out.shape)
    # persistent (not scratch): the padding between the copied-in pixels stays zero (every
    # chunk of a size writes the same interior positions)
    if g.n not in phase_buffers:
        phase_buffers[g.n] = ctx.persistent_buffer(
            ("winograd", x.shape, out.shape, tuple(node.attrs["pads"])), (2, 2, g.span + g.margin), x.dtype
        )
    phases = phase_buffers[g.n]
    rows_combined, v, m = (
        buf[: math.prod(shape)].reshape(shape) for buf, (shape, _) in zip(buffers, _scratch_shapes(g, out.dtype))
    )
    threads = gemm_node_threads(ctx, node) if 16 * g.k * g.c * g.columns >= SPLIT_MIN_MACS else 1
    transform_in = [
        _input_part(x, node.attrs["pads"], g, phases, rows_combined, v, lo, hi)
        for lo, hi in parallel.ranges(g.c, threads)
    ]
    multiply_out = [_output_part(u, bias, out, g, v, m, lo, hi) for lo, hi in parallel.ranges(g.k, threads)]
    return chain(ctx.split(transform_in), split_activated(ctx, node, out, multiply_out))


def _combine_rows(d0, d1, d2, d3, out):
    """B^T applied along one axis: out[0..3] = d0 - d2, d1 + d2, d2 - d1, d1 - d3."""
    return (
        lambda: np.subtract(d0, d2, out=out[0]),
        lambda: np.add(d1, d2, out=out[1]),
        lambda: np.subtract(d2, d1, out=out[2]),
        lambda: np.subtract(d1, d3, out=out[3]),
    )


def _input_part(x, pads, g, phases, rows_combined, v, c0, c1):
    """Copy channels c0:c1 of every image into the phases, then V = B^T d B over their
    wide positions. A term's slice may read a little of the next channel's plane: only
    discarded positions (past the last tile of a plane) use it."""
    pt, pl = pads[0], pads[1]
    planes = phases[:, :, : g.span].reshape(2, 2, g.c, g.n, g.rows, g.cols)
    steps = []
    for py in range(2):
        for px in range(2):
            y0, x0 = (py - pt) % 2, (px - pl) % 2  # first input row/column in this phase
            src = x[:, c0:c1, y0::2, x0::2].transpose(1, 0, 2, 3)
            i0, j0 = (y0 + pt) // 2, (x0 + pl) // 2
            dst = planes[py, px, c0:c1, :, i0 : i0 + src.shape[2], j0 : j0 + src.shape[3]]
            steps.append(copy_strided(dst, src))
    lo, hi = c0 * g.columns, c1 * g.columns
    extra = 1 if c1 == g.c else 0  # the last part also makes the one position past span
    for px in range(2):
        d = [phases[a % 2, px, lo + (a // 2) * g.cols : hi + extra + (a // 2) * g.cols] for a in range(4)]
        steps += _combine_rows(*d, [rows_combined[px, r, lo : hi + extra] for r in range(4)])
    vf = v.reshape(4, 4, g.span)
    for r in range(4):
        t = [rows_combined[b % 2, r, lo + b // 2 : hi + b // 2] for b in range(4)]
        steps += _combine_rows(*t, [vf[r, s, lo:hi] for s in range(4)])
    return chain(*steps)


def _output_part(u, bias, out, g, v, m, k0, k1):
    """(work, out[:, k0:k1]) for output channels k0:k1: their 16 GEMMs, bias, Y = A^T M A
    in place in M, and the copy of each output phase into `out` (split_activated adds
    the activation)."""
    u16 = u.reshape(16, g.k, g.c)[:, k0:k1]
    v16 = v.reshape(16, g.c, g.columns)
    m16 = m.reshape(16, g.k, g.columns)[:, k0:k1]
    mf = m.reshape(4, 4, g.k * g.columns)[:, :, k0 * g.columns : k1 * g.columns]
    steps = [blas.matmul(u16, v16, m16)]
    if bias is not None:
        center, b = m[1, 1, k0:k1], bias[k0:k1, None]
        steps.append(lambda: np.add(center, b, out=center))
    # A^T = [[1, 1, 1, 0], [0, 1, -1, -1]] along r (into rows 0, 1), then along s
    for s in range(4):
        steps += _combine_out(mf[0, s], mf[1, s], mf[2, s], mf[3, s])
    for a in range(2):
        steps += _combine_out(mf[a, 0], mf[a, 1], mf[a, 2], mf[a, 3])
    part = out[:, k0:k1]
    for a in range(2):
        for c in range(2):
            dst = part[:, :, a::2, c::2]
            tiles = mf[a, c].reshape(k1 - k0, g.n, g.rows, g.cols).transpose(1, 0, 2, 3)
            src = tiles[:, :, : dst.shape[2], : dst.shape[3]]
            steps.append(lambda dst=dst, src=src: np.copyto(dst, src))
    return chain(*steps), part


def _combine_out(m0, m1, m2, m3):
    """A^T along one axis, in place: m0 <- m0 + m1 + m2, then m1 <- m1 - m2 - m3."""
    return (
        lambda: np.add(m0, m1, out=m0),
        lambda: np.add(m0, m2, out=m0),
        lambda: np.subtract(m1, m2, out=m1),
        lambda: np.subtract(m1, m3, out=m1),
    )
