"""Typed errors. Every error a user can cause is a PmxError subclass with a message that
says what was expected and what was found."""


class PmxError(Exception):
    """Base class of every error pmx raises on purpose."""


class PmxFormatError(PmxError):
    """A .pmx, .param or .bin file is damaged, truncated, hostile or of another format:
    the loader's verifier (or the compiler's parser) refused it."""


class PmxCompileError(PmxError):
    """The model cannot be compiled: bad parameter, shape mismatch, unsupported construct."""


class PmxUnsupportedOpError(PmxCompileError):
    """An operator type pmx does not know."""


class PmxInputError(PmxError, ValueError):
    """A run() input does not match what the model expects."""


class PmxResourceError(PmxError):
    """A file declares sizes beyond the configured limits."""


class PmxRunTerminated(PmxError):
    """A run stopped because its RunOptions.terminate was set (by another thread)."""


class PmxInternalError(PmxError):
    """A bug of pmx's own: a kernel failed while binding or running a file that passed
    every check of the verifier. Its message names the node and asks for a bug report."""


def internal_error(path, node, stage, exc):
    """PmxInternalError for `exc` raised by `node`'s kernel at `stage` ("bind" or "run")
    of the model at `path`. A file that passed the verifier must bind and run, so the
    fault is pmx's (a kernel, or a check the verifier lacks), not the user's."""
    where = f"node {node.name[:40]!r} ({node.op})" if node is not None else "the model"
    return PmxInternalError(
        f"{path}: internal error: {where} failed at {stage}: {type(exc).__name__}: {str(exc)[:160]}. "
        f"This is a bug in pmx; please report it with the model file (the .pmx, or the "
        f".pnnx.param and .pnnx.bin it was compiled from) and this message"
    )
