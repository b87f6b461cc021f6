"""Decide which input dimensions may change at run time, and make frozen shapes follow them.

pnnx records every shape at the traced size: a `view(1, 3, 6, 64, 64)` or a `flatten`
carries the batch and spatial sizes it saw. This pass takes the requested dynamic input
dims (`pmx compile --dynamic in0:0`, `--shape in0=1..16x3x224x224`; by default dim 0 of
every input, the batch, when the model allows it), then probes the graph with those dims
changed, running every node's shape rule:

- reshape targets are rewritten symbolically where their meaning allows: a target dim
  equal to an input dim that moves with a dynamic dim, aligned from the front (a leading
  1 that equals the batch) or from the back (trailing spatial dims), becomes "copy input
  dim k"; a remaining single literal dim becomes -1 (inferred) when needed. The rewrite is
  stored as attr `dyn_shape` (ints: >= 0 literal, -1 inferred, -2-k copy input dim k).
- any node whose shape rule rejects the probe fixes those dims; the compile reports which
  input dims are fixed and by which node (an explicit --dynamic request that cannot be
  honoured fails the compile, naming the node and its .param line).

Results: graph.dynamic = {input name: [(min, max) per dim]} (max -1 = unbounded) and
graph.fixed_reasons = [text, ...] for the compile summary.
"""

import numpy as np

from pmx.runtime.errors import PmxCompileError
from pmx.runtime.kernels import get
from pmx.runtime.kernels.shape import resolve_dyn_shape

UNBOUNDED = -1


def copy_dim(k):
    return -2 - k


def _numel(s):
    return int(np.prod(s, dtype=np.int64))


def symbolic_reshape(target, in_compiled, in_probe):
    """Rewrite a frozen reshape target so it follows the input dims that changed between
    the compiled and the probe shape; None if no rewrite keeps the element count."""
    squeezed = _squeeze_like(target, in_compiled, in_probe)
    if squeezed is not None:
        return squeezed
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
    for candidate in (t, _with_inferred(t)):
        if candidate is None:
            continue
        try:
            if (resolve_dyn_shape(candidate, in_compiled) == tuple(_concrete(target, in_compiled))
                    and _numel(resolve_dyn_shape(candidate, in_probe)) == _numel(in_probe)):
                return tuple(candidate)
        except ValueError:
            continue
    return None


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


def _concrete(target, in_shape):
    return resolve_dyn_shape([d for d in target], in_shape)


def _with_inferred(t):
    if -1 in t:
        return None
    literal = [i for i, d in enumerate(t) if d >= 0]
    if len(literal) != 1:
        return None
    t2 = list(t)
    t2[literal[0]] = -1
    return t2


def _requested(graph):
    """{input uid: {dim: (min, max)}} and whether each request was explicit."""
    req = {}
    explicit = set()
    by_name = {v.name: v for v in graph.inputs}
    for name, dims in getattr(graph, "dynamic_request", {}).items():
        if name not in by_name:
            raise PmxCompileError(f"--dynamic/--shape names input {name!r}; the model's inputs are {list(by_name)}")
        v = by_name[name]
        for dim, rng in dims.items():
            if not -len(v.shape) <= dim < len(v.shape):
                raise PmxCompileError(f"--dynamic {name}:{dim}: input {name} has rank {len(v.shape)}")
            req.setdefault(v.uid, {})[dim % len(v.shape)] = rng
            explicit.add((v.uid, dim % len(v.shape)))
    if getattr(graph, "auto_batch", True):
        for v in graph.inputs:
            if v.shape and v.uid not in req:
                req[v.uid] = {0: (1, UNBOUNDED)}
    return req, explicit


def _probe_value(compiled, rng):
    lo, hi = rng
    for p in (compiled * 2, compiled + 1, compiled - 1):
        if p >= max(lo, 1) and (hi == UNBOUNDED or p <= hi) and p != compiled:
            return p
    return None


def mark_dynamic_dims(graph) -> bool:
    """All requested dims are probed together (inputs that share a batch move together)."""
    req, explicit = _requested(graph)
    graph.dynamic = {}
    graph.dynamic_outputs = {}
    graph.fixed_reasons = []
    if not req:
        return False
    failure, shapes = _probe(graph, req)
    if failure is not None:
        node, why = failure
        if explicit:
            names = ", ".join(f"{v.name}:{d}" for v in graph.inputs for d in req.get(v.uid, {}))
            raise PmxCompileError(f"dynamic dims {names} cannot change: {node.where()} {why}")
        names = ", ".join(f"{v.name} dim {d}" for v in graph.inputs for d in req.get(v.uid, {}))
        graph.fixed_reasons.append(f"{names} fixed: {node.where()} {why}")
        return False
    for v in graph.inputs:
        if v.uid in req:
            ranges = [(d, d) for d in v.shape]
            for d, rng in req[v.uid].items():
                ranges[d] = rng
            graph.dynamic[v.name] = ranges
    # outputs whose dims moved in the probe are reported as dynamic (get_outputs: None)
    graph.dynamic_outputs = {
        v.uid: [i for i, (a, b) in enumerate(zip(v.shape, shapes[v.uid])) if a != b]
        for v in graph.outputs if v.uid in shapes and shapes[v.uid] != v.shape}
    return False


def _probe(graph, req):
    """Run shape rules with the requested dims changed; rewrite reshapes on the way.
    Returns (None, probe shapes by value uid), or ((node, reason), None) for the first
    node that rejects the change."""
    shapes = {}
    for v in graph.inputs:
        dims = req.get(v.uid)
        if not dims:
            continue
        probe = list(v.shape)
        for d, rng in dims.items():
            p = _probe_value(v.shape[d], rng)
            if p is None:
                return (_FakeNode(v.name), f"range {rng} of dim {d} leaves no other size to allow"), None
            probe[d] = p
        shapes[v.uid] = tuple(probe)
    rewrites = {}
    for node in graph.nodes:
        ins = [x for x in node.inputs if x is not None]
        in_probe = [shapes.get(x.uid, x.shape) for x in ins]
        if all(p == x.shape for p, x in zip(in_probe, ins)):
            continue  # untouched by the change
        kernel = get(node.op)
        if kernel.infer is None:
            return (node, "has no shape rule"), None
        if node.op == "reshape":
            target = node.attrs.get("dyn_shape") or node.attrs.get("pnnx_shape") or node.attrs["shape"]
            if not isinstance(target, tuple) or not all(isinstance(d, int) for d in target):
                target = node.attrs["shape"]
            new = symbolic_reshape(target, ins[0].shape, in_probe[0])
            if new is None:
                return (node, f"reshapes to {node.attrs['shape']}, which cannot follow input {tuple(in_probe[0])}"), None
            rewrites[node.uid] = (node, new)
            shapes[node.outputs[0].uid] = resolve_dyn_shape(new, in_probe[0])
            continue
        try:
            results = kernel.infer(node, in_probe, [np.dtype(x.dtype) for x in ins])
        except Exception as e:  # noqa: BLE001 - a rule rejecting the probe fixes the dim
            return (node, f"cannot take input shapes {[list(s) for s in in_probe]} ({e})"), None
        for out, (shape, _) in zip(node.outputs, results):
            shapes[out.uid] = tuple(int(d) for d in shape)
    for node, new in rewrites.values():
        node.attrs["dyn_shape"] = new
    return None, shapes


class _FakeNode:
    def __init__(self, name):
        self.name = name

    def where(self):
        return f"input {self.name}"
