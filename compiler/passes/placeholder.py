"""Sizes to plan memory at for input dims pnnx wrote as '?' that no --shape sized.

The canonicalize pass calls `canonicalize_at_placeholder` when the compile has such dims
(PassContext.placeholders): it tries the placeholder sizes in order, each on a copy of
the graph, canonicalizing and inferring shapes; the first copy that succeeds becomes the
graph (Graph.adopt), so that work is not done again, and a note says which size memory
is planned at. The runtime plans memory again at the first run's shape.
"""

from pmx.compiler.passes.infer_shapes import infer_shapes
from pmx.compiler.shape_specs import shape_template, shape_text
from pmx.runtime.dim_ranges import UNBOUNDED
from pmx.runtime.errors import PmxCompileError, PmxError

# Sizes tried, in order (the leading dim of an input of rank >= 2 tries 1 first: a
# batch). Moderate sizes first, so convolutions and pools fit and a large model's stored
# plan stays small; all multiples of 8, most of 32 (patch sizes, windows, strides).
PLACEHOLDER_SIZES = (64, 224, 32, 128, 16, 8, 256, 512)


def canonicalize_at_placeholder(graph, ctx, canonicalize_graph):
    """Canonicalize `graph` (with `canonicalize_graph`) at the first placeholder sizes for
    ctx.placeholders, {(input name, dim): (min, max)}, at which the whole graph
    canonicalizes and infers shapes; the compile fails saying what to give when none does."""
    unplanned = ctx.placeholders
    inputs = {v.name: v for v in graph.inputs}
    tried, errors = [], []
    for sizes in _candidates(unplanned, inputs):
        shapes = {name: tuple(sizes.get((name, d), s) for d, s in enumerate(v.shape)) for name, v in inputs.items()}
        trial = graph.clone()
        for v in trial.inputs:
            v.shape = shapes[v.name]
        try:
            canonicalize_graph(trial)
            infer_shapes(trial, ctx)
        except PmxError as e:
            tried.append(shapes)
            errors.append(e)
            continue
        graph.adopt(trial)
        _note_sizes(graph, unplanned, ctx.notes)
        return
    if len({str(e) for e in errors}) == 1:  # no size would do: --shape advice would fail too
        raise errors[0]
    open_inputs = [inputs[name] for name in dict.fromkeys(name for name, _ in unplanned)]
    shown = "; ".join(", ".join(f"{v.name} {shape_text(t[v.name])}" for v in open_inputs) for t in tried[:3])
    templates = " ".join(f"--shape {v.name}={shape_template(v.shape)}" for v in open_inputs)
    raise PmxCompileError(
        f"{graph.source}: the model's '?' dims need a size to plan memory for, and none of the "
        f"sizes tried fits ({shown}, ...): {errors[0]}. Give sizes the model runs at, such as "
        f"those of the input you exported with: {templates}, each <n> a size (fixed), or <n>.. "
        f"to allow any size from <n> (memory is planned at <n>)"
    ) from None


def _candidates(unplanned, inputs):
    """{(input name, dim): size} per try: PLACEHOLDER_SIZES, the leading dim of an input of
    rank >= 2 at 1 first and then at the same size; each clamped into the dim's range."""
    seen = []
    for size in PLACEHOLDER_SIZES:
        for lead in (1, size):
            sizes = {}
            for (name, d), (lo, hi) in unplanned.items():
                want = lead if d == 0 and len(inputs[name].shape) >= 2 else size
                sizes[(name, d)] = max(lo, want if hi == UNBOUNDED else min(want, hi))
            if sizes not in seen:
                seen.append(sizes)
                yield sizes


def _note_sizes(graph, unplanned, notes):
    for v in graph.inputs:
        dims = [str(d) for name, d in unplanned if name == v.name]
        if dims:
            which = f"dims {', '.join(dims)} are" if len(dims) > 1 else f"dim {dims[0]} is"
            notes.append(
                f"{v.name} {which} '?' in the export and dynamic; memory is planned at "
                f"{shape_text(v.shape)}, a placeholder: the first run plans it for its own shape"
            )
