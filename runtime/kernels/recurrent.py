"""Recurrent layers: `lstm`, `gru`, `rnn` (whole multi-layer, optionally bidirectional
torch module in one node).

Inputs: x, then (has_state) h0 [and c0 for lstm], then per layer, per direction (forward
first): w_ih, w_hh, [b_ih, b_hh] (has_bias), [w_hr] (lstm with proj_size). Weights keep
torch's layout and gate order (lstm i f g o, gru r z n).
Outputs: y, h_n [, c_n for lstm], shaped as torch returns them.
attrs: hidden_size, num_layers, bidirectional, batch_first, has_bias, has_state,
proj_size (lstm; 0 = none), nonlinearity (rnn: "tanh" or "relu").

The input projection of every time step is one GEMM per layer and direction, done before
the time loop; the loop itself runs a handful of numpy calls per step on views built in
the factory. Sequences stay in the caller's layout (batch-first or not) throughout, so
intermediate layers need no transposes.
"""

import numpy as np

from pmx.runtime import blas
from pmx.runtime.kernels.attr_specs import FLAG, NON_NEGATIVE, POSITIVE, integer, one_of, optional
from pmx.runtime.kernels.registry import register

RECURRENT_ATTRS = dict(
    hidden_size=POSITIVE,
    num_layers=POSITIVE,
    bidirectional=optional(FLAG),
    batch_first=optional(FLAG),
    has_bias=optional(FLAG),
    has_state=optional(FLAG),
    proj_size=optional(integer(0, 0)),
    nonlinearity=optional(one_of("tanh")),
)
# lstm projects its output (proj_size), rnn may use relu
ATTRS = {
    "lstm": dict(RECURRENT_ATTRS, proj_size=optional(NON_NEGATIVE)),
    "gru": RECURRENT_ATTRS,
    "rnn": dict(RECURRENT_ATTRS, nonlinearity=optional(one_of("tanh", "relu"))),
}
GATES = {"lstm": 4, "gru": 3, "rnn": 1}


def _dims(node, x_shape):
    a = node.attrs
    batched = len(x_shape) == 3
    if batched:
        t, b = (x_shape[1], x_shape[0]) if a.get("batch_first") else (x_shape[0], x_shape[1])
    else:
        t, b = x_shape[0], 1
    dirs = 2 if a.get("bidirectional") else 1
    hidden = a["hidden_size"]
    hout = a.get("proj_size") or hidden
    return batched, t, b, dirs, hidden, hout


def recurrent_infer(node, shapes, dtypes):
    x = shapes[0]
    a = node.attrs
    batched, _t, b, dirs, hidden, hout = _dims(node, x)
    layers = a["num_layers"]
    y = tuple(x[:-1]) + (dirs * hout,)
    state = (layers * dirs, b) if batched else (layers * dirs,)
    n_states = (2 if node.op == "lstm" else 1) if a.get("has_state") else 0
    if len(x) not in (2, 3) or x[-1] != shapes[1 + n_states][1]:
        w = tuple(shapes[1 + n_states])
        raise ValueError(f"input {tuple(x)} does not match weight_ih_l0 {w}")
    if n_states and tuple(shapes[1]) != state + (hout,):
        raise ValueError(f"initial h {tuple(shapes[1])} does not match {state + (hout,)}")
    if n_states == 2 and tuple(shapes[2]) != state + (hidden,):
        raise ValueError(f"initial c {tuple(shapes[2])} does not match {state + (hidden,)}")
    weights = [tuple(w) for w in shapes[1 + n_states :]]
    expected = _weight_shapes(node, x[-1], hidden, hout, dirs, layers)
    if len(weights) != len(expected):
        raise ValueError(
            f"{len(weights)} weight inputs, expected {len(expected)} for {layers} layers x {dirs} directions"
        )
    for k, (got, want) in enumerate(zip(weights, expected)):
        if got != want:
            raise ValueError(f"weight input {1 + n_states + k} is {got}, expected {want}")
    result = [(y, dtypes[0]), (state + (hout,), dtypes[0])]
    if node.op == "lstm":
        result.append((state + (hidden,), dtypes[0]))
    return result


def _weight_shapes(node, features, hidden, hout, dirs, layers):
    """The weight inputs make_recurrent takes, in order: per layer and direction w_ih,
    w_hh, then b_ih and b_hh (has_bias), then w_hr (lstm with proj_size)."""
    rows, shapes = GATES[node.op] * hidden, []
    for _layer in range(layers):
        for _ in range(dirs):
            shapes += [(rows, features), (rows, hout)]
            shapes += [(rows,), (rows,)] if node.attrs.get("has_bias") else []
            shapes += [(hout, hidden)] if node.op == "lstm" and node.attrs.get("proj_size") else []
        features = dirs * hout
    return shapes


