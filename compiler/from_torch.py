"""One call from a torch module to a checked .pmx file: pnnx's export in a temporary
directory, `compile_model`, then the compiled model run against the module.

pnnx sometimes writes a graph that differs from the model it traced (seen on real
models: a tanh-approximated GELU written as the exact one, an attention key that lost its
position embedding, a bias slice fed as the whole bias), and pmx then computes what the
graph says. So the result is compared with the module on the example inputs and on a
second random draw of the same shapes and dtypes, and a difference beyond the tolerance
is a PmxCompileError naming the largest error per output. torch and pnnx are needed
here only, never by the runtime.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np

from pmx.runtime.errors import PmxCompileError, PmxInputError

# |pmx - torch| <= atol + rtol * max |torch| per output, as the tests compare
DEFAULT_RTOL, DEFAULT_ATOL = 1e-4, 1e-5


def from_torch(
    module,
    example_inputs,
    output,
    *,
    check=True,
    rtol=DEFAULT_RTOL,
    atol=DEFAULT_ATOL,
    export_options=None,
    verbose=False,
    **compile_options,
):
    """Export `module` (traced on `example_inputs`, a tensor or a tuple of them) with
    pnnx, compile it to `output` (str or os.PathLike) with `compile_options` (those of
    compile_model: dynamic=, shape=, keep=, tune=, metadata=, ...) and, with `check`,
    compare the .pmx with the module (check_against_torch). Returns compile_model's
    result (its repr is a one-line summary).

    `export_options` are pnnx.export's: check_trace (default False here: torch's
    re-trace comparison fails on nn.MultiheadAttention, and `check` compares the result
    with the module itself), inputs2 (a second set of example inputs of other sizes:
    pnnx's dynamic-shape export), customop, moduleop, optlevel, fp16, device. pnnx's
    converter prints a long log; it is kept quiet unless `verbose`, and its last lines
    are part of the error when it writes no graph.

    A 0-d example input (a scalar tensor) gets its shape and dtype from the example:
    pnnx records neither for it. A .pmx that fails the check is removed."""
    from pmx.compiler.driver import compile_model  # here: `import pmx.compiler` stays light

    torch, pnnx = _torch_and_pnnx()
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    module = module.eval()
    scalars = {f"in{k}": x for k, x in enumerate(inputs) if x.dim() == 0}
    if scalars:
        compile_options = _scalar_options(scalars, compile_options)
    with tempfile.TemporaryDirectory(prefix="pmx-from-torch-") as d:
        param = _export(torch, pnnx, module, inputs, d, dict(export_options or {}), verbose)
        result = compile_model(param, os.path.join(d, "model.pnnx.bin"), os.fspath(output), **compile_options)
    if check:
        removed_if_it_fails(
            result.output, lambda: check_against_torch(module, inputs, result.output, rtol=rtol, atol=atol)
        )
    return result


def _scalar_options(scalars, compile_options):
    """compile_options with the plan shape () and the dtype of each 0-d input
    ({name: tensor}) added where the caller gave none."""
    from pmx.compiler.shape_specs import dtype_option

    options = dict(compile_options)
    options["plan_shapes"] = {**dict.fromkeys(scalars, ()), **(options.get("plan_shapes") or {})}
    given = dtype_option(options.get("dtype"))
    options["dtype"] = {**{name: str(x.numpy().dtype) for name, x in scalars.items()}, **given}
    return options


def removed_if_it_fails(path, check):
    """Run `check`; where it raises a PmxCompileError, remove the file at `path` (a model
    that failed its check is not left to be used by mistake) and say so in the error."""
    try:
        return check()
    except PmxCompileError as e:
        try:
            os.remove(path)
        except OSError:
            raise e from None
        raise PmxCompileError(f"{e} ({path} was removed)") from None


_EXPORT_OPTIONS = ("check_trace", "inputs2", "customop", "moduleop", "optlevel", "fp16", "device")


def _export(torch, pnnx, module, inputs, directory, options, verbose):
    """pnnx.export's two steps, done here so pnnx's log can be kept: the trace saved as
    model.pt (torch.jit.trace, as pnnx.export traces), then pnnx's converter on it.
    Returns the path of the model.pnnx.param it wrote."""
    from pnnx.utils.utils import generate_inputs_arg, get_shape_from_inputs, get_type_from_inputs

    unknown = sorted(set(options) - set(_EXPORT_OPTIONS))
    if unknown:
        raise PmxInputError(
            f"from_torch: export_options {unknown} are not pnnx.export's; it takes {list(_EXPORT_OPTIONS)}"
        )

    def shapes_arg(tensors):
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        return generate_inputs_arg(get_shape_from_inputs(tensors), get_type_from_inputs(tensors))

    scalar = any(x.dim() == 0 for x in inputs)
    if scalar and options.get("inputs2") is not None:
        raise PmxInputError(
            "from_torch: export_options inputs2 (pnnx's inputshape2) cannot go with a 0-d example input; "
            "give dynamic= or shape= instead"
        )

    pt = os.path.join(directory, "model.pt")
    # traced with autograd on: under no_grad an eval-mode nn.TransformerEncoderLayer
    # (batch_first) takes torch's fused fast path, one op pnnx leaves unconverted
    # (aten::_transformer_encoder_layer_fwd); with parameters that require grad it
    # traces as plain ops
    with torch.enable_grad():
        torch.jit.trace(module, inputs, check_trace=options.get("check_trace", False)).save(pt)
    # pnnx reads the shapes from the trace without inputshape=, which it cannot spell
    # for a 0-d input
    command = [pnnx.EXEC_PATH, pt] + ([] if scalar else ["inputshape=" + shapes_arg(inputs)])
    command += [f"device={options.get('device', 'cpu')}", f"optlevel={options.get('optlevel', 2)}"]
    if options.get("inputs2") is not None:
        command.append("inputshape2=" + shapes_arg(options["inputs2"]))
    for key in ("customop", "moduleop"):
        names = options.get(key)
        if names:
            command.append(f"{key}=" + ",".join([names] if isinstance(names, str) else names))
    if options.get("fp16", True) is not True:
        command.append("fp16=0")
    log = subprocess.run(
        command, cwd=directory, text=True, errors="replace", **({} if verbose else dict(capture_output=True))
    )
    param = os.path.join(directory, "model.pnnx.param")
    if not os.path.exists(param):
        tail = " | ".join((log.stderr or log.stdout or "").strip().splitlines()[-5:]) if not verbose else ""
        raise PmxCompileError(
            f"pnnx did not export {type(module).__name__} (no model.pnnx.param was written; exit status "
            f"{log.returncode}){': ' + tail if tail else ''}"
        )
    return param


def check_against_torch(
    module, example_inputs, pmx_path, *, rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL, draws=2, pnnx_python=None
):
    """Run the .pmx at `pmx_path` and `module` on the example inputs, on `draws - 1`
    random draws of the same shapes and dtypes and, where the .pmx takes other batch
    sizes (dim 0 of its first input dynamic), on a batch twice the example's (the
    example and a draw stacked). PmxCompileError naming the inputs and, per output, the
    largest error or both shapes, where any output differs beyond atol + rtol *
    max |torch|; `pnnx_python`, pnnx's generated .py, is named in the advice. Returns the
    batch sizes checked."""
    from pmx.runtime import InferenceSession

    torch, _ = _torch_and_pnnx()
    sess = InferenceSession(os.fspath(pmx_path))
    names = [a.name for a in sess.get_inputs()]
    generator = torch.Generator().manual_seed(0)
    randoms = [tuple(_like(x, generator) for x in example_inputs) for _ in range(max(draws - 1, 1))]
    cases = [("the example inputs", tuple(example_inputs), False)]
    cases += [("a random draw of inputs like them", draw, False) for draw in randoms[: draws - 1]]
    stacked = _stacked(sess, example_inputs, randoms[0], torch)
    if stacked is not None:
        cases.append((f"inputs at batch {stacked[0].shape[0]}", stacked, True))
    for which, inputs, another_batch in cases:
        with torch.no_grad():
            want = module(*inputs)
        want = [w.numpy() for w in (want if isinstance(want, (tuple, list)) else (want,))]
        got = sess.run(None, dict(zip(names, (x.numpy() for x in inputs))))
        bad = _differences(got, want, rtol, atol)
        if bad:
            raise PmxCompileError(
                f"{pmx_path}: the compiled model differs from the torch module on {which}: {'; '.join(bad)}. "
                + _mismatch_advice(another_batch, pnnx_python)
            )
    return sorted({int(inputs[0].shape[0]) for _, inputs, _ in cases if inputs and inputs[0].dim()})


def _stacked(sess, example_inputs, draw, torch):
    """The example inputs and a draw stacked along dim 0 where the .pmx's inputs take
    another batch there; None where the first input's batch is fixed."""
    args = sess.get_inputs()
    if not args or not args[0].shape or args[0].shape[0] is not None:
        return None
    return tuple(
        torch.cat([x, d]) if x.dim() and a.shape[0] is None else x for x, d, a in zip(example_inputs, draw, args)
    )


