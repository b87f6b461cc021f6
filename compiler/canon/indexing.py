"""Canonicalization rules: indexing and data movement (roll, flip, expand, repeat/tile,
stack, narrow, index_select/gather/Tensor.index (one index -> take, several -> index),
where, masked_fill, dtype casts, constant factories).

Shapes and dtypes come from what pnnx recorded for the node's outputs; the kernels'
shape rules re-check them in infer_shapes.
"""

import re

import numpy as np

from pmx.compiler.canon import (
    Forward,
    data_input,
    elementwise,
    fail,
    in_shape,
    make,
    out_shape,
    param,
    rule,
)


def _dims(node, key, rank, default=None):
    v = param(node, key, default)
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v,)
    if not isinstance(v, tuple) or not all(isinstance(d, int) and not isinstance(d, bool) for d in v):
        fail(node, f"{key}={v!r} must be constant ints")
    if any(not -rank <= d < rank for d in v):
        fail(node, f"{key}={v!r} out of range for input of rank {rank}")
    return tuple(d % rank for d in v)


@rule("torch.roll", "Tensor.roll")
def roll(node, ctx):
    x = data_input(node)
    shape = in_shape(node, x)
    shifts = param(node, "shifts")
    if isinstance(shifts, int):
        shifts = (shifts,)
    if not isinstance(shifts, tuple) or not all(isinstance(s, int) for s in shifts):
        fail(node, f"shifts={shifts!r} must be constant ints")
    dims = _dims(node, "dims", len(shape), None)
    if dims is None or dims == ():
        # torch rolls the flattened tensor and restores the shape
        if len(shifts) != 1:
            fail(node, f"shifts={shifts!r} needs dims")
        n = int(np.prod(shape))
        flat_in = ctx.temp(node, (n,), x.dtype)
        flat_out = ctx.temp(node, (n,), x.dtype)
        return [
            make(node, "reshape", [x], dict(shape=(n,)), outputs=[flat_in], name=node.name + ".flat"),
            make(node, "roll", [flat_in], dict(axes=(0,), shifts=(shifts[0] % n if n else 0,)),
                 outputs=[flat_out], name=node.name + ".roll"),
            make(node, "reshape", [flat_out], dict(shape=tuple(shape))),
        ]
    if len(dims) != len(shifts):
        fail(node, f"shifts={shifts!r} and dims={dims!r} differ in length")
    total = {}
    for d, s in zip(dims, shifts):  # torch applies repeated dims one after another
        total[d] = total.get(d, 0) + s
    axes = tuple(sorted(d for d in total if shape[d] and total[d] % shape[d]))
    if not axes:
        return Forward(x)
    return [make(node, "roll", [x], dict(axes=axes, shifts=tuple(total[d] % shape[d] for d in axes)))]


@rule("torch.flip", "Tensor.flip")
def flip(node, ctx):
    x = data_input(node)
    dims = _dims(node, "dims", len(in_shape(node, x)))
    axes = tuple(sorted(set(d for d in dims if x.shape[d] > 1)))
    if not axes:
        return Forward(x)
    return [make(node, "flip", [x], dict(axes=axes))]


@rule("torch.fliplr")
def fliplr(node, ctx):
    return [make(node, "flip", [data_input(node)], dict(axes=(1,)))]


@rule("torch.flipud")
def flipud(node, ctx):
    return [make(node, "flip", [data_input(node)], dict(axes=(0,)))]


def attach_size_expression(node, ctx):
    """A pnnx.Expression listing sizes (`[size(@0,0),-1,3]`, a dynamic-shape export of
    x.expand(y.size())) that only feeds Tensor.expand: its text and its one tensor move
    onto each consumer, which reads the sizes from that tensor at run time."""
    if len(node.inputs) != 1:
        fail(node, f"size list {node.attrs['expr']!r} must read one tensor")
    for c in list(node.outputs[0].consumers):
        i = c.inputs.index(node.outputs[0])
        ctx.graph.set_input(c, i, node.inputs[0])
        c.input_names[i] = "like"
        c.attrs["sizes_expr"] = node.attrs["expr"]
    return []


