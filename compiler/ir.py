"""The compiler's graph: Values and Nodes with explicit use-def links.

Weights are constant Values (`data` set), not attributes, so folding, dead-code
elimination and planning treat every tensor alike. Attributes are plain Python scalars,
strings and tuples. `Node.input_names` carries PNNX's `$name` / `@name` labels until
canonicalization consumes them.
"""

from __future__ import annotations

import itertools

import numpy as np

from pmx.runtime.errors import PmxCompileError, PmxInternalError

_ids = itertools.count()


class Value:
    __slots__ = ("name", "shape", "dtype", "producer", "consumers", "data", "uid", "recorded_dtype")

    def __init__(self, name, shape=None, dtype="float32", data=None):
        self.name = name
        self.shape = tuple(shape) if shape is not None else None
        self.dtype = dtype
        self.producer = None
        self.consumers = []
        self.data = data
        self.uid = next(_ids)
        # the dtype pnnx wrote for this operand (None: none written, or a value pmx made);
        # `dtype` defaults to float32 where pnnx wrote none, until infer_shapes sets it
        self.recorded_dtype = None

    @property
    def is_constant(self):
        return self.data is not None

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def __repr__(self):
        kind = "const " if self.is_constant else ""
        return f"<{kind}Value {self.name} {self.shape} {self.dtype}>"


class Node:
    __slots__ = ("op", "name", "inputs", "outputs", "attrs", "input_names", "line", "expr", "variant", "uid")

    def __init__(self, op, name, inputs=(), outputs=(), attrs=None, input_names=None, line=0, expr=None, variant=""):
        self.op = op
        self.name = name
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.attrs = dict(attrs or {})
        self.input_names = list(input_names) if input_names else [None] * len(self.inputs)
        self.line = line
        self.expr = expr
        self.variant = variant
        self.uid = next(_ids)

    def named_input(self, key):
        for name, value in zip(self.input_names, self.inputs):
            if name == key:
                return value
        return None

    def where(self):
        """Location for error messages."""
        at = f" (line {self.line})" if self.line else ""
        return f"{self.op} '{self.name}'{at}"

    def __repr__(self):
        return f"<Node {self.op} {self.name}>"


