"""Verify a decoded .pmx model: everything its header claims, before anything uses it.

The verifier. It owns the checks of the model runtime/load.py decoded, run in this
order, the first failure raising: the arena against the limit; each tensor's kind,
shape (sign, and work against max_arena_bytes) and where its bytes are (constants inside
the data section, arena tensors inside the arena, both aligned; alias targets that are
tensor indices); alias chains (no loops, no views of constants) and each view's bytes
inside its root; the model's inputs, outputs and kept tensors; per node in stored order
its op, its tensor indices (each input a constant, a model input or produced earlier,
each tensor produced once) and its expression (grammar, expanded size); then each node's
attributes against its op's specs (kernels/attr_specs.py) and its op's shape rule, which
checks the node's operands, against the stored output shapes and dtypes. It also owns the data section's CRC32, which reads
every weight byte and so runs only when asked (`pmx verify`, verify=True). A failure
raises PmxFormatError naming the first tensor or node that fails; sizes beyond the
limits raise PmxResourceError before anything is allocated. It sets model.roots and
model.run_sized (the tensors sized at run time), and replaces each node's expression
text by its tree (None where empty); it changes nothing else.

It trusts the reader for the decoding: one entry per tensor and node in every column,
shapes, inputs and outputs cut at checked ends, known dtypes (numpy dtypes), ranks at
most MAX_RANK, numbers as Python ints (which do not overflow, so offsets and sizes are
compared as read); and for the parse_expression it is handed (load._expression), which
parses with pmx's own grammar, never eval, and gives one tree object per distinct text
and input count, so check_shape_rules can key expressions by identity and reuse a rule's
result across nodes with equal text. It never imports the reader: what it needs comes
in as arguments.
"""

from __future__ import annotations

import math

import numpy as np

from pmx.runtime import fileformat as ff
from pmx.runtime.errors import PmxError, PmxFormatError, PmxResourceError
from pmx.runtime.kernels.attr_specs import problem as attr_problem
from pmx.runtime.kernels.registry import checked_infer, kernel_of
from pmx.schema import layout as schema

# Nodes of the expression after desugaring, counting repeated subtrees each time: the
# numexpr and numpy backends walk the expanded tree, so nested erf/square would blow up.
MAX_EXPANDED_EXPR = 1 << 16
_KINDS = (schema.TensorKind.Intermediate, schema.TensorKind.Constant, schema.TensorKind.Input, schema.TensorKind.Output)


def _fail(path, msg):
    """A damaged file, named (the reader raises through this too)."""
    raise PmxFormatError(f"{path}: {msg}")


def verify_structure(model, pre, max_arena_bytes, parse_expression):
    """Every structural check of `model` (a header.Model) in the order the module docstring
    gives; `pre` is its preamble, parse_expression(text, num_inputs) -> (tree, expanded
    size) the reader's."""
    if model.arena_size > max_arena_bytes:
        raise PmxResourceError(
            f"{model.path}: arena of {model.arena_size} bytes exceeds the limit of {max_arena_bytes} bytes (raise it with max_arena_bytes=)"
        )
    nbytes = _check_tensors(model, pre["data_size"], max_arena_bytes)
    model.roots = _resolve_aliases(model)
    constant = schema.TensorKind.Constant
    for i, t in enumerate(model.tensors):
        if t.alias_of >= 0 and t.kind != constant:
            _check_alias_extent(model, i, t, nbytes)
    _check_io(model)
    _check_nodes(model, parse_expression)
    check_shape_rules(model)


# Tensor sizes and limits are kept below this (the arena and scratch sizes derived from
# them stay far from int64 overflow in numpy). Nothing real comes near 2 EiB.
_CLAMP = 1 << 61


def _tensor_label(i, t):
    """How messages name tensor i (built only on failure, like _label for nodes)."""
    return f"tensor {i} ({t.name[:40]!r})"


