"""Test helpers: export torch modules with pnnx, compile, run and compare."""

import contextlib
import io
import os
import pathlib
import re
import struct

import numpy as np


def export_pnnx(directory, module, inputs, inputs2=None):
    """Export `module` traced on `inputs` with pnnx into `directory`; returns the path
    prefix (prefix + '.pnnx.param' / '.pnnx.bin'). With `inputs2` (other sizes), pnnx's
    dynamic-shape export: the dims that differ are written '?'."""
    import pnnx
    import torch

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    pt = directory / "model.pt"
    inputs = tuple(inputs)
    cwd = os.getcwd()
    try:
        os.chdir(directory)  # pnnx writes some side files into the working directory
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            try:
                # check_trace=False: torch's re-trace to compare (about half an export's
                # time) is redundant here, since every test compares pmx with eager torch
                pnnx.export(module, str(pt), inputs, None if inputs2 is None else tuple(inputs2), check_trace=False)
            except SyntaxError:
                pass  # pnnx's generated model_pnnx.py cannot spell aten:: ops; the .param is written
    finally:
        os.chdir(cwd)
    prefix = str(directory / "model")
    if not os.path.exists(prefix + ".pnnx.param"):
        raise RuntimeError(f"pnnx did not write {prefix}.pnnx.param")
    return prefix


def signed_input(shape, seed):
    """Uniform in [-1, 1) with about a tenth of the entries exactly zero."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    x[rng.random(shape) < 0.1] = 0
    return x


# F.pad's mode for each conv padding_mode
TORCH_PAD_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def torch_outputs(module, inputs):
    import torch

    with torch.no_grad():
        out = module.eval()(*inputs)
    if isinstance(out, torch.Tensor):
        out = (out,)
    flat = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            flat.append(o.detach().resolve_conj().resolve_neg().numpy())  # fft outputs may carry a lazy conj bit
        elif isinstance(o, (list, tuple)):
            for e in o:
                walk(e)

    walk(out)
    return flat


def rel_error(a, b):
    # complex outputs compare as complex: a float64 cast would drop the imaginary parts
    kind = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    a = np.asarray(a, kind)
    b = np.asarray(b, kind)
    if b.size == 0:
        return 0.0
    scale = max(float(np.abs(b).max()), 1e-12)
    return float(np.abs(a - b).max() / scale)


def compare_with_torch(prefix, module, inputs, out_path, tol=1e-4, **compile_kwargs):
    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(out_path), verify=True, **compile_kwargs)
    sess = InferenceSession(str(out_path), verify=True)
    feed = {arg.name: x.numpy() for arg, x in zip(sess.get_inputs(), inputs)}
    got = sess.run(None, feed)
    want = torch_outputs(module, inputs)
    assert len(got) == len(want), f"pmx returned {len(got)} outputs, torch {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"output {i}: shape {g.shape} != torch {w.shape}"
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w, err_msg=f"output {i}")
        else:
            err = rel_error(g, w)
            assert err <= tol, f"output {i}: max|pmx - torch| / max|torch| = {err:.3g} > {tol}"
    return sess, got, want


class KernelNode:
    """Stand-in for a node when calling a kernel directly (kernel property tests). `expr`
    may be given as text (the grammar of runtime/expr/tree.py) for readability: nodes hold trees."""

    def __init__(self, op, attrs=None, expr="", variant="", name="test"):
        from pmx.runtime import expr as E

        tree = E.parse(expr) if isinstance(expr, str) and expr else (expr or None)
        self.op, self.attrs, self.expr, self.variant, self.name = op, dict(attrs or {}), tree, variant, name


def kernel_pool(threads, splits_gemms=True):
    """A worker pool of `threads` threads for kernels made in a test (parallel.Pool); GEMMs
    split over it whatever BLAS's own thread count."""
    from pmx.runtime import parallel

    return parallel.Pool(threads, splits_gemms)


