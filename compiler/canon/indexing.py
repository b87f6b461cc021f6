"""Canonicalization rules: indexing and data movement (roll, flip, expand, repeat/tile,
stack, narrow, index_select/gather/Tensor.index (one index -> take, several -> index),
index_put, scatter_add, fill, where, masked_fill, masked_select, topk, cumsum/cumprod,
diag, cross, as_strided, repeat_interleave, addcmul, dtype casts, constant factories).

Shapes and dtypes come from what pnnx recorded for the node's outputs; the kernels'
shape rules re-check them in infer_shapes.
"""

import numpy as np

from pmx.compiler.canon import (
    Forward,
    as_terms,
    data_input,
    elementwise,
    fail,
    in_shape,
    make,
    operands,
    out_shape,
    param,
    rule,
    slice_end,
)
from pmx.compiler.canon.math_ops import LIST, NONE, compile_time_number, pnnx_expression_tree, pnnx_text, size_dim
from pmx.compiler.ir import Value
from pmx.runtime import expr as E
from pmx.runtime.errors import PmxFormatError
from pmx.runtime.kernels.shape import copy_dim

_NO_DEFAULT = object()


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
            make(
                node,
                "roll",
                [flat_in],
                dict(axes=(0,), shifts=(shifts[0],)),
                outputs=[flat_out],
                name=node.name + ".roll",
            ),
            make(node, "reshape", [flat_out], dict(shape=tuple(shape))),
        ]
    if len(dims) != len(shifts):
        fail(node, f"shifts={shifts!r} and dims={dims!r} differ in length")
    total = {}
    for d, s in zip(dims, shifts):  # torch applies repeated dims one after another
        total[d] = total.get(d, 0) + s
    # shifts stay as given (the kernel takes them modulo the size it runs at): at the
    # exported size a shift may be a whole turn, at another size of a dynamic dim not
    axes = tuple(sorted(d for d in total if total[d]))
    if not axes:
        return Forward(x)
    return [make(node, "roll", [x], dict(axes=axes, shifts=tuple(total[d] for d in axes)))]


@rule("torch.flip", "Tensor.flip")
def flip(node, ctx):
    x = data_input(node)
    dims = _dims(node, "dims", len(in_shape(node, x)))
    # every dim is kept, size 1 too: a dim exported at size 1 (a batch) may be dynamic
    return [make(node, "flip", [x], dict(axes=tuple(sorted(set(dims)))))]


@rule("torch.fliplr")
def fliplr(node, ctx):
    return [make(node, "flip", [data_input(node)], dict(axes=(1,)))]


@rule("torch.flipud")
def flipud(node, ctx):
    return [make(node, "flip", [data_input(node)], dict(axes=(0,)))]


def attach_expand_sizes(node, ctx, sizes):
    """A pnnx.Expression listing sizes (the tree of `[size(@0,0),-1,3]`, a dynamic-shape
    export of x.expand(y.size()) or x.new_zeros(B, N, 2)) that only feeds Tensor.expand
    and the zeros/ones/full ops: the list and its one tensor move onto each consumer,
    which reads the sizes from that tensor at run time."""
    if len(node.inputs) != 1:
        fail(node, f"size list {pnnx_text(sizes)!r} must read one tensor")
    for c in list(node.outputs[0].consumers):
        i = c.inputs.index(node.outputs[0])
        ctx.graph.set_input(c, i, node.inputs[0])
        c.input_names[i] = "like"
        c.attrs["size_list"] = sizes
    return []


def _int(tree):
    """The int a literal leaf holds (not a bool), else None."""
    return tree[1] if tree[0] == "#" and type(tree[1]) is int else None


def _like_sizes(node, like):
    """expand's sizes as expand_infer codes, from expand_as's other tensor or a size list."""
    rank = len(in_shape(node, like))
    if node.op == "Tensor.expand_as":
        return tuple(copy_dim(k) for k in range(rank))
    sizes = node.attrs["size_list"]
    codes = []
    for item in sizes[1:]:
        d, n = size_dim(item), _int(item)
        if d is not None and -rank <= d < rank:
            codes.append(copy_dim(d % rank))
        elif n is not None and n >= -1:
            codes.append(n)
        else:
            fail(
                node,
                f"size list {pnnx_text(sizes)!r}: entry {pnnx_text(item)!r} is not an int or size(@0, dim) "
                f"(pmx follows sizes read from a tensor, not arithmetic on them; export with a fixed input shape)",
            )
    return tuple(codes)


