"""Recurrent modules: nn.LSTM / nn.GRU / nn.RNN -> lstm, gru, rnn (one node per module).

pnnx keeps these as modules with per-layer weights @weight_ih_l0, @weight_hh_l0_reverse,
... and writes only the outputs the model uses: y alone, or y with h_n (and c_n). The
canonical node always produces every output (unused ones get temporaries that the
planner gives short lifetimes), so the kernel has one fixed signature.
"""

import numpy as np

from pmx.compiler.canon import data_input, fail, in_shape, make, param, rule

CELLS = {"nn.LSTM": ("lstm", 4), "nn.GRU": ("gru", 3), "nn.RNN": ("rnn", 1)}


@rule("nn.LSTM", "nn.GRU", "nn.RNN")
def recurrent(node, ctx):
    cell, gates = CELLS[node.op]
    x = data_input(node)
    shape = in_shape(node, x)
    hidden = param(node, "hidden_size")
    layers = param(node, "num_layers", 1)
    bidirectional = bool(param(node, "bidirectional", False))
    batch_first = bool(param(node, "batch_first", False))
    has_bias = bool(param(node, "bias", True))
    proj = param(node, "proj_size", 0) if cell == "lstm" else 0
    nonlinearity = param(node, "nonlinearity", "tanh") if cell == "rnn" else "tanh"
    for key, v in (("hidden_size", hidden), ("num_layers", layers), ("proj_size", proj)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "proj_size" else 1):
            kind = "non-negative" if key == "proj_size" else "positive"
            fail(node, f"{key}={v!r} must be a {kind} int")
    if proj >= hidden and proj:
        fail(node, f"proj_size={proj} must be smaller than hidden_size={hidden}")
    if nonlinearity not in ("tanh", "relu"):
        fail(node, f"nonlinearity={nonlinearity!r}: expected 'tanh' or 'relu'")
    if len(shape) not in (2, 3):
        fail(node, f"input shape {shape}: expected (T, N, features), (N, T, features) or (T, features)")
    dirs = 2 if bidirectional else 1
    hout = proj or hidden

    states = [v for v, n in zip(node.inputs, node.input_names) if v is not x and not (n or "").startswith("@")]
    expected_states = 2 if cell == "lstm" else 1
    if states and len(states) != expected_states:
        fail(node, f"expected {expected_states} initial state inputs, got {len(states)}")
    if states and all(v.is_constant and not np.any(v.data) for v in states):
        # torch.zeros(...) states folded by pnnx: the kernel's own zero start is the same,
        # and dropping the constant frees the batch size
        states = []

    weights = []
    in_size = shape[-1]
    for layer in range(layers):
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if has_bias else [])
            names += ["weight_hr"] if proj else []
            for name in names:
                w = node.named_input("@" + name + sfx)
                if w is None:
                    fail(node, f"missing weight {name + sfx!r}")
                want = {
                    "weight_ih": (gates * hidden, in_size),
                    "weight_hh": (gates * hidden, hout),
                    "bias_ih": (gates * hidden,),
                    "bias_hh": (gates * hidden,),
                    "weight_hr": (proj, hidden),
                }[name]
                if tuple(w.shape) != want:
                    fail(node, f"weight {name + sfx} has shape {w.shape}, expected {want}")
                weights.append(w)
        in_size = dirs * hout

    attrs = dict(
        hidden_size=hidden,
        num_layers=layers,
        bidirectional=bidirectional,
        batch_first=batch_first,
        has_bias=has_bias,
        has_state=bool(states),
        proj_size=proj,
        nonlinearity=nonlinearity,
    )
    batched = len(shape) == 3
    batch = (shape[0] if batch_first else shape[1]) if batched else None
    state = (layers * dirs, batch) if batched else (layers * dirs,)
    full = [tuple(shape[:-1]) + (dirs * hout,), state + (hout,)]
    if cell == "lstm":
        full.append(state + (hidden,))
    if len(node.outputs) > len(full):
        fail(node, f"{len(node.outputs)} outputs, {node.op} has at most {len(full)}")
    unused = full[len(node.outputs) :]
    outputs = list(node.outputs) + [ctx.temp(node, s, x.dtype, suffix="state") for s in unused]
    return [make(node, cell, [x] + states + weights, attrs, outputs=outputs)]