def _time_major(a, batch_first, batched):
    """(T, B, F) view of a sequence in the caller's layout."""
    if not batched:
        return a[:, None, :]
    return a.transpose(1, 0, 2) if batch_first else a


def _flat_rows(a):
    """a as (rows, features) without copying; None when its layout does not allow it."""
    if not a.flags.c_contiguous:
        return None
    v = a.view()
    v.shape = (-1, a.shape[-1])
    return v


def _sigmoid(a, out):
    # 1 / (1 + exp(-x)): numpy's exp is SIMD, its float32 tanh is not (2x slower here).
    # exp overflows to inf for x < -88 and the result is then exactly 0, as it should be;
    # the caller runs the loop with overflow warnings off.
    np.negative(a, out=out)
    np.exp(out, out=out)
    np.add(out, 1, out=out)
    np.reciprocal(out, out=out)


def make_recurrent(node, inputs, outputs, ctx):
    a = node.attrs
    cell = node.op
    x = inputs[0]
    batch_first = bool(a.get("batch_first"))
    batched, steps, batch, dirs, hidden, hout = _dims(node, x.shape)
    layers = a["num_layers"]
    gates = GATES[cell]
    pos = 1
    h0 = c0 = None
    if a.get("has_state"):
        h0 = inputs[pos]
        pos += 1
        if cell == "lstm":
            c0 = inputs[pos]
            pos += 1
    y, h_n = outputs[0], outputs[1]
    c_n = outputs[2] if cell == "lstm" else None
    dtype = y.dtype
    # (layers * dirs, batch, features) views whatever the tensors' strides
    states = (h_n, c_n, h0, c0)
    h_n3, c_n3, h03, c03 = (v if v is None or batched else v[:, None, :] for v in states)

    # sequences in the caller's layout: layer l reads seqs[l] and writes seqs[l + 1]
    scratch = [np.empty(y.shape, dtype) for _ in range(min(layers - 1, 2))]
    seqs = [x] + [scratch[i % 2] for i in range(layers - 1)] + [y]
    gx = np.empty(y.shape[:-1] + (gates * hidden,), dtype)
    gx_rows = _flat_rows(gx)
    gx_steps = _time_major(gx, batch_first, batched)

    work = []
    for layer in range(layers):
        src, dst = seqs[layer], seqs[layer + 1]
        src_rows = _flat_rows(src)
        dst_steps = _time_major(dst, batch_first, batched)
        for d in range(dirs):
            w_ih, w_hh = inputs[pos], inputs[pos + 1]
            pos += 2
            b_ih = b_hh = None
            if a.get("has_bias"):
                b_ih, b_hh = inputs[pos], inputs[pos + 1]
                pos += 2
            w_hr = None
            if cell == "lstm" and a.get("proj_size"):
                w_hr = inputs[pos]
                pos += 1
            if b_ih is None:
                bias_x, bias_h = None, None
            elif cell == "gru":  # b_hn sits inside r * (W_hn h + b_hn)
                bias_x, bias_h = b_ih.astype(dtype, copy=False), b_hh.astype(dtype, copy=False)
            else:
                bias_x, bias_h = (b_ih + b_hh).astype(dtype), None
            k = layer * dirs + d
            h_init = h03[k] if h03 is not None else np.zeros((batch, hout), dtype)
            c_init = c03[k] if c03 is not None else None
            order = range(steps) if d == 0 else range(steps - 1, -1, -1)
            outs = [dst_steps[t, :, d * hout : (d + 1) * hout] for t in order]
            ins = [gx_steps[t] for t in order]
            project = _projection(src, src_rows, gx, gx_rows, w_ih, bias_x)
            if cell == "lstm":
                loop = _lstm_loop(ins, outs, h_init, c_init, w_hh.T, w_hr, hidden, h_n3[k], c_n3[k], dtype)
            elif cell == "gru":
                loop = _gru_loop(ins, outs, h_init, w_hh.T, bias_h, hidden, h_n3[k], dtype)
            else:
                relu = a.get("nonlinearity") == "relu"
                loop = _rnn_loop(ins, outs, h_init, w_hh.T, relu, h_n3[k], dtype)
            work.append(project)
            work.append(loop)

    def run():
        with np.errstate(over="ignore"):
            for step in work:
                step()

    return run