@rule("Tensor.expand", "Tensor.expand_as", "torch.broadcast_to", "Tensor.broadcast_to")
def expand(node, ctx):
    x = data_input(node)
    like = node.named_input("other") if node.op == "Tensor.expand_as" else node.named_input("like")
    if like is not None:  # sizes that follow another tensor at run time
        return [make(node, "expand", [x, like], dict(shape=_like_sizes(node, like)))]
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
    label = "sizes" if node.op == "Tensor.repeat" else "dims"
    given = node.named_input(label)
    if given is None:
        reps = param(node, label)
    elif given.is_constant:  # repeats in a tensor (ONNX Tile): its values
        reps = tuple(int(r) for r in np.ravel(given.data))
    else:  # an input's values, read when the model runs
        return _repeat_at_run(node, x, rank, given)
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


def _repeat_at_run(node, x, rank, given):
    shape = in_shape(node, given)
    if len(shape) != 1 or np.dtype(given.dtype).kind not in "iu":
        fail(node, f"repeats {given.name} are {list(shape)} {given.dtype}; a 1-d integer tensor expected")
    if node.op == "Tensor.repeat" and shape[0] < rank:
        fail(node, f"repeat needs at least {rank} sizes, {given.name} has {shape[0]}")
    return _sized_at_run(node, "tile_values", [x, given], {}, rank=max(rank, shape[0]))


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
    first = start + n if start < 0 else start
    if not (first >= 0 and length >= 0 and first + length <= n):
        fail(node, f"narrow start={start} length={length} out of range for dim {dim} of size {n}")
    # a negative start stays one, counting from the end of the dim's size at run time
    attrs = dict(axes=(dim,), starts=(start,), ends=(slice_end(start, length),), steps=(1,), squeeze=())
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


def attach_index_expression(node, ctx, indices):
    """A pnnx.Expression producing a list (the tree of `[None,@0]`) only feeds Tensor.index
    or index_put: move the list and the inputs it reads onto each consumer, which then
    reads them directly (@k as its input expr@k)."""
    for c in list(node.outputs[0].consumers):
        i = c.inputs.index(node.outputs[0])
        ctx.graph.set_input(c, i, None)
        c.input_names[i] = None
        c.attrs["index_list"] = indices
        for k, v in enumerate(node.inputs):
            at = len(c.inputs)
            ctx.graph.set_input(c, at, v)
            c.input_names[at] = f"expr@{k}"
    return []


def _index_list(node):
    """(pnnx's spelling, items) of the node's index list: the tree attach_index_expression
    moved onto it, or the constant list pnnx folds into the node's own expr=
    (`[None,[4,0,-1]]`), read by the pnnx expression reader."""
    tree = node.attrs.get("index_list")
    if tree is None:
        text = node.attrs.get("expr")
        if not isinstance(text, str):
            fail(node, f"indices must be a list expression such as [None,@0], got {text!r}")
        try:
            tree = pnnx_expression_tree(text, sum(1 for n in node.input_names if n and n.startswith("expr@")))
        except PmxFormatError as e:
            fail(node, str(e))
    if tree[0] != LIST:
        fail(node, f"index expression {pnnx_text(tree)!r} is not a list")
    return pnnx_text(tree), tree[1:]


