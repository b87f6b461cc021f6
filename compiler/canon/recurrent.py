"""Canonicalization rules: recurrent."""

from pmx.compiler.canon import rule  # noqa: F401
