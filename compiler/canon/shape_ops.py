"""Shape ops: reshape spellings (reshape_as too), cat, chunk/split, slice/select,
slice assignment (slice_copy, slice_scatter), permute/transpose/t, channel shuffle, and
identities (Dropout, Identity, contiguous) which are removed.

Reshape-like ops keep the concrete output shape pnnx recorded (`shape`) and, for later
re-planning at other input shapes, the shape argument as written (`pnnx_shape`). A
reshape whose target is a size list of a dynamic-shape export (`[size(@0,0),size(@0,1),
4,16]`) reads the tensors the sizes come from as extra inputs and follows them exactly
(`like_shape`), so mark_dynamic_dims has nothing to guess there.
"""

import numpy as np

from pmx.compiler.canon import (
    TO_END,
    Forward,
    data_input,
    exact_target,
    fail,
    in_shape,
    make,
    out_shape,
    param,
    rule,
    slice_end,
)
from pmx.compiler.canon.math_ops import pnnx_text, size_dim
from pmx.runtime.kernels.shape import copy_dim, like_dims, resolve_dyn_shape, slice_infer

# the input names a size list's tensors take on a reshape: size(@k, d) reads "like@k"
LIKE = "like@"


@rule(
    "nn.Dropout",
    "nn.Dropout1d",
    "nn.Dropout2d",
    "nn.Dropout3d",
    "nn.AlphaDropout",
    "F.dropout",
    "F.dropout1d",
    "F.dropout2d",
    "F.dropout3d",
    "F.alpha_dropout",
    "nn.Identity",
    "Tensor.contiguous",
    "Tensor.detach",
    "Tensor.clone",
    "torch.clone",
    "torch.detach",
)
def identity(node, ctx):
    return Forward(data_input(node))


@rule(
    "Tensor.reshape",
    "Tensor.view",
    "torch.reshape",
    "torch.flatten",
    "Tensor.flatten",
    "nn.Flatten",
    "torch.squeeze",
    "Tensor.squeeze",
    "torch.unsqueeze",
    "Tensor.unsqueeze",
    "nn.Unflatten",
    "torch.unflatten",
    "Tensor.unflatten",
    "torch.ravel",
    "Tensor.ravel",
)
def reshape(node, ctx):
    x = data_input(node)
    if "size_list" in node.attrs:
        return [_reshape_like(node, x, _like_inputs(node))]
    shape = out_shape(node)
    n_in = 1
    for d in in_shape(node, x):
        n_in *= d
    n_out = 1
    for d in shape:
        n_out *= d
    if n_in != n_out:
        fail(node, f"cannot reshape {x.shape} ({n_in} elements) to {shape} ({n_out} elements)")
    attrs = dict(shape=tuple(shape))
    if "shape" in node.attrs:
        attrs["pnnx_shape"] = node.attrs["shape"]
    exact = exact_target(node, in_shape(node, x))
    if exact is not None:
        attrs["dyn_shape"] = exact
    return [make(node, "reshape", [x], attrs)]


def attach_reshape_sizes(node, ctx, sizes):
    """A pnnx.Expression listing a reshape's target (the tree of `[size(@0,0),size(@0,1),
    4,16]`, a dynamic-shape export of x.reshape(B, N, 4, 16)) that only reshapes read:
    the list moves onto each reader, and the tensors it reads become the reader's inputs
    "like@k" (size(@k, d) reads like@k), so the target follows their dims at run time."""
    for c in list(node.outputs[0].consumers):
        i = c.inputs.index(node.outputs[0])
        ctx.graph.set_input(c, i, None)
        for k, v in enumerate(node.inputs):
            at = i if k == 0 else len(c.inputs)
            ctx.graph.set_input(c, at, v)
            c.input_names[at] = f"{LIKE}{k}"
        c.attrs["size_list"] = sizes
    return []


def _like_inputs(node):
    """The tensors a reshape's size list reads, in the list's @k order."""
    named = {n: v for n, v in zip(node.input_names, node.inputs) if n and n.startswith(LIKE)}
    return [named[f"{LIKE}{k}"] for k in range(len(named))]


def _reshape_like(node, x, likes):
    """reshape with attr like_shape: one code per entry of the size list, over the dims
    of `likes` (runtime/kernels/shape.py); `shape` is the target at the compiled sizes."""
    codes = _size_list_codes(node, node.attrs["size_list"], likes)
    try:
        shape = resolve_dyn_shape(codes, in_shape(node, x), like_dims([x.shape, *(v.shape for v in likes)]))
    except ValueError as e:
        fail(node, f"size list {pnnx_text(node.attrs['size_list'])!r}: {e}")
    recorded = node.outputs[0].shape
    if recorded is not None and (
        len(recorded) != len(shape) or any(r is not None and r != d for r, d in zip(recorded, shape))
    ):
        fail(node, f"size list {pnnx_text(node.attrs['size_list'])!r} gives shape {shape}, pnnx recorded {recorded}")
    return make(node, "reshape", [x, *likes], dict(shape=shape, like_shape=codes))


