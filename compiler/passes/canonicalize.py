"""PNNX spellings -> the canonical op set (rules in compiler/canon/)."""

import numpy as np

from pmx.compiler.canon import RULES, Context, Forward
from pmx.compiler.passes.placeholder import canonicalize_at_placeholder
from pmx.runtime.errors import PmxCompileError, PmxUnsupportedOpError
from pmx.runtime.kernels.registry import kernel_of, output_shapes


def _foreign(op):
    """An op name in none of pnnx's namespaces (nn., F., torch., Tensor., pnnx., aten::,
    prim::): what pnnx's ONNX import leaves of an ONNX op it did not convert (Slice)."""
    return "." not in op and "::" not in op


def canonicalize(graph, ctx):
    """Every node in the canonical op set (RULES rewrite pnnx's spellings), at placeholder
    sizes for the '?' dims no --shape sized (placeholder.py)."""
    _refuse_unknown_ops(graph)
    if ctx.placeholders:
        canonicalize_at_placeholder(graph, ctx, _canonicalize)
    else:
        _canonicalize(graph)
    _refuse_kept_sizes(graph)


def _refuse_kept_sizes(graph):
    """A kept tensor no node makes any more: a size list (`[size(@0,0),4]`), which the
    reshape or expand reading it took in as its target, is no tensor at run time."""
    for v in graph.kept:
        if v.producer is None and not v.is_constant and v not in graph.inputs:
            raise PmxCompileError(
                f"{graph.source}: --keep {v.name}: a list of sizes pmx folds into the ops that read it (their target "
                f"shape), not a tensor a run computes; keep a tensor of the model instead"
            )


def _refuse_unknown_ops(graph):
    unknown = [n for n in graph.nodes if n.op not in RULES and kernel_of(n.op) is None]
    if unknown:
        first = unknown[0]
        others = sorted({n.op for n in unknown[1:]} - {first.op})
        more = f"; also unsupported: {', '.join(others)}" if others else ""
        raise PmxUnsupportedOpError(
            f"{graph.source}: line {first.line}: unsupported op {first.op} (node '{first.name}'){more}. "
            + (
                f"{first.op} is an ONNX op that pnnx left unconverted: pnnx's own Python cannot run it "
                f"either. Export the model from torch with pnnx, or simplify the ONNX model first. "
                if _foreign(first.op)
                else ""
            )
            + "`pmx compile --list-ops` prints the supported op types"
            + (
                " (Tensor.size appears in exports with dynamic dims: export with a fixed shape and "
                "declare dynamic dims with --dynamic / --shape)"
                if first.op in ("Tensor.size", "aten::size")
                else ""
            )
        )


def _canonicalize(graph):
    rules_ctx = Context(graph)
    run_sized = set()  # ids of the values whose length is known only at run time
    for node in list(graph.nodes):
        reads = next((v for v in node.inputs if v is not None and id(v) in run_sized), None)
        if kernel_of(node.op) is not None:
            _follow_run_sizes(node, node, reads, run_sized)
            continue
        try:
            result = RULES[node.op](node, rules_ctx)
        except PmxCompileError:
            if reads is None:
                raise
            _refuse_run_sized_reader(node, reads)  # its rule saw the planned empty shape
        index = graph.nodes.index(node)
        graph.remove_node(node)
        if isinstance(result, Forward):
            for out in node.outputs:
                graph.replace_uses(out, result.value)
            continue
        for offset, new in enumerate(result):
            graph.add_node(new, index + offset)
            _follow_run_sizes(node, new, reads, run_sized)
            _fill_shapes(new)


def _follow_run_sizes(source, node, reads, run_sized):
    """Tensors sized at run time: a node that reads a length from tensor values
    (attrs sized_at_run) makes one; so does a node reading one, which its op must allow
    (registry reads_run_sized: elementwise, cast), else the compile fails naming the
    pnnx node `source`. Their outputs are planned empty: pnnx recorded the traced length,
    which other inputs change."""
    value = next((v for v in node.inputs if v is not None and id(v) in run_sized), None)
    late = value is not None
    if late and not kernel_of(node.op).reads_run_sized:
        _refuse_run_sized_reader(source, reads or value)
    if late or node.attrs.get("sized_at_run") is True:
        for out in node.outputs:
            run_sized.add(id(out))
            if not node.attrs.get("sized_at_run"):
                out.shape = None  # _fill_shapes gives the rule's: empty


def _refuse_run_sized_reader(node, value):
    raise PmxCompileError(
        f"{node.where()} reads {value.name}, the output of {value.producer.where()}, whose length is "
        f"known only at run time (read from tensor values); pmx runs only elementwise ops and "
        f"casts on such a tensor, and this op needs a planned shape. Make it a model output, "
        f"or export with a fixed size"
    ) from None


def _fill_shapes(node):
    """Exports with dynamic ('?') dims leave shapes partly unknown, and pnnx writes no
    dtype for 0-d results and scalar expressions (the frontend assumes float32); once the
    inputs are concrete (the graph inputs get their planning shape), the canonical op's
    shape rule fills its outputs, so the next rule sees concrete input shapes and the
    dtypes the ops compute (an integer index read by a gather)."""
    if all(v.shape is not None and None not in v.shape and v.recorded_dtype is not None for v in node.outputs):
        return
    ins = node.inputs  # None where an optional input is absent: shape rules read positions
    if any(v is not None and (v.shape is None or None in v.shape) for v in ins):
        return
    try:
        results = output_shapes(
            node, [None if v is None else v.shape for v in ins], [None if v is None else np.dtype(v.dtype) for v in ins]
        )
    except Exception:  # infer_shapes reports the error with context
        return
    for v, (shape, dtype) in zip(node.outputs, results):
        if v.shape is None or None in v.shape:
            v.shape = shape
        if v.recorded_dtype is None:
            v.dtype = dtype.name
