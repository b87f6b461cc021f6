"""What to do with a file that is not what a command or InferenceSession takes: a PyTorch
or ONNX model, an ncnn model, a .pnnx.param not compiled yet. Shared by the CLI and the
loader, so `InferenceSession("model.onnx")` gives the advice `pmx run model.onnx` gives."""

import os

from pmx.runtime.fileformat import MAGIC

_PNNX_HINT = "export it with pnnx first (pip install pnnx): {cmd}, then: pmx compile model.pnnx.param"


def foreign_model_hint(path, command):
    """What to do with `path` when it is a model pmx does not take where it was given (a
    PyTorch or ONNX file, an ncnn model, or a .pnnx.param not compiled yet), else None.
    Told by content first (a .pmx file by its magic, whatever its name), then by name and
    first bytes, before any attempt to read it as the wrong thing."""
    name = os.path.basename(str(path)).lower()
    head = b""
    try:
        if os.path.isfile(path):  # not a FIFO or device, which a read could block on
            with open(path, "rb") as f:
                head = f.read(4096)
    except OSError:
        pass
    if head.startswith(MAGIC):
        return f"{path} is already compiled: pmx run {path} --random" if command == "compile" else None
    if name.endswith((".pt", ".pth", ".torchscript", ".ptl")) or (
        head.startswith(b"PK\x03\x04") and not name.endswith(".bin")
    ):
        return f"{path} is a PyTorch model; " + _PNNX_HINT.format(
            cmd=f"pnnx {path} inputshape=[1,3,224,224] (your input shape)"
        )
    if name.endswith(".onnx"):
        return f"{path} is an ONNX model; " + _PNNX_HINT.format(
            cmd=f"pnnx {path} inputshape=[1,3,224,224] (your input shape)"
        )
    text = head.lstrip()
    is_param_text = text.startswith(b"7767517")
    if name.endswith(".pnnx.param") or (is_param_text and b"pnnx.Input" in head):
        if command == "compile":
            return None
        return (
            f"{path} is a PNNX model, not compiled yet: pmx compile {path} -o model.pmx, then: pmx {command} model.pmx"
        )
    if name.endswith(".pnnx.bin"):
        param = str(path)[: -len(".bin")] + ".param"
        if command == "compile":
            return f"{path} holds the weights; compile the graph beside it: pmx compile {param}"
        return f"{path} holds PNNX weights; compile its graph first: pmx compile {param} -o model.pmx"
    if name.endswith((".param", ".bin")) or is_param_text:
        if command == "compile" and name.endswith(".param"):
            return None  # the PNNX parser says what it found (an ncnn file, or where it broke)
        return (
            f"{path} looks like an ncnn model: pnnx's ncnn output (model.ncnn.param/.bin) is not pmx input; "
            f"compile the model.pnnx.param pnnx wrote beside it: pmx compile model.pnnx.param"
        )
    if command == "compile" and name.endswith(".pmx"):
        return f"{path} is already compiled: pmx run {path} --random"
    return None