# a size pnnx wraps in int() or an integer cast stays that size
_INT_CASTS = {"int", "torch.int", "torch.int32", "torch.long", "torch.int64", "torch.short", "torch.int16"}
# arithmetic a computed entry may do on sizes (mul(size(@0,1),64) for x.reshape(B, N * D))
_SIZE_ARITHMETIC = _INT_CASTS | {"add", "sub", "mul", "div", "floor_divide"}


def _size_list_codes(node, sizes, likes):
    """like_shape's codes for the entries of `sizes`: an int as itself (-1 inferred),
    size(@k, d) as -2 - (dim d of likes[k], counting the dims of likes one after
    another). One entry computed from sizes (mul(size(@0,1),64)) becomes -1: inferred
    from the element count, it is that product wherever torch's reshape succeeds."""
    ranks = [len(in_shape(node, v)) for v in likes]
    offsets = [sum(ranks[:k]) for k in range(len(ranks))]
    codes, inferred = [], []
    for item in sizes[1:]:
        code = _size_code(node, sizes, item, ranks, offsets)
        if code is None:
            if not _is_size_arithmetic(item):
                fail(
                    node,
                    f"size list {pnnx_text(sizes)!r}: entry {pnnx_text(item)!r} is not an int, size(@k,dim) "
                    f"or arithmetic on those",
                )
            code = -1
        if code == -1:
            inferred.append(repr(pnnx_text(item)))
        codes.append(code)
    if len(inferred) > 1:
        fail(
            node,
            f"size list {pnnx_text(sizes)!r}: entries {', '.join(inferred)} all need inferring from the "
            f"element count (a -1 or arithmetic on sizes); pmx infers one",
        )
    return tuple(codes)


def _size_code(node, sizes, item, ranks, offsets):
    """The code of an int or a (cast) size(@k, d) entry; None for anything else."""
    while item[0] in _INT_CASTS:
        item = item[1]
    if item[0] == "#":
        n = item[1]
        if type(n) is not int or n < -1:
            fail(node, f"size list {pnnx_text(sizes)!r}: entry {pnnx_text(item)!r} is not a size")
        return n
    ref = _size_ref(item, ranks)
    if ref is None:
        return None
    k, d = ref
    if not -ranks[k] <= d < ranks[k]:
        fail(
            node, f"size list {pnnx_text(sizes)!r}: entry {pnnx_text(item)!r} reads dim {d} of a rank-{ranks[k]} tensor"
        )
    return copy_dim(offsets[k] + d % ranks[k])


def _size_ref(item, ranks):
    """(k, d) when item is size(@k, d) with d an int literal and k a tensor of the list."""
    if item[0] != "size" or item[1][0] != "@" or not 0 <= item[1][1] < len(ranks):
        return None
    d = item[2]
    return (item[1][1], d[1]) if d[0] == "#" and type(d[1]) is int else None


def _is_size_arithmetic(item):
    if item[0] == "#":
        return type(item[1]) in (int, float)
    if item[0] == "size":
        return item[1][0] == "@" and item[2][0] == "#"
    return item[0] in _SIZE_ARITHMETIC and all(_is_size_arithmetic(a) for a in item[1:])


@rule("torch.cat", "torch.concat", "torch.concatenate")
def cat(node, ctx):
    inputs = list(node.inputs)
    dim = param(node, "dim", 0)
    ranks = {len(in_shape(node, v)) for v in inputs}
    if len(ranks) != 1:
        fail(node, f"inputs have different ranks: {[v.shape for v in inputs]}")
    return [make(node, "concat", inputs, dict(axis=dim))]


@rule("torch.chunk", "Tensor.chunk", "torch.split", "Tensor.split", "torch.tensor_split", "Tensor.tensor_split")
def split(node, ctx):
    x = data_input(node)
    dim = param(node, "dim", 0)
    rank = len(in_shape(node, x))
    if type(dim) is not int:  # pnnx writes dim=None for ONNX's Split without an axis
        fail(node, f"dim={dim!r}: {node.op} needs one int dim")
    if not -rank <= dim < rank:
        fail(node, f"dim={dim} out of range for input of rank {rank}")
    sizes = tuple(out_shape(node, i)[dim] for i in range(len(node.outputs)))
    if sum(sizes) != x.shape[dim]:
        fail(node, f"output sizes {sizes} along dim {dim} do not add up to the input's {x.shape[dim]}")
    return [make(node, "split", [x], dict(axis=dim, sizes=sizes))]


