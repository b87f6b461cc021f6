"""Attention: F.scaled_dot_product_attention and nn.MultiheadAttention -> `attention`
(runtime/kernels/attention.py), with nn.MultiheadAttention's projections as `linear`
nodes around it (q's 1/sqrt(head_dim) folded into its weights; q, k and v projected by
one GEMM when they read the same tensor).

What pnnx records for nn.MultiheadAttention, and how it is read here:
- The operands are the module's distinct tensor arguments in the order the traced graph
  first uses them, which is not the call's order (bool masks come before the query), and
  its `$attn_mask` label points at the wrong operand (its index is the argument's
  position in the call). So operands are classified by shape: q/k/v are float
  [L|S, N, E] tensors (batch axis by batch_first), in call order among themselves; a 3-d
  mask [N*H, L, S] is an attn_mask; a 2-d mask is an attn_mask [L, S] or a
  key_padding_mask [N, S]. When N == L (> 1) a 2-d mask is ambiguous and the compile
  fails, asking for an export where batch size and target length differ.
- Two distinct q/k/v operands are read as (query, key = value), as pnnx's own generated
  Python does; a module called as (x, x, y) cannot be told apart from that.
- average_attn_weights is not recorded; the attention-weights output's recorded rank
  says which (3: averaged, 4: per head).
- A mask tensor the module captured from outside forward (not computed in it) is
  dropped by pnnx without a trace in the .param, so pmx cannot apply it; build such
  masks inside forward (pnnx then folds them into a constant operand) or pass them in.
"""

import math

import numpy as np

from pmx.compiler.canon import fail, in_shape, make, out_shape, param, rule, weight
from pmx.compiler.ir import Node


def _is_float(v):
    return np.dtype(v.dtype).kind == "f"


def _additive(mask):
    """A constant bool mask (True = masked) as a float mask (0 / -inf), added at run time."""
    return np.where(mask, -np.inf, 0).astype(np.float32)


def _mask_input(node, ctx, v, mode, name, pad=0):
    """The mask operand as the kernel takes it: padded by `pad` zero/False columns (for
    add_bias_kv / add_zero_attn), constant bool masks made additive."""
    nodes = []
    if v.is_constant:
        data = v.data
        if pad:
            data = np.concatenate([data, np.zeros(data.shape[:-1] + (pad,), data.dtype)], axis=-1)
        if data.dtype == np.bool_:
            data = _additive(data if mode == "drop" else ~data)
            mode = "add"
        return nodes, ctx.const(f"{node.name}.{name}", data.astype(np.float32) if mode == "add" else data), mode
    if pad:
        zeros = ctx.const(f"{node.name}.{name}_pad", np.zeros(v.shape[:-1] + (pad,), v.dtype))
        padded = ctx.temp(node, v.shape[:-1] + (v.shape[-1] + pad,), v.dtype, suffix=name)
        nodes.append(
            make(
                node,
                "concat",
                [v, zeros],
                dict(axis=len(v.shape) - 1),
                outputs=[padded],
                name=f"{node.name}.{name}_pad",
            )
        )
        v = padded
    return nodes, v, mode


def _mask_mode(node, v, bool_mode):
    if v.dtype == "bool":
        return bool_mode
    if _is_float(v):
        return "add"
    fail(node, f"mask {v.name} has dtype {v.dtype}; expected bool or float")


@rule("F.scaled_dot_product_attention")
def scaled_dot_product_attention(node, ctx):
    q, k, v = (node.named_input(n) for n in ("query", "key", "value"))
    if q is None or k is None or v is None:
        fail(node, "expected operands labelled $query, $key and $value")
    for x in (q, k, v):
        if len(in_shape(node, x)) < 2 or not _is_float(x):
            fail(node, f"{x.name} {x.shape} {x.dtype} must be a float tensor [..., L, E]")
    if float(param(node, "dropout_p", 0.0) or 0.0) != 0.0:
        fail(node, "dropout_p > 0 drops attention weights even in eval mode; export with dropout_p=0")
    gqa = bool(param(node, "enable_gqa", False))
    if gqa and (len(q.shape) < 3 or len(k.shape) < 3 or k.shape[-3] != v.shape[-3] or q.shape[-3] % k.shape[-3]):
        fail(node, f"enable_gqa=True needs query heads {q.shape} to be a multiple of key/value heads {k.shape}")
    causal = bool(param(node, "is_causal", False))
    scale = param(node, "scale", None)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    mask = node.named_input("attn_mask")
    nodes, masks, modes = [], [], []
    if mask is not None:
        if causal:
            fail(node, "attn_mask and is_causal=True together are refused by torch")
        extra, m, mode = _mask_input(node, ctx, mask, _mask_mode(node, mask, "keep"), "mask")
        nodes += extra
        masks.append(m)
        modes.append(mode)
    attrs = dict(heads=0, scale=float(scale), causal=int(causal), masks=tuple(modes), masked_rows="zero", gqa=int(gqa))
    return nodes + [make(node, "attention", [q, k, v] + masks, attrs)]