def _check_tensors(model, data_size, max_arena_bytes):
    """Kind, shape, size, and where each tensor's bytes are (data section, arena range or
    alias target). Returns each tensor's byte count. (Plain Python: on the few hundred
    tensors of a model a loop costs less than the numpy calls would, and a fresh process
    pays tens of microseconds for the first use of each numpy operation.)"""
    path, tensors, n = model.path, model.tensors, len(model.tensors)

    limit = min(max(max_arena_bytes, data_size), _CLAMP - 1)
    prod, kinds, constant, align, arena_size = (
        math.prod,
        frozenset(_KINDS),
        schema.TensorKind.Constant,
        ff.ALIGNMENT,
        model.arena_size,
    )
    nbytes = [prod(t.shape) * t.dtype.itemsize for t in tensors]
    for i, (t, size) in enumerate(zip(tensors, nbytes)):
        if t.kind not in kinds:
            _fail(path, f"{_tensor_label(i, t)} has kind {t.kind}, not one of {list(_KINDS)}")
        shape, bound = t.shape, size
        if shape and min(shape) <= 0:
            if min(shape) < 0:
                _fail(path, f"{_tensor_label(i, t)} has shape {shape}: dims must be non-negative")
            # Zero dims count as 1 (kernels may loop over the other dims of an empty
            # tensor) and views count in full (a stride-0 view of 4 bytes can have 2**40
            # elements): the bound is on work, not only on bytes.
            bound = prod(max(d, 1) for d in shape) * t.dtype.itemsize
        if bound > limit:
            raise PmxResourceError(
                f"{path}: {_tensor_label(i, t)} of shape {shape} {t.dtype.name} exceeds the limit of {max_arena_bytes} bytes (max_arena_bytes)"
            )
    # Python ints do not overflow: offsets and sizes are compared as read.
    for i, (t, size) in enumerate(zip(tensors, nbytes)):
        if t.kind == constant:
            if t.alias_of != -1 or t.alias_strides is not None:
                _fail(
                    path,
                    f"{_tensor_label(i, t)} is a constant but has alias_of {t.alias_of} / alias_strides {t.alias_strides}",
                )
            if t.data_size != size:
                _fail(
                    path,
                    f"{_tensor_label(i, t)}: data_size {t.data_size} != shape {t.shape} x {t.dtype.itemsize} bytes = {size}",
                )
            if t.data_offset % align or t.data_offset + size > data_size:
                _fail(
                    path,
                    f"{_tensor_label(i, t)}: data [{t.data_offset}, +{t.data_size}) is outside the {data_size}-byte data section or not {align}-byte aligned",
                )
        elif t.alias_of == -1:
            if t.alias_strides is not None:
                _fail(path, f"{_tensor_label(i, t)} has alias_strides {t.alias_strides} but aliases nothing")
            if t.arena_offset % align or t.arena_offset + size > arena_size:
                _fail(
                    path,
                    f"{_tensor_label(i, t)}: arena range [{t.arena_offset}, +{size}) is outside the {arena_size}-byte arena or not {align}-byte aligned",
                )
        elif not 0 <= t.alias_of < n:
            _fail(path, f"{_tensor_label(i, t)}: alias_of {t.alias_of} is not a tensor index (0..{n - 1})")
    return nbytes


def _resolve_aliases(model):
    """(root, byte offset) for every tensor, following alias chains once each (memoized,
    so long chains cost linear time); a chain that loops or ends at a constant fails."""
    path, tensors, constant = model.path, model.tensors, schema.TensorKind.Constant
    roots = [None if t.kind != constant and t.alias_of >= 0 else (i, 0) for i, t in enumerate(tensors)]
    for i in [i for i, r in enumerate(roots) if r is None]:
        chain = []
        on_chain = set()
        j = i
        while roots[j] is None:
            if j in on_chain:
                _fail(path, f"{_tensor_label(i, tensors[i])}: alias chain loops at tensor {j}")
            on_chain.add(j)
            chain.append(j)
            j = tensors[j].alias_of
        if tensors[j].kind == schema.TensorKind.Constant:
            _fail(
                path,
                f"{_tensor_label(chain[-1], tensors[chain[-1]])} aliases constant tensor {j}; views of constants are not stored",
            )
        root, offset = roots[j]
        for k in reversed(chain):
            offset += tensors[k].alias_offset
            roots[k] = (root, offset)
    return roots


