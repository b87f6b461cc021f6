"""The optimization pipeline: an ordered list, each pass a function Graph -> bool
(changed?). With verify=True (tests, `pmx compile --verify`) the graph is checked after
every pass and a failure names the pass."""

from pmx.compiler.passes.canonicalize import canonicalize
from pmx.compiler.passes.choose_kernels import choose_kernels
from pmx.compiler.passes.eliminate_dead_code import eliminate_dead_code
from pmx.compiler.passes.fold_constants import fold_constants
from pmx.compiler.passes.infer_shapes import infer_shapes
from pmx.compiler.passes.order import order
from pmx.compiler.passes.plan_memory import plan_memory

PIPELINE = [
    # PNNX spellings -> canonical ops; everything after sees one op set.
    ("canonicalize", canonicalize),
    # Checks pnnx's recorded shapes against our shape rules before anything moves.
    ("infer_shapes", infer_shapes),
    # Constant subgraphs (shape arithmetic, Attribute chains) become constants, which
    # exposes more dead code and lets fusion see plain weights.
    ("fold_constants", fold_constants),
    # Drops what no output needs, including constants only dead nodes read.
    ("eliminate_dead_code", eliminate_dead_code),
    # Per-node kernel choice; after fusion so it sees the final expressions.
    ("choose_kernels", choose_kernels),
    # Fixes the execution order the file stores; planning depends on it.
    ("order", order),
    # Lifetimes over the final order -> arena offsets and aliases; must be last.
    ("plan_memory", plan_memory),
]

# Passes that only optimize; `pmx compile --no-opt` skips them.
OPTIONAL = {"fold_constants", "eliminate_dead_code"}
# Passes that can be switched off one by one (`--disable NAME`).
REQUIRED = {"canonicalize", "infer_shapes", "choose_kernels", "order", "plan_memory"}


def run_pipeline(graph, verify=False, disabled=()):
    for name, fn in PIPELINE:
        if name in disabled and name not in REQUIRED:
            continue
        before = len(graph.nodes)
        fn(graph)
        graph.pass_stats.append((name, before, len(graph.nodes)))
        if verify:
            graph.verify(after=name)
    return graph