def _like_sizes(node, x, like):
    """expand's sizes as expand_infer codes, from expand_as's other tensor or a size list."""
    rank = len(in_shape(node, like))
    if node.op == "Tensor.expand_as":
        return tuple(-2 - k for k in range(rank))
    codes = []
    for item in _split_top(node.attrs["sizes_expr"]) or ():
        m = re.fullmatch(r"size\(@0,(-?\d+)\)", item)
        if m and -rank <= int(m.group(1)) < rank:
            codes.append(-2 - int(m.group(1)) % rank)
        elif re.fullmatch(r"-?\d+", item) and int(item) >= -1:
            codes.append(int(item))
        else:
            fail(node, f"size list {node.attrs['sizes_expr']!r}: entry {item!r} is not an int or size(@0, dim)")
    return tuple(codes)


@rule("Tensor.expand", "Tensor.expand_as", "torch.broadcast_to", "Tensor.broadcast_to")
def expand(node, ctx):
    x = data_input(node)
    like = node.named_input("other") if node.op == "Tensor.expand_as" else node.named_input("like")
    if like is not None:  # sizes that follow another tensor at run time
        return [make(node, "expand", [x, like], dict(shape=_like_sizes(node, x, like)))]
    shape = out_shape(node)
    if tuple(in_shape(node, x)) == tuple(shape):
        return Forward(x)
    try:
        np.broadcast_shapes(tuple(x.shape), tuple(shape))
    except ValueError:
        fail(node, f"cannot expand {x.shape} to {shape}")
    # -1 keeps the input's size (torch's spelling), so a re-plan at another batch follows it
    lead = len(shape) - len(x.shape)
    sizes = tuple(-1 if i >= lead and x.shape[i - lead] == d else d for i, d in enumerate(shape))
    return [make(node, "expand", [x], dict(shape=sizes))]


