"""pnnx.Expression, binary arithmetic spellings, reductions and softmax."""

import re

from pmx.compiler.canon import Forward, as_terms, data_input, elementwise, fail, make, operands, param, rule
from pmx.runtime import expr as E
from pmx.runtime.errors import PmxFormatError

# pnnx's shape arithmetic in dynamic-shape exports: x.size(d), int(), and casts of such
# scalars (Tensor.to of a scalar, written with the dtype's name)
SHAPE_FUNCTIONS = {"size": 2, "int": 1} | {
    f"torch.{t}": 1
    for t in (
        "bool",
        "uint8",
        "int8",
        "short",
        "int16",
        "int",
        "int32",
        "long",
        "int64",
        "half",
        "float16",
        "bfloat16",
        "float",
        "float32",
        "double",
        "float64",
        "complex64",
        "complex128",
    )
}
# pnnx's list [a,b,...] as the tree (LIST, a, b, ...): a compiler-side head, since index and
# size lists are consumed by canonicalization and never stored
LIST = "list"
NONE = ("#", None)
_ARITY = E.FUNCTIONS | SHAPE_FUNCTIONS
_PNNX_TOKEN = re.compile(r"[\[\]()]|,|[^\[\](),]+")
_OPENS = {")": "(", "]": "["}
_END = object()  # stands for a ']' while the items of its list are read


def _pnnx_tokens(text):
    """The names and values between pnnx's separators '(', ')', ',', with '[' and ']' kept
    (they bound lists). Brackets and parentheses must nest, and '(' follows a function's
    name (pnnx writes nothing else), though the parentheses carry no meaning after this."""
    tokens, opened, prev = [], [], None
    for m in _PNNX_TOKEN.finditer(text):
        t = m.group().strip()
        if not t:
            continue
        if t in ("(", "["):
            if t == "(" and prev not in _ARITY:
                raise PmxFormatError(f"expression {text[:80]!r}: '(' at {m.start()} follows no function name")
            opened.append(t)
        elif t in (")", "]"):
            if not opened or opened.pop() != _OPENS[t]:
                raise PmxFormatError(f"expression {text[:80]!r}: unbalanced {t!r} at {m.start()}")
        if t not in ("(", ")", ","):
            tokens.append(t)
        prev = t
    if opened:
        raise PmxFormatError(f"expression {text[:80]!r}: {len(opened)} unclosed {opened[-1]!r}")
    return tokens


def _leaf(t, text):
    if t == "None":
        return NONE
    try:
        return E.parse(t)  # an input or a literal: t holds no separator, so never a call
    except PmxFormatError:
        raise PmxFormatError(f"expression {text[:80]!r}: unknown token {t[:40]!r}") from None


def pnnx_expression_tree(text, num_inputs):
    """The tree pnnx means by `text`: pnnx reads its expressions as prefix notation over
    tokens split at '(', ')' and ',', each function taking its fixed number of operands
    (tools/pnnx/src/ir.cpp, expand_expression), so it writes some unary calls as
    `expm1,sub(@0,0.5)` or `log1p,@0`; '[' ... ']' is a list of the values between them.
    Read the same way here: leaves by the strict grammar (E.parse) of the text pmx stores,
    plus None; functions E's and pnnx's shape functions (SHAPE_FUNCTIONS); lists as
    (LIST, item, ...) (`[None,@0]`, `[size(@0,0),3]`), never a function's operand.
    Iterative, with E's length and depth limits checked on the way (a deep tree would
    overflow to_text's recursion). Anything else is a PmxFormatError."""
    if len(text) > E.MAX_EXPR_LENGTH:
        raise PmxFormatError(f"expression {text[:80]!r}... is longer than {E.MAX_EXPR_LENGTH} characters")
    stack = []  # (tree, depth), or _END
    for t in reversed(_pnnx_tokens(text)):
        if t == "]":
            stack.append(_END)
            continue
        if t == "[":
            items = []
            while stack[-1] is not _END:  # there is one: the brackets nest
                items.append(stack.pop())
            stack.pop()
            stack.append(_grown(text, LIST, items))
            continue
        arity = _ARITY.get(t)
        if arity is None:
            stack.append((_leaf(t, text), 1))
            continue
        args = []
        while len(args) < arity and stack and stack[-1] is not _END:
            args.append(stack.pop())
        if len(args) < arity:
            raise PmxFormatError(f"expression {text[:80]!r}: {t} takes {arity} operands, finds {len(args)}")
        if any(a[0] == LIST for a, _ in args):
            raise PmxFormatError(f"expression {text[:80]!r}: a list is no operand of {t}")
        stack.append(_grown(text, t, args))
    if len(stack) != 1:
        raise PmxFormatError(f"expression {text[:80]!r} holds {len(stack)} values, expected one expression")
    tree = stack[0][0]
    used = E.inputs_used(tree)
    if used and max(used) >= num_inputs:
        raise PmxFormatError(f"expression {text[:80]!r} uses @{max(used)} but the node has {num_inputs} inputs")
    return tree


