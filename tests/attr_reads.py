"""Recording which attributes kernels read: conftest.py runs the whole test suite under
record_reads() and fails if a kernel (shape rule, scratch rule, factory, or the callable
it returns) reads an attribute its op does not declare (runtime/kernels/attr_specs.py):
the loader checks only declared attributes, so an undeclared read would see a value
nothing checked."""

import collections
import contextlib
import functools


class _NotingAttrs(dict):
    """A node's attributes, noting each read of a name `declared` does not hold."""

    def __init__(self, attrs, op, declared, undeclared):
        super().__init__(attrs)
        self._op, self._declared, self._undeclared = op, declared, undeclared

    def _note(self, name):
        if name not in self._declared:
            self._undeclared[(self._op, name)] += 1

    def __getitem__(self, name):
        self._note(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self._note(name)
        return super().get(name, default)

    def __contains__(self, name):
        self._note(name)
        return super().__contains__(name)


class _Reading:
    """Stands for a node while its kernel runs: everything is the node's but `attrs`."""

    __slots__ = ("_node", "attrs")

    def __init__(self, node, attrs):
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "attrs", attrs)

    def __getattr__(self, name):
        return getattr(self._node, name)


def _noting(fn, kernel, undeclared):
    """fn (a kernel's infer, make or scratch) called with a node whose reads are noted."""
    declared = kernel.attrs

    @functools.wraps(fn)  # inspect.signature sees fn's parameters
    def call(node, *args):
        if isinstance(node, _Reading):  # a kernel calling another's rule on its own node
            return fn(node, *args)
        return fn(_Reading(node, _NotingAttrs(node.attrs, kernel.op, declared, undeclared)), *args)

    return call


@contextlib.contextmanager
def record_reads(registry):
    """While active, every kernel of `registry` ({op: Kernel}) notes the attributes it
    reads that its op does not declare; yields the Counter of (op, name) -> reads."""
    undeclared = collections.Counter()
    saved = {op: (k.infer, k.make, k.scratch) for op, k in registry.items()}
    for k in registry.values():
        k.infer, k.make = _noting(k.infer, k, undeclared), _noting(k.make, k, undeclared)
        if k.scratch is not None:
            k.scratch = _noting(k.scratch, k, undeclared)
    try:
        yield undeclared
    finally:
        for op, (infer, make, scratch) in saved.items():
            k = registry[op]
            k.infer, k.make, k.scratch = infer, make, scratch