@rule("Tensor.repeat", "torch.tile", "Tensor.tile")
def repeat(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    reps = param(node, "sizes" if node.op == "Tensor.repeat" else "dims")
    if isinstance(reps, int):
        reps = (reps,)
    if not isinstance(reps, tuple) or not all(isinstance(r, int) and r >= 0 for r in reps):
        fail(node, f"repeats {reps!r} must be constant non-negative ints")
    if node.op == "Tensor.repeat" and len(reps) < rank:
        fail(node, f"repeat needs at least {rank} sizes, got {reps!r}")
    reps = (1,) * (rank - len(reps)) + tuple(reps)
    if all(r == 1 for r in reps) and len(reps) == rank:
        return Forward(x)
    return [make(node, "tile", [x], dict(reps=reps))]


@rule("torch.stack")
def stack(node, ctx):
    shapes = {tuple(in_shape(node, v)) for v in node.inputs}
    if len(shapes) != 1:
        fail(node, f"stack inputs have different shapes: {sorted(shapes)}")
    shape = shapes.pop()
    rank = len(shape) + 1
    dim = param(node, "dim", 0)
    if not -rank <= dim < rank:
        fail(node, f"dim={dim} out of range for stacking rank-{rank - 1} tensors")
    dim %= rank
    unsq = shape[:dim] + (1,) + shape[dim:]
    nodes, parts = [], []
    for i, v in enumerate(node.inputs):
        t = ctx.temp(node, unsq, v.dtype)
        nodes.append(make(node, "reshape", [v], dict(shape=unsq), outputs=[t], name=f"{node.name}.unsqueeze{i}"))
        parts.append(t)
    nodes.append(make(node, "concat", parts, dict(axis=dim)))
    return nodes


@rule("torch.narrow", "Tensor.narrow")
def narrow(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    dim = _dims(node, "dim", rank)[0]
    start, length = param(node, "start"), param(node, "length")
    if not isinstance(start, int) or not isinstance(length, int):
        fail(node, f"start={start!r} and length={length!r} must be constant ints")
    n = x.shape[dim]
    if start < 0:
        start += n
    if not (0 <= start and length >= 0 and start + length <= n):
        fail(node, f"narrow start={start} length={length} out of range for dim {dim} of size {n}")
    attrs = dict(axes=(dim,), starts=(start,), ends=(start + length,), steps=(1,), squeeze=())
    return [make(node, "slice", [x], attrs)]


def _index_tensor(node, ctx, v, label):
    if v is None:
        fail(node, f"missing {label} tensor")
    if np.dtype(v.dtype).kind == "b":
        fail(node, f"boolean {label} selects a data-dependent number of elements; pmx needs static shapes")
    if np.dtype(v.dtype).kind not in "iu":
        fail(node, f"{label} must be an integer tensor, found {v.dtype}")
    return v


@rule("torch.index_select", "Tensor.index_select")
def index_select(node, ctx):
    x = data_input(node)
    dim = _dims(node, "dim", len(in_shape(node, x)))[0]
    idx = _index_tensor(node, ctx, node.named_input("index"), "index")
    return [make(node, "take", [x, idx], dict(axis=dim))]


@rule("torch.gather", "Tensor.gather")
def gather(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    dim = _dims(node, "dim", rank)[0]
    idx = _index_tensor(node, ctx, node.named_input("index"), "index")
    ishape = in_shape(node, idx)
    if len(ishape) != rank or any(i > s for d, (i, s) in enumerate(zip(ishape, x.shape)) if d != dim):
        fail(node, f"index shape {ishape} does not fit input {x.shape} for gather along dim {dim}")
    return [make(node, "gather", [x, idx], dict(axis=dim))]


def _split_top(text):
    """'[None,[1,2],@0]' -> ['None', '[1,2]', '@0']; '[size(@0,0),3]' -> ['size(@0,0)', '3']"""
    if not (text.startswith("[") and text.endswith("]")):
        return None
    parts, depth, cur = [], 0, ""
    for ch in text[1:-1]:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (ch in "[(") - (ch in "])")
        cur += ch
    if cur:
        parts.append(cur)
    return parts


def attach_index_expression(node, ctx):
    """A pnnx.Expression producing a list (`[None,@0]`) only feeds Tensor.index: move its
    text and inputs onto each consumer, which then reads them directly."""
    text = node.attrs["expr"]
    for c in list(node.outputs[0].consumers):
        i = c.inputs.index(node.outputs[0])
        ctx.graph.set_input(c, i, None)
        c.input_names[i] = None
        c.attrs["expr"] = text
        for k, v in enumerate(node.inputs):
            c.inputs.append(v)
            c.input_names.append(f"expr@{k}")
            v.consumers.append(c)
    return []


@rule("Tensor.index")
def index(node, ctx):
    x = node.named_input("input") or node.inputs[0]
    rank = len(in_shape(node, x))
    text = param(node, "expr")
    parts = _split_top(text) if isinstance(text, str) else None
    if parts is None:
        fail(node, f"index expression {text!r} is not a list")
    if len(parts) > rank:
        fail(node, f"index expression {text!r} has more entries than the input's {rank} dims")
    used = [(d, p) for d, p in enumerate(parts) if p != "None"]
    if not used:
        return Forward(x)
    indices = []
    for axis, p in used:
        if p.startswith("@"):
            indices.append(_index_tensor(node, ctx, node.named_input(f"expr{p}"), "index"))
            continue
        if not p.startswith("["):
            fail(node, f"index entry {p!r} in {text!r} is not supported")
        n = x.shape[axis]
        items = p[1:-1].split(",")
        if items and all(e in ("True", "False") for e in items):
            # a constant bool list selects the positions holding True (torch's nonzero)
            if len(items) != n:
                fail(node, f"boolean index list {p!r} has {len(items)} entries for dim {axis} of size {n}")
            items = [str(i) for i, e in enumerate(items) if e == "True"]
        try:
            vals = [int(e) for e in items]
        except ValueError:
            fail(node, f"index list {p!r} must hold constant ints or bools")
        if any(not -n <= e < n for e in vals):
            fail(node, f"index list {p!r} out of range for dim {axis} of size {n}")
        indices.append(ctx.const(f"{node.name}.index{axis}", np.array([e % n for e in vals], np.int64)))
    if len(used) == 1:
        return [make(node, "take", [x, indices[0]], dict(axis=used[0][0]))]
    try:
        np.broadcast_shapes(*[tuple(in_shape(node, v)) for v in indices])
    except ValueError:
        fail(node, f"index tensors {[v.shape for v in indices]} do not broadcast together")
    return [make(node, "index", [x] + indices, dict(axes=tuple(d for d, _ in used)))]


def _operand(node, label, what):
    """(value or None, literal or None) for an operand given as tensor ($label) or scalar."""
    v = node.named_input(label)
    if v is not None:
        return v, None
    lit = param(node, label, None)
    if lit is None or not isinstance(lit, (int, float, bool)):
        fail(node, f"{what} {label}={lit!r} must be a tensor or a number")
    return None, lit


def _lit(v):
    return repr(v) if not isinstance(v, float) or np.isfinite(v) else ("inf" if v > 0 else ("-inf" if v < 0 else "nan"))


@rule("torch.where", "Tensor.where")
def where(node, ctx):
    cond = node.named_input("condition")
    if cond is None:
        fail(node, "torch.where(condition) with one argument has a data-dependent shape")
    tensors, args = [cond], ["@0"]
    for label in ("input", "other"):
        v, lit = _operand(node, label, "branch")
        if v is not None:
            tensors.append(v)
            args.append(f"@{len(tensors) - 1}")
        else:
            args.append(_lit(lit))
    c = "@0" if np.dtype(cond.dtype).kind == "b" else "ne(@0,0)"
    return [elementwise(node, f"where({c},{args[1]},{args[2]})", tensors)]


@rule("Tensor.masked_fill", "torch.masked_fill")
def masked_fill(node, ctx):
    x = data_input(node)
    mask = node.named_input("mask")
    if mask is None:
        fail(node, "missing mask")
    v, lit = _operand(node, "value", "fill")
    if v is not None:
        return [elementwise(node, "where(@1,@2,@0)", [x, mask, v])]
    return [elementwise(node, f"where(@1,{_lit(lit)},@0)", [x, mask])]


_TORCH_DTYPES = {
    "torch.float": "float32", "torch.float32": "float32", "torch.double": "float64", "torch.float64": "float64",
    "torch.half": "float16", "torch.float16": "float16", "torch.long": "int64", "torch.int64": "int64",
    "torch.int": "int32", "torch.int32": "int32", "torch.short": "int16", "torch.int16": "int16",
    "torch.int8": "int8", "torch.uint8": "uint8", "torch.bool": "bool",
}


@rule("Tensor.to", "Tensor.type", "Tensor.float", "Tensor.double", "Tensor.half", "Tensor.int",
      "Tensor.long", "Tensor.bool", "Tensor.short", "Tensor.char", "Tensor.byte", "Tensor.type_as")
def cast(node, ctx):
    x = data_input(node)
    target = node.outputs[0].dtype
    if node.outputs[0].shape is None and isinstance(node.attrs.get("dtype"), str):
        # pnnx records no shape (nor dtype) for 0-d results; the dtype argument says it
        target = _TORCH_DTYPES.get(node.attrs["dtype"], target)
    if target is None:
        fail(node, "pnnx recorded no output dtype for this cast")
    if target == x.dtype:
        return Forward(x)
    return [make(node, "cast", [x], dict(dtype=str(np.dtype(target))))]


def _filled(node, ctx, fill):
    shape = out_shape(node)
    dtype = node.outputs[0].dtype
    return Forward(ctx.const(node.outputs[0].name, np.full(shape, fill, dtype=dtype)))


@rule("torch.zeros_like", "torch.zeros", "Tensor.new_zeros", "aten::zero")  # aten::zero: zero_()'s functional form
def zeros(node, ctx):
    return _filled(node, ctx, 0)


@rule("torch.ones_like", "torch.ones", "Tensor.new_ones")
def ones(node, ctx):
    return _filled(node, ctx, 1)


@rule("torch.full_like", "torch.full", "Tensor.new_full")
def full(node, ctx):
    value = param(node, "fill_value")
    if not isinstance(value, (int, float, bool)):
        fail(node, f"fill_value={value!r} must be a constant number")
    return _filled(node, ctx, value)


@rule("torch.arange")
def arange(node, ctx):
    start, end, step = param(node, "start", 0), param(node, "end"), param(node, "step", 1)
    if not all(isinstance(v, (int, float)) for v in (start, end, step)):
        fail(node, f"arange({start!r}, {end!r}, {step!r}) needs constant numbers")
    data = np.arange(start, end, step).astype(node.outputs[0].dtype or "int64")
    if node.outputs[0].shape is not None and tuple(node.outputs[0].shape) != data.shape:
        fail(node, f"arange gives {data.shape} but pnnx recorded {node.outputs[0].shape}")
    return Forward(ctx.const(node.outputs[0].name, data))