def _grown(text, head, operands):
    depth = 1 + max((d for _, d in operands), default=0)
    if depth > E.MAX_DEPTH:
        raise PmxFormatError(f"expression {text[:80]!r} nests deeper than {E.MAX_DEPTH}")
    return (head, *(a for a, _ in operands)), depth


def size_dim(tree):
    """d when tree is size(@0, d) with d an int literal (not a bool), else None."""
    if tree[0] != "size" or tree[1] != E.at(0) or tree[2][0] != "#" or type(tree[2][1]) is not int:
        return None
    return tree[2][1]


def pnnx_text(tree):
    """pnnx's spelling of a tree pnnx_expression_tree read, for messages."""
    if tree == NONE:
        return "None"
    if tree[0] in ("@", "#"):
        return E.to_text(tree)
    inner = ",".join(pnnx_text(a) for a in tree[1:])
    return f"[{inner}]" if tree[0] == LIST else f"{tree[0]}({inner})"


def _subtrees(tree):
    todo = [tree]
    while todo:
        t = todo.pop()
        yield t
        if t[0] not in ("@", "#"):
            todo.extend(t[1:])


# ops making a tensor of one value whose size a dynamic export may give as a size list
FILLED_OPS = frozenset(
    {"torch.zeros", "Tensor.new_zeros", "torch.ones", "Tensor.new_ones", "torch.full", "Tensor.new_full"}
)


@rule("pnnx.Expression")
def expression(node, ctx):
    """An elementwise expression, or a list or size its consumers read as parameters
    (index lists, expand's sizes, arange's end, reshape's target; canon/indexing.py and
    canon/shape_ops.py move the tree onto them). Other shape arithmetic is refused."""
    text = param(node, "expr")
    if not isinstance(text, str):
        fail(node, f"expr={text!r} is not an expression string")
    try:
        tree = pnnx_expression_tree(text, len(node.inputs))
    except PmxFormatError as e:
        fail(node, str(e))
    readers = {c.op for c in node.outputs[0].consumers}
    if tree[0] == LIST and readers and readers <= {"Tensor.index", "Tensor.index_put", "Tensor.index_put_"}:
        from pmx.compiler.canon.indexing import attach_index_expression  # x[:, ids]: [None,@0]

        return attach_index_expression(node, ctx, tree)
    if tree[0] in ("size", "floor_divide") and readers == {"Tensor.slice"}:  # pos[:, : x.size(1)], dynamic export
        from pmx.compiler.canon.shape_ops import attach_slice_end

        return attach_slice_end(node, ctx, tree)
    if tree[0] == "size" and readers == {"torch.arange"}:  # arange(x.size(1)), dynamic export
        from pmx.compiler.canon.indexing import attach_arange_size

        return attach_arange_size(node, ctx, tree)
    # x.expand(y.size()), x.new_zeros(B, N)
    if tree[0] == LIST and readers and readers <= {"Tensor.expand", *FILLED_OPS}:
        from pmx.compiler.canon.indexing import attach_expand_sizes

        return attach_expand_sizes(node, ctx, tree)
    if tree[0] == LIST and readers and readers <= {"Tensor.reshape", "Tensor.view", "torch.reshape"}:
        from pmx.compiler.canon.shape_ops import attach_reshape_sizes  # x.reshape(B, N, 4, 16)

        return attach_reshape_sizes(node, ctx, tree)
    parts = list(_subtrees(tree))
    if any(t[0] == LIST or t[0] in SHAPE_FUNCTIONS for t in parts):
        read_by = f" for {', '.join(sorted(readers))}" if readers else ""
        fail(
            node,
            f"expression {text!r} computes on tensor shapes (dynamic-shape export){read_by}, which pmx follows "
            f"at run time only into reshape/view, expand, zeros/ones/full, index, arange and a slice's end; "
            f"export with a fixed input shape",
        )
    if NONE in parts:
        fail(node, f"expression {text!r}: None is no value to compute with")
    return [elementwise(node, tree, list(node.inputs))]


