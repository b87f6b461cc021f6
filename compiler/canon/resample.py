"""Canonicalization rules: resample."""

from pmx.compiler.canon import rule  # noqa: F401