def _batch_first_rows(node, ranks, batched):
    """A batched [N, L, E] input with batch_first: each sequence runs apart. Sequence
    first ([L, N, E]) or unbatched ([L, E]), dim 0 is time."""
    return ranks[0] == 3 and bool(node.attrs.get("batch_first"))


for _op in ("lstm", "gru", "rnn"):
    register(_op, infer=recurrent_infer, attrs=ATTRS[_op], rows=_batch_first_rows)(make_recurrent)


def _projection(src, src_rows, gx, gx_rows, w_ih, bias):
    """Input projection of every time step: one GEMM (rows = steps x batch)."""
    w_t = w_ih.T
    if src_rows is not None and gx_rows is not None:
        multiply = blas.matmul(src_rows, w_t, gx_rows)
    else:
        multiply = blas.matmul(src, w_t, gx)

    def run():
        multiply()
        if bias is not None:
            np.add(gx, bias, out=gx)

    return run


def _lstm_loop(ins, outs, h_init, c_init, whh_t, w_hr, hidden, h_last, c_last, dtype):
    batch = h_init.shape[0]
    g = np.empty((batch, 4 * hidden), dtype)
    s = np.empty((batch, 4 * hidden), dtype)
    i_, f_, o_ = s[:, :hidden], s[:, hidden : 2 * hidden], s[:, 3 * hidden :]
    cand = np.empty((batch, hidden), dtype)
    c = np.empty((batch, hidden), dtype)
    tmp = np.empty((batch, hidden), dtype)
    whr_t = w_hr.T if w_hr is not None else None
    prevs = [h_init] + outs[:-1]
    steps = [
        (gx_t, out_t, blas.matmul(h_prev, whh_t, g), None if whr_t is None else blas.matmul(tmp, whr_t, out_t))
        for gx_t, out_t, h_prev in zip(ins, outs, prevs)
    ]

    def run():
        if c_init is None:
            c.fill(0)
        else:
            np.copyto(c, c_init)
        for gx_t, out_t, recur, project in steps:
            recur()
            np.add(g, gx_t, out=g)
            np.tanh(g[:, 2 * hidden : 3 * hidden], out=cand)
            _sigmoid(g, s)
            np.multiply(c, f_, out=c)
            np.multiply(i_, cand, out=cand)
            np.add(c, cand, out=c)
            np.tanh(c, out=tmp)
            if whr_t is None:
                np.multiply(o_, tmp, out=out_t)
            else:
                np.multiply(o_, tmp, out=tmp)
                project()
        np.copyto(h_last, outs[-1] if outs else h_init)
        np.copyto(c_last, c)

    return run


def _gru_loop(ins, outs, h_init, whh_t, bias_h, hidden, h_last, dtype):
    batch = h_init.shape[0]
    gh = np.empty((batch, 3 * hidden), dtype)
    rz = np.empty((batch, 2 * hidden), dtype)
    r, z = rz[:, :hidden], rz[:, hidden:]
    n = np.empty((batch, hidden), dtype)
    tmp = np.empty((batch, hidden), dtype)
    prevs = [h_init] + outs[:-1]
    steps = [(gx_t, out_t, h_prev, blas.matmul(h_prev, whh_t, gh)) for gx_t, out_t, h_prev in zip(ins, outs, prevs)]

    def run():
        for gx_t, out_t, h_prev, recur in steps:
            recur()
            if bias_h is not None:
                np.add(gh, bias_h, out=gh)
            np.add(gx_t[:, : 2 * hidden], gh[:, : 2 * hidden], out=rz)
            _sigmoid(rz, rz)
            np.multiply(r, gh[:, 2 * hidden :], out=n)
            np.add(n, gx_t[:, 2 * hidden :], out=n)
            np.tanh(n, out=n)
            np.subtract(h_prev, n, out=tmp)
            np.multiply(z, tmp, out=tmp)
            np.add(n, tmp, out=out_t)
        np.copyto(h_last, outs[-1] if outs else h_init)

    return run


def _rnn_loop(ins, outs, h_init, whh_t, relu, h_last, dtype):
    acc = np.empty(h_init.shape, dtype)
    prevs = [h_init] + outs[:-1]
    steps = [(gx_t, out_t, blas.matmul(h_prev, whh_t, acc)) for gx_t, out_t, h_prev in zip(ins, outs, prevs)]

    def run():
        for gx_t, out_t, recur in steps:
            recur()
            np.add(acc, gx_t, out=out_t)
            if relu:
                np.maximum(out_t, 0, out=out_t)
            else:
                np.tanh(out_t, out=out_t)
        np.copyto(h_last, outs[-1] if outs else h_init)

    return run