_BINARY = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "pow": "pow",
    "maximum": "maximum",
    "minimum": "minimum",
    "atan2": "atan2",
    "fmod": "fmod",
    "remainder": "remainder",
    "floor_divide": "floor_divide",
    "gt": "gt",
    "ge": "ge",
    "lt": "lt",
    "le": "le",
    "eq": "eq",
    "ne": "ne",
    "logaddexp": "logaddexp",
    "bitwise_left_shift": "lshift",
    "bitwise_right_shift": "rshift",
}


def _binary(fn_name):
    """torch.<fn>(input, other): either operand a tensor or a number, as pnnx wrote it
    (pnnx's ONNX import writes the number first: `torch.lt input=2.0 $other=x`)."""

    def fn(node, ctx):
        (lhs, rhs), tensors = as_terms(operands(node, "input", ("other", "exponent")))
        if not tensors:
            fail(node, "both operands are numbers (pnnx folds such nodes; the file was edited?)")
        alpha = param(node, "alpha", 1)
        if alpha != 1 and fn_name in ("add", "sub"):
            rhs = E.call("mul", rhs, alpha)
        return [elementwise(node, E.call(fn_name, lhs, rhs), tensors)]

    return fn


for _name, _fn in _BINARY.items():
    rule(f"torch.{_name}", f"Tensor.{_name}")(_binary(_fn))


_REDUCE = {
    "mean": "reduce_mean",
    "sum": "reduce_sum",
    "amax": "reduce_max",
    "amin": "reduce_min",
    "prod": "reduce_prod",
}


def _reduce(op):
    def fn(node, ctx):
        x = data_input(node)
        dim = param(node, "dim", None)
        if dim is None or dim == ():
            axes = ()
        elif isinstance(dim, int):
            axes = (dim,)
        else:
            axes = tuple(dim)
        rank = len(x.shape)
        if any(not -rank <= a < rank for a in axes):
            fail(node, f"dim={dim} out of range for input of rank {rank}")
        return [
            make(node, op, [x], dict(axes=tuple(a % rank for a in axes), keepdim=bool(param(node, "keepdim", False))))
        ]

    return fn


for _name, _op in _REDUCE.items():
    rule(f"torch.{_name}", f"Tensor.{_name}")(_reduce(_op))


def _softmax(op):
    def fn(node, ctx):
        x = data_input(node)
        dim = param(node, "dim", None)
        if not isinstance(dim, int):
            fail(node, f"dim={dim!r} must be an int")
        if not -len(x.shape) <= dim < len(x.shape):
            fail(node, f"dim={dim} out of range for input of rank {len(x.shape)}")
        return [make(node, op, [x], dict(axis=dim % len(x.shape)))]

    return fn


rule("F.softmax", "nn.Softmax", "torch.softmax", "Tensor.softmax")(_softmax("softmax"))
rule("F.log_softmax", "nn.LogSoftmax", "torch.log_softmax", "Tensor.log_softmax")(_softmax("log_softmax"))