@rule("Tensor.index")
def index(node, ctx):
    x = node.named_input("input") or node.inputs[0]
    rank = len(in_shape(node, x))
    text, parts = _index_list(node)
    if len(parts) > rank:
        fail(node, f"index expression {text!r} has more entries than the input's {rank} dims")
    used = [(d, p) for d, p in enumerate(parts) if p != NONE]
    if not used:
        return Forward(x)
    indices = []
    for axis, p in used:
        if p[0] == "@":
            indices.append(_index_tensor(node, ctx, node.named_input(f"expr@{p[1]}"), "index"))
            continue
        if p[0] != LIST:
            fail(node, f"index entry {pnnx_text(p)!r} in {text!r} is not supported")
        n = x.shape[axis]
        items = p[1:]
        if items and all(e[0] == "#" and type(e[1]) is bool for e in items):
            # a constant bool list selects the positions holding True (torch's nonzero)
            if len(items) != n:
                fail(node, f"boolean index list {pnnx_text(p)!r} has {len(items)} entries for dim {axis} of size {n}")
            vals = [i for i, e in enumerate(items) if e[1]]
        else:
            vals = [_int(e) for e in items]
            if not vals or None in vals:
                fail(node, f"index list {pnnx_text(p)!r} must hold constant ints or bools")
        if any(not -n <= e < n for e in vals):
            fail(node, f"index list {pnnx_text(p)!r} out of range for dim {axis} of size {n}")
        # negative entries stay negative: they count from the end of the dim's size at run time
        indices.append(ctx.const(f"{node.name}.index{axis}", np.array(vals, np.int64)))
    if len(used) == 1:
        return [make(node, "take", [x, indices[0]], dict(axis=used[0][0]))]
    try:
        np.broadcast_shapes(*[tuple(in_shape(node, v)) for v in indices])
    except ValueError:
        fail(node, f"index tensors {[v.shape for v in indices]} do not broadcast together")
    return [make(node, "index", [x] + indices, dict(axes=tuple(d for d, _ in used)))]


NUMBERS = (int, float, bool)


@rule("torch.where", "Tensor.where")
def where(node, ctx):
    if node.named_input("condition") is None:
        fail(node, "torch.where(condition) with one argument has a data-dependent shape")
    args, tensors = as_terms(operands(node, "condition", "input", "other", numbers=NUMBERS))
    cond = tensors[0]
    c = E.at(0) if np.dtype(cond.dtype).kind == "b" else E.call("ne", E.at(0), 0)
    return [elementwise(node, E.call("where", c, *args[1:]), tensors)]


@rule("Tensor.masked_fill", "torch.masked_fill")
def masked_fill(node, ctx):
    x, mask, v = operands(node, "input", "mask", "value", numbers=NUMBERS)
    if not isinstance(x, Value) or not isinstance(mask, Value):
        fail(node, "the input and the mask must be tensors")
    if isinstance(v, Value):
        return [elementwise(node, E.call("where", E.at(1), E.at(2), E.at(0)), [x, mask, v])]
    return [elementwise(node, E.call("where", E.at(1), v, E.at(0)), [x, mask])]


_TORCH_DTYPES = {
    "torch.float": "float32",
    "torch.float32": "float32",
    "torch.double": "float64",
    "torch.float64": "float64",
    "torch.half": "float16",
    "torch.float16": "float16",
    "torch.long": "int64",
    "torch.int64": "int64",
    "torch.int": "int32",
    "torch.int32": "int32",
    "torch.short": "int16",
    "torch.int16": "int16",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
    "torch.bool": "bool",
}


@rule(
    "Tensor.to",
    "Tensor.type",
    "Tensor.float",
    "Tensor.double",
    "Tensor.half",
    "Tensor.int",
    "Tensor.long",
    "Tensor.bool",
    "Tensor.short",
    "Tensor.char",
    "Tensor.byte",
    "Tensor.type_as",
)
def cast(node, ctx):
    x = data_input(node)
    recorded = node.outputs[0].recorded_dtype
    named = _TORCH_DTYPES.get(node.attrs.get("dtype")) if isinstance(node.attrs.get("dtype"), str) else None
    # pnnx records no dtype for 0-d results; the dtype argument says it (else the
    # frontend's float32)
    target = recorded or named or node.outputs[0].dtype
    if target is None:
        fail(node, "pnnx recorded no output dtype for this cast")
    if named is not None and np.dtype(named) != np.dtype(target):
        fail(
            node,
            f"casts to {named} (dtype={node.attrs['dtype']}) but its output {node.outputs[0].name} is "
            f"recorded as {target}; the .param contradicts itself (edited or damaged?)",
        )
    if target == x.dtype:
        return Forward(x)
    return [make(node, "cast", [x], dict(dtype=str(np.dtype(target))))]


