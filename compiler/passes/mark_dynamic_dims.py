"""Decide which input dimensions may change at run time, and make frozen shapes follow them.

pnnx records every shape at the traced size: a `view(1, 3, 6, 64, 64)` or a `flatten`
carries the batch and spatial sizes it saw. This pass takes the requested dynamic input
dims (`pmx compile --dynamic in0:0`, `--shape in0=1..16x3x224x224`; by default dim 0 of
every input, the batch, when the model allows it and no fixed size was asked for it),
then probes the graph with those dims changed, running every node's shape rule:

- reshape targets are rewritten symbolically where their meaning allows: a target dim
  equal to an input dim that moves with a dynamic dim, aligned from the front (a leading
  1 that equals the batch) or from the back (trailing spatial dims), becomes "copy input
  dim k"; a remaining single literal dim becomes -1 (inferred) when needed. The rewrite is
  stored as attr `dyn_shape` (ints: >= 0 literal, -1 inferred, -2-k copy input dim k).
  A reshape whose target came from a size list (attr `like_shape`, over the tensors the
  sizes read) already follows them exactly: it is probed by its shape rule, not guessed.
- any node whose shape rule rejects the probe fixes those dims; the compile reports which
  input dims are fixed and by which node (an explicit --dynamic request that cannot be
  honoured fails the compile, naming the node and its .param line).

Results, in the compile's context: ctx.dynamic = {input name: [(min, max) per dim]} (max
-1 = unbounded), ctx.dynamic_outputs = {output uid: {dim that follows the inputs: (min, max)}},
ctx.fixed_reasons = [text, ...] and ctx.notes (a reshape like view(1, -1) read per image)
for the compile summary.
"""

import copy

import numpy as np

from pmx.runtime.dim_ranges import UNBOUNDED
from pmx.runtime.errors import PmxCompileError
from pmx.runtime.kernels.registry import output_shapes
from pmx.runtime.kernels.shape import copy_dim, resolve_dyn_shape


def _numel(s):
    return int(np.prod(s, dtype=np.int64))


def symbolic_reshape(target, in_compiled, in_probe, batch_values=(), batch_scale=None):
    """Rewrite a frozen reshape target so it follows the input dims that changed between
    the compiled and the probe shape; None if no rewrite keeps the element count.

    A target with a -1 is kept where it takes the probe: pnnx resolves every -1 of a
    fixed-shape export, so one left is a dynamic-shape export's, written as the module
    wrote it, but for a leading literal equal to the traced batch, which may be
    x.size(0) folded where both of pnnx's traces had that batch (the rules below copy it).
    Else a leading literal equal to a traced batch is the batch (-1 takes it):
    the GPT-2 pattern x.view(-1, C) ... .view(B, T, C) traced at B = 1, whose (1, T, C)
    the rules after would read as (1, B * T, C) since T's size coincides. That only where
    the batch alone grew the input (batch_scale: the probe's batch over the traced one):
    a growth of another dim must not pass into the batch."""
    folded_batch = bool(target) and target[0] in batch_values  # pnnx folds a size both traces shared
    if -1 in target and not folded_batch and _takes(target, in_compiled, in_probe):
        return tuple(target)
    leading = _leading_inferred(list(target), batch_values)
    if (
        leading is not None
        and batch_scale is not None
        and _numel(in_probe) == _numel(in_compiled) * batch_scale
        and _takes(leading, in_compiled, in_probe, like=target)
    ):
        return tuple(leading)
    for rule in (_squeeze_like, _leading_merge):
        found = rule(target, in_compiled, in_probe)
        if found is not None:
            return found
    # Copying a dim that does not change is the same as the literal, so aligned equal dims
    # become copies whether or not this probe moves them.
    t = list(target)
    rank = len(in_compiled)
    for i in range(min(len(t), rank)):  # leading dims: batch and friends
        if t[i] == in_compiled[i]:
            t[i] = copy_dim(i)
        else:
            break
    for k in range(1, min(len(t), rank) + 1):  # trailing dims: spatial
        jt, jin = len(t) - k, rank - k
        if t[jt] <= -2:
            break
        if t[jt] == in_compiled[jin]:
            t[jt] = copy_dim(jin)
        else:
            break
    for candidate in (t, _with_inferred(t), _leading_inferred(t, batch_values)):
        if candidate is None:
            continue
        try:
            if resolve_dyn_shape(candidate, in_compiled) == resolve_dyn_shape(target, in_compiled) and _numel(
                resolve_dyn_shape(candidate, in_probe)
            ) == _numel(in_probe):
                return tuple(candidate)
        except ValueError:
            continue
    return None