def _mismatch_advice(at_another_batch, pnnx_python):
    if at_another_batch:
        return (
            "It matches at the exported batch: something in the model ties the batch, as torch runs "
            "it, to the traced size (a view(1, -1) over the batch, which pnnx writes as a flatten); "
            "compile with --static (auto_batch=False in Python) to keep the exported shapes"
        )
    compare = f" (compare {pnnx_python} with it)" if pnnx_python else ""
    return f"pnnx's export may not match the module{compare}"


def _differences(got, want, rtol, atol):
    """Per output beyond the tolerance: its name and both shapes, or the largest error."""
    if len(got) != len(want):
        raise PmxCompileError(f"the compiled model has {len(got)} outputs, the torch module {len(want)}")
    bad = []
    for k, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            bad.append(f"out{k} has shape {list(g.shape)}, torch's {list(w.shape)}")
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        both_nan = np.isnan(g64) & np.isnan(w64)
        error = float(np.nan_to_num(np.where(both_nan, 0.0, np.abs(g64 - w64)), nan=np.inf).max(initial=0.0))
        largest = float(np.nan_to_num(np.abs(w64), nan=0.0).max(initial=0.0))
        if error > atol + rtol * largest:
            bad.append(f"out{k}: max |error| {error:.3g} (max |torch| {largest:.3g})")
    return bad


def _like(x, generator):
    import torch

    if x.dtype.is_floating_point:
        return torch.rand(x.shape, generator=generator, dtype=x.dtype)
    if x.dtype == torch.bool:
        return torch.rand(x.shape, generator=generator) > 0.5
    return x.clone()  # integer inputs (indices, lengths) keep their values


def _torch_and_pnnx():
    try:
        import pnnx
        import torch
    except ImportError as e:
        raise PmxCompileError(
            f"from_torch needs torch and pnnx installed (pip install torch pnnx, or the [torch] extra): {e}"
        ) from None
    return torch, pnnx