class Graph:
    def __init__(self, source=""):
        self.nodes: list[Node] = []
        self._members = set()  # uids of self.nodes: has_node in O(1) for the rewrite engine
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        # tensors that stay readable after a run besides the outputs (`--keep`): every pass
        # treats them as it treats outputs, and the file lists them
        self.kept: list[Value] = []
        self.source = source

    # --- construction -------------------------------------------------------------

    def add_node(self, node: Node, index=None):
        for v in node.inputs:
            if v is not None:
                v.consumers.append(node)
        for v in node.outputs:
            v.producer = node
        if index is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(index, node)
        self._members.add(node.uid)
        return node

    def has_node(self, node: Node) -> bool:
        """Whether `node` is in the graph (not removed since it was added)."""
        return node.uid in self._members

    def remove_node(self, node: Node):
        for v in node.inputs:
            if v is not None and node in v.consumers:
                v.consumers.remove(node)
        for v in node.outputs:
            if v.producer is node:
                v.producer = None
        self.nodes.remove(node)
        self._members.discard(node.uid)

    def set_input(self, node: Node, index: int, value):
        """node's input `index` becomes value; inputs up to it that the node lacked are
        absent (None) ones."""
        while len(node.inputs) <= index:
            node.inputs.append(None)
            node.input_names.append(None)
        old = node.inputs[index]
        if old is not None and node in old.consumers:
            old.consumers.remove(node)
        node.inputs[index] = value
        if value is not None:
            value.consumers.append(node)

    def set_inputs(self, node: Node, values):
        """node reads `values` (unnamed) instead of its inputs."""
        for i in range(len(node.inputs)):
            self.set_input(node, i, None)
        node.inputs, node.input_names = [], []
        for i, v in enumerate(values):
            self.set_input(node, i, v)

    def keep(self, values):
        """`values` are the graph's kept tensors."""
        self.kept = list(values)

    def set_order(self, nodes):
        """The nodes run in the order of `nodes`, which must hold exactly the graph's nodes."""
        if sorted(n.uid for n in nodes) != sorted(n.uid for n in self.nodes):
            raise PmxInternalError("set_order: the new order does not hold exactly the graph's nodes")
        self.nodes = list(nodes)

    def move_before(self, node: Node, other: Node):
        """node runs right before `other` (a rewrite that swapped their order)."""
        self.nodes.remove(node)
        self.nodes.insert(self.nodes.index(other), node)

    def set_outputs(self, node: Node, values):
        """node produces `values` instead of its outputs (a fusion taking over the outputs
        of a node it removed)."""
        for v in node.outputs:
            if v.producer is node:
                v.producer = None
        node.outputs = list(values)
        for v in node.outputs:
            v.producer = node

    def replace_uses(self, old: Value, new: Value):
        """Point every consumer (and graph output) of `old` at `new`."""
        for node in list(old.consumers):
            for i, v in enumerate(node.inputs):
                if v is old:
                    self.set_input(node, i, new)
        self.outputs = [new if v is old else v for v in self.outputs]

    def sole_reader(self, v: Value):
        """The one node that reads v (once or more), when nothing else sees v: it is not a
        graph output or kept (`--keep`). Else None. A fusion may then fold v away."""
        if v in self.outputs or v in self.kept:
            return None
        readers = {c.uid: c for c in v.consumers}
        return next(iter(readers.values())) if len(readers) == 1 else None

    def values(self):
        """Every Value reachable from nodes, inputs and outputs, each once, in order."""
        seen = {}
        for v in self.inputs:
            seen.setdefault(v.uid, v)
        for n in self.nodes:
            for v in n.inputs + n.outputs:
                if v is not None:
                    seen.setdefault(v.uid, v)
        for v in self.outputs:
            seen.setdefault(v.uid, v)
        return list(seen.values())

    def clone(self) -> Graph:
        """A copy to try passes on (new Values and Nodes; constants share their data,
        which no pass writes in place)."""
        copies = {}

        def copy(v):
            if v is None:
                return None
            if v.uid not in copies:
                copies[v.uid] = Value(v.name, v.shape, v.dtype, v.data)
                copies[v.uid].recorded_dtype = v.recorded_dtype
            return copies[v.uid]

        g = Graph(self.source)
        for n in self.nodes:
            g.add_node(
                Node(
                    n.op,
                    n.name,
                    [copy(v) for v in n.inputs],
                    [copy(v) for v in n.outputs],
                    n.attrs,
                    n.input_names,
                    n.line,
                    n.expr,
                    n.variant,
                )
            )
        g.inputs = [copy(v) for v in self.inputs]
        g.outputs = [copy(v) for v in self.outputs]
        g.kept = [copy(v) for v in self.kept]
        return g

    def adopt(self, other: Graph):
        """Take `other`'s nodes and tensors (a clone that passes ran on, kept instead of
        running them again here); `other` is not to be used after."""
        self.nodes, self._members = other.nodes, other._members
        self.inputs, self.outputs, self.kept = other.inputs, other.outputs, other.kept

    # --- checking -----------------------------------------------------------------

    def verify(self, after="", require_shapes=True):
        """Check use-def links, single producers, topological order and (after shape
        inference) that every value has a shape. Raises PmxCompileError naming the pass
        that broke the graph."""
        where = f" after pass {after}" if after else ""
        position = {}
        for i, n in enumerate(self.nodes):
            for v in n.outputs:
                if v.producer is not n:
                    raise PmxCompileError(
                        f"graph check failed{where}: {v.name} output of {n.where()} has producer {v.producer}"
                    )
                if v.uid in position:
                    raise PmxCompileError(f"graph check failed{where}: {v.name} produced twice")
                position[v.uid] = i
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                if v is None:
                    continue
                if n not in v.consumers:
                    raise PmxCompileError(
                        f"graph check failed{where}: {n.where()} reads {v.name} but is not among its consumers"
                    )
                if v.is_constant or v in self.inputs:
                    continue
                if v.uid not in position:
                    raise PmxCompileError(
                        f"graph check failed{where}: {n.where()} reads {v.name}, which nothing produces"
                    )
                if position[v.uid] >= i:
                    raise PmxCompileError(
                        f"graph check failed{where}: {n.where()} reads {v.name} before it is produced"
                    )
            for v in n.inputs + n.outputs if require_shapes else ():
                if v is not None and v.shape is None:
                    raise PmxCompileError(f"graph check failed{where}: {v.name} of {n.where()} has no shape")
        for v in self.outputs:
            if not (v.is_constant or v in self.inputs or v.uid in position):
                raise PmxCompileError(f"graph check failed{where}: output {v.name} is not produced")
            for c in v.consumers:
                if c not in self.nodes:
                    raise PmxCompileError(f"graph check failed{where}: {v.name} lists a removed consumer {c}")