def _takes(candidate, in_compiled, in_probe, like=None):
    """Whether `candidate` reshapes the probe's elements and, at the compiled shape, gives
    what `like` (default: itself) gives."""
    try:
        same = resolve_dyn_shape(candidate, in_compiled) == resolve_dyn_shape(like or candidate, in_compiled)
        return same and _numel(resolve_dyn_shape(candidate, in_probe)) == _numel(in_probe)
    except ValueError:
        return False


def _squeeze_like(target, in_compiled, in_probe):
    """A reshape that only adds or removes size-1 dims (squeeze, unsqueeze, unbind's
    squeeze): map the input's real dims, and the 1-sized dims that move (a batch of 1),
    in order onto the target; the target's other 1s are inserted."""
    if -1 in target or [d for d in target if d != 1] != [d for d in in_compiled if d != 1]:
        return None
    kept = [i for i, (a, b) in enumerate(zip(in_compiled, in_probe)) if a != 1 or b != 1]
    out, p = [], 0
    for d in target:
        if p < len(kept) and d == in_compiled[kept[p]]:
            out.append(copy_dim(kept[p]))
            p += 1
        elif d == 1:
            out.append(1)
        else:
            return None
    return tuple(out) if p == len(kept) else None


def _groups(a, b):
    """Pair consecutive dims of a and b whose products match ([(dims of a, dims of b)]), as
    a reshape that merges or splits neighbouring dims does; None if there is no pairing."""
    i = j = 0
    groups = []
    while i < len(a) and j < len(b):
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        while pa != pb:
            if pa < pb:
                i += 1
                if i >= len(a):
                    return None
                pa *= a[i]
                ga.append(i)
            else:
                j += 1
                if j >= len(b):
                    return None
                pb *= b[j]
                gb.append(j)
        groups.append((ga, gb))
        i, j = i + 1, j + 1
    if any(d != 1 for d in a[i:]) or any(d != 1 for d in b[j:]):
        return None
    groups += [([k], []) for k in range(i, len(a))] + [([], [k]) for k in range(j, len(b))]
    return groups


def _leading_merge(target, in_compiled, in_probe):
    """A reshape whose first target dim merges the leading input dims, the batch among
    them (Swin's windows: (B, nH, nW, ws, ws, C) -> (B*nH*nW, ws*ws, C)): that dim
    becomes -1, one-to-one dims are copied, other unchanged groups stay literal."""
    if -1 in target:
        return None
    groups = _groups(list(in_compiled), list(target))
    if groups is None:
        return None
    out = list(target)
    for ga, gb in groups:
        changed = any(in_compiled[k] != in_probe[k] for k in ga)
        if len(ga) == 1 and len(gb) == 1:
            out[gb[0]] = copy_dim(ga[0])
        elif changed and gb == [0] and ga[0] == 0 and in_compiled[0] != in_probe[0]:
            out[0] = -1
        elif changed:
            return None
    return tuple(out)


def _leading_inferred(t, batch_values):
    """Last resort: a leading literal equal to the traced batch of a dynamic input absorbs
    the change (Swin's window reverse view(B, H/ws, W/ws, ws, ws, C) traced with B = 1)."""
    if -1 in t or not t or t[0] < 0 or t[0] not in batch_values:
        return None
    return [-1] + list(t[1:])


def _with_inferred(t):
    if -1 in t:
        return None
    literal = [i for i, d in enumerate(t) if d >= 0]
    if len(literal) != 1:
        return None
    t2 = list(t)
    t2[literal[0]] = -1
    return t2


