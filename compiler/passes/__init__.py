"""The optimization pipeline: an ordered list of passes, each a function (Graph,
PassContext) that edits the graph in place and returns nothing, with the passes it must
follow. What a pass did is visible where it matters: the node counts before and after
each pass (`pass_stats`, stored in the file, `pmx inspect`) and each rule's hits
(`rule_hits`, `pmx compile -v`); no pass reports "changed", which nothing used. The PassContext
(compiler/plan.py) carries the compile's options to the passes and collects what they
find; run_pipeline returns that as the Plan. A local-rewrite pass is a rule table
(compiler/rewrite.py) whose run applies its rule set to a fixpoint. The order is checked
when a pipeline is built or run (check_pipeline), as torch.fx checks its pass
constraints: a pass placed before one it must follow is refused, naming both. Passes from
`order` on must keep the node list as it is (they only place tensors); run_pipeline
checks that too. With options.verify (tests, `pmx compile --verify`) the graph is checked
after every pass and a failure names the pass."""

from collections.abc import Callable
from typing import NamedTuple

from pmx.compiler.passes.alias_concat import alias_concat
from pmx.compiler.passes.alias_views import alias_views
from pmx.compiler.passes.batch_norm_as_elementwise import batch_norm_as_elementwise
from pmx.compiler.passes.canonicalize import canonicalize
from pmx.compiler.passes.choose_kernels import choose_kernels
from pmx.compiler.passes.eliminate_dead_code import eliminate_dead_code
from pmx.compiler.passes.fold_affine_relu import fold_affine_relu
from pmx.compiler.passes.fold_constants import fold_constants
from pmx.compiler.passes.fuse_activation import fuse_activation
from pmx.compiler.passes.fuse_conv_batchnorm import fuse_conv_batchnorm
from pmx.compiler.passes.fuse_elementwise import fuse_elementwise
from pmx.compiler.passes.infer_shapes import infer_shapes
from pmx.compiler.passes.mark_dynamic_dims import mark_dynamic_dims
from pmx.compiler.passes.negate_silu_weights import negate_silu_weights
from pmx.compiler.passes.order import order
from pmx.compiler.passes.plan_memory import plan_memory
from pmx.compiler.passes.pool_before_pointwise import pool_before_pointwise
from pmx.compiler.passes.prepack_weights import prepack_weights
from pmx.compiler.passes.tune import tune
from pmx.compiler.passes.write_inplace import write_inplace
from pmx.compiler.plan import Plan
from pmx.runtime.errors import PmxInternalError


class Pass(NamedTuple):
    name: str
    run: Callable
    # an optimization: `pmx compile --no-opt` skips it, `--disable NAME` this one
    optional: bool = False
    # passes that, where both run, must run before this one, and why
    after: tuple = ()
    # a placement pass: it changes where tensors live, never the node list
    keeps_nodes: bool = False


FUSIONS = (
    "fuse_conv_batchnorm",
    "fuse_activation",
    "batch_norm_as_elementwise",
    "fuse_elementwise",
    "negate_silu_weights",
    "fold_affine_relu",
    "pool_before_pointwise",
)

PIPELINE = [
    # PNNX spellings -> canonical ops; everything after sees one op set.
    Pass("canonicalize", canonicalize),
    # Checks pnnx's recorded shapes against our shape rules before anything moves.
    Pass("infer_shapes", infer_shapes, after=("canonicalize",)),
    # Constant subgraphs (shape arithmetic, Attribute chains) become constants, which
    # exposes more dead code and lets fusion see plain weights.
    Pass("fold_constants", fold_constants, optional=True, after=("infer_shapes",)),
    # Drops what no output needs, including constants only dead nodes read; before the
    # fusions so a dead second reader does not block them.
    Pass("eliminate_dead_code", eliminate_dead_code, optional=True, after=("fold_constants",)),
    # Which input dims may change at run time (and frozen reshapes made symbolic); after
    # folding, so only nodes that run are probed, before fusion rewrites them.
    Pass("mark_dynamic_dims", mark_dynamic_dims, after=("fold_constants", "eliminate_dead_code")),
    # Fusions see live nodes only, with their dynamic dims known.
    Pass("fuse_conv_batchnorm", fuse_conv_batchnorm, optional=True, after=("eliminate_dead_code", "mark_dynamic_dims")),
    # After fuse_conv_batchnorm: a conv carrying an epilogue can no longer absorb a BN.
    Pass("fuse_activation", fuse_activation, optional=True, after=("mark_dynamic_dims", "fuse_conv_batchnorm")),
    # A batch_norm no conv absorbed becomes an expression fuse_elementwise can merge
    # with its neighbours (DenseNet's BN -> ReLU).
    Pass(
        "batch_norm_as_elementwise",
        batch_norm_as_elementwise,
        optional=True,
        after=("mark_dynamic_dims", "fuse_conv_batchnorm"),
    ),
    # After fuse_activation, so a GEMM's activation goes into its epilogue (in cache)
    # rather than into a separate elementwise region that re-reads the output.
    Pass(
        "fuse_elementwise",
        fuse_elementwise,
        optional=True,
        after=("mark_dynamic_dims", "fuse_activation", "batch_norm_as_elementwise"),
    ),
    # After the activations are final: SiLU epilogues run over negated products, one
    # numpy pass fewer (bit-identical results).
    Pass("negate_silu_weights", negate_silu_weights, optional=True, after=("fuse_activation", "fuse_elementwise")),
    # After fuse_elementwise has made a pre-activation BN -> ReLU one expression: its
    # scale and shift move into the 1x1 convs reading it, and max(x, t) is left (one
    # pass instead of three; DenseNet).
    Pass("fold_affine_relu", fold_affine_relu, optional=True, after=("fuse_elementwise",)),
    # After fold_affine_relu (which needs the conv to read the ReLU directly): an average
    # pool after a 1x1 conv runs before it, so the conv multiplies the pooled positions
    # only (DenseNet's transitions: a quarter of the GEMM).
    Pass("pool_before_pointwise", pool_before_pointwise, optional=True, after=("fold_affine_relu",)),
    # Per-node kernel choice; after fusion so it sees the final expressions.
    Pass("choose_kernels", choose_kernels, after=FUSIONS),
    # Only with --tune: replaces the rule's choices by timings on this machine, on the
    # final node set, before placement (it uses private buffers, so aliases do not matter).
    Pass("tune", tune, optional=True, after=("choose_kernels",)),
    # Rewrites nodes whose chosen kernel wants another weight layout (Winograd); after
    # the final kernel choice, before placement (it swaps constants, not activations).
    # Skipped, a conv keeps its variant and runs as the im2col GEMM.
    Pass("prepack_weights", prepack_weights, optional=True, after=("choose_kernels", "tune")),
    # Fixes the execution order the file stores; lifetimes (in-place, planning) use it.
    Pass("order", order, after=("prepack_weights",)),
    # Reshape-like views first: a concat slice or in-place write then sees them as part
    # of their input's buffer.
    Pass("alias_views", alias_views, optional=True, after=("order",), keeps_nodes=True),
    # Before write_inplace: removing a concat's copy saves time as well as memory, so
    # concat gets the first claim on a tensor's placement.
    Pass("alias_concat", alias_concat, optional=True, after=("order", "alias_views"), keeps_nodes=True),
    # Needs the final order and every other alias to know where each buffer dies.
    Pass(
        "write_inplace", write_inplace, optional=True, after=("order", "alias_views", "alias_concat"), keeps_nodes=True
    ),
    # Lifetimes over the final order and placement -> arena offsets.
    Pass("plan_memory", plan_memory, after=("order", "write_inplace"), keeps_nodes=True),
]