@rule("F.softmin", "nn.Softmin")
def softmin(node, ctx):
    """softmax(-x), as torch defines it: a negation the elementwise passes can fuse
    into the producer, then the softmax kernel."""
    (soft,) = _softmax("softmax")(node, ctx)
    x = soft.inputs[0]
    neg = ctx.temp(node, x.shape, x.dtype, "neg")
    soft.inputs = [neg]
    return [elementwise(node, E.call("neg", E.at(0)), [x], outputs=[neg], name=node.name + ".neg"), soft]


@rule("nn.Softmax2d")
def softmax2d(node, ctx):
    """Softmax over the channels of a (C, H, W) or (N, C, H, W) input: dim -3."""
    x = data_input(node)
    if x.shape is None or len(x.shape) not in (3, 4):
        fail(node, f"Softmax2d needs a 3-d or 4-d input, found shape {x.shape}")
    return [make(node, "softmax", [x], dict(axis=len(x.shape) - 3))]


@rule("torch.positive", "Tensor.positive")
def positive(node, ctx):
    return Forward(data_input(node))


# --- logical and bitwise ops on bool / integer tensors ---------------------------------

for _name, _fn in (("bitwise_and", "and"), ("bitwise_or", "or"), ("bitwise_xor", "xor")):
    rule(f"torch.{_name}", f"Tensor.{_name}")(_binary(_fn))


def _truth(v, i):
    return E.at(i) if v.dtype == "bool" else E.call("ne", E.at(i), 0)


@rule("torch.logical_not", "Tensor.logical_not")
def logical_not(node, ctx):
    return [elementwise(node, E.call("not", E.at(0)), [data_input(node)])]


@rule("torch.bitwise_not", "Tensor.bitwise_not")
def bitwise_not(node, ctx):
    x = data_input(node)
    if x.dtype == "bool":
        return [elementwise(node, E.call("not", E.at(0)), [x])]
    if x.dtype is None or x.dtype[0] not in "iu":
        fail(node, f"bitwise_not needs a bool or integer tensor, found {x.dtype}")
    return [elementwise(node, E.call("sub", E.call("neg", E.at(0)), 1), [x])]  # ~x == -x - 1 in two's complement


def _logical(fn_name):
    def fn(node, ctx):
        a, b = operands(node, "input", "other", numbers=())
        return [elementwise(node, E.call(fn_name, _truth(a, 0), _truth(b, 1)), [a, b])]

    return fn


for _name, _fn in (("logical_and", "and"), ("logical_or", "or"), ("logical_xor", "xor")):
    rule(f"torch.{_name}", f"Tensor.{_name}")(_logical(_fn))


# --- reductions with an index output, statistics, norms --------------------------------


def _axes_param(node, x, key="dim"):
    dim = param(node, key, None)
    rank = len(x.shape)
    if dim is None or dim == ():
        return ()
    axes = (dim,) if isinstance(dim, int) else tuple(dim)
    if any(not isinstance(a, int) or not -rank <= a < rank for a in axes):
        fail(node, f"{key}={dim!r} out of range for input of rank {rank}")
    return tuple(sorted({a % rank for a in axes}))


def _max_min(values_op, index_op, binary):
    def fn(node, ctx):
        x = data_input(node)
        other = node.named_input("other")
        if other is not None:  # torch.max(a, b): elementwise
            return [elementwise(node, E.call(binary, E.at(0), E.at(1)), [x, other])]
        dim = param(node, "dim", None)
        if dim is None:
            return [make(node, values_op, [x], dict(axes=(), keepdim=False))]
        if not isinstance(dim, int) or not -len(x.shape) <= dim < len(x.shape):
            fail(node, f"dim={dim!r} must be one int in range for rank {len(x.shape)}")
        keep = bool(param(node, "keepdim", False))
        axis = dim % len(x.shape)
        nodes = [
            make(
                node,
                values_op,
                [x],
                dict(axes=(axis,), keepdim=keep),
                outputs=node.outputs[:1],
                name=node.name + ".values",
            )
        ]
        if len(node.outputs) > 1:
            nodes.append(
                make(
                    node,
                    index_op,
                    [x],
                    dict(axis=axis, keepdim=keep),
                    outputs=node.outputs[1:2],
                    name=node.name + ".indices",
                )
            )
        return nodes

    return fn