class _Mha:
    """nn.MultiheadAttention's parameters, read and checked once."""

    def __init__(self, node):
        self.e = param(node, "embed_dim")
        self.heads = param(node, "num_heads")
        if not isinstance(self.e, int) or not isinstance(self.heads, int) or self.heads <= 0 or self.e % self.heads:
            fail(node, f"embed_dim={self.e!r} must be divisible by num_heads={self.heads!r}")
        self.kdim, self.vdim = param(node, "kdim", self.e), param(node, "vdim", self.e)
        self.batch_first = bool(param(node, "batch_first", False))
        self.sa = 1 if self.batch_first else 0  # sequence axis; the batch axis is the other
        self.extra_rows = int(bool(param(node, "add_bias_kv", False))) + int(bool(param(node, "add_zero_attn", False)))
        out = out_shape(node, 0)
        if len(out) != 3:
            fail(node, f"output {out} is not batched [L, N, E] / [N, L, E]; unbatched inputs are not supported")
        self.out = out
        self.n, self.lq = out[1 - self.sa], out[self.sa]


def _split_operands(node, a):
    """(q, k, v, attn_mask, key_padding_mask) from the operands, by shape (see the module
    docstring for why pnnx's order and labels cannot be used)."""
    operands = [v for v, name in zip(node.inputs, node.input_names) if name is None or not name.startswith("@")]
    data, masks = [], []
    for v in operands:
        s = in_shape(node, v)
        looks_data = _is_float(v) and len(s) == 3 and s[1 - a.sa] == a.n and s[-1] in (a.e, a.kdim, a.vdim)
        # a float attn_mask [N*H, L, S] can look like data only when H == 1 (batch_first) or
        # N == L; data is preferred then, as pnnx lists q, k, v before float masks
        looks_3d_mask = a.heads > 1 and s[:2] == (a.n * a.heads, a.lq) and bool(data)
        if looks_data and len(data) < 3 and not looks_3d_mask:
            data.append(v)
        else:
            masks.append(v)
    if not data or len(masks) > 2:
        listing = [(v.name, v.shape, v.dtype) for v in operands]
        fail(node, f"cannot tell query/key/value from masks among operands {listing}")
    q = data[0]
    k = data[1] if len(data) > 1 else q
    v = data[2] if len(data) > 2 else k
    if (q.shape[a.sa], q.shape[-1], k.shape[-1], v.shape[-1]) != (a.lq, a.e, a.kdim, a.vdim) or k.shape[
        a.sa
    ] != v.shape[a.sa]:
        fail(
            node,
            f"query {q.shape}, key {k.shape}, value {v.shape} do not fit embed_dim={a.e} "
            f"kdim={a.kdim} vdim={a.vdim} batch_first={a.batch_first}",
        )
    s_len = k.shape[a.sa]
    found = {}
    for m in masks:
        role = _mask_role(node, a, m, s_len)
        if role in found:
            fail(node, f"two operands look like the same mask ({found[role].name} and {m.name})")
        found[role] = m
    return q, k, v, found.get("attn"), found.get("key_padding")


def _mask_role(node, a, m, s_len):
    ms = m.shape
    if len(ms) == 3 and ms == (a.n * a.heads, a.lq, s_len):
        return "attn"
    if len(ms) == 2 and ms[1] == s_len and ms[0] in (a.lq, a.n):
        if ms[0] == a.lq == a.n and a.n > 1:
            fail(
                node,
                f"mask {m.name} {ms} could be an attn_mask [L, S] or a key_padding_mask [N, S]: pnnx "
                f"does not record which; export with a batch size different from the target length {a.lq}",
            )
        return "attn" if ms[0] == a.lq else "key_padding"
    fail(
        node,
        f"operand {m.name} {ms} {m.dtype} is neither an attn_mask [L, S] / [N*H, L, S] nor a "
        f"key_padding_mask [N, S] (L={a.lq}, S={s_len}, N={a.n}, H={a.heads})",
    )