def _filled(node, ctx, fill):
    """A tensor full of `fill`: of the shape pnnx recorded for a *_like op or a size
    written as numbers; of the values of a size tensor ($size, ONNX's ConstantOfShape),
    which a constant gives now and an input only when the model runs."""
    dtype = node.outputs[0].dtype
    if "size_list" in node.attrs:  # a dynamic export's [size(@0,0),size(@0,1),2]
        return _filled_like(node, ctx, fill, dtype)
    like = node.named_input("input") if node.op.endswith("_like") else None
    if like is not None and not like.is_constant:
        # zeros_like(x) follows x's shape at run time (a batch, a '?' dim), as torch does
        value = ctx.const(f"{node.name}.value", np.array(fill, dtype=dtype))
        codes = tuple(copy_dim(k) for k in range(len(in_shape(node, like))))
        return [make(node, "expand", [value, like], dict(shape=codes))]
    size = node.named_input("size")
    if size is None:
        return Forward(ctx.const(node.outputs[0].name, np.full(out_shape(node), fill, dtype=dtype)))
    shape = in_shape(node, size)
    if len(shape) != 1 or np.dtype(size.dtype).kind not in "iu":
        fail(node, f"size {size.name} is {list(shape)} {size.dtype}; a 1-d integer tensor expected")
    if size.is_constant:
        dims = tuple(int(n) for n in size.data)
        if min(dims, default=0) < 0:
            fail(node, f"size {list(dims)} has a negative dim")
        return Forward(ctx.const(node.outputs[0].name, np.full(dims, fill, dtype=dtype)))
    return _sized_at_run(node, "full_values", [size], dict(value=fill, dtype=str(np.dtype(dtype))), rank=shape[0])


def _filled_like(node, ctx, fill, dtype):
    """The fill value expanded to sizes read from another tensor's dims at run time (the
    size list attach_expand_sizes moved here): an `expand` of a one-element constant."""
    like = node.named_input("like")
    codes = _like_sizes(node, like)
    if -1 in codes:
        fail(node, f"size list {pnnx_text(node.attrs['size_list'])!r}: -1 is no size for a new tensor")
    value = ctx.const(f"{node.name}.value", np.array(fill, dtype=dtype))
    return [make(node, "expand", [value, like], dict(shape=codes))]


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


def _scalar_param(node, label, default=_NO_DEFAULT):
    """param or tensor input `label` as a compile-time number (None stays None)."""
    v = node.named_input(label)
    if v is None:
        return param(node, label) if default is _NO_DEFAULT else param(node, label, default)
    n = compile_time_number(v)
    if n is None:
        fail(
            node,
            f"{label} is computed from tensor values (operand {v.name}), so the output's size would "
            f"depend on the data; pmx needs it known at compile time",
        )
    return n


def attach_arange_size(node, ctx, size):
    """The tree of `size(@0,d)` feeding torch.arange (pnnx's dynamic-shape spelling of
    arange(x.size(d))): each arange reads the tensor and dim directly, so its length is
    a shape rule of that tensor's shape (re-planned like any other), not a value."""
    d = size_dim(size)
    if d is None or len(node.inputs) != 1:
        fail(node, f"expression {pnnx_text(size)!r} feeding arange must be size(@0,dim)")
    for c in list(node.outputs[0].consumers):
        i = c.inputs.index(node.outputs[0])
        label = c.input_names[i]
        ctx.graph.set_input(c, i, node.inputs[0])
        c.input_names[i] = f"{label}@size"
        c.attrs[f"{label}@size"] = d
    return []


def _arange_dtype(node, start, end, step):
    dtype = node.outputs[0].dtype
    named = node.attrs.get("dtype")
    if isinstance(named, str) and named in _TORCH_DTYPES:
        dtype = _TORCH_DTYPES[named]
    if dtype is None:
        dtype = "int64" if all(isinstance(v, int) for v in (start, end, step)) else "float32"
    return dtype