rule("torch.max", "Tensor.max")(_max_min("reduce_max", "argmax", "maximum"))
rule("torch.min", "Tensor.min")(_max_min("reduce_min", "argmin", "minimum"))


def _arg(op):
    def fn(node, ctx):
        x = data_input(node)
        dim = param(node, "dim", None)
        keep = bool(param(node, "keepdim", False))
        if node.outputs[0].shape is None:  # pnnx records nothing for a 0-d result
            node.outputs[0].dtype = "int64"
        if dim is None:  # index into the flattened tensor
            n = 1
            for d in x.shape:
                n *= d
            flat = ctx.temp(node, (n,), x.dtype)
            idx = ctx.temp(node, (), "int64")
            return [
                make(node, "reshape", [x], dict(shape=(n,)), outputs=[flat], name=node.name + ".flat"),
                make(node, op, [flat], dict(axis=0, keepdim=False), outputs=[idx], name=node.name + ".arg"),
                make(node, "reshape", [idx], dict(shape=tuple(node.outputs[0].shape or ()))),
            ]
        if not isinstance(dim, int) or not -len(x.shape) <= dim < len(x.shape):
            fail(node, f"dim={dim!r} must be one int in range for rank {len(x.shape)}")
        return [make(node, op, [x], dict(axis=dim % len(x.shape), keepdim=keep))]

    return fn


rule("torch.argmax", "Tensor.argmax")(_arg("argmax"))
rule("torch.argmin", "Tensor.argmin")(_arg("argmin"))


def _statistic(op):
    def fn(node, ctx):
        x = data_input(node)
        correction = param(node, "correction", None)
        if correction is None:
            correction = 1 if param(node, "unbiased", True) else 0
        if not isinstance(correction, (int, float)) or isinstance(correction, bool):
            fail(node, f"correction={correction!r} must be a number")
        axes = _axes_param(node, x)
        return [
            make(
                node,
                op,
                [x],
                dict(axes=axes, keepdim=bool(param(node, "keepdim", False)), correction=float(correction)),
            )
        ]

    return fn


rule("torch.var", "Tensor.var")(_statistic("reduce_var"))
rule("torch.std", "Tensor.std")(_statistic("reduce_std"))


@rule("torch.norm", "Tensor.norm", "torch.linalg.vector_norm")
def norm(node, ctx):
    x = data_input(node)
    p = param(node, "p", param(node, "ord", 2))
    if p == "fro" or p is None:
        p = 2
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        fail(node, f"p={p!r}: pmx supports numeric vector norms (p=1, 2, inf, ...) only")
    return [
        make(
            node,
            "reduce_norm",
            [x],
            dict(axes=_axes_param(node, x), keepdim=bool(param(node, "keepdim", False)), p=float(p)),
        )
    ]


@rule("torch.logsumexp", "Tensor.logsumexp")
def logsumexp(node, ctx):
    x = data_input(node)
    return [
        make(
            node, "reduce_logsumexp", [x], dict(axes=_axes_param(node, x), keepdim=bool(param(node, "keepdim", False)))
        )
    ]


def compile_time_number(v):
    """A scalar operand given as a tensor input, when it is known at compile time: a
    one-element constant, or a pnnx.Expression that is a bare number (pnnx writes
    addcmul's value and linalg_cross's dim so). None otherwise."""
    if v.is_constant:
        return v.data.reshape(-1)[0].item() if v.data.size == 1 else None
    p = v.producer
    if p is None or p.inputs:
        return None
    if p.op == "elementwise" and p.expr[0] == "#" and type(p.expr[1]) in (int, float):
        return p.expr[1]
    text = p.attrs.get("expr") if p.op == "pnnx.Expression" else None
    if isinstance(text, str):
        try:
            tree = pnnx_expression_tree(text, 0)
        except PmxFormatError:
            return None
        if tree[0] == "#" and type(tree[1]) in (int, float):
            return tree[1]
    return None
