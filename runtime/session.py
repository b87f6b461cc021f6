"""InferenceSession: the onnxruntime-shaped API over a loaded .pmx file.

    sess = InferenceSession("model.pmx")
    [y] = sess.run(None, {"in0": x})

Load does no graph work: it verifies and wraps the file (runtime/load.py). Each thread
that calls run() gets its own binding, built once: an arena, a view of it per tensor, and
the list of kernel callables (weights shared by all threads, read-only). A run copies
inputs into their arena slots, calls the list, and copies the requested outputs out.

What run() accepts (decided here, documented in the README):
  - a dict {input name: value}; every model input must be given, unknown names are refused
  - numpy arrays of exactly the input's dtype; any memory layout (non-contiguous arrays
    are copied into the arena like any other)
  - lists, tuples and scalars, converted with np.asarray(value, dtype=input dtype)
  - arrays of another dtype are refused (PmxInputError says which dtype and how to
    convert), as onnxruntime does: a silent float64 -> float32 cast can hide a bug
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from pmx.runtime import kernels
from pmx.runtime.dtypes import ORT_TYPE
from pmx.runtime.errors import PmxError, PmxFormatError, PmxInputError, PmxResourceError
from pmx.runtime.load import DEFAULT_MAX_ARENA_BYTES, open_model, resolve_alias
from pmx.schema import pmx_generated as fb


@dataclass(frozen=True)
class NodeArg:
    """Same fields as onnxruntime.NodeArg: name, shape (None for dynamic dims), type."""

    name: str
    shape: list
    type: str


class _Binding:
    """One thread's arena, tensor views and kernel callables."""

    def __init__(self, model):
        self.arena = _aligned_empty(model.arena_size)
        self.views = [None] * len(model.tensors)
        for i, t in enumerate(model.tensors):
            if t.kind == fb.TensorKind.Constant:
                self.views[i] = model.constants[i]
            else:
                self.views[i] = self._arena_view(model, i)
        self.steps = []
        for node in model.nodes:
            ins = [self.views[j] if j >= 0 else None for j in node.inputs]
            outs = [self.views[j] for j in node.outputs]
            try:
                fn = kernels.get(node.op).make(node, ins, outs)
            except PmxError:
                raise
            except MemoryError:
                raise PmxResourceError(f"{model.path}: node {node.name[:40]!r} ({node.op}) needs more scratch memory than is available") from None
            except Exception as e:  # noqa: BLE001 - a kernel refusing its attributes: the file is inconsistent
                raise PmxFormatError(f"{model.path}: node {node.name[:40]!r} ({node.op}) cannot be bound: {type(e).__name__}: {str(e)[:120]}") from None
            self.steps.append(fn)
        self.subsets = {}

    def _arena_view(self, model, i):
        t = model.tensors[i]
        root, offset = resolve_alias(model, i)
        start = model.tensors[root].arena_offset + offset
        if t.alias_strides is not None:
            return np.ndarray(t.shape, t.dtype, buffer=self.arena, offset=start, strides=t.alias_strides)
        return self.arena[start:start + t.nbytes].view(t.dtype).reshape(t.shape)


def _aligned_empty(nbytes, align=64):
    raw = np.empty(nbytes + align, np.uint8)
    shift = (-raw.ctypes.data) % align
    return raw[shift:shift + nbytes]


