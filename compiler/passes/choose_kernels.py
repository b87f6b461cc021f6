"""Pick each node's kernel implementation (stored as node.variant).

elementwise: numexpr or numpy. numexpr is slower than numpy's SIMD ufuncs almost
everywhere measured (its build without VML runs tanh/exp/log as scalar libm, and one
numexpr pass over float32 costs more than a numpy pass). It wins where numpy's form is
weak: where() (numpy needs two masked copies) over cheap arithmetic only, and tiny
tensors with many operations (one call instead of one per operation). Hence the rule:

  numexpr  if  the expression uses where, has no transcendental function, and has
               >= NUMEXPR_WHERE_MIN_ELEMENTS elements (leaky_relu, prelu, clamp-by-where);
           or  it has >= NUMEXPR_TINY_MIN_OPS operations on <= NUMEXPR_TINY_MAX_ELEMENTS
               elements (call overhead dominates);
  numpy    otherwise.

conv: the depthwise lowering for groups == channels (faster than im2col + GEMM on
MobileNetV2/V3's and EfficientNet-B0's depthwise shapes); for 3x3 stride-1 convs with at
least WINOGRAD_MIN_CHANNELS input channels and WINOGRAD_MIN_TILES 2x2 output tiles per
image, Winograd F(2x2, 3x3) (prepack_weights stores its transformed weights); one GEMM
otherwise. Few input channels make the transforms cost more than the GEMM saves; few
tiles make the 16 GEMMs too narrow. `--tune` times both where the rule is unsure. Fused
epilogues of conv/linear/matmul run on numpy (in place, on a tensor still in cache).
The measurements behind both rules: docs/performance.md, "Kernel choice: the tables".
"""

import numpy as np

from pmx.compiler.passes.prepack_weights import WINOGRAD, winograd_applies
from pmx.runtime import expr as E

WINOGRAD_MIN_CHANNELS = 64
WINOGRAD_MIN_TILES = 36
NUMEXPR_WHERE_MIN_ELEMENTS = 1 << 16
NUMEXPR_TINY_MAX_ELEMENTS = 1 << 10
NUMEXPR_TINY_MIN_OPS = 6
TRANSCENDENTAL = E.names_with("transcendental")


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


def choose_kernels(graph, ctx):
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
