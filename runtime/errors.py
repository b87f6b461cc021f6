"""Typed errors. Every error a user can cause is a PmxError subclass with a message that
says what was expected and what was found."""


class PmxError(Exception):
    """Base class of every error pmx raises on purpose."""


class PmxFormatError(PmxError):
    """A .pmx, .param or .bin file is damaged, truncated, hostile or of another format."""


class PmxCompileError(PmxError):
    """The model cannot be compiled: bad parameter, shape mismatch, unsupported construct."""


class PmxUnsupportedOpError(PmxCompileError):
    """An operator type pmx does not know."""


class PmxInputError(PmxError, ValueError):
    """A run() input does not match what the model expects."""


class PmxResourceError(PmxError):
    """A file declares sizes beyond the configured limits."""
