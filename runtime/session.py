"""InferenceSession: the onnxruntime-shaped API over a loaded .pmx file.

    sess = InferenceSession("model.pmx")
    [y] = sess.run(None, {"in0": x})

Load does no graph work: it verifies and wraps the file (runtime/load.py). Each thread
that calls run() gets its own binding, built once: an arena, a view of it per tensor, one
scratch buffer all nodes share for their temporaries (runtime/kernels/bind.py), and
the list of kernel callables (weights shared by all threads, read-only). A run copies
inputs into their arena slots, calls the list (kernels split their work over the worker
threads this InferenceSession keeps for the calling thread: runtime/parallel.py), and copies the
requested outputs out.

What run() accepts (decided here, documented in the README):
  - a dict {input name: value}; every model input must be given, unknown names are refused
  - numpy arrays of exactly the input's dtype; any memory layout (non-contiguous arrays
    are copied into the arena like any other)
  - lists, tuples and scalars, converted with np.asarray(value, dtype=input dtype)
  - arrays of another dtype are refused (PmxInputError says which dtype and how to
    convert), as onnxruntime does: a silent float64 -> float32 cast can hide a bug
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import os
import threading
import time
import weakref

import numpy as np

from pmx.runtime import batch_chunks, blas, compat, parallel
from pmx.runtime import expr as E
from pmx.runtime.dim_ranges import format_ranges, shape_allowed, tensor_ranges
from pmx.runtime.dtypes import ORT_TYPE
from pmx.runtime.errors import (
    PmxError,
    PmxInputError,
    PmxResourceError,
    PmxRunTerminated,
    internal_error,
)
from pmx.runtime.kernels.bind import BindContext
from pmx.runtime.kernels.registry import RunSized, check_run_sized, get, node_scratch_nbytes, output_shapes
from pmx.runtime.load import DEFAULT_MAX_ARENA_BYTES, collector_paused, open_model
from pmx.runtime.options import SessionOptions, resolve_thread_count
from pmx.runtime.record import FrozenRecord
from pmx.runtime.replan import compiled_layout, infer_shapes, plan_layout
from pmx.schema import layout as schema


class NodeArg(FrozenRecord):
    """Same fields as onnxruntime.NodeArg: name, shape (None for dynamic dims), type."""

    __slots__ = ("name", "shape", "type")

    def __init__(self, name, shape, type):  # onnxruntime's field name
        for f, v in (("name", name), ("shape", shape), ("type", type)):
            object.__setattr__(self, f, v)


@contextlib.contextmanager
def _naming_node(model, node):
    """A kernel refusing a node while its scratch is sized or it is bound (attributes or
    operands the file got inconsistent) fails naming that node."""
    try:
        yield
    except PmxError:
        raise
    except MemoryError:
        raise PmxResourceError(
            f"{model.path}: node {node.name[:40]!r} ({node.op}) needs more scratch memory than is available"
        ) from None
    except Exception as e:  # whatever the kernel raised, on a file the verifier passed
        raise internal_error(model.path, node, "bind", e) from e


class _Binding:
    """One thread's arena, scratch, tensor views and kernel callables for one input-shape
    layout. Arena plus scratch count against max_arena_bytes.

    With a pool of several threads, whether a run uses the pool's workers or the calling
    thread alone is decided on whole runs (parallel.RunChooser): on a host whose other
    cores are busy, and for small models, one thread can be faster. The one-thread way is
    a second set of callables over the same arena and scratch, bound for one thread
    (whole GEMMs, no parts) and made when first chosen; a GEMM computed whole and one
    computed in parts may differ in the last bits, so runs may differ there when the
    choice changes. With `deterministic` (SessionOptions.use_deterministic_compute) the
    one-thread way runs the split parts one after another instead: every run of the
    binding computes the same bits, and that way is slower (docs/performance.md)."""

    def __init__(self, model, layout, max_arena_bytes, pool, run_sized, deterministic=False):
        self.model = model
        self.pool = pool
        self.gate = parallel.RunChooser(pool.threads > 1)
        self.step_nodes = None  # id(step) -> its node, made when profiling first needs it
        self.single = parallel.Pool(1) if pool.threads > 1 and not deterministic else None
        self._bind(model, layout, max_arena_bytes, run_sized)
        self._ways = {True: None, False: None}
        # The first run takes the one-thread way where there is one, unless the model is
        # heavy: binding for the split way plans every split, which on a light model costs
        # more on one run than the split saves, and on a heavy one less (docs/performance.md,
        # "The first run on one thread", "The first run of heavy models: split"); the
        # other way is bound when the run chooser first takes it.
        self.started = False
        self._use(self.single is None or _heavy_model(model, layout))

    def _bind(self, model, layout, max_arena_bytes, run_sized):
        self.layout = layout
        self.arena = _aligned_empty(layout.arena_size)
        self.views = [None] * len(model.tensors)
        for i, t in enumerate(model.tensors):
            if t.kind == schema.TensorKind.Constant:
                self.views[i] = model.constants[i]
            else:
                self.views[i] = self._arena_view(t, i, layout)
        for i in run_sized:
            self.views[i] = RunSized()
        self.operands = [
            ([self.views[k] if k >= 0 else None for k in node.inputs], [self.views[k] for k in node.outputs])
            for node in model.nodes
        ]
        # sized for the split kernels: the one-thread ones have needed no more on any model
        # tried, and a request past the buffer gets an array of its own (scratch_array)
        scratch_size = self._scratch_size(model)
        if layout.arena_size + scratch_size > max_arena_bytes:
            raise PmxResourceError(
                f"{model.path}: the {layout.arena_size}-byte arena plus {scratch_size} bytes of kernel "
                f"scratch exceed the limit of {max_arena_bytes} (max_arena_bytes)"
            )
        self.scratch = _aligned_empty(scratch_size)
        self.persistent = {}  # BindContext.persistent_buffer: padded inputs shared by same-geometry nodes
        self.temporaries = []  # BindContext.temporary_array: expression temporaries shared by all nodes

    def _scratch_size(self, model):
        size = 0
        ctx = BindContext(self.pool)
        for node, (ins, outs) in zip(model.nodes, self.operands):
            if not _reads_run_sized(ins):  # bound at run, with arrays of its own
                with _naming_node(model, node):
                    size = max(size, node_scratch_nbytes(node, ins, outs, ctx))
        return size

    def _make_steps(self, model, pool=None):
        steps = []
        ctx = BindContext(pool or self.pool, self.scratch, self.persistent, self.temporaries)
        for node, (ins, outs) in zip(model.nodes, self.operands):
            with _naming_node(model, node):
                if _reads_run_sized(ins):
                    steps.append(_bound_at_run(model, node, ins, outs))
                else:
                    steps.append(get(node.op).make(node, ins, outs, ctx.begin_node()))
        return steps

    def before_run(self):
        """Pick whether this run's splits use the pool's workers (RunChooser); True when
        the run is a trial to time and report to self.gate.after_run."""
        if not self.started:  # the first run: the way bound at init, not counted by the chooser
            self.started = True
            return False
        timed = self.gate.before_run()
        if self.single is None:
            self.pool.serial = not self.gate.concurrent
        elif self.gate.concurrent != self.concurrent:
            self._use(self.gate.concurrent)
        return timed

    def use_chosen_way(self):
        """Switch to the set of callables the thread chooser keeps (what a profile shows)."""
        if self.single is not None:
            self._use(self.gate.splits)
            self.started = True

    def _use(self, concurrent):
        """Switch to the split (True) or the one-thread (False) set of callables."""
        if self._ways[concurrent] is None:
            with collector_paused():
                self._ways[concurrent] = (self._make_steps(self.model, self.pool if concurrent else self.single), {})
        self.steps, self.subsets = self._ways[concurrent]
        self.concurrent = concurrent
        self.step_nodes = None  # the profiler's map from callables to nodes

    def _arena_view(self, t, i, layout):
        shape = layout.shapes[i]
        if i in layout.views:
            root, offset, strides = layout.views[i]
            start = layout.offsets[root] + offset
            if strides is not None:
                return np.ndarray(shape, t.dtype, buffer=self.arena, offset=start, strides=strides)
        else:
            start = layout.offsets[i]
        nbytes = math.prod(shape) * t.dtype.itemsize
        return self.arena[start : start + nbytes].view(t.dtype).reshape(shape)


# From this many multiply-adds in its conv and linear layers, a model's first run bound
# for the split way ends sooner than one bound for one thread: binding for the split
# costs a few ms more, and the split saves a share of the compute.
HEAVY_MODEL_MACS = 600_000_000


def _heavy_model(model, layout):
    """Whether the model's nodes perform at least HEAVY_MODEL_MACS multiply-adds at this
    layout's shapes, as their ops count them (registry, "Work")."""
    macs = 0
    for node in model.nodes:
        count = get(node.op).macs
        if count is not None:
            shapes = layout.shapes
            macs += count(node, [shapes[i] if i >= 0 else None for i in node.inputs], [shapes[i] for i in node.outputs])
    return macs >= HEAVY_MODEL_MACS


