"""The optimization pipeline: an ordered list, each pass a function Graph -> bool
(changed?). With verify=True (tests, `pmx compile --verify`) the graph is checked after
every pass and a failure names the pass."""

from pmx.compiler.passes.alias_concat import alias_concat
from pmx.compiler.passes.alias_views import alias_views
from pmx.compiler.passes.batch_norm_as_elementwise import batch_norm_as_elementwise
from pmx.compiler.passes.canonicalize import canonicalize
from pmx.compiler.passes.choose_kernels import choose_kernels
from pmx.compiler.passes.eliminate_dead_code import eliminate_dead_code
from pmx.compiler.passes.fold_affine_relu import fold_affine_relu
from pmx.compiler.passes.fold_channel_gate import fold_channel_gate
from pmx.compiler.passes.fold_hardswish_scale import fold_hardswish_scale
from pmx.compiler.passes.fold_norm_affine import fold_norm_affine
from pmx.compiler.passes.fold_constants import fold_constants
from pmx.compiler.passes.fuse_activation import fuse_activation
from pmx.compiler.passes.fuse_conv_batchnorm import fuse_conv_batchnorm
from pmx.compiler.passes.fuse_elementwise import fuse_elementwise
from pmx.compiler.passes.fuse_shuffle_split import fuse_shuffle_split
from pmx.compiler.passes.infer_shapes import infer_shapes
from pmx.compiler.passes.mark_dynamic_dims import mark_dynamic_dims
from pmx.compiler.passes.negate_silu_weights import negate_silu_weights
from pmx.compiler.passes.order import order
from pmx.compiler.passes.plan_memory import plan_memory
from pmx.compiler.passes.pool_before_pointwise import pool_before_pointwise
from pmx.compiler.passes.prepack_weights import prepack_weights
from pmx.compiler.passes.tune import tune
from pmx.compiler.passes.write_inplace import write_inplace

PIPELINE = [
    # PNNX spellings -> canonical ops; everything after sees one op set.
    ("canonicalize", canonicalize),
    # Checks pnnx's recorded shapes against our shape rules before anything moves.
    ("infer_shapes", infer_shapes),
    # Constant subgraphs (shape arithmetic, Attribute chains) become constants, which
    # exposes more dead code and lets fusion see plain weights.
    ("fold_constants", fold_constants),
    # Drops what no output needs, including constants only dead nodes read; before the
    # fusions so a dead second reader does not block them.
    ("eliminate_dead_code", eliminate_dead_code),
    # Which input dims may change at run time (and frozen reshapes made symbolic); after
    # folding, so only nodes that run are probed, before fusion rewrites them.
    ("mark_dynamic_dims", mark_dynamic_dims),
    # Before fuse_activation: a conv carrying an epilogue can no longer absorb a BN.
    ("fuse_conv_batchnorm", fuse_conv_batchnorm),
    # Before fuse_elementwise, so a GEMM's activation goes into its epilogue (in cache)
    # rather than into a separate elementwise region that re-reads the output.
    ("fuse_activation", fuse_activation),
    # A batch_norm no conv absorbed becomes an expression fuse_elementwise can merge
    # with its neighbours (DenseNet's BN -> ReLU).
    ("batch_norm_as_elementwise", batch_norm_as_elementwise),
    # Merges what is left of elementwise chains into one expression per region.
    ("fuse_elementwise", fuse_elementwise),
    # After the activations are final: SiLU epilogues run over negated products, one
    # numpy pass fewer (bit-identical results).
    ("negate_silu_weights", negate_silu_weights),
    # After fuse_elementwise has left a squeeze-and-excitation gate as one mul node: a
    # 1x1 conv reading it scales its weights instead (one pass over the tensor fewer).
    ("fold_channel_gate", fold_channel_gate),
    # After fold_channel_gate (a gated conv then reads the hardswish output itself): a
    # hardswish epilogue read only by convs and linears leaves its division by 6 to
    # their weights (one pass fewer).
    ("fold_hardswish_scale", fold_hardswish_scale),
    # After fuse_elementwise has made a pre-activation BN -> ReLU one expression: its
    # scale and shift move into the 1x1 convs reading it, and max(x, t) is left (one
    # pass instead of three; DenseNet).
    ("fold_affine_relu", fold_affine_relu),
    # After fold_affine_relu (which needs the conv to read the ReLU directly): an average
    # pool after a 1x1 conv runs before it, so the conv multiplies the pooled positions
    # only (DenseNet's transitions: a quarter of the GEMM).
    ("pool_before_pointwise", pool_before_pointwise),
    # A layer norm read only by linears leaves its gamma and beta to their weights and
    # biases (transformers' norm -> QKV and norm -> MLP: two passes fewer).
    ("fold_norm_affine", fold_norm_affine),
    # A channel shuffle feeding a split writes the split's parts itself (ShuffleNetV2);
    # before the alias passes, which then place those parts in their concats.
    ("fuse_shuffle_split", fuse_shuffle_split),
    # Per-node kernel choice; after fusion so it sees the final expressions.
    ("choose_kernels", choose_kernels),
    # Only with --tune: replaces the rule's choices by timings on this machine; right
    # after choose_kernels, on the final node set, before placement (it uses private
    # buffers, so aliases do not matter).
    ("tune", tune),
    # Rewrites nodes whose chosen kernel wants another weight layout (Winograd); after
    # the final kernel choice, before placement (it swaps constants, not activations).
    # Skipped, a conv keeps its variant and runs as the im2col GEMM.
    ("prepack_weights", prepack_weights),
    # Fixes the execution order the file stores; lifetimes (in-place, planning) use it.
    ("order", order),
    # Aliases from here on only change where tensors live, never the node list.
    # Reshape-like views first: a concat slice or in-place write then sees them as part
    # of their input's buffer.
    ("alias_views", alias_views),
    # Before write_inplace: removing a concat's copy saves time as well as memory, so
    # concat gets the first claim on a tensor's placement.
    ("alias_concat", alias_concat),
    # Needs the final order and every other alias to know where each buffer dies.
    ("write_inplace", write_inplace),
    # Lifetimes over the final order -> arena offsets; must be last.
    ("plan_memory", plan_memory),
]

