"""Canonicalization rules: conv_transpose."""

from pmx.compiler.canon import rule  # noqa: F401