def _check_alias_extent(model, i, t, nbytes):
    """The bytes a view can touch must lie inside its root's arena range."""
    path = model.path
    root, offset = model.roots[i]
    root_bytes = nbytes[root]
    if 0 in t.shape:
        lo, hi = 0, 0
    elif t.alias_strides is not None:
        if len(t.alias_strides) != len(t.shape):
            _fail(path, f"{_tensor_label(i, t)}: {len(t.alias_strides)} alias strides for rank {len(t.shape)}")
        lo = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s < 0)
        hi = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s > 0) + t.dtype.itemsize
    else:
        lo, hi = 0, nbytes[i]
    if offset + lo < 0 or offset + hi > root_bytes:
        _fail(
            path,
            f"{_tensor_label(i, t)}: view bytes [{offset + lo}, {offset + hi}) exceed its root tensor {root}'s {root_bytes} bytes (alias_of {t.alias_of}, alias_offset {t.alias_offset}, strides {t.alias_strides})",
        )
    target = model.tensors[t.alias_of]
    if target.alias_strides is None and t.alias_offset + hi > nbytes[t.alias_of]:
        # inside the arena, but reaching past the tensor it claims to view
        _fail(
            path,
            f"{_tensor_label(i, t)}: view bytes [{t.alias_offset + lo}, {t.alias_offset + hi}) exceed its target tensor {t.alias_of}'s {nbytes[t.alias_of]} bytes",
        )


def _check_io(model):
    path, tensors, n = model.path, model.tensors, len(model.tensors)
    for name, ids in (("inputs", model.inputs), ("outputs", model.outputs), ("kept", model.kept)):
        for idx in ids:
            if not 0 <= idx < n:
                _fail(path, f"model {name} names tensor {idx}, but there are {n} tensors")
    if len(set(model.inputs)) != len(model.inputs):
        _fail(path, f"model inputs {model.inputs} name a tensor twice")
    input_kind = schema.TensorKind.Input
    marked = {i for i, t in enumerate(tensors) if t.kind == input_kind}
    if marked != set(model.inputs):
        _fail(path, f"tensors marked as inputs {sorted(marked)} differ from the model inputs {sorted(model.inputs)}")


def _label(j, node):
    """How messages name node j (built only on failure: formatting it for every node
    would cost more than the checks)."""
    return f"node {j} ({node.op[:40]!r} {node.name[:40]!r})"


def _check_nodes(model, parse_expression):
    """Indices in range, stored order respected (each input is a constant, a model input
    or produced earlier), each tensor produced once, expressions within the grammar
    (parse_expression, the reader's) and bounded in expanded size. A node that passes is
    checked with a few set operations; one that fails is walked index by index to name
    what is wrong."""
    path, tensors = model.path, model.tensors
    constant, fixed = schema.TensorKind.Constant, (schema.TensorKind.Constant, schema.TensorKind.Input)
    available = {i for i, t in enumerate(tensors) if t.kind == constant} | set(model.inputs)
    available.add(-1)  # an absent optional input
    writable = {i for i, t in enumerate(tensors) if t.kind not in fixed}
    run_sized = set()
    for j, node in enumerate(model.nodes):
        kernel = kernel_of(node.op)
        if kernel is None:
            _fail(path, f"{_label(j, node)}: unknown op {node.op[:40]!r}")
        outputs = set(node.outputs)
        # a node reading a tensor sized at run is sized at run too, if its op may read one
        late = not run_sized.isdisjoint(node.inputs) and kernel.reads_run_sized
        readable = available | run_sized if late else available
        if not (
            readable.issuperset(node.inputs) and writable.issuperset(outputs) and len(outputs) == len(node.outputs)
        ):
            _explain_node(model, j, node, readable, writable, run_sized)
        writable -= outputs  # each tensor is produced once
        if late or node.attrs.get("sized_at_run") is True:
            for i in node.outputs:  # allocated when its node runs (registry.RunSized)
                if math.prod(tensors[i].shape) != 0:
                    _fail(
                        path,
                        f"{_label(j, node)}: sizes {_tensor_label(i, tensors[i])} at run time, but the file plans it as {list(tensors[i].shape)}",
                    )
            run_sized |= outputs
        else:
            available |= outputs
        if not node.expr:
            node.expr = None
            if node.op == "elementwise":
                _fail(path, f"{_label(j, node)}: an elementwise node without an expression")
        elif node.op == "elementwise" and -1 in node.inputs:
            _fail(path, f"{_label(j, node)}: an elementwise node with an absent input")
        if isinstance(node.expr, str):  # as read (a model checked again holds trees)
            try:
                node.expr, size = parse_expression(node.expr, len(node.inputs) if node.op == "elementwise" else 1)
            except PmxFormatError as e:
                _fail(path, f"{_label(j, node)}: {e}")
            if size > MAX_EXPANDED_EXPR:
                _fail(path, f"{_label(j, node)}: expression expands to more than {MAX_EXPANDED_EXPR} terms ({size})")
    for idx in model.outputs + model.kept:
        if idx == -1 or (idx not in available and idx not in run_sized):
            _fail(path, f"output tensor {idx} ({tensors[idx].name[:40]!r}) is never produced")
    model.run_sized = frozenset(run_sized)


