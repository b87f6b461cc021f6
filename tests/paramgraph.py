"""One-op models written as .pnnx.param text (the spelling pnnx writes), compiled and run:
property tests draw many parameter combinations without a pnnx export per example."""

import pathlib
import tempfile

import numpy as np

CODES = {
    "float32": "f32",
    "float64": "f64",
    "complex64": "c64",
    "complex128": "c128",
    "int64": "i64",
    "int32": "i32",
    "uint8": "u8",
    "bool": "bool",
}


def operand(name, array):
    shape = ",".join(str(d) for d in array.shape)
    return f"#{name}=({shape}){CODES[np.dtype(array.dtype).name]}"


def run_one_op(op, params, inputs, expected, labels=None, weights=None):
    """Compile and run `op` with `params` (text) over `inputs` (numpy arrays, labelled with
    `labels` as pnnx does, e.g. $input=x0) and `weights` ({name: array}, written as @name
    and stored in the .bin); `expected` gives each output's shape and dtype as pnnx would
    record it. Returns pmx's outputs."""
    from ziputil import write_bin

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    names = [f"x{i}" for i in range(len(inputs))]
    outs = [f"y{i}" for i in range(len(expected))]
    labels = labels or [None] * len(inputs)
    label_text = " ".join(f"${lab}={n}" for lab, n in zip(labels, names) if lab)
    weights = weights or {}
    weight_text = " ".join(f"@{k}=" + operand(k, v)[len(k) + 2 :] for k, v in weights.items())
    types = " ".join([operand(n, a) for n, a in zip(names, inputs)] + [operand(n, a) for n, a in zip(outs, expected)])
    lines = [f"pnnx.Input in{i} 0 1 {n} {operand(n, a)}" for i, (n, a) in enumerate(zip(names, inputs))]
    operands = f"{len(names)} {len(outs)} {' '.join(names)} {' '.join(outs)}"
    lines.append(f"{op} the_op {operands} {params} {weight_text} {label_text} {types}")
    lines += [f"pnnx.Output out{i} 1 0 {n}" for i, n in enumerate(outs)]
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        param = d / "m.pnnx.param"
        param.write_text("\n".join(["7767517", f"{len(lines)} {len(names) + len(outs)}", *lines]) + "\n")
        write_bin(d / "m.pnnx.bin", {f"the_op.{k}": v for k, v in weights.items()})
        compile_model(str(param), str(d / "m.pnnx.bin"), str(d / "m.pmx"), verify=True)
        sess = InferenceSession(str(d / "m.pmx"), verify=True)
        return sess.run(None, {arg.name: a for arg, a in zip(sess.get_inputs(), inputs)})


def write_lines(directory, lines, weights=None):
    """Write `lines` (operator lines as pnnx writes them, inputs and outputs included) as
    m.pnnx.param in `directory`, with `weights` ({stored name: array}) in m.pnnx.bin.
    Returns the .param's path."""
    from ziputil import write_bin

    directory = pathlib.Path(directory)
    operands = {t for line in lines for t in line.split()[4 : 4 + sum(map(int, line.split()[2:4]))]}
    param = directory / "m.pnnx.param"
    param.write_text("\n".join(["7767517", f"{len(lines)} {len(operands)}", *lines]) + "\n")
    write_bin(directory / "m.pnnx.bin", weights or {})
    return param


def compile_lines(directory, lines, weights=None, **options):
    """write_lines, then compile it (verify=True, then `options`) and open it. Returns
    the InferenceSession."""
    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    param = write_lines(directory, lines, weights)
    output = param.parent / "m.pmx"
    compile_model(str(param), str(param.parent / "m.pnnx.bin"), str(output), verify=True, **options)
    return InferenceSession(str(output), verify=True)


# --- hypothesis draws shared by the one-op property tests


def generator(data):
    """A torch generator seeded from the example, so inputs replay with it."""
    import torch
    from hypothesis import strategies as st

    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))


def sizes(data, lo, hi, n):
    from hypothesis import strategies as st

    return data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