@rule("torch.unbind", "Tensor.unbind")
def unbind(node, ctx):
    x = data_input(node)
    dim = param(node, "dim", 0) % len(in_shape(node, x))
    nodes, parts = [], []
    for _ in node.outputs:
        parts.append(ctx.temp(node, tuple(1 if j == dim else d for j, d in enumerate(x.shape)), x.dtype))
    nodes.append(
        make(node, "split", [x], dict(axis=dim, sizes=(1,) * len(parts)), outputs=parts, name=node.name + ".split")
    )
    for part, out in zip(parts, node.outputs):
        nodes.append(
            make(
                node,
                "reshape",
                [part],
                dict(shape=out_shape(node, node.outputs.index(out))),
                outputs=[out],
                name=out.name + ".squeeze",
            )
        )
    return nodes


def _slice_params(node):
    if "dims" in node.attrs:
        dims = param(node, "dims")
        n = len(dims)
        starts = param(node, "starts", (0,) * n)
        ends = param(node, "ends", (TO_END,) * n)
        steps = param(node, "steps", (1,) * n)
        selects = param(node, "selects", (TO_END,) * n)
    else:
        dims = (param(node, "dim"),)
        starts = (param(node, "start", 0),)
        ends = (param(node, "end", TO_END),)
        steps = (param(node, "step", 1),)
        selects = (param(node, "select", TO_END),)
    for name, vals in (("starts", starts), ("ends", ends), ("steps", steps), ("selects", selects)):
        if not isinstance(vals, tuple) or len(vals) != len(dims) or not all(isinstance(v, int) for v in vals):
            fail(node, f"{name}={vals!r} must be {len(dims)} constant ints (dynamic slice bounds are not supported)")
    # pnnx writes step 0 for the dims it selects (x[:, 1]); only sliced dims need a step
    if any(p <= 0 and sel == TO_END for p, sel in zip(steps, selects)):
        fail(node, f"steps {steps} must be positive")
    return dims, starts, ends, steps, selects


def _slice_attrs(node, rank):
    dims, starts, ends, steps, selects = _slice_params(node)
    axes, st, en, sp, squeeze = [], [], [], [], []
    for d, s, e, p, sel in zip(dims, starts, ends, steps, selects):
        d %= rank
        if sel != TO_END:
            axes.append(d), st.append(sel), en.append(slice_end(sel)), sp.append(1)
            squeeze.append(d)
        else:
            axes.append(d), st.append(s), en.append(e), sp.append(p)
    return dict(axes=tuple(axes), starts=tuple(st), ends=tuple(en), steps=tuple(sp), squeeze=tuple(squeeze))


@rule("Tensor.slice")
def slice_(node, ctx):
    x = data_input(node)
    attrs = _slice_attrs(node, len(in_shape(node, x)))
    like = node.named_input("like")
    if like is None:
        return [make(node, "slice", [x], attrs)]
    if "dims" in node.attrs:
        fail(node, "a slice of several dims whose end is a size read from a tensor is not supported")
    attrs["end_dims"] = (node.attrs["end_dim"] % len(in_shape(node, like)),)
    if node.attrs["end_div"] != 1:
        attrs["end_divs"] = (node.attrs["end_div"],)
    return [make(node, "slice", [x, like], attrs)]


def attach_slice_end(node, ctx, tree):
    """A size(@0, d), or size(@0, d) // q, that only Tensor.slice reads as its end
    (pos[:, : x.size(1)], z[..., : z.size(2) // 2], a dynamic-shape export): the tensor
    moves onto the slice as input "like", and the slice's end follows its dim d at run
    time (attrs end_dims and end_divs of the IR slice)."""
    div = 1
    if tree[0] == "floor_divide" and tree[2][0] == "#" and type(tree[2][1]) is int and tree[2][1] > 0:
        tree, div = tree[1], tree[2][1]
    d = size_dim(tree)
    if d is None or len(node.inputs) != 1:
        fail(node, f"size expression {pnnx_text(tree)!r}: size(@0, dim) or size(@0, dim) // n of one tensor expected")
    for c in list(node.outputs[0].consumers):
        i = c.inputs.index(node.outputs[0])
        if c.input_names[i] != "end":
            fail(
                c,
                f"its {c.input_names[i] or 'input'} is a size read from a tensor; pmx follows one as a slice's end only",
            )
        ctx.graph.set_input(c, i, node.inputs[0])
        c.input_names[i] = "like"
        c.attrs["end_dim"], c.attrs["end_div"] = d, div
    return []