# Passes that only optimize; `pmx compile --no-opt` skips them, `--disable NAME` one.
OPTIONAL = {"tune", "prepack_weights", "fold_constants", "eliminate_dead_code", "fuse_conv_batchnorm", "fuse_activation",
            "batch_norm_as_elementwise", "negate_silu_weights", "fold_channel_gate", "fold_hardswish_scale",
            "fold_affine_relu", "pool_before_pointwise", "fold_norm_affine", "fuse_shuffle_split", "fuse_elementwise", "alias_views", "alias_concat", "write_inplace"}
# Passes the compile cannot do without.
REQUIRED = {"canonicalize", "infer_shapes", "mark_dynamic_dims", "choose_kernels", "order", "plan_memory"}


def run_pipeline(graph, verify=False, disabled=()):
    if not hasattr(graph, "aliases"):
        graph.aliases = {}
    shapes_known = False  # pnnx leaves some shapes out; infer_shapes fills them
    for name, fn in PIPELINE:
        if name in disabled and name not in REQUIRED:
            continue
        before = len(graph.nodes)
        fn(graph)
        graph.pass_stats.append((name, before, len(graph.nodes)))
        shapes_known = shapes_known or name == "infer_shapes"
        if verify:
            graph.verify(after=name, require_shapes=shapes_known)
            check_aliases(graph, after=name)
    return graph


def check_aliases(graph, after=""):
    """Every alias points at a live, non-constant tensor with room for the view, and
    alias chains end (no cycles)."""
    from pmx.runtime.errors import PmxCompileError

    where = f" after pass {after}" if after else ""
    values = {v.uid for v in graph.values()}
    for uid, (target, offset, strides) in graph.aliases.items():
        if uid not in values:
            continue  # the viewing tensor was removed; harmless, the writer ignores it
        if target.is_constant or target.uid not in values:
            raise PmxCompileError(
                f"alias check failed{where}: a tensor aliases {target.name}, which is not a live tensor")
        seen = {uid}
        t = target
        while t.uid in graph.aliases:
            if t.uid in seen:
                raise PmxCompileError(
                    f"alias check failed{where}: alias chain through {t.name} loops")
            seen.add(t.uid)
            t = graph.aliases[t.uid][0]
    by_uid = {v.uid: v for v in graph.values()}
    for uid, (target, offset, strides) in graph.aliases.items():
        v = by_uid.get(uid)
        if v is not None and strides is None and offset + v.nbytes > target.nbytes:
            raise PmxCompileError(f"alias check failed{where}: {v.name} [{offset}, +{v.nbytes}) "
                                  f"exceeds {target.name} ({target.nbytes} bytes)")