@rule("torch.arange")
def arange(node, ctx):
    """All of arange's spellings once its bounds are numbers at compile time (literals,
    constants, folded expressions), or its end a dim of a tensor (x.size(d) in a
    dynamic-shape export: the `arange` op, whose length follows that tensor's shape);
    bounds read from input values give a data-dependent length, which pmx refuses
    naming the node."""
    for label in ("start", "step"):
        if f"{label}@size" in node.attrs:
            fail(node, f"{label} is a tensor's size; pmx follows sizes only as arange's end (arange(x.size(d)))")
    sized = node.named_input("end@size")
    if sized is not None:
        start, step = _scalar_param(node, "start", 0), _scalar_param(node, "step", 1)
        start, step = (0 if start is None else start), (1 if step is None else step)
        rank = len(in_shape(node, sized))
        axis = node.attrs["end@size"]
        if not -rank <= axis < rank or not all(isinstance(v, (int, float)) for v in (start, step)) or step == 0:
            fail(node, f"arange(start={start!r}, end=size(dim {axis}), step={step!r}) of a rank-{rank} tensor")
        dtype = _arange_dtype(node, start, 0, step)
        node.outputs[0].dtype = dtype
        n = max(0, int(np.ceil((sized.shape[axis] - start) / step)))
        if node.outputs[0].shape is None or None in node.outputs[0].shape:
            node.outputs[0].shape = (n,)
        attrs = dict(start=start, step=step, axis=axis % rank, dtype=str(np.dtype(dtype)))
        return [make(node, "arange", [sized], attrs)]
    read = [node.named_input(label) for label in ("start", "end", "step")]
    if any(v is not None and compile_time_number(v) is None for v in read):
        return _arange_values(node, ctx)
    start = _scalar_param(node, "start", 0)
    end = _scalar_param(node, "end", None)
    step = _scalar_param(node, "step", 1)
    if end is None:
        fail(node, "arange needs an end")
    start = 0 if start is None else start
    step = 1 if step is None else step
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, end, step)) or step == 0:
        fail(node, f"arange({start!r}, {end!r}, {step!r}) needs numbers and a nonzero step")
    dtype = _arange_dtype(node, start, end, step)
    n = max(0, int(np.ceil((end - start) / step)))
    # torch computes start + i * step in int64 for integer bounds, else in double
    exact = all(isinstance(v, int) for v in (start, end, step))
    data = (start + np.arange(n, dtype=np.int64 if exact else np.float64) * step).astype(dtype)
    if (
        node.outputs[0].shape is not None
        and None not in node.outputs[0].shape
        and int(np.prod(node.outputs[0].shape)) != n
    ):
        fail(node, f"arange gives {n} elements but pnnx recorded {node.outputs[0].shape}")
    return Forward(ctx.const(node.outputs[0].name, data))


def _arange_values(node, ctx):
    """arange with a bound read from tensor values (torch.arange(x[0])): the length is
    known only when it runs, so the output is sized at run time (_sized_at_run)."""
    out = node.outputs[0]
    operands, kinds = [], []
    for label, default in (("start", 0), ("end", None), ("step", 1)):
        v = node.named_input(label)
        if v is None:
            n = param(node, label, default)
            if not isinstance(n, (int, float)) or isinstance(n, bool):
                fail(node, f"arange's {label} must be a number or a one-element tensor, found {n!r}")
            v = ctx.const(f"{node.name}.{label}", np.array(n))
        elif v.shape is not None and None not in v.shape and int(np.prod(v.shape)) != 1:
            fail(node, f"arange's {label} {v.name} has shape {list(v.shape)}; one element expected")
        operands.append(v)
        kinds.append(np.dtype(v.dtype).kind)
    dtype = out.dtype
    named = node.attrs.get("dtype")
    if isinstance(named, str) and named in _TORCH_DTYPES:
        dtype = _TORCH_DTYPES[named]
    if dtype is None:  # torch: the default float dtype if any bound is floating, else int64
        dtype = "float32" if any(k in "fc" for k in kinds) else "int64"
    out.dtype = str(np.dtype(dtype))
    return _sized_at_run(node, "arange_values", operands, dict(dtype=out.dtype))