def _slice_assign(node, x, src, attrs):
    new = make(node, "slice_assign", [x, src], attrs)
    probe = slice_infer(new, [tuple(in_shape(node, x))], [None])[0][0]  # the shape `slice` would read
    try:
        fits = np.broadcast_shapes(tuple(in_shape(node, src)), probe) == probe
    except ValueError:
        fits = False
    if not fits:
        fail(node, f"src of shape {src.shape} does not fit the slice of shape {probe}")
    return [new]


@rule("Tensor.slice_copy")
def slice_copy(node, ctx):
    """x[2:10, 3] = src as pnnx writes it: the slice's parameters (as Tensor.slice) on
    $self, the values in $src; a copy of self with the slice replaced."""
    x = node.named_input("self") or data_input(node)
    src = node.named_input("src")
    if src is None:
        fail(node, "missing src tensor")
    return _slice_assign(node, x, src, _slice_attrs(node, len(in_shape(node, x))))


@rule("torch.slice_scatter", "Tensor.slice_scatter")
def slice_scatter(node, ctx):
    x = data_input(node)
    src = node.named_input("src")
    if src is None:
        fail(node, "missing src tensor")
    rank = len(in_shape(node, x))
    dim = param(node, "dim", 0)
    start, end, step = param(node, "start", None), param(node, "end", None), param(node, "step", 1)
    start = 0 if start is None else start
    end = TO_END if end is None else end
    step = 1 if step is None else step
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, start, end, step)) or step <= 0:
        fail(node, f"dim={dim!r} start={start!r} end={end!r} step={step!r} must be constant ints, step positive")
    if not -rank <= dim < rank:
        fail(node, f"dim={dim} out of range for rank {rank}")
    attrs = dict(axes=(dim % rank,), starts=(start,), ends=(end,), steps=(step,), squeeze=())
    return _slice_assign(node, x, src, attrs)


@rule("Tensor.select", "torch.select")
def select(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    dim = param(node, "dim") % rank
    index = param(node, "index")
    if not isinstance(index, int):
        fail(node, f"index={index!r} must be a constant int")
    n = x.shape[dim]
    if not -n <= index < n:
        fail(node, f"index {index} out of range for dim {dim} of size {n}")
    # a negative index stays one: it counts from the end of the dim's size at run time
    attrs = dict(axes=(dim,), starts=(index,), ends=(slice_end(index),), steps=(1,), squeeze=(dim,))
    return [make(node, "slice", [x], attrs)]


@rule("Tensor.reshape_as")
def reshape_as(node, ctx):
    x = data_input(node)
    shape = out_shape(node)
    other = node.named_input("other")
    if other is not None and other.shape is not None and tuple(other.shape) != tuple(shape):
        fail(node, f"output shape {shape} differs from other's {other.shape}")
    if int(np.prod(in_shape(node, x))) != int(np.prod(shape)):
        fail(node, f"cannot reshape {x.shape} to {shape}")
    return [make(node, "reshape", [x], dict(shape=tuple(shape)))]


@rule("torch.t", "Tensor.t")
def t(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    if rank > 2:
        fail(node, f"t() takes a tensor of at most 2 dims, got {x.shape}")
    if rank < 2:
        return Forward(x)
    return [make(node, "transpose", [x], dict(perm=(1, 0)))]


@rule("torch.permute", "Tensor.permute")
def permute(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    dims = param(node, "dims")
    perm = tuple(d % rank for d in dims)
    if sorted(perm) != list(range(rank)):
        fail(node, f"dims={dims} is not a permutation of {rank} axes")
    return [make(node, "transpose", [x], dict(perm=perm))]


@rule("torch.transpose", "Tensor.transpose")
def transpose(node, ctx):
    x = data_input(node)
    rank = len(in_shape(node, x))
    a, b = param(node, "dim0") % rank, param(node, "dim1") % rank
    perm = list(range(rank))
    perm[a], perm[b] = perm[b], perm[a]
    return [make(node, "transpose", [x], dict(perm=tuple(perm)))]


@rule("nn.ChannelShuffle", "F.channel_shuffle", "torch.channel_shuffle", "F.pixel_shuffle_channel")
def channel_shuffle(node, ctx):
    x = data_input(node)
    shape = in_shape(node, x)
    g = param(node, "groups")
    if not isinstance(g, int) or g < 1 or shape[1] % g:
        fail(node, f"groups={g!r} must divide the {shape[1]} channels")
    # one op, not reshape + transpose + reshape: ShuffleNetV2 has 16 shuffles, and each
    # node and tensor costs the load 5-6 us (its 136 nodes took 5.6-6.9 ms to load)
    return [make(node, "channel_shuffle", [x], dict(groups=g))]