def _requested(graph, options):
    """{input uid: {dim: (min, max)}} and whether each request was explicit. A request
    (n, n) fixes the dim (`--shape in0=1x...`): it is not probed, and not made dynamic as
    the batch by default."""
    req = {}
    explicit = set()
    fixed = set()
    by_name = {v.name: v for v in graph.inputs}
    for name, dims in options.dynamic.items():
        if name not in by_name:
            raise PmxCompileError(f"--dynamic/--shape names input {name!r}; the model's inputs are {list(by_name)}")
        v = by_name[name]
        for dim, rng in dims.items():
            if not -len(v.shape) <= dim < len(v.shape):
                raise PmxCompileError(f"--dynamic {name}:{dim}: input {name} has rank {len(v.shape)}")
            if rng[0] == rng[1]:
                fixed.add((v.uid, dim % len(v.shape)))
                continue
            req.setdefault(v.uid, {})[dim % len(v.shape)] = rng
            explicit.add((v.uid, dim % len(v.shape)))
    auto = {}
    if options.auto_batch:
        for v in graph.inputs:
            if v.shape and 0 not in req.get(v.uid, {}) and (v.uid, 0) not in fixed:
                auto[v.uid] = {0: (1, UNBOUNDED)}
    return req, explicit, auto


def _probe_value(compiled, rng):
    lo, hi = rng
    for p in (compiled * 2, compiled + 1, compiled - 1):
        if p >= max(lo, 1) and (hi == UNBOUNDED or p <= hi) and p != compiled:
            return p
    return None


def mark_dynamic_dims(graph, ctx):
    """All requested dims are probed together (inputs that share a batch move together)."""
    explicit_req, explicit, auto = _requested(graph, ctx.options)
    req = {uid: {**auto.get(uid, {}), **explicit_req.get(uid, {})} for uid in set(explicit_req) | set(auto)}
    if not req:
        return
    failure, shapes, notes, rewrites = _probe_each_and_all(graph, req)
    if failure is not None and auto and explicit_req:
        # the batch the user did not ask for may be what cannot change: try without it
        where, why = failure
        names = ", ".join(f"{v.name} dim 0" for v in graph.inputs if v.uid in auto)
        ctx.fixed_reasons.append(f"{names} fixed: {where} {why}")
        req = explicit_req
        failure, shapes, notes, rewrites = _probe_each_and_all(graph, req)
    if failure is not None:
        where, why = failure
        if explicit:
            names = ", ".join(f"{v.name}:{d}" for v in graph.inputs for d in req.get(v.uid, {}))
            raise PmxCompileError(f"dynamic dims {names} cannot change: {where} {why}{_range_advice(graph, req)}")
        names = ", ".join(f"{v.name} dim {d}" for v in graph.inputs for d in req.get(v.uid, {}))
        ctx.fixed_reasons.append(f"{names} fixed: {where} {why}")
        return
    for node, attrs in rewrites.values():
        node.attrs.update(attrs)
    ctx.notes.extend(notes)
    for v in graph.inputs:
        if v.uid in req:
            ranges = [(d, d) for d in v.shape]
            for d, rng in req[v.uid].items():
                ranges[d] = rng
            ctx.dynamic[v.name] = ranges
    # outputs whose dims moved in the probe are reported as dynamic (get_outputs: None)
    for v in graph.outputs:
        if v.uid in shapes and shapes[v.uid] != v.shape:
            ctx.dynamic_outputs[v.uid] = _output_ranges(graph, req, shapes, v)
    if any(0 in req.get(uid, {}) for uid in auto):  # the default batch is still dynamic
        ctx.notes.extend(_outputs_not_following_the_batch(graph, shapes))


def _outputs_not_following_the_batch(graph, shapes):
    """Notes on outputs whose shape stays the same when the default dynamic batch grows:
    a reduction over the batch, or a size pnnx folded into a constant (torch.zeros(x.size(0),
    4) is written as a (1, 4) constant), which torch would have followed."""
    still = [v.name for v in graph.outputs if shapes.get(v.uid, v.shape) == v.shape and v.shape]
    if not still:
        return []
    keeps = "keeps its" if len(still) == 1 else "keep their"
    return [
        f"{', '.join(still)} {keeps} exported shape at every batch: right for a reduction over the "
        f"batch, wrong where the model made a tensor from x.size(0), which pnnx folds into a constant "
        f"(--check tests it; --static keeps the export's shapes)"
    ]


