"""Canonicalization rules: indexing."""

from pmx.compiler.canon import rule  # noqa: F401