class InferenceSession:
    """Load a .pmx file and run it. Mirrors onnxruntime.InferenceSession.

    verify=True checks the CRC32 checksums of the whole file at load (off by default so
    load stays fast; the structural verifier always runs). num_threads sets numexpr's
    thread count. providers / sess_options are accepted for drop-in compatibility and
    ignored (pmx runs on the CPU).
    """

    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None,
                 *, verify=False, num_threads=None, max_arena_bytes=DEFAULT_MAX_ARENA_BYTES):
        if not isinstance(path_or_bytes, (str, bytes)) and not hasattr(path_or_bytes, "__fspath__"):
            raise PmxInputError(f"InferenceSession takes a path to a .pmx file, got {type(path_or_bytes).__name__}")
        self._model = open_model(str(path_or_bytes) if not isinstance(path_or_bytes, bytes) else path_or_bytes.decode(),
                                 verify_checksum=verify, max_arena_bytes=max_arena_bytes)
        if num_threads is not None:
            import numexpr

            numexpr.set_num_threads(int(num_threads))
        m = self._model
        self._inputs = [NodeArg(m.tensors[i].name, list(m.tensors[i].shape), ORT_TYPE[m.tensors[i].dtype.name]) for i in m.inputs]
        self._outputs = [NodeArg(m.tensors[i].name, list(m.tensors[i].shape), ORT_TYPE[m.tensors[i].dtype.name]) for i in m.outputs]
        self._input_index = {m.tensors[i].name: i for i in m.inputs}
        self._fetchable = {m.tensors[i].name: i for i in m.outputs + m.kept}
        self._local = threading.local()

    # --- metadata -------------------------------------------------------------------

    def get_inputs(self):
        return list(self._inputs)

    def get_outputs(self):
        return list(self._outputs)

    def get_providers(self):
        return ["CPUExecutionProvider"]

    @property
    def model(self):
        return self._model

    # --- running --------------------------------------------------------------------

    def _binding(self):
        b = getattr(self._local, "binding", None)
        if b is None:
            try:
                b = _Binding(self._model)
            except PmxError:
                raise
            except MemoryError:
                raise PmxResourceError(f"{self._model.path}: cannot allocate the {self._model.arena_size}-byte arena") from None
            except Exception as e:  # noqa: BLE001 - views the verifier let through but numpy refuses
                raise PmxFormatError(f"{self._model.path}: cannot bind the model: {type(e).__name__}: {str(e)[:120]}") from None
            self._local.binding = b
        return b

    def _check_feed(self, feed):
        if not isinstance(feed, dict):
            raise PmxInputError(f"run() takes a dict of input name -> array, got {type(feed).__name__}")
        unknown = [k for k in feed if k not in self._input_index]
        if unknown:
            raise PmxInputError(f"unknown input name(s) {unknown}; the model's inputs are {list(self._input_index)}")
        missing = [k for k in self._input_index if k not in feed]
        if missing:
            raise PmxInputError(f"missing input(s) {missing}; the model's inputs are {list(self._input_index)}")
        arrays = {}
        for name, value in feed.items():
            t = self._model.tensors[self._input_index[name]]
            if isinstance(value, np.ndarray):
                if value.dtype != t.dtype:
                    raise PmxInputError(
                        f"input {name!r}: expected dtype {t.dtype.name}, got {value.dtype.name} "
                        f"(convert with .astype(np.{t.dtype.name}))")
                arr = value
            else:
                try:
                    arr = np.asarray(value, dtype=t.dtype)
                except (ValueError, TypeError) as e:
                    raise PmxInputError(f"input {name!r}: cannot convert {type(value).__name__} to {t.dtype.name}: {e}") from None
            if arr.shape != tuple(t.shape):
                raise PmxInputError(f"input {name!r}: expected shape {list(t.shape)}, got {list(arr.shape)}")
            arrays[self._input_index[name]] = arr
        return arrays

    def _steps_for(self, binding, wanted):
        key = tuple(wanted)
        steps = binding.subsets.get(key)
        if steps is None:
            steps = binding.subsets[key] = self._needed_steps(binding, wanted)
        return steps

    def _needed_steps(self, binding, wanted):
        """Only the nodes the requested outputs depend on, in stored order. Following
        inputs is enough even with aliases: whatever writes into a tensor's bytes is an
        ancestor of it (a concat's slices are its inputs, an in-place or view node reads
        the tensor it aliases), and running a subset in stored order keeps every needed
        tensor live as in a full run."""
        m = self._model
        producer = {}
        for j, node in enumerate(m.nodes):
            for t in node.outputs:
                producer[t] = j
        need = set()
        stack = list(wanted)
        seen = set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            j = producer.get(t)
            if j is not None and j not in need:
                need.add(j)
                stack.extend(i for i in m.nodes[j].inputs if i >= 0)
        return [binding.steps[j] for j in sorted(need) if binding.steps[j] is not None]

    def run(self, output_names=None, input_feed=None, run_options=None):
        """Run the model; returns a list of new numpy arrays, one per requested output
        (all graph outputs when output_names is None; kept tensors may be requested by
        name)."""
        if input_feed is None:
            input_feed = {}
        arrays = self._check_feed(input_feed)
        if output_names is None:
            wanted = list(self._model.outputs)
        else:
            if isinstance(output_names, str):
                raise PmxInputError("output_names must be a list of names or None, not a string")
            wanted = []
            for name in output_names:
                if name not in self._fetchable:
                    raise PmxInputError(
                        f"unknown output {name!r}; available: {list(self._fetchable)} "
                        f"(compile with --keep NAME to fetch an intermediate tensor)")
                wanted.append(self._fetchable[name])
        binding = self._binding()
        for i, arr in arrays.items():
            np.copyto(binding.views[i], arr)
        steps = self._steps_for(binding, wanted)
        step = None
        try:
            with np.errstate(all="ignore"):
                for step in steps:
                    step()
        except PmxError:
            raise
        except MemoryError:
            raise PmxResourceError(f"{self._model.path}: out of memory in {self._describe(binding, step)}") from None
        except Exception as e:  # noqa: BLE001 - only PmxError subclasses leave run()
            raise PmxFormatError(f"{self._model.path}: {self._describe(binding, step)} failed: {type(e).__name__}: {str(e)[:120]}") from None
        return [np.array(binding.views[i], copy=True) for i in wanted]

    def _describe(self, binding, step):
        """'node NAME (op)' for the step that raised (found only after an error, so the
        loop in run() stays a bare loop)."""
        for j, fn in enumerate(binding.steps):
            if fn is step:
                node = self._model.nodes[j]
                return f"node {node.name[:40]!r} ({node.op})"
        return "a node"

    def profile(self, input_feed, repeat=10):
        """Per-node timings (median ms over `repeat` runs): list of dicts op, name,
        shapes, ms, sorted by time."""
        arrays = self._check_feed(input_feed)
        binding = self._binding()
        for i, arr in arrays.items():
            np.copyto(binding.views[i], arr)
        m = self._model
        times = [[] for _ in m.nodes]
        with np.errstate(all="ignore"):
            for _ in range(repeat):
                for j, step in enumerate(binding.steps):
                    if step is None:
                        continue
                    t0 = time.perf_counter()
                    step()
                    times[j].append(time.perf_counter() - t0)
        rows = []
        for j, node in enumerate(m.nodes):
            ms = float(np.median(times[j])) * 1e3 if times[j] else 0.0
            shapes = [list(m.tensors[i].shape) for i in node.inputs if i >= 0 and m.tensors[i].kind != fb.TensorKind.Constant]
            rows.append(dict(op=node.op, name=node.name, variant=node.variant,
                             in_shapes=shapes, out_shapes=[list(m.tensors[i].shape) for i in node.outputs], ms=ms))
        rows.sort(key=lambda r: -r["ms"])
        return rows