def _explain_node(model, j, node, readable, writable, run_sized):
    """Fail naming the first input or output of node j that _check_nodes refuses."""
    path, tensors, n = model.path, model.tensors, len(model.tensors)
    for idx in node.inputs:
        if idx == -1:
            continue
        if not 0 <= idx < n:
            _fail(path, f"{_label(j, node)}: input tensor index {idx} out of range (0..{n - 1})")
        if idx in run_sized and idx not in readable:
            _fail(
                path,
                f"{_label(j, node)}: reads tensor {idx} ({tensors[idx].name[:40]!r}), whose size a node sets at run time, "
                f"which no {node.op[:40]} node may read",
            )
        if idx not in readable:
            _fail(
                path, f"{_label(j, node)}: reads tensor {idx} ({tensors[idx].name[:40]!r}) before any node produces it"
            )
    seen = set()
    for idx in node.outputs:
        if not 0 <= idx < n:
            _fail(path, f"{_label(j, node)}: output tensor index {idx} out of range (0..{n - 1})")
        if idx not in writable or idx in seen:
            _fail(
                path,
                f"{_label(j, node)}: writes tensor {idx} ({tensors[idx].name[:40]!r}), which is a constant, an input or already produced",
            )
        seen.add(idx)
    _fail(path, f"{_label(j, node)}: inputs {node.inputs} / outputs {node.outputs} are inconsistent")


def check_shape_rules(model):
    """Check each node's attributes against its op's specs (kernels/attr_specs.py), then
    run its shape rule on its stored input shapes and compare with its stored output
    shapes (and their number). Kernels size their scratch buffers (padding, im2col)
    from attributes; this ties the attributes to shapes already checked against the
    arena, so a damaged padding or stride is refused here instead of becoming a huge
    allocation at bind. It needs a model the rest of the verifier passed (open_model
    runs it last). Of all
    checks it alone runs per-op code (the rules), so it is kept cheap: a rule reads only
    the op, attributes, expression, variant and input shapes and dtypes, so a node that
    repeats all of them (the blocks of a CNN stage, the layers of a transformer) reuses
    the first one's result. Nodes are first told apart by op and
    inputs, each input as a small int standing for its (shape, dtype); only nodes that
    match there compare expression, variant and attributes, since building and hashing
    that key for every node cost more than the rules it saved on CNNs, where most nodes
    differ in shape. A node whose rule runs has its attributes checked first, once per
    attribute dict (nodes of one attribute set share it) and input ranks, which is all a
    spec reads. (Runs after _check_nodes: indices are in range.)"""
    path, tensors = model.path, model.tensors
    kinds = {}
    sig = [kinds.setdefault((t.shape, t.dtype), len(kinds)) for t in tensors] + [-1]  # [-1]: absent input
    shape_of = [t.shape for t in tensors] + [None]  # [None]: an absent input (index -1)
    seen = {}  # (op, input signatures) -> [[node, its exact key or None, output shapes]]
    attrs_keys = {}  # id(attrs) -> _attrs_key(attrs): nodes of one attribute set share its dict

    def exact_key(node):
        attrs = node.attrs
        key = attrs_keys.get(id(attrs))
        if key is None:
            key = attrs_keys[id(attrs)] = _attrs_key(attrs)
        return id(node.expr), node.variant, key

    dtype_of = [t.dtype for t in tensors] + [None]
    rank_of_sig = [len(shape) for shape, _ in kinds] + [None]  # [None]: an absent input (sig -1)
    attrs_passed = set()  # (op, id(attrs), input ranks): attribute sets that met their op's specs
    nodes = model.nodes
    # built by comprehensions, which cost less per node than the statements of the loop
    groups = [(node.op, *map(sig.__getitem__, node.inputs)) for node in nodes]
    wanted = [[(shape_of[i], dtype_of[i]) for i in node.outputs] for node in nodes]
    for j, (node, group, want) in enumerate(zip(nodes, groups, wanted)):
        same_inputs = seen.get(group)
        got = None
        if same_inputs is None:
            same_inputs = seen[group] = []
        else:
            key = exact_key(node)
            for entry in same_inputs:
                if entry[1] is None:
                    entry[1] = exact_key(entry[0])
                if entry[1] == key:
                    got = entry[2]
                    break
        if got is None:
            ranks = tuple(map(rank_of_sig.__getitem__, group[1:]))
            checked = node.op, id(node.attrs), ranks
            if checked not in attrs_passed:
                _check_attrs(path, j, node, ranks)
                attrs_passed.add(checked)
            got = _rule_shapes(
                path,
                j,
                node,
                list(map(shape_of.__getitem__, node.inputs)),
                list(map(dtype_of.__getitem__, node.inputs)),
            )
            same_inputs.append([node, None, got])
        if got != want:
            _output_mismatch(path, j, node, got, want)


