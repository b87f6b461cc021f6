"""Predictor: an InferenceSession adapted to batch engines (Ray Data's map_batches, Dask, process pools).

    ds.map_batches(Predictor, fn_constructor_kwargs={"path": "/models/cnn.pmx"},
                   compute=ray.data.ActorPoolStrategy(size=2), batch_size=64, num_cpus=1)

A Predictor takes a batch as {column name: array with one row per item} and returns
{output name: array with one row per item}, whatever the batch size and whatever batch
size the model was compiled for. It pickles by path, like the InferenceSession it holds.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from pmx.runtime.dtypes import ORT_TYPE
from pmx.runtime.errors import PmxInputError
from pmx.runtime.session import InferenceSession

_NUMPY_DTYPE = {ort: np.dtype(name) for name, ort in ORT_TYPE.items()}

_shared = {}
_shared_lock = threading.Lock()


class Predictor:
    """Run a .pmx model over batches of any size: `predictor(batch) -> {output: array}`.

    path: the .pmx file (or its bytes), opened once, when the Predictor is made; or an
        open InferenceSession to use.
    outputs: the output names to return (default: all of the model's outputs).
    sess_options: SessionOptions for the InferenceSession; its intra_op_num_threads (0 = default:
        OMP_NUM_THREADS, which Ray sets to an actor's num_cpus and Dask's nanny to 1, else
        the process's cores) is resolved in the process that opens the file.
    columns: {column name: model input name} when the dataset's columns are named
        otherwise (default: every input reads the column of its own name). Other columns
        of the batch are ignored.
    max_batch: the most rows one run gets when dim 0 of the inputs is dynamic (default:
        the whole batch in one run, which the InferenceSession runs in chunks of rows
        where the graph keeps rows apart; set it to bound the arena of a graph that does
        not, which grows with the rows).
    verify, num_threads: passed to InferenceSession.

    Batch dim: where the model's inputs have a fixed dim 0 (k), the batch is run k rows
    at a time and the outputs are concatenated, so a batch must hold a multiple of k rows
    (otherwise PmxInputError); where it is dynamic the batch runs whole (or max_batch rows
    at a time). An empty batch gives empty outputs.

    Column types: arrays follow the InferenceSession's rule, as onnxruntime's: an array of another
    dtype is refused with the conversion to make, since a silent float64 -> float32 cast
    can hide a bug. A list, or an object array with one array or list per row (what Ray
    hands over for columns it could not store as a tensor), is stacked into one array of
    the input's dtype; rows that are arrays must already have that dtype.

    Pickling stores the path and settings; the receiving process reopens the file (which
    must exist at that path there). Predictor.shared() returns one Predictor per process
    for the same settings, for engines that call a function per batch (Dask).
    """

    def __init__(
        self, path, outputs=None, sess_options=None, columns=None, *, max_batch=None, verify=False, num_threads=None
    ):
        if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
            raise PmxInputError(f"max_batch must be an integer >= 1 or None, got {max_batch!r}")
        if isinstance(path, InferenceSession):
            if sess_options is not None or verify or num_threads is not None:
                raise PmxInputError(
                    "sess_options, verify and num_threads belong to the InferenceSession: give them to "
                    "InferenceSession, or give Predictor the path"
                )
            self.session = path
        else:
            self.session = InferenceSession(path, sess_options, verify=verify, num_threads=num_threads)
        self._args = {"outputs": outputs, "columns": columns, "max_batch": max_batch}
        inputs = self.session.get_inputs()
        names = [a.name for a in inputs]
        self.columns = _column_map(columns, names)
        self.outputs = _output_names(outputs, [o.name for o in self.session.get_outputs()])
        self.max_batch = max_batch
        self._dtypes = {a.name: _NUMPY_DTYPE[a.type] for a in inputs}
        self._step = _batch_step(inputs, self.session.model.path)
        self._out_args = {o.name: o for o in self.session.get_outputs()}

    def __reduce__(self):
        return _rebuild, (self.session, self._args)  # the InferenceSession pickles by path

    @classmethod
    def shared(cls, path, outputs=None, sess_options=None, columns=None, **kwargs):
        """The Predictor of this process for these arguments, made at the first call: a
        function that Dask (or a process pool) runs per batch opens the file once per
        worker process instead of once per batch. Kept until the process ends."""
        if isinstance(path, str) or hasattr(path, "__fspath__"):
            source = os.path.abspath(path)
        else:
            source = (
                bytes(path) if isinstance(path, (bytes, bytearray, memoryview)) else path
            )  # an InferenceSession: itself
        key = (
            cls,
            source,
            None if outputs is None else tuple(outputs),
            _options_key(sess_options),
            None if columns is None else tuple(sorted(columns.items())),
            tuple(sorted(kwargs.items())),
        )
        with _shared_lock:
            p = _shared.get(key)
            if p is None:
                p = _shared[key] = cls(path, outputs, sess_options, columns, **kwargs)
        return p

    def __call__(self, batch):
        if not isinstance(batch, dict):
            raise PmxInputError(
                f"a Predictor takes a dict of column name -> array (Ray Data: batch_format='numpy'), "
                f"got {type(batch).__name__}"
            )
        feed = {name: self._column(batch, column, name) for column, name in self.columns.items()}
        scalars = [c for c, n in self.columns.items() if feed[n].ndim == 0]
        if scalars:
            raise PmxInputError(f"column(s) {scalars} hold a single value: a batch column has one row per item")
        rows = {len(a) for a in feed.values()}
        if len(rows) > 1:
            raise PmxInputError(
                f"the batch's columns have different numbers of rows: "
                f"{ {c: len(feed[n]) for c, n in self.columns.items()} }"
            )
        n = rows.pop()
        if n == 0:
            return {o: self._empty(o) for o in self.outputs}
        step = self._step or self.max_batch or n
        if self._step and n % self._step:
            raise PmxInputError(
                f"the model's batch dim (dim 0) is fixed at {self._step}: a batch must hold a multiple "
                f"of {self._step} rows, got {n} (compile it with a dynamic batch, or pick a batch_size "
                f"that is a multiple of {self._step})"
            )
        if step >= n:
            return dict(zip(self.outputs, self.session.run(self.outputs, feed)))
        parts = [
            self.session.run(self.outputs, {k: v[i : i + step] for k, v in feed.items()}) for i in range(0, n, step)
        ]
        result = {}
        for j, o in enumerate(self.outputs):
            chunks = [p[j] for p in parts]
            if any(c.ndim == 0 or len(c) != min(step, n - i * step) for i, c in enumerate(chunks)):
                raise PmxInputError(
                    f"output {o!r} has no batch dim (its dim 0 is not the rows of the run): a batch "
                    f"larger than {step} rows cannot be split for it"
                )
            result[o] = np.concatenate(chunks)
        return result

    def _column(self, batch, column, name):
        """The batch's column as an array of the input's dtype (see the class docstring)."""
        if column not in batch:
            raise PmxInputError(
                f"the batch has no column {column!r} (for model input {name!r}); its columns are "
                f"{list(batch)} (map names with Predictor(..., columns={{column: input}}))"
            )
        value, dtype = batch[column], self._dtypes[name]
        if isinstance(value, np.ndarray) and value.dtype != object:
            if value.dtype != dtype:
                raise PmxInputError(
                    f"column {column!r} (model input {name!r}): expected dtype {dtype.name}, got "
                    f"{value.dtype.name} (convert with .astype(np.{dtype.name}))"
                )
            return value
        rows = list(value) if isinstance(value, (list, tuple, np.ndarray)) else None
        if rows is None:
            raise PmxInputError(f"column {column!r}: expected an array or a list of rows, got {type(value).__name__}")
        for r in rows:
            if isinstance(r, np.ndarray) and r.dtype != dtype:
                raise PmxInputError(
                    f"column {column!r} (model input {name!r}): a row has dtype {r.dtype.name}, "
                    f"expected {dtype.name} (convert with .astype(np.{dtype.name}))"
                )
        try:
            return np.stack([np.asarray(r, dtype=dtype) for r in rows]) if rows else np.empty((0,), dtype)
        except (ValueError, TypeError) as e:
            raise PmxInputError(f"column {column!r}: cannot stack its rows into one {dtype.name} array: {e}") from None

    def _empty(self, name):
        arg = self._out_args[name]
        return np.empty((0, *[d or 0 for d in arg.shape[1:]]), _NUMPY_DTYPE[arg.type])


def _rebuild(session, args):
    return Predictor(session, **args)


def _column_map(columns, names):
    if columns is None:
        return {n: n for n in names}
    if not isinstance(columns, dict):
        raise PmxInputError(f"columns must be a dict of column name -> model input name, got {type(columns).__name__}")
    unknown = [v for v in columns.values() if v not in names]
    if unknown:
        raise PmxInputError(f"columns maps to unknown input(s) {unknown}; the model's inputs are {names}")
    mapped = dict(columns)
    for n in names:
        if n not in mapped.values():
            if n in mapped:
                raise PmxInputError(f"columns: column {n!r} feeds input {mapped[n]!r}, and input {n!r} has no column")
            mapped[n] = n
    if len(set(mapped.values())) != len(mapped):
        raise PmxInputError(f"columns: two columns feed the same input ({columns})")
    return mapped


def _output_names(outputs, names):
    if outputs is None:
        return list(names)
    if isinstance(outputs, str):
        raise PmxInputError("outputs must be a list of names or None, not a string")
    unknown = [o for o in outputs if o not in names]
    if unknown:
        raise PmxInputError(f"unknown output(s) {unknown}; the model's outputs are {names}")
    return list(outputs)


def _batch_step(inputs, path):
    """Rows per run the model requires (its fixed dim 0), or None when dim 0 is dynamic."""
    fixed = {a.name: a.shape[0] for a in inputs if a.shape and a.shape[0] is not None}
    if any(not a.shape for a in inputs):
        raise PmxInputError(
            f"{path}: input {next(a.name for a in inputs if not a.shape)!r} is a scalar: a model "
            f"without a batch dim (dim 0) on every input cannot take batches"
        )
    if len(set(fixed.values())) > 1:
        raise PmxInputError(f"{path}: the inputs' fixed batch dims differ ({fixed}): cannot split a batch for them")
    return next(iter(fixed.values()), None)


def _options_key(so):
    if so is None:
        return None
    state = so.__getstate__()
    return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in state.items()))
