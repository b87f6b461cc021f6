"""Pick each node's kernel implementation (stored as node.variant).

elementwise: numexpr or numpy, by a rule measured with tools/bench_elementwise.py on
this machine (2-core AMD EPYC VM, numexpr 2.14.2 without VML, 2 threads, numpy 2.4.6;
float32, median us, np/ne > 1 means numexpr wins; the machine was shared with other
test runs, load average 4-10, so single cells are noisy, the pattern is not):

    expression   ops   numel 1K    16K     64K     256K    1M      4M
    add            1    0.40       0.07    0.18    0.28    0.44    0.42
    relu           2    0.61       0.16    0.11    0.10    0.10    0.11
    add_relu       3    0.78       0.18    0.15    0.13    0.08    0.19
    sigmoid        1    0.85       0.32    0.41    0.46    0.71    0.34
    tanh           1    0.21       0.13    0.14    0.14    0.14    0.14
    exp            1    0.52       0.29    0.55    0.53    0.57    0.74
    silu           3    0.95       0.32    0.42    0.47    0.47    0.65
    hardswish     10    1.12       0.26    0.34    0.33    0.53    0.58
    gelu (erf)     9    0.40       0.14    0.16    0.21    0.24    0.23
    affine+add+relu 7   1.18       0.26    0.20    0.20    0.16    0.23
    leaky_relu     7    2.07       0.98    1.06    1.13    0.58    1.17
      (rerun)           2.06       0.94    1.04    3.21    1.35    1.34
    prelu          6    1.88       1.02    1.07    0.62    1.47    1.31
    elu            8    1.32       0.94    0.43    0.91    1.00    1.09
    softplus      13    1.02       0.73    0.39    0.88    0.89    0.87

numexpr is slower than numpy's SIMD ufuncs almost everywhere here (this build has no
VML, so its tanh/exp/log run scalar libm, and one numexpr pass over float32 costs more
than a numpy pass). It wins where numpy's form is weak: where() (numpy needs two masked
copies) over cheap arithmetic only, and tiny tensors with many operations (one call
instead of one per operation). Hence the rule:

  numexpr  if  the expression uses where, has no transcendental function, and has
               >= NUMEXPR_WHERE_MIN_ELEMENTS elements (leaky_relu, prelu, clamp-by-where);
           or  it has >= NUMEXPR_TINY_MIN_OPS operations on <= NUMEXPR_TINY_MAX_ELEMENTS
               elements (call overhead dominates);
  numpy    otherwise.

conv: the depthwise lowering for groups == channels (1.0-4.3x faster than im2col + GEMM
on MobileNetV2/V3's and EfficientNet-B0's depthwise shapes: runtime/kernels/conv.py);
for 3x3 stride-1 convs with at least
WINOGRAD_MIN_CHANNELS input channels and WINOGRAD_MIN_TILES 2x2 output tiles per image,
Winograd F(2x2, 3x3) (prepack_weights stores its transformed weights); one GEMM
otherwise. Measured with 2 threads, one image, im2col GEMM ms / Winograd ms (noisy
machine, helpers running; one thread in brackets):

    Cin  Cout  out    gemm/winograd
     64    64  56x56  1.24-1.35 (1.44)     128  32  56x56  1.35-1.49 (1.49)
    128   128  28x28  1.24-1.26 (1.53)     128  32  14x14  1.37 (1.44)
    256   256  14x14  1.13-1.16 (1.38)     128  32   7x7   0.87-1.01 (0.99)
    512   512   7x7   0.84 (0.73)           64  64  14x14  1.02 (1.21)
     64   192  56x56  1.32-1.34 (1.32)      96 128  28x28  1.16-1.18 (1.46)
     48    64  28x28  0.71-0.90 (1.34)      32  32  55x55  0.78-1.02 (1.26)
     16    64  55x55  0.61-0.76 (0.89)      16  16  56x56  0.86-0.93 (1.03)

Few input channels make the transforms cost more than the GEMM saves; few tiles make
the 16 GEMMs too narrow. `--tune` times both where the rule is unsure. Fused epilogues of
conv/linear/matmul run on numpy (in place, on a tensor still in cache).
"""

import numpy as np

from pmx.compiler.passes.prepack_weights import WINOGRAD, winograd_applies
from pmx.runtime import expr as E

WINOGRAD_MIN_CHANNELS = 64
WINOGRAD_MIN_TILES = 36
NUMEXPR_WHERE_MIN_ELEMENTS = 1 << 16
NUMEXPR_TINY_MAX_ELEMENTS = 1 << 10
NUMEXPR_TINY_MIN_OPS = 6
TRANSCENDENTAL = {
    "exp",
    "log",
    "log10",
    "log1p",
    "expm1",
    "pow",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "atan2",
    "sinh",
    "cosh",
    "tanh",
    "asinh",
    "acosh",
    "atanh",
}


def _functions(tree, acc):
    if tree[0] not in ("@", "#"):
        acc.add(tree[0])
        for a in tree[1:]:
            _functions(a, acc)
    return acc


def elementwise_variant(node):
    tree = node.expr
    if not node.inputs or not E.numexpr_supported(tree):
        return "numpy"
    numel = int(np.prod(node.outputs[0].shape))
    ops = E.size(tree) - len(E.inputs_used(tree))  # as tools/bench_elementwise.py counts
    fns = _functions(E.desugar(tree), set())
    if "where" in fns and not fns & TRANSCENDENTAL and numel >= NUMEXPR_WHERE_MIN_ELEMENTS:
        return "numexpr"
    if ops >= NUMEXPR_TINY_MIN_OPS and numel <= NUMEXPR_TINY_MAX_ELEMENTS:
        return "numexpr"
    return "numpy"


def choose_kernels(graph, ctx) -> bool:
    for node in graph.nodes:
        if node.variant:
            continue
        if node.op == "elementwise":
            node.variant = elementwise_variant(node)
        elif node.op == "conv":
            w = node.inputs[1].shape
            groups = node.attrs.get("groups", 1)
            node.variant = "depthwise" if groups > 1 and w[1] == 1 and w[0] == groups else "gemm"
            if node.variant == "gemm" and winograd_pays(node):
                node.variant = WINOGRAD
    return False


def winograd_pays(node) -> bool:
    """The rule for F(2x2, 3x3) over the im2col GEMM (see WINOGRAD_MIN_* above)."""
    if not winograd_applies(node):
        return False
    k, c = node.inputs[1].shape[:2]
    ho, wo = node.outputs[0].shape[2:]
    return (
        c >= WINOGRAD_MIN_CHANNELS
        and k >= WINOGRAD_MIN_CHANNELS // 4
        and (-(-ho // 2)) * (-(-wo // 2)) >= WINOGRAD_MIN_TILES
    )