def _output_mismatch(path, j, node, got, want):
    """Fails naming what differs between the outputs node j's rule gives and the stored
    ones: their number, a shape, or a dtype (a kernel writes the dtype its rule gives, and
    the compiler stores exactly that, so any other is damage)."""
    label = f"node {j} ({node.op} {node.name[:40]!r})"
    if len(got) != len(want):  # kernels write (and index) the outputs their rule gives
        _fail(path, f"{label}: its attributes and input shapes give {len(got)} outputs, the file stores {len(want)}")
    shapes = [shape for shape, _ in got], [shape for shape, _ in want]
    if shapes[0] != shapes[1]:
        _fail(
            path,
            f"{label}: its attributes and input shapes give output shapes {shapes[0]}, the file stores {shapes[1]}",
        )
    for k, ((_, rule), (_, stored)) in enumerate(zip(got, want)):
        if rule != stored:
            _fail(path, f"{label}: its inputs give output {k} dtype {rule.name}, the file stores {stored.name}")


def _check_attrs(path, j, node, ranks):
    """Node j's attributes against its op's specs (kernels/attr_specs.py), before its
    shape rule reads them: what is missing, mistyped, out of range or unknown is named."""
    try:
        found = attr_problem(kernel_of(node.op).attrs, node.attrs, ranks)
    except Exception as e:  # a spec tripping over a value it did not foresee
        found = "?", f"cannot be checked ({type(e).__name__}: {str(e)[:100]})"
    if found is not None:
        name, message = found
        _fail(path, f"node {j} ({node.op} {node.name[:40]!r}): attribute {name[:40]!r} {message}")


def _attrs_key(attrs):
    """`attrs` as a hashable key that tells 1, 1.0 and True apart: equal in Python, not
    necessarily to a shape rule. (Tuples read from a file hold one type throughout.)"""
    return tuple((k, v, type(v[0]) if type(v) is tuple and v else type(v)) for k, v in attrs.items())


def _rule_shapes(path, j, node, shapes, dtypes):
    """The (shape, dtype) of each output node j's shape rule gives, which also checks its
    operands (a conv's weight against its input's channels, its bias against the output
    channels, an index's dtype, ...); any failure names the node and what does not fit.
    Each shape is the rule's own tuple: registry.output_shapes would also turn each dim
    into an int, which a comparison with the stored shapes (Python ints, checked
    non-negative) does not need: what differs fails."""
    label = f"node {j} ({node.op} {node.name[:40]!r})"
    try:
        return [
            (tuple(shape), np.dtype(dtype)) for shape, dtype in checked_infer(kernel_of(node.op), node, shapes, dtypes)
        ]
    except PmxError as e:
        _fail(path, f"{label}: {e}")
    except MemoryError:
        raise PmxResourceError(f"{path}: {label}: attributes need too much memory") from None
    except Exception as e:  # a rule refusing hostile attributes or operands, whatever it raises
        _fail(path, f"{label}: its attributes and inputs do not fit its op: {type(e).__name__}: {str(e)[:160]}")


def check_data_checksum(path, buf, pre):
    """CRC32 of the data section against the preamble (`pmx verify`, verify=True): it
    reads every weight byte, so a plain load leaves it out."""
    d0 = pre["data_offset"]
    with memoryview(buf) as view:
        crc = ff.crc32(view[d0 : d0 + pre["data_size"]])
    if crc != pre["data_crc"]:
        _fail(
            path, f"data checksum mismatch: stored {pre['data_crc']:#010x}, computed {crc:#010x}: the file is damaged"
        )