def check_pipeline(pipeline):
    """Refuse a pipeline that breaks a pass's `after` constraint, repeats a name, names an
    unknown pass, or lets a node-changing pass follow a placement pass."""
    position = {}
    for i, p in enumerate(pipeline):
        if p.name in position:
            raise PmxInternalError(f"pipeline: pass {p.name} appears twice")
        position[p.name] = i
    placing = None
    for i, p in enumerate(pipeline):
        for earlier in p.after:
            if earlier not in position:
                raise PmxInternalError(f"pipeline: pass {p.name} must follow {earlier}, which is not in the pipeline")
            if position[earlier] > i:
                raise PmxInternalError(f"pipeline: pass {p.name} must run after {earlier}, but comes before it")
        if p.keeps_nodes:
            placing = placing or p.name
        elif placing is not None:
            raise PmxInternalError(f"pipeline: pass {p.name} changes the node list after placement pass {placing}")
    return pipeline


check_pipeline(PIPELINE)

# Passes that only optimize; `pmx compile --no-opt` skips them, `--disable NAME` one.
OPTIONAL = frozenset(p.name for p in PIPELINE if p.optional)


def run_pipeline(graph, ctx) -> Plan:
    """Run the passes ctx.options leaves on (not `disabled`, none of the optional ones
    with `no_opt`) and return the Plan they made."""
    check_pipeline(PIPELINE)
    options = ctx.options
    disabled = options.disabled | (OPTIONAL if options.no_opt else frozenset())
    shapes_known = False  # pnnx leaves some shapes out; infer_shapes fills them
    for p in PIPELINE:
        if p.optional and p.name in disabled:
            continue
        nodes = list(graph.nodes)
        p.run(graph, ctx)
        ctx.pass_stats.append((p.name, len(nodes), len(graph.nodes)))
        if p.keeps_nodes and (len(nodes) != len(graph.nodes) or any(a is not b for a, b in zip(nodes, graph.nodes))):
            raise PmxInternalError(f"pass {p.name} changed the node list; placement passes only place tensors")
        shapes_known = shapes_known or p.name == "infer_shapes"
        if options.verify:
            graph.verify(after=p.name, require_shapes=shapes_known)
            check_aliases(graph, ctx.aliases, after=p.name)
    return ctx.plan(graph)


def check_aliases(graph, aliases, after=""):
    """Every alias points at a live, non-constant tensor with room for the view, and
    alias chains end (no cycles)."""
    from pmx.runtime.errors import PmxCompileError

    where = f" after pass {after}" if after else ""
    values = {v.uid for v in graph.values()}
    for uid, (target, _offset, _strides) in aliases.items():
        if uid not in values:
            continue  # the viewing tensor was removed; harmless, the writer ignores it
        if target.is_constant or target.uid not in values:
            raise PmxCompileError(
                f"alias check failed{where}: a tensor aliases {target.name}, which is not a live tensor"
            )
        seen = {uid}
        t = target
        while t.uid in aliases:
            if t.uid in seen:
                raise PmxCompileError(f"alias check failed{where}: alias chain through {t.name} loops")
            seen.add(t.uid)
            t = aliases[t.uid][0]
    by_uid = {v.uid: v for v in graph.values()}
    for uid, (target, offset, strides) in aliases.items():
        v = by_uid.get(uid)
        if v is not None and strides is None and offset + v.nbytes > target.nbytes:
            raise PmxCompileError(
                f"alias check failed{where}: {v.name} [{offset}, +{v.nbytes}) "
                f"exceeds {target.name} ({target.nbytes} bytes)"
            )