def _model_source(path_or_bytes):
    """What open_model takes: a path (str or os.PathLike), or the model's bytes (bytes,
    bytearray, memoryview), which onnxruntime takes as the model's content too."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return path_or_bytes
    if isinstance(path_or_bytes, str) or hasattr(path_or_bytes, "__fspath__"):
        return os.fspath(path_or_bytes)
    raise PmxInputError(
        f"InferenceSession takes a path to a .pmx file or its bytes, got {type(path_or_bytes).__name__}"
    )


def _node_arg(t, run_sized=False):
    """onnxruntime-style NodeArg: dims that may change are None."""
    shape = [d if lo == hi and not run_sized else None for d, (lo, hi) in zip(t.shape, tensor_ranges(t))]
    return NodeArg(t.name, shape, ORT_TYPE[t.dtype.name])


def _reads_run_sized(inputs):
    return any(isinstance(x, RunSized) for x in inputs)


def _bound_at_run(model, node, inputs, outputs):
    """The callable of a node reading a tensor sized at run time (registry, "Tensors
    sized at run time"): at each run its kernel is bound anew, on one thread, to the
    arrays its inputs then hold and to output arrays of the shapes its rule gives."""
    kernel = get(node.op)
    pool = parallel.Pool(1)

    def run():
        arrays = [x.value if isinstance(x, RunSized) else x for x in inputs]
        try:
            results = output_shapes(node, [a.shape for a in arrays], [a.dtype for a in arrays])
        except (ValueError, IndexError, TypeError) as e:
            raise PmxInputError(
                f"{model.path}: node {node.name[:40]!r} ({node.op}) cannot take the shapes its inputs "
                f"have at run time, {[list(a.shape) for a in arrays]}: {e}"
            ) from None
        for shape, dtype in results:
            check_run_sized(node, shape, dtype)
        values = [np.empty(shape, dtype) for shape, dtype in results]
        step = kernel.make(node, arrays, values, BindContext(pool))
        if step is not None:
            step()
        for holder, value in zip(outputs, values):
            holder.value = value

    return run


def _aligned_empty(nbytes, align=64):
    raw = np.empty(nbytes + align, np.uint8)
    shift = (-raw.ctypes.data) % align
    return raw[shift : shift + nbytes]


class InferenceSession:
    """Load a .pmx file and run it. Mirrors onnxruntime.InferenceSession.

    verify=True checks the CRC32 checksums of the whole file at load (off by default so
    load stays fast; the structural verifier always runs). The thread count is this
    InferenceSession's own: num_threads= if given, else sess_options.intra_op_num_threads if not
    0, else OMP_NUM_THREADS, else the cores this process may use (capped by its cgroup CPU
    quota). A run uses the calling
    thread and up to that many minus one worker threads of the InferenceSession's (one set per
    calling thread, sleeping while they wait); nothing process-wide changes.
    path_or_bytes is a path or the file's bytes (verified alike). providers
    other than "CPUExecutionProvider" warn, as onnxruntime warns for one it lacks (pmx
    runs on the CPU).
    """

    # layouts kept per InferenceSession (shared by threads) and bindings kept per thread
    PLAN_CACHE_SIZE = 8

    def __init__(
        self,
        path_or_bytes,
        sess_options=None,
        providers=None,
        provider_options=None,
        *,
        verify=False,
        num_threads=None,
        max_arena_bytes=DEFAULT_MAX_ARENA_BYTES,
        plan_cache_size=PLAN_CACHE_SIZE,
        disabled_optimizers=None,
    ):
        self._model = open_model(_model_source(path_or_bytes), verify_checksum=verify, max_arena_bytes=max_arena_bytes)
        compat.check_providers(providers)
        self._options = sess_options if sess_options is not None else SessionOptions()
        self._num_threads = resolve_thread_count(sess_options, num_threads)
        m = self._model
        self._inputs = [_node_arg(m.tensors[i]) for i in m.inputs]
        # outputs whose length is known only when their node runs (masked_select, arange of values)
        self._run_sized = m.run_sized
        self._outputs = [_node_arg(m.tensors[i], i in self._run_sized) for i in m.outputs]
        self._input_index = {m.tensors[i].name: i for i in m.inputs}
        self._input_ranges = {i: tensor_ranges(m.tensors[i]) for i in m.inputs}
        self._fetchable = {m.tensors[i].name: i for i in m.outputs + m.kept}
        self._local = threading.local()
        self._max_arena_bytes = max_arena_bytes
        self._reopen_with = {
            "verify": verify,
            "num_threads": num_threads,
            "max_arena_bytes": max_arena_bytes,
            "plan_cache_size": plan_cache_size,
        }  # for __reduce__
        self._reopen_path = os.path.abspath(self._model.path)
        self._cache_size = max(1, int(plan_cache_size))
        self._compiled_key = tuple(m.tensors[i].shape for i in m.inputs)
        self._layouts = collections.OrderedDict({self._compiled_key: compiled_layout(m)})
        self._layouts_lock = threading.Lock()
        self.plans_built = 0  # layouts planned at run time (inputs of other shapes)
        self._profiler = compat.Profiler(self._options.profile_file_prefix) if self._options.enable_profiling else None
        self._profiling_start_ns = self._profiler.start_ns if self._profiler is not None else 0
        self._batch_chunk_rows = batch_chunks.chunk_rows_option(self._options)
        self._rows_apart = {}  # (inner input shapes, wanted outputs) -> whether rows stay apart
        self._async = None  # run_async's executor, made on first use
        self._chunks = None  # the executor running a batch's chunks at once, made on first use
        self._async_lock = threading.Lock()

    # --- metadata -------------------------------------------------------------------

    def get_inputs(self):
        return list(self._inputs)

    def get_outputs(self):
        return list(self._outputs)

    def get_session_options(self):
        """A copy of the options this InferenceSession runs with; intra_op_num_threads is the
        resolved count (never 0), so callers can see what the default came to."""
        options = copy.copy(self._options)
        options._config = dict(self._options._config)
        options.intra_op_num_threads = self._num_threads
        return options

    def __reduce__(self):
        """Pickle by path: the absolute path, the options and the constructor's keywords (so
        Ray, Dask and process pools can ship an InferenceSession); unpickling reopens and re-verifies
        the file, which must exist at that path on the receiving machine, and resolves a
        default thread count there. An InferenceSession opened from the model's bytes pickles them."""
        m = self._model
        source = m._map if isinstance(m._map, (bytes, bytearray)) else self._reopen_path
        identity = (m.file_size, m.preamble["header_crc"], m.preamble["data_crc"])
        return _reopen_session, (source, self._options, self._reopen_with, identity)

    def get_providers(self):
        return [compat.CPU_PROVIDER]

    def get_provider_options(self):
        return {compat.CPU_PROVIDER: {}}

    def set_providers(self, providers=None, provider_options=None):
        """Warns for any provider but the CPU one, as __init__ does; pmx runs on the CPU."""
        compat.check_providers(providers)

    def get_overridable_initializers(self):
        """None: a .pmx file's weights are constants of the compiled graph (compile again to
        change them), so there are no initializers to feed."""
        return []

    def get_profiling_start_time_ns(self):
        """When profiling started, in nanoseconds since the epoch, after end_profiling too
        (as onnxruntime); 0 without profiling."""
        return self._profiling_start_ns

    def io_binding(self):
        return compat.IOBinding(self)

    def run_with_iobinding(self, iobinding, run_options=None):
        iobinding.run(run_options)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        """run() over {input name: OrtValue}, returning a list of OrtValue, as onnxruntime."""
        feed = {name: value.numpy() for name, value in input_dict_ort_values.items()}
        return [compat.OrtValue(a) for a in self.run(output_names, feed, run_options)]

    def run_with_ortvaluevector(self, run_options, feed_names, feeds, fetch_names, fetches, fetch_devices=None):
        """onnxruntime's lowest-level run: `feeds` (OrtValues) by `feed_names`; `fetches`, a
        list, is filled with one OrtValue per name in `fetch_names` (onnxruntime fills its
        OrtValueVector in place). fetch_devices: CPU only."""
        for device in fetch_devices or ():
            compat.check_cpu(device)
        values = self.run_with_ort_values(list(fetch_names), dict(zip(feed_names, feeds)), run_options)
        fetches[:] = values

    def get_modelmeta(self):
        """onnxruntime's ModelMetadata: producer "pmx", graph name, and the user metadata
        stored with `pmx compile --meta KEY=VALUE` as custom_metadata_map."""
        return compat.model_metadata(self._model)

    def end_profiling(self):
        """With SessionOptions.enable_profiling: write the runs profiled so far as a Chrome
        trace to <profile_file_prefix>_<time>.json, stop profiling, return the path
        ("" when profiling is off), as onnxruntime does."""
        profiler, self._profiler = self._profiler, None
        return profiler.write() if profiler is not None else ""

    @property
    def model(self):
        return self._model

    # --- running --------------------------------------------------------------------

    def _pool(self):
        """This thread's worker pool (made on its first run, gone with the thread). Kernels
        split GEMMs over it only while BLAS runs on one thread (parallel.Pool), so when
        BLAS's thread count has moved across that line since (threadpoolctl limits around
        some runs), this thread's pool and bindings are made anew."""
        pool = getattr(self._local, "pool", None)
        if pool is not None and pool.threads > 1 and pool.splits_gemms != (blas.threads() == 1):
            pool = self._local.pool = self._local.bindings = None
        if pool is None:
            pool = self._local.pool = parallel.Pool(self._num_threads)
        return pool

    def _binding(self, key=None):
        """This thread's binding for the input shapes `key` (None: the compiled ones)."""
        key = self._compiled_key if key is None else key
        self._pool()
        cache = getattr(self._local, "bindings", None)
        if cache is None:
            cache = self._local.bindings = collections.OrderedDict()
        b = cache.get(key)
        if b is not None:
            cache.move_to_end(key)
            return b
        layout = self._layout(key)
        try:
            with collector_paused():
                b = _Binding(
                    self._model,
                    layout,
                    self._max_arena_bytes,
                    self._pool(),
                    self._run_sized,
                    self._options.use_deterministic_compute,
                )
        except PmxError:
            raise
        except MemoryError:
            raise PmxResourceError(f"{self._model.path}: cannot allocate the {layout.arena_size}-byte arena") from None
        except Exception as e:  # views the verifier let through but numpy refuses
            raise internal_error(self._model.path, None, "bind", e) from e
        cache[key] = b
        while len(cache) > self._cache_size:
            cache.popitem(last=False)
        return b

    def _layout(self, key):
        """Layout for input shapes `key`: stored in the file for the compiled shapes,
        otherwise planned once (shape rules + the same arena planner) and cached (LRU)."""
        with self._layouts_lock:
            layout = self._layouts.get(key)
            if layout is not None:
                self._layouts.move_to_end(key)
                return layout
        m = self._model
        try:
            shapes = infer_shapes(m, dict(zip(m.inputs, key)))
        except PmxInputError as e:
            given = ", ".join(f"{m.tensors[i].name} {list(s)}" for i, s in zip(m.inputs, key))
            allowed = ", ".join(
                f"{a.name} {format_ranges(self._input_ranges[i])}" for a, i in zip(self._inputs, m.inputs)
            )
            raise PmxInputError(
                f"input shapes {given} are not allowed by this model (allowed: {allowed}): {e}"
            ) from None
        layout = plan_layout(m, shapes)
        if layout.arena_size > self._max_arena_bytes:
            raise PmxResourceError(
                f"input shapes {[list(k) for k in key]} need a {layout.arena_size}-byte arena, "
                f"over the limit of {self._max_arena_bytes} (max_arena_bytes)"
            )
        with self._layouts_lock:
            self._layouts[key] = layout
            self.plans_built += 1
            while len(self._layouts) > self._cache_size:
                oldest = next(iter(self._layouts))
                if oldest == self._compiled_key:
                    self._layouts.move_to_end(oldest)
                    oldest = next(iter(self._layouts))
                del self._layouts[oldest]
        return layout

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
                        f"(convert with .astype(np.{t.dtype.name}))"
                    )
                arr = value
            else:
                try:
                    arr = np.asarray(value, dtype=t.dtype)
                except (ValueError, TypeError) as e:
                    raise PmxInputError(
                        f"input {name!r}: cannot convert {type(value).__name__} to {t.dtype.name}: {e}"
                    ) from None
            ranges = self._input_ranges[self._input_index[name]]
            if not shape_allowed(arr.shape, ranges):
                raise PmxInputError(f"input {name!r}: expected shape {format_ranges(ranges)}, got {list(arr.shape)}")
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
        name). With run_options (a RunOptions), the run checks run_options.terminate
        before each node and raises PmxRunTerminated once it is set."""
        arrays, wanted = self._prepare(output_names, input_feed)
        return self._run_checked(arrays, wanted, compat.check_run_options(run_options))

    def run_into(self, output_names, input_feed, outputs=None, run_options=None):
        """run(), writing each output into the array given for it in `outputs` (None
        entries, or outputs None: new arrays): what IOBinding's bound outputs use, saving
        the copy out. Returns the arrays written."""
        arrays, wanted = self._prepare(output_names, input_feed)
        return self._run_checked(arrays, wanted, compat.check_run_options(run_options), outputs)

    def run_async(self, output_names, input_feed, callback=None, user_data=None, run_options=None):
        """onnxruntime's run_async: the run happens on a thread of this InferenceSession's
        (one, so async runs queue in order), then callback(outputs, user_data, error) is
        called there, error "" on success (the message otherwise, outputs None). pmx also
        takes no callback: then it returns a concurrent.futures.Future of the outputs
        (`await asyncio.wrap_future(sess.run_async(None, feed))` in asyncio)."""
        compat.check_run_options(run_options)
        return callback_or_future(
            self._executor().submit(self.run, output_names, input_feed, run_options), callback, user_data
        )

    def _executor(self):
        with self._async_lock:
            if self._async is None:
                self._async = _futures().ThreadPoolExecutor(1, thread_name_prefix="pmx-async")
                weakref.finalize(self, self._async.shutdown, wait=False)
            return self._async

    def _run_steps(self, binding, wanted, run_options, watch=None):
        """A run of the steps `wanted` needs: the run loop, with `watch` (or the session's
        profiler, when profiling is on) watching, and the whole run timed for the thread
        chooser."""
        timed = binding.before_run()
        start = time.perf_counter() if timed else 0.0
        profiler = self._profiler if watch is None else None
        if profiler is not None:
            watch = self._profiling_watch(binding, profiler)
        self._loop(binding, self._steps_for(binding, wanted), run_options, watch)
        if profiler is not None:
            profiler.run(watch.start, time.perf_counter())
        if timed:
            binding.gate.after_run(time.perf_counter() - start)

    def _loop(self, binding, steps, run_options=None, watch=None):
        """The one run loop: each step in order; with run_options, terminate is checked
        before each step; with `watch`, watch(step, t0, t1) is called after each step with
        its start and end times (profiling, kernel timing). Unwatched and without
        run_options it is a bare loop. Whatever a step raises leaves as a PmxError
        naming its node."""
        step = None
        try:
            with np.errstate(all="ignore"):
                if watch is None and run_options is None:
                    for step in steps:
                        step()
                else:
                    clock = time.perf_counter
                    for step in steps:
                        if run_options is not None and run_options.terminate:
                            raise _terminated(run_options)
                        t0 = clock()
                        step()
                        if watch is not None:
                            watch(step, t0, clock())
        except PmxError:
            raise
        except MemoryError:
            raise PmxResourceError(f"{self._model.path}: out of memory in {self._describe(binding, step)}") from None
        except Exception as e:  # only PmxError subclasses leave run()
            raise internal_error(self._model.path, self._node_of(binding, step), "run", e) from e

    def _profiling_watch(self, binding, profiler):
        """A watch for _loop recording each node into `profiler` (SessionOptions.enable_profiling)."""
        nodes = binding.step_nodes
        if nodes is None:
            nodes = binding.step_nodes = {id(fn): node for fn, node in zip(binding.steps, self._model.nodes)}
        shapes = binding.layout.shapes

        def watch(step, t0, t1):
            node = nodes[id(step)]
            profiler.node(node, t0, t1, [list(shapes[i]) for i in node.outputs])

        watch.start = time.perf_counter()
        return watch

    def _prepare(self, output_names, input_feed):
        """(checked inputs {tensor index: array}, wanted output tensors) for a run."""
        if input_feed is None:
            input_feed = {}
        arrays = self._check_feed(input_feed)
        return arrays, self._wanted_outputs(output_names)

    def _bind_checked(self, arrays):
        """The calling thread's binding for these inputs ({tensor index: array}, already
        checked by _check_feed), with the inputs copied in."""
        binding = self._binding_of(arrays)
        for i, arr in arrays.items():
            np.copyto(binding.views[i], arr)
        return binding

    def _binding_of(self, arrays):
        """The calling thread's binding for the shapes of these checked inputs."""
        return self._binding(tuple(arrays[i].shape for i in self._model.inputs))

    def _run_checked(self, arrays, wanted, run_options=None, outputs=None, watch=None):
        """run() for inputs _check_feed passed and output indices _wanted_outputs gave
        (what BatchingSession runs, having checked each request when it was queued),
        writing into `outputs` as run_into does. A batch larger than a chunk runs in
        chunks of rows where the graph keeps rows apart (runtime/batch_chunks.py)."""
        plan = self._chunk_plan(arrays, wanted)
        if plan is not None:
            return self._run_in_chunks(arrays, wanted, run_options, plan, outputs, watch)
        binding = self._bind_checked(arrays)
        self._run_steps(binding, wanted, run_options, watch)
        return self._outputs_of(binding, wanted, outputs)

    def _outputs_of(self, binding, wanted, outputs=None):
        """The wanted outputs copied out of the binding, into `outputs` where given."""
        dests = outputs or [None] * len(wanted)
        run_sized = self._run_sized
        return [
            self._written(i, binding.views[i].value if i in run_sized else binding.views[i], dest)
            for i, dest in zip(wanted, dests)
        ]

    def _written(self, i, value, dest):
        """`value` copied into `dest` (a new array when dest is None), checked to fit."""
        if dest is None:
            return np.array(value, copy=True)
        np.copyto(self._output_array(i, value.shape, value.dtype, dest), value)
        return dest

    def _output_array(self, i, shape, dtype, dest):
        """`dest`, checked to fit output `i` of this shape and dtype, or a new array."""
        if dest is None:
            return np.empty(shape, dtype)
        if dest.shape != tuple(shape) or dest.dtype != dtype:
            raise PmxInputError(
                f"bound output {self._model.tensors[i].name!r}: expected "
                f"{dtype.name} {list(shape)}, got {dest.dtype.name} {list(dest.shape)}"
            )
        return dest

    def _chunk_plan(self, arrays, wanted):
        """How a run of these checked inputs goes through the graph: None to run them
        whole, else (bounds, parallel): the (start, stop) rows of each chunk, and whether
        the chunks run on the session's threads at once, each bound for one thread
        (runtime/batch_chunks.py)."""
        rows = batch_chunks.batch_rows(arrays)
        most = self._batch_chunk_rows
        if not most or rows is None or rows < 2:
            return None
        # images shared out, each thread running whole chunks: only where the BLAS pmx
        # calls runs on one thread, as split GEMMs require (parallel.Pool.splits_gemms)
        parallel = self._num_threads > 1 and blas.threads() == 1
        chunk_rows = min(most, -(-rows // self._num_threads)) if parallel else most
        # the fewest rows dim 0 takes: a chunk below it would run a shape the file refuses
        least = max(self._input_ranges[i][0][0] for i in self._model.inputs)
        if not least <= chunk_rows < rows or not self._keeps_rows_apart(arrays, wanted):
            return None
        bounds = batch_chunks.chunks(rows, chunk_rows, least)
        return (bounds, parallel) if len(bounds) > 1 else None

    def _keeps_rows_apart(self, arrays, wanted):
        key = (tuple(arrays[i].shape[1:] for i in self._model.inputs), tuple(wanted))
        apart = self._rows_apart.get(key)
        if apart is None:
            inner = {i: arrays[i].shape[1:] for i in self._model.inputs}
            apart = batch_chunks.rows_apart(self._model, inner, wanted, self._run_sized) is None
            self._rows_apart[key] = apart
        return apart

    def _first_chunk(self, arrays):
        """(inputs of the first binding a run of `arrays` uses, whether it runs on a chunk
        thread): the first chunk when the batch runs in chunks."""
        plan = self._chunk_plan(arrays, self._model.outputs)
        if plan is None:
            return arrays, False
        (start, stop), parallel = plan[0][0], plan[1]
        return {i: arr[start:stop] for i, arr in arrays.items()}, parallel

    def _run_in_chunks(self, arrays, wanted, run_options, plan, outputs, watch=None):
        """The run of a batch as chunks of rows, each through the binding for its shapes
        (of the thread that runs it), each writing its rows of every output. Watched runs
        (profiling the kernels) run the chunks on the calling thread, one after another."""
        bounds, parallel = plan
        rows = bounds[-1][1]
        first = tuple(arrays[i][bounds[0][0] : bounds[0][1]].shape for i in self._model.inputs)
        shapes = self._layout(first).shapes
        dests = outputs or [None] * len(wanted)
        results = [
            self._output_array(i, (rows, *shapes[i][1:]), self._model.tensors[i].dtype, dest)
            for i, dest in zip(wanted, dests)
        ]

        def run_chunk(start, stop):
            binding = self._bind_checked({i: arr[start:stop] for i, arr in arrays.items()})
            self._run_steps(binding, wanted, run_options, watch)
            for result, i in zip(results, wanted):
                result[start:stop] = binding.views[i]

        if parallel and watch is None:
            executor = self._chunk_executor()
            futures = [executor.submit(run_chunk, start, stop) for start, stop in bounds]
            _futures().wait(futures)
            for future in futures:
                future.result()  # the first chunk's error, as the run's
        else:
            for start, stop in bounds:
                run_chunk(start, stop)
        return results

    def _chunk_executor(self):
        """The threads that run a batch's chunks at once, as many as the session's
        threads, each binding for one thread (made on first use)."""
        with self._async_lock:
            if self._chunks is None:
                self._chunks = _futures().ThreadPoolExecutor(
                    self._num_threads,
                    thread_name_prefix="pmx-chunks",
                    initializer=_bind_for_one_thread,
                    initargs=(self._local,),
                )
                weakref.finalize(self, self._chunks.shutdown, wait=False)
            return self._chunks

    def _wanted_outputs(self, output_names):
        """The tensor indices run() returns for `output_names` (None or []: every output,
        as onnxruntime)."""
        if output_names is None or (not isinstance(output_names, str) and len(output_names) == 0):
            return list(self._model.outputs)
        if isinstance(output_names, str):
            raise PmxInputError("output_names must be a list of names or None, not a string")
        wanted = []
        for name in output_names:
            if name not in self._fetchable:
                raise PmxInputError(
                    f"unknown output {name!r}; available: {list(self._fetchable)} "
                    f"(compile with --keep NAME to fetch an intermediate tensor)"
                )
            wanted.append(self._fetchable[name])
        return wanted

    def _run_timing_kernels(self, input_feed):
        """run(None, input_feed) that also returns the seconds spent inside the nodes'
        kernel callables (runtime/overhead.py): (outputs, seconds)."""
        arrays, wanted = self._prepare(None, input_feed)
        inside = [0.0]

        def watch(step, t0, t1):
            inside[0] += t1 - t0

        return self._run_checked(arrays, wanted, watch=watch), inside[0]

    def _describe(self, binding, step):
        """'node NAME (op)' for the step that raised (found only after an error, so the
        loop in run() stays a bare loop)."""
        node = self._node_of(binding, step)
        return f"node {node.name[:40]!r} ({node.op})" if node is not None else "a node"

    def _node_of(self, binding, step):
        """The node whose kernel callable is `step` (None if none is)."""
        for j, fn in enumerate(binding.steps):
            if fn is step:
                return self._model.nodes[j]
        return None

    def thread_choice(self, input_feed):
        """How runs of input_feed's shapes on the calling thread use the session's
        threads, as (threads, settled): the threads the next run's kernels split over (1
        where the session has one, or where it found, timing whole runs both ways, that
        one is faster on this host), and whether it has made that choice yet (it times
        both ways after about ten runs, and again from time to time). For benchmarks:
        time runs once it is settled, and report the threads. A batch whose chunks run
        on the session's threads at once uses all of them, settled."""
        arrays, on_chunk_threads = self._first_chunk(self._check_feed(input_feed))
        if on_chunk_threads:
            return self._num_threads, True
        binding = self._binding_of(arrays)
        return (binding.pool.threads if binding.gate.splits else 1), binding.gate.settled

    def profile(self, input_feed, repeat=10):
        """Per-node timings (median ms over `repeat` runs): list of dicts op, name,
        variant, fused (the epilogue run after the kernel, or an elementwise node's
        expression), in_shapes, out_shapes, ms; sorted by time. A batch that runs in
        chunks of rows is profiled on its first chunk (the shapes say so), on a chunk
        thread when chunks run on the session's threads at once."""
        arrays, on_chunk_threads = self._first_chunk(self._check_feed(input_feed))
        if on_chunk_threads:
            return self._chunk_executor().submit(self._profile, arrays, repeat).result()
        return self._profile(arrays, repeat)

    def _profile(self, arrays, repeat):
        binding = self._bind_checked(arrays)
        binding.use_chosen_way()
        m = self._model
        shapes = binding.layout.shapes
        times = [[] for _ in m.nodes]
        index = {id(fn): j for j, fn in enumerate(binding.steps) if fn is not None}

        def watch(step, t0, t1):
            times[index[id(step)]].append(t1 - t0)

        steps = [fn for fn in binding.steps if fn is not None]
        for _ in range(repeat):
            self._loop(binding, steps, watch=watch)
        rows = []
        for j, node in enumerate(m.nodes):
            ms = float(np.median(times[j])) * 1e3 if times[j] else 0.0
            in_shapes = [
                list(shapes[i]) for i in node.inputs if i >= 0 and m.tensors[i].kind != schema.TensorKind.Constant
            ]
            rows.append(
                dict(
                    op=node.op,
                    name=node.name,
                    variant=node.variant,
                    fused=E.describe_node_expr(node.op, node.expr),
                    in_shapes=in_shapes,
                    out_shapes=[list(shapes[i]) for i in node.outputs],
                    ms=ms,
                )
            )
        rows.sort(key=lambda r: -r["ms"])
        return rows


def _futures():
    """concurrent.futures, imported on first use: it brings logging, a cost every import
    of pmx.runtime that runs no batch or async run would pay (docs/performance.md,
    "Kernel measurements")."""
    import concurrent.futures

    return concurrent.futures


def _bind_for_one_thread(local):
    """A chunk thread's start: its bindings are bound for one thread (no split parts)."""
    local.pool = parallel.Pool(1)


def callback_or_future(future, callback, user_data):
    """run_async's two ways to answer: the Future itself without a callback; else None,
    and callback(outputs, user_data, error) once it is done (error "" on success, the
    message otherwise, outputs None), as onnxruntime calls it."""
    if callback is None:
        return future

    def report(done):
        error = done.exception()
        callback(None if error else done.result(), user_data, "" if error is None else f"{error}")

    future.add_done_callback(report)
    return None


def _terminated(run_options):
    name = run_options.run_tag or run_options.logid
    tag = f" {name!r}" if name else ""
    return PmxRunTerminated(f"run{tag} terminated: its RunOptions.terminate was set")


def _reopen_session(source, sess_options, kwargs, identity):
    """Unpickle an InferenceSession: reopen the file, check it is the one that was pickled."""
    if isinstance(source, str) and not os.path.isfile(source):
        raise PmxInputError(
            f"{source}: cannot reopen the pickled session: the .pmx must exist at that path on the "
            f"receiving machine (copy it there, or to shared storage at the same path)"
        )
    sess = InferenceSession(source, sess_options, **kwargs)
    m = sess._model
    found = (m.file_size, m.preamble["header_crc"], m.preamble["data_crc"])
    if found != tuple(identity):
        raise PmxInputError(
            f"{source}: cannot reopen the pickled session: the file at that path on this machine is "
            f"not the one that was pickled (size and checksums {found}, expected {tuple(identity)})"
        )
    return sess