def bind_context(threads=None, scratch=None, persistent=None, temporaries=None):
    """A BindContext as an InferenceSession's binding makes one: over a new pool of
    `threads` (an int, GEMMs split over it: `kernel_pool`; a parallel.Pool as it is; None: the
    default thread count) and the given scratch, persistent dict and temporaries list."""
    from pmx.runtime import parallel
    from pmx.runtime.kernels.bind import BindContext

    workers = threads if threads is None or isinstance(threads, parallel.Pool) else kernel_pool(threads)
    return BindContext(workers, scratch, persistent, temporaries)


def run_kernel(op, inputs, attrs=None, expr="", variant="", threads=None):
    """Run one registered kernel on numpy inputs: output shapes come from the op's shape
    rule, outputs are preallocated (as the arena would be) and returned as a list. The
    kernel is bound as an InferenceSession binds it, over shared scratch of the size its scratch
    rule declares, here full of NaN as if an earlier node had left it so; a request past
    that size fails the test. `threads`: the pool it splits over, as bind_context takes
    it. With attrs sized_at_run, output 0 is the array the kernel allocated
    (registry.RunSized)."""
    from pmx.runtime.kernels.registry import RunSized, get, node_scratch_nbytes

    node = KernelNode(op, attrs, expr, variant)
    kernel = get(op)
    arrays = [np.ascontiguousarray(x) if x is not None else None for x in inputs]
    specs = kernel.infer(
        node, [None if x is None else x.shape for x in arrays], [None if x is None else x.dtype for x in arrays]
    )
    outputs = [np.full(shape, np.nan if np.dtype(dt).kind == "f" else 0, dtype=dt) for shape, dt in specs]
    if node.attrs.get("sized_at_run"):
        outputs[0] = RunSized()
    ctx = bind_context(threads, None, {}, [])
    stale = np.full(-(-node_scratch_nbytes(node, arrays, outputs, ctx) // 4), np.nan, np.float32).view(np.uint8)
    ctx.scratch = stale
    fn = kernel.make(node, arrays, outputs, ctx)
    assert ctx.shortfall == 0, f"{op}: scratch_array asked for {ctx.shortfall} bytes past the declared scratch"
    if fn is not None:
        with np.errstate(all="ignore"):
            fn()
    return [o.value if isinstance(o, RunSized) else o for o in outputs]


def recompute_crcs(data: bytes) -> bytes:
    """Rewrite the preamble's three CRCs to match the (mutated) bytes, as a forger would,
    so what refuses the file is the structural verifier, not a checksum; header/data
    extents are taken from the preamble as stored."""
    import struct

    from pmx.runtime import fileformat as ff

    pre = ff.unpack_preamble(data[: ff.PREAMBLE_SIZE])
    h0, hs, d0 = pre["header_offset"], pre["header_size"], pre["data_offset"]
    header_crc = ff.crc32(data[h0 : h0 + hs])
    data_crc = ff.crc32(data[d0:])
    head = bytearray(data[: ff.PREAMBLE_SIZE])
    struct.pack_into("<II", head, 48, header_crc, data_crc)
    struct.pack_into("<I", head, 56, ff.crc32(bytes(head[:56])))
    return bytes(head) + bytes(data[ff.PREAMBLE_SIZE :])


# --- walking the FlatBuffer -------------------------------------------------------------

_SCALARS = {
    "bool": 1,
    "byte": 1,
    "ubyte": 1,
    "short": 2,
    "ushort": 2,
    "int": 4,
    "uint": 4,
    "float": 4,
    "long": 8,
    "ulong": 8,
    "double": 8,
}


def _schema():
    """{table: [(field, type)]} and {enum: underlying type} from schema/pmx.fbs."""
    text = re.sub(r"//[^\n]*", "", (pathlib.Path(__file__).resolve().parents[1] / "schema" / "pmx.fbs").read_text())
    enums = dict(re.findall(r"enum\s+(\w+)\s*:\s*(\w+)", text))
    tables = {}
    for name, body in re.findall(r"table\s+(\w+)\s*\{([^}]*)\}", text):
        tables[name] = re.findall(r"(\w+)\s*:\s*(\[?\w+\]?)", body)
    return tables, enums


def flatbuffer_sites(data: bytes):
    """Every integer field of the header: (absolute file offset, width, label)."""
    from pmx.runtime import fileformat as ff

    tables, enums = _schema()
    h0 = ff.PREAMBLE_SIZE
    buf = data[h0 : h0 + ff.unpack_preamble(data[: ff.PREAMBLE_SIZE])["header_size"]]
    u32 = lambda p: struct.unpack_from("<I", buf, p)[0]
    sites = []
    seen = set()

    def site(p, width, label):
        sites.append((h0 + p, width, label))

    def table(pos, name):
        if (pos, name) in seen:
            return
        seen.add((pos, name))
        site(pos, 4, f"{name} soffset")
        vt = pos - struct.unpack_from("<i", buf, pos)[0]
        vt_len = struct.unpack_from("<H", buf, vt)[0]
        site(vt, 2, f"{name} vtable length")
        for k, (field, ftype) in enumerate(tables[name]):
            slot = 4 + 2 * k
            if slot >= vt_len:
                break
            off = struct.unpack_from("<H", buf, vt + slot)[0]
            site(vt + slot, 2, f"{name}.{field} vtable entry")
            if not off:
                continue
            p = pos + off
            ftype = enums.get(ftype, ftype)
            if ftype in _SCALARS:
                if ftype not in ("float", "double"):
                    site(p, _SCALARS[ftype], f"{name}.{field}")
                continue
            site(p, 4, f"{name}.{field} uoffset")
            target = p + u32(p)
            if ftype == "string":
                site(target, 4, f"{name}.{field} string length")
            elif ftype.startswith("["):
                elem = enums.get(ftype[1:-1], ftype[1:-1])
                n = u32(target)
                site(target, 4, f"{name}.{field} vector length")
                for i in range(n):
                    q = target + 4 + i * _SCALARS.get(elem, 4)
                    if elem in tables:
                        site(q, 4, f"{name}.{field}[] uoffset")
                        table(q + u32(q), elem)
                    elif elem == "string":
                        site(q, 4, f"{name}.{field}[] uoffset")
                    elif elem not in ("float", "double"):
                        site(q, _SCALARS[elem], f"{name}.{field}[]")
            else:
                table(target, ftype)

    site(0, 4, "root uoffset")
    table(u32(0), "Model")
    return sites


def write_int(data: bytes, pos: int, width: int, value: int) -> bytes:
    raw = (value % (1 << (8 * width))).to_bytes(width, "little")
    return data[:pos] + raw + data[pos + width :]


def operand_swaps(data: bytes):
    """Every way to point one node input of the .pmx `data` at another tensor of a
    different (shape, dtype) that the verifier's order checks allow there (a constant, a
    model input, or an output of an earlier node): a list of (node index, node, input
    slot, tensor index, header position of that input). One tensor stands for each
    (shape, dtype), so the count stays near nodes x inputs x distinct tensor kinds.
    with_input(data, position, tensor) makes the changed file."""
    import tempfile

    from pmx.runtime import load

    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "m.pmx"
        path.write_bytes(data)
        model = load.open_model(str(path))
        nodes, tensors, inputs = list(model.nodes), list(model.tensors), list(model.inputs)
    sites = [pos for pos, _w, label in flatbuffer_sites(data) if label == "Nodes.inputs[]"]
    assert len(sites) == sum(len(n.inputs) for n in nodes), "one Nodes.inputs[] site per node input"
    available = {i for i, t in enumerate(tensors) if t.kind == 1} | set(inputs)
    swaps = []
    flat = 0
    for j, node in enumerate(nodes):
        kinds = {}
        for i in sorted(available):
            kinds.setdefault((tuple(tensors[i].shape), str(tensors[i].dtype)), i)
        for slot, current in enumerate(node.inputs):
            own = (tuple(tensors[current].shape), str(tensors[current].dtype)) if current >= 0 else None
            swaps += [(j, node, slot, i, sites[flat]) for kind, i in kinds.items() if kind != own]
            flat += 1
        available |= set(node.outputs)
    return swaps


def with_input(data: bytes, position: int, tensor: int) -> bytes:
    """`data` with the node input at header `position` (operand_swaps) reading `tensor`,
    CRCs recomputed."""
    return recompute_crcs(write_int(data, position, 4, tensor))