def _projection_weights(node, a):
    """Float64 (wq, wk, wv, bq, bk, bv) with q's 1/sqrt(head_dim) folded in."""
    packed = weight(node, "in_proj_weight", required=False)
    if packed is not None:
        wq, wk, wv = np.split(packed.data.astype(np.float64), 3, axis=0)
    else:
        wq, wk, wv = (weight(node, f"{x}_proj_weight").data.astype(np.float64) for x in "qkv")
    if wq.shape != (a.e, a.e) or wk.shape != (a.e, a.kdim) or wv.shape != (a.e, a.vdim):
        fail(
            node,
            f"projection weights {wq.shape} {wk.shape} {wv.shape} do not fit embed_dim={a.e} "
            f"kdim={a.kdim} vdim={a.vdim}",
        )
    b = weight(node, "in_proj_bias", required=False)
    if b is None and param(node, "bias", True):
        fail(node, "bias=True but no in_proj_bias weight")
    bq, bk, bv = np.split(b.data.astype(np.float64), 3) if b is not None else (None, None, None)
    scale = 1.0 / math.sqrt(a.e // a.heads)
    return wq * scale, wk, wv, (bq * scale if bq is not None else None), bk, bv


def _linear(node, ctx, x, weights, biases, name):
    """A linear node projecting x with the rows of `weights` stacked (one GEMM)."""
    w = np.concatenate(weights, axis=0)
    inputs = [x, ctx.const(f"{node.name}.{name}_weight", w.astype(x.dtype))]
    if biases[0] is not None:
        inputs.append(ctx.const(f"{node.name}.{name}_bias", np.concatenate(biases).astype(x.dtype)))
    out = ctx.temp(node, x.shape[:-1] + (w.shape[0],), x.dtype, suffix=name)
    return make(node, "linear", inputs, outputs=[out], name=f"{node.name}.{name}"), out


def _append_row(node, ctx, x, row, seq_axis, name):
    """x [S, N, E] / [N, S, E] with one more position holding `row` [E] in every batch."""
    n = x.shape[1 - seq_axis]
    shape = (1, n, row.size) if seq_axis == 0 else (n, 1, row.size)
    const = ctx.const(
        f"{node.name}.{name}", np.ascontiguousarray(np.broadcast_to(row.reshape(1, 1, -1), shape), dtype=x.dtype)
    )
    out_shape_ = list(x.shape)
    out_shape_[seq_axis] += 1
    out = ctx.temp(node, tuple(out_shape_), x.dtype, suffix=name)
    return make(node, "concat", [x, const], dict(axis=seq_axis), outputs=[out], name=f"{node.name}.{name}"), out


def _project(node, ctx, a, q, k, v):
    """Projection nodes and the attention kernel's tensor inputs and packing."""
    wq, wk, wv, bq, bk, bv = _projection_weights(node, a)
    if not a.extra_rows and q is k and k is v:
        lin, qkv = _linear(node, ctx, q, (wq, wk, wv), (bq, bk, bv), "qkv")
        return [lin], [qkv], "qkv"
    lin_q, qp = _linear(node, ctx, q, (wq,), (bq,), "q")
    if not a.extra_rows and k is v:
        lin_kv, kvp = _linear(node, ctx, k, (wk, wv), (bk, bv), "kv")
        return [lin_q, lin_kv], [qp, kvp], "kv"
    lin_k, kp = _linear(node, ctx, k, (wk,), (bk,), "k")
    lin_v, vp = _linear(node, ctx, v, (wv,), (bv,), "v")
    nodes = [lin_q, lin_k, lin_v]
    rows = []
    if param(node, "add_bias_kv", False):
        rows.append(("bias", weight(node, "bias_k").data, weight(node, "bias_v").data))
    if param(node, "add_zero_attn", False):
        rows.append(("zero", np.zeros(a.e), np.zeros(a.e)))
    for tag, row_k, row_v in rows:
        n1, kp = _append_row(node, ctx, kp, np.asarray(row_k, np.float64).reshape(-1), a.sa, f"{tag}_k")
        n2, vp = _append_row(node, ctx, vp, np.asarray(row_v, np.float64).reshape(-1), a.sa, f"{tag}_v")
        nodes += [n1, n2]
    return nodes, [qp, kp, vp], ""


def _unbatched_mha(node, ctx):
    """nn.MultiheadAttention on an unbatched query [L, E]: torch adds a batch axis of one
    (axis 1 of q, k, v; axis 0 of a key_padding_mask [S] and of the weights output) and
    removes it from the results, whatever batch_first says; so does this. Float [.., E]
    operands are q, k, v (up to three, in order); other 2-d and 3-d operands are attention
    masks [L, S] / [H, L, S], which need no batch axis."""
    e, kdim, vdim = param(node, "embed_dim"), param(node, "kdim", None), param(node, "vdim", None)
    nodes, inputs, n_data = [], [], 0
    for v, label in zip(node.inputs, node.input_names):
        if v is None or (label is not None and label.startswith("@")):
            inputs.append(v)
            continue
        s = tuple(in_shape(node, v))
        if _is_float(v) and len(s) == 2 and s[-1] in (e, kdim, vdim) and n_data < 3:
            n_data += 1
            shape = (s[0], 1, s[1])
        elif len(s) == 1:
            shape = (1, s[0])
        else:
            inputs.append(v)
            continue
        t = ctx.temp(node, shape, v.dtype, suffix="batched")
        nodes.append(make(node, "reshape", [v], dict(shape=shape), outputs=[t], name=f"{t.name}.reshape"))
        inputs.append(t)
    outs = [out_shape(node, i) for i in range(len(node.outputs))]
    batched = [(outs[0][0], 1, outs[0][1])] + [(1,) + tuple(s) for s in outs[1:]]
    temps = [ctx.temp(node, b, v.dtype, suffix="batched_out") for b, v in zip(batched, node.outputs)]
    copy = Node(
        node.op,
        node.name,
        inputs,
        temps,
        dict(node.attrs, batch_first=False),
        input_names=node.input_names,
        line=node.line,
    )
    nodes += multihead_attention(copy, ctx)
    for t, v, s in zip(temps, node.outputs, outs):
        nodes.append(make(node, "reshape", [t], dict(shape=tuple(s)), outputs=[v], name=f"{v.name}.unbatch"))
    return nodes


@rule("nn.MultiheadAttention")
def multihead_attention(node, ctx):
    if len(out_shape(node, 0)) == 2:
        return _unbatched_mha(node, ctx)
    a = _Mha(node)
    q, k, v, attn_mask, kp_mask = _split_operands(node, a)
    nodes, tensors, packed = _project(node, ctx, a, q, k, v)
    masks, modes, roles = [], [], []
    for m, role in ((attn_mask, "attn"), (kp_mask, "key_padding")):
        if m is not None:
            more, m, mode = _mask_input(node, ctx, m, _mask_mode(node, m, "drop"), role + "_mask", a.extra_rows)
            nodes += more
            masks.append(m)
            modes.append(mode)
            roles.append(role)
    outputs = [ctx.temp(node, a.out, q.dtype, suffix="attn")]
    weights = "none"
    if len(node.outputs) > 1:
        ws = out_shape(node, 1)
        weights = {3: "mean", 4: "heads"}.get(len(ws))
        if weights is None:
            fail(node, f"attention weights output {ws} must be [N, L, S] or [N, H, L, S]")
        outputs.append(node.outputs[1])
    attrs = dict(
        heads=a.heads,
        seq_axis=a.sa,
        scale=1.0,
        causal=0,
        masks=tuple(modes),
        mask_roles=tuple(roles),
        weights=weights,
        masked_rows="nan",
    )
    if packed:
        attrs["packed"] = packed
    nodes.append(make(node, "attention", tensors + masks, attrs, outputs=outputs, name=f"{node.name}.attention"))
    wo = weight(node, "out_proj.weight")
    bo = weight(node, "out_proj.bias", required=False)
    nodes.append(
        make(
            node,
            "linear",
            [outputs[0], wo] + ([bo] if bo is not None else []),
            outputs=[node.outputs[0]],
            name=f"{node.name}.out_proj",
        )
    )
    return nodes