def _range_advice(graph, req):
    """How to allow such dims up to a size only (a position table the model slices to
    the length: the probe at twice the size ran past it)."""
    shapes = []
    for v in graph.inputs:
        wanted = req.get(v.uid)
        if wanted:
            dims = [f"{wanted[d][0]}..<max>" if d in wanted else str(n) for d, n in enumerate(v.shape)]
            shapes.append(f"--shape {v.name}={'x'.join(dims)}")
    return (
        f". If the model takes those dims up to a size only (a table it slices to the length), "
        f"give the range: {' '.join(shapes)}, each <max> the largest size it takes"
    )


def _output_ranges(graph, req, shapes, out):
    """{dim: (min, max)} of the output dims that moved in the probe. A dim that moved as
    a requested input dim did (same size compiled, same size probed: the batch passing
    through) takes that dim's range; any other may be any size, 0 included."""
    moved = {}
    for v in graph.inputs:
        for d, rng in req.get(v.uid, {}).items():
            moved.setdefault((v.shape[d], shapes[v.uid][d]), rng)
    return {i: moved.get((a, b), (0, UNBOUNDED)) for i, (a, b) in enumerate(zip(out.shape, shapes[out.uid])) if a != b}


def _probe_each_and_all(graph, req):
    """_probe with every requested dim moved at once, its reshape rewrites checked against
    probes that move one dim alone: a reshape of a dim merged from two (B * T, from
    x.view(-1, C) of a fixed-shape export) is rewritten by a guess that may fit the joint
    probe alone (growing T where B grew). A rewrite that gives another shape than the
    one-dim probe's own is a failure naming the reshape, as any rejected probe is."""
    failure, shapes, notes, rewrites = _probe(graph, req)
    pairs = [(uid, d) for uid, dims in req.items() for d in dims]
    if failure is not None or len(pairs) < 2:
        return failure, shapes, notes, rewrites
    names = {v.uid: v.name for v in graph.inputs}
    for uid, d in pairs:
        alone, alone_shapes, _, _ = _probe(graph, {uid: {d: req[uid][d]}})
        if alone is not None:
            continue  # that dim cannot move alone: nothing to compare with
        for node, attrs in rewrites.values():
            if "dyn_shape" not in attrs:
                continue
            x, out = node.inputs[0], node.outputs[0]
            moved = alone_shapes.get(x.uid, x.shape)
            try:
                same = resolve_dyn_shape(attrs["dyn_shape"], moved) == alone_shapes.get(out.uid, out.shape)
            except ValueError:
                same = False
            if not same:
                dims = ", ".join(f"{names[u]}:{k}" for u, k in pairs)
                return _rejected(
                    node.where(),
                    f"reshapes to {node.attrs['shape']}, which cannot follow {dims} together: it mixes "
                    f"them in one dim of a fixed-shape export (export with pnnx's two input shapes)",
                )
    return failure, shapes, notes, rewrites


