"""Canonicalization rules: attention."""

from pmx.compiler.canon import rule  # noqa: F401