def _sized_at_run(node, op, inputs, attrs, rank=1):
    """The node as `op` whose kernel allocates its output when it runs (attrs sized_at_run,
    runtime/session.py): planned empty, of its rank; the canonicalize pass checks its readers."""
    node.outputs[0].shape = (0,) * rank
    return [make(node, op, inputs, dict(attrs, sized_at_run=True))]


@rule("Tensor.fill", "Tensor.fill_", "torch.fill", "torch.fill_")
def fill(node, ctx):
    x = data_input(node)
    v = node.named_input("value")
    if v is not None:
        n = compile_time_number(v)
        if n is None:
            if v.shape is not None and None not in v.shape and int(np.prod(v.shape)) != 1:
                fail(node, f"fill value {v.name} has shape {v.shape}; it must have one element")
            return [make(node, "fill", [x, v], {})]
        value = n
    else:
        value = param(node, "value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(node, f"value={value!r} must be a number or a one-element tensor")
    return [make(node, "fill", [x], dict(value=value))]


@rule("Tensor.index_put", "Tensor.index_put_", "torch.index_put", "torch.index_put_")
def index_put(node, ctx):
    """x[i0, :, i1] = values (accumulate: +=). The indices arrive as the list tree
    attach_index_expression moved onto this node: None entries are whole dims, @k
    entries integer or boolean tensors."""
    x = data_input(node)
    rank = len(in_shape(node, x))
    text, parts = _index_list(node)
    axes, indices, dim = [], [], 0
    for p in parts:
        if p == NONE:
            dim += 1
            continue
        if p[0] != "@":
            fail(node, f"index entry {pnnx_text(p)!r} in {text!r} is not supported")
        v = node.named_input(f"expr@{p[1]}")
        if v is None:
            fail(node, f"missing index tensor @{p[1]}")
        kind = np.dtype(v.dtype).kind
        if kind not in "iub":
            fail(node, f"index {v.name} must be an integer or boolean tensor, found {v.dtype}")
        axes.append(dim)
        indices.append(v)
        dim += len(in_shape(node, v)) if kind == "b" else 1
    if dim > rank:
        fail(node, f"indices {text!r} index {dim} dims of a rank-{rank} input")
    attrs = dict(axes=tuple(axes), accumulate=bool(param(node, "accumulate", False)))
    values = node.named_input("values")
    if values is None:
        lit = param(node, "values")
        if isinstance(lit, bool) or not isinstance(lit, (int, float)):
            fail(node, f"values={lit!r} must be a tensor or a number")
        attrs["value"] = lit
    return [make(node, "index_put", [x, values] + indices, attrs)]


@rule("torch.scatter_add", "Tensor.scatter_add", "Tensor.scatter_add_")
def scatter_add(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    dim = _dims(node, "dim", rank)[0]
    idx = _index_tensor(node, ctx, node.named_input("index"), "index")
    src = node.named_input("src")
    if src is None:
        fail(node, "missing src tensor")
    ishape, sshape = in_shape(node, idx), in_shape(node, src)
    if (
        len(ishape) != rank
        or len(sshape) != rank
        or any(i > s for i, s in zip(ishape, sshape))
        or any(i > s for d, (i, s) in enumerate(zip(ishape, x.shape)) if d != dim)
    ):
        fail(node, f"index {ishape} must fit src {sshape} and input {x.shape} (except along dim {dim})")
    return [make(node, "scatter_add", [x, idx, src], dict(axis=dim))]


@rule("torch.diag", "Tensor.diag")
def diag(node, ctx):
    x = data_input(node)
    if len(in_shape(node, x)) not in (1, 2):
        fail(node, f"diag takes a 1-d or 2-d input, got shape {x.shape}")
    k = param(node, "diagonal", 0)
    if not isinstance(k, int) or isinstance(k, bool):
        fail(node, f"diagonal={k!r} must be an int")
    return [make(node, "diag", [x], dict(diagonal=k))]


@rule("torch.cross", "Tensor.cross", "torch.linalg.cross", "aten::linalg_cross")
def cross(node, ctx):
    """torch.cross without dim takes the first dim of size 3 (its old default);
    torch.linalg.cross defaults to the last dim."""
    a, b = operands(node, "input", "other", numbers=())
    shape = np.broadcast_shapes(tuple(in_shape(node, a)), tuple(in_shape(node, b)))
    if node.op == "aten::linalg_cross" and len(node.inputs) > 2:
        dim = compile_time_number(node.inputs[2])
        if not isinstance(dim, int):
            fail(node, "dim must be a constant int")
    else:
        dim = param(node, "dim", None)
    if dim is None:
        dim = -1 if "linalg" in node.op else next((d for d, n in enumerate(shape) if n == 3), None)
        if dim is None:
            fail(node, f"no dim of size 3 in {shape}")
    if not isinstance(dim, int) or not -len(shape) <= dim < len(shape) or shape[dim] != 3:
        fail(node, f"dim={dim!r} must name a dim of size 3 of {shape}")
    return [make(node, "cross", [a, b], dict(axis=dim % len(shape)))]


def _cumulative(op):
    def fn(node, ctx):
        x = data_input(node)
        rank = len(in_shape(node, x))
        dim = param(node, "dim")
        if not isinstance(dim, int) or not -max(rank, 1) <= dim < max(rank, 1):
            fail(node, f"dim={dim!r} must be an int in range for rank {rank}")
        out = node.outputs[0].dtype
        named = node.attrs.get("dtype")
        if isinstance(named, str) and named in _TORCH_DTYPES:
            out = _TORCH_DTYPES[named]
        if out is None:  # torch widens integers (and bool) to int64
            out = "int64" if np.dtype(x.dtype).kind in "biu" else x.dtype
        return [make(node, op, [x], dict(axis=dim % max(rank, 1), dtype=str(np.dtype(out))))]

    return fn


rule("torch.cumsum", "Tensor.cumsum", "Tensor.cumsum_")(_cumulative("cumsum"))
rule("torch.cumprod", "Tensor.cumprod", "Tensor.cumprod_")(_cumulative("cumprod"))


@rule("torch.topk", "Tensor.topk")
def topk(node, ctx):
    x = data_input(node)
    shape = in_shape(node, x)
    rank = len(shape)
    k, dim = param(node, "k"), param(node, "dim", -1)
    if not isinstance(k, int) or not isinstance(dim, int) or not -max(rank, 1) <= dim < max(rank, 1):
        fail(node, f"k={k!r} and dim={dim!r} must be ints, dim in range for rank {rank}")
    axis = dim % max(rank, 1)
    if not 0 <= k <= (shape[axis] if rank else 1):
        fail(node, f"k={k} out of range for dim {axis} of {shape}")
    attrs = dict(axis=axis, k=k, largest=bool(param(node, "largest", True)), sorted=bool(param(node, "sorted", True)))
    outputs = list(node.outputs)
    if len(outputs) == 1:
        outputs.append(ctx.temp(node, node.outputs[0].shape, "int64"))
    return [make(node, "topk", [x], attrs, outputs=outputs)]


@rule("torch.masked_select", "Tensor.masked_select")
def masked_select(node, ctx):
    """The output's length is the number of True mask elements, known only at run time:
    the kernel allocates it when it runs (_sized_at_run)."""
    x = data_input(node)
    mask = node.named_input("mask")
    if mask is None:
        fail(node, "missing mask")
    if np.dtype(mask.dtype).kind != "b":
        fail(node, f"mask must be a boolean tensor, found {mask.dtype}")
    try:
        shape = np.broadcast_shapes(tuple(in_shape(node, x)), tuple(in_shape(node, mask)))
    except ValueError:
        fail(node, f"mask {mask.shape} does not broadcast with input {x.shape}")
    out = node.outputs[0]
    if x.is_constant and mask.is_constant:
        data = np.broadcast_to(x.data, shape)[np.broadcast_to(mask.data, shape)]
        return Forward(ctx.const(out.name, data))
    return _sized_at_run(node, "masked_select", [x, mask], {})


@rule("torch.as_strided", "Tensor.as_strided")
def as_strided(node, ctx):
    """Reads the input in its contiguous (row-major) order, which is torch's storage
    order for any tensor an op computed. Torch reads a view's underlying storage instead
    (x.t().as_strided(...) sees x's order); pmx's tensors are contiguous, so there the
    two differ. storage_offset is honoured when the .param has it (pnnx drops it)."""
    x = data_input(node)
    numel = int(np.prod(in_shape(node, x), dtype=np.int64))
    size, stride = param(node, "size"), param(node, "stride")
    offset = param(node, "storage_offset", 0) or 0
    size = (size,) if isinstance(size, int) else size
    stride = (stride,) if isinstance(stride, int) else stride
    ok = all(isinstance(t, tuple) and all(isinstance(e, int) and e >= 0 for e in t) for t in (size, stride))
    if not ok or len(size) != len(stride) or not isinstance(offset, int) or offset < 0:
        fail(node, f"size={size!r} stride={stride!r} storage_offset={offset!r} must be non-negative ints of one rank")
    if all(size) and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= numel:
        fail(node, f"size={size} stride={stride} storage_offset={offset} reach past the input's {numel} elements")
    return [make(node, "as_strided", [x], dict(size=tuple(size), stride=tuple(stride), offset=offset))]


@rule("torch.repeat_interleave", "Tensor.repeat_interleave")
def repeat_interleave(node, ctx):
    """An int repeat -> repeat_interleave; a repeats tensor known at compile time -> take
    with the repeated indices; repeats read from input values are data-dependent."""
    x = data_input(node)
    shape = tuple(in_shape(node, x))
    dim = param(node, "dim", None)
    nodes = []
    if dim is None:  # torch flattens first
        n = int(np.prod(shape, dtype=np.int64))
        if shape != (n,):
            flat = ctx.temp(node, (n,), x.dtype)
            nodes.append(make(node, "reshape", [x], dict(shape=(n,)), outputs=[flat], name=node.name + ".flat"))
            x, shape = flat, (n,)
        dim = 0
    if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        fail(node, f"dim={dim!r} out of range for rank {len(shape)}")
    dim %= len(shape)
    rv = node.named_input("repeats")
    if rv is None:
        reps = param(node, "repeats")
    elif rv.is_constant:
        reps = rv.data.reshape(-1)
        reps = int(reps[0]) if reps.size == 1 else reps.astype(np.int64)
    else:
        fail(
            node,
            f"repeats are computed from tensor values (operand {rv.name}), so the output's size would "
            f"depend on the data; pmx needs them known at compile time",
        )
    if isinstance(reps, int):
        if reps < 0:
            fail(node, f"repeats={reps} must be non-negative")
        return nodes + [make(node, "repeat_interleave", [x], dict(axis=dim, repeats=reps))]
    if not isinstance(reps, np.ndarray) or reps.shape != (shape[dim],) or (reps < 0).any():
        fail(node, f"repeats {reps!r} must be {shape[dim]} non-negative ints (one per element along dim {dim})")
    idx = ctx.const(f"{node.name}.index", np.repeat(np.arange(shape[dim], dtype=np.int64), reps))
    return nodes + [make(node, "take", [x, idx], dict(axis=dim))]


@rule("torch.addcmul", "Tensor.addcmul", "aten::addcmul")
def addcmul(node, ctx):
    """input + value * tensor1 * tensor2; aten::addcmul (as pnnx writes torch.addcmul)
    passes value as a fourth input."""
    if node.op == "aten::addcmul":
        if len(node.inputs) < 3:
            fail(node, "addcmul needs input, tensor1 and tensor2")
        x, t1, t2 = node.inputs[:3]
        value = compile_time_number(node.inputs[3]) if len(node.inputs) > 3 else 1
    else:
        x, t1, t2 = data_input(node), node.named_input("tensor1"), node.named_input("tensor2")
        if t1 is None or t2 is None:
            fail(node, "addcmul needs tensor1 and tensor2")
        value = param(node, "value", 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(node, f"value={value!r} must be a constant number")
    product = E.call("mul", E.at(1), E.at(2))
    if value != 1:
        product = E.call("mul", float(value), product)
    return [elementwise(node, E.call("add", E.at(0), product), [x, t1, t2])]