def _probe(graph, req):
    """Run shape rules with the requested dims changed, rewriting reshapes on the way.
    Returns (None, probe shapes by value uid, notes for the compile summary, the rewrites
    as {node uid: (node, attrs to set)}), or ((where, reason), None, [], {}) for the first
    node (or input range) that rejects the change. Nothing is changed in the graph."""
    shapes = {}
    for v in graph.inputs:
        dims = req.get(v.uid)
        if not dims:
            continue
        probe = list(v.shape)
        for d, rng in dims.items():
            p = _probe_value(v.shape[d], rng)
            if p is None:
                return _rejected(f"input {v.name}", f"range {rng} of dim {d} leaves no other size to allow")
            probe[d] = p
        shapes[v.uid] = tuple(probe)
    batch_values = {v.shape[0] for v in graph.inputs if 0 in req.get(v.uid, {})}
    batch_scale = _batch_scale(graph, req, shapes)
    rewrites = {}
    notes = []
    for node in graph.nodes:
        ins = node.inputs  # None where an optional input is absent: shape rules read positions
        in_probe = [None if x is None else shapes.get(x.uid, x.shape) for x in ins]
        if all(x is None or p == x.shape for p, x in zip(in_probe, ins)):
            continue  # untouched by the change
        # like_shape, and a dyn_shape canonicalize derived from the op (unsqueeze, flatten),
        # are exact: their rule runs
        if node.op == "reshape" and "like_shape" not in node.attrs and "dyn_shape" not in node.attrs:
            target = node.attrs.get("pnnx_shape") or node.attrs["shape"]
            if not isinstance(target, tuple) or not all(isinstance(d, int) for d in target):
                target = node.attrs["shape"]
            new = symbolic_reshape(target, ins[0].shape, in_probe[0], batch_values, batch_scale)
            if new is None:
                return _rejected(
                    node.where(), f"reshapes to {node.attrs['shape']}, which cannot follow input {tuple(in_probe[0])}"
                )
            rewrites[node.uid] = (node, {"dyn_shape": new})
            shapes[node.outputs[0].uid] = resolve_dyn_shape(new, in_probe[0])
            if "pnnx_shape" in node.attrs and _flattens_per_image(target, new, ins[0].shape):
                notes.append(
                    f"{node.where()} flattens to {tuple(target)}, read as (batch, {target[1]}): a batch of N gives "
                    f"N rows. Had the module written view(1, -1) to mix the images, compile with --static"
                )
            continue
        dtypes = [None if x is None else np.dtype(x.dtype) for x in ins]
        try:
            results = output_shapes(node, in_probe, dtypes)
        except Exception as e:  # a rule rejecting the probe fixes the dim
            results = _broadcast_constants(node, ins, in_probe, dtypes, rewrites)
            if results is None:
                return _rejected(node.where(), f"cannot take input shapes {[list(s) for s in in_probe]} ({e})")
        for out, (shape, _) in zip(node.outputs, results):
            shapes[out.uid] = shape
    return None, shapes, notes, rewrites


def _rejected(where, why):
    """What _probe returns for the first node (or input range) that rejects the change."""
    return (where, why), None, [], {}


def _batch_scale(graph, req, shapes):
    """How many times the probe's batch is the traced one, where every input whose dim 0
    moves grows it by the same whole factor and the probe moves no other dim; else None."""
    scales = set()
    for v in graph.inputs:
        dims = req.get(v.uid, {})
        if not dims:
            continue
        if set(dims) != {0} or shapes[v.uid][0] % v.shape[0]:
            return None
        scales.add(shapes[v.uid][0] // v.shape[0])
    return scales.pop() if len(scales) == 1 else None


def _flattens_per_image(target, rewritten, in_compiled):
    """A view or reshape to (1, n) traced at batch 1 whose leading 1 now copies the batch:
    pnnx writes view(x.size(0), -1) and view(1, -1) alike as (1, n), and only the first
    keeps the images apart as torch runs it at a larger batch (the compile summary says
    which reading pmx took). torch.flatten(x, 1) says which itself: no note."""
    return len(target) == 2 and len(in_compiled) >= 3 and target[0] == 1 and rewritten[0] in (copy_dim(0), -1)


# Constants pnnx folded at the traced batch, and the attribute that lets them follow it:
# a class token concatenated to the tokens (an expand), an attention mask repeated per batch.
_CONSTANT_FOLLOWS = {"concat": ("broadcast", True), "attention": ("tile_masks", 1)}


def _broadcast_constants(node, ins, in_probe, dtypes, rewrites):
    """A node reading a constant traced at batch 1 (see _CONSTANT_FOLLOWS) whose other
    inputs now have a larger batch: set the attribute that stretches the constant, if the
    shape rule then accepts the probe. Returns the probe results, or None."""
    if node.op not in _CONSTANT_FOLLOWS or not any(x is not None and x.is_constant for x in ins):
        return None
    key, value = _CONSTANT_FOLLOWS[node.op]
    attrs = dict(node.attrs, **{key: value})
    probe_node = copy.copy(node)  # detached: the graph's links stay with `node`
    probe_node.attrs = attrs
    try:
        results = output_shapes(probe_node, in_probe, dtypes)
        if output_shapes(probe_node, [None if x is None else x.shape for x in ins], dtypes)[0][0] != tuple(
            node.outputs[0].shape
        ):
            return None
    except Exception:
        return None
    rewrites[node.uid] = (node, {key: value})
    return results
