"""BatchingSession: concurrent requests gathered into batches, one run each.

    sess = BatchingSession("model.pmx", max_batch_size=32, max_wait_ms=2.0)
    outputs = sess.run(None, {"in0": image[None]})     # from many threads at once

Each request is a feed of its own batch (one or more rows along dim 0 of every input).
One dispatcher thread takes the oldest waiting request, waits up to max_wait_ms for more,
and runs every waiting request of the same kind (the same non-batch shapes and dtypes)
whose rows fit within max_batch_size as one InferenceSession run on the concatenated
inputs; each caller gets its own rows of every output. A request is checked against the
model before it is queued, by the InferenceSession's own check, so a bad request fails
alone, at once, with the error InferenceSession.run gives. When a batched run fails (an
input value that only the run can refuse, such as an index out of range), each request of
that batch runs alone, so only the requests that fail by themselves get the error.

Why a thread and not the callers: a small model's run is mostly Python and holds the GIL,
so several threads each running a batch of one run no faster than one thread; one run of
many rows pays the per-node costs once (README, "Serving").
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from pmx.runtime import compat
from pmx.runtime.dim_ranges import UNBOUNDED, tensor_ranges
from pmx.runtime.errors import PmxError, PmxInputError
from pmx.runtime.session import InferenceSession, _terminated, callback_or_future


def _batch_top(t):
    """The largest dim 0 tensor `t` takes (1 << 30: unbounded), or None when dim 0 cannot
    grow from 1."""
    ranges = tensor_ranges(t)
    if not ranges:
        return None
    lo, hi = ranges[0]
    if lo > 1 or (hi != UNBOUNDED and hi <= 1):
        return None
    return 1 << 30 if hi == UNBOUNDED else hi


class _Request:
    """One caller's run: its checked inputs ({tensor index: array}), the output tensor
    indices it wants, its rows along dim 0, its kind (what a batch must share) and its
    Future."""

    __slots__ = ("arrays", "future", "key", "rows", "run_options", "wanted")

    def __init__(self, arrays, wanted, rows, key, run_options):
        from concurrent.futures import Future  # on first use (it brings logging: ~3 ms of import)

        self.arrays, self.wanted, self.rows, self.key = arrays, wanted, rows, key
        self.run_options = run_options
        self.future = Future()


class BatchingSession:
    """An InferenceSession that runs concurrent requests as batches.

    model_or_session: a .pmx path (or its bytes), opened with sess_options; or an open
        InferenceSession (sess_options must then be None).
    max_batch_size: the most rows one run takes (capped at the model's largest batch); a
        request with more rows runs alone.
    max_wait_ms: how long the dispatcher waits after the oldest waiting request for others
        to join its batch (0: run whatever is waiting at once).
    on_batch: called with the rows of each run the dispatcher makes (a batch, or one
        request run alone), before it runs, on the dispatcher's thread: for metrics.

    The model's batch dim (dim 0 of every input and output) must be able to grow, else
    PmxInputError at construction naming the input and how to compile it with a dynamic
    batch. run() and run_async() take InferenceSession's arguments; run_options apply to
    one request: a request whose RunOptions.terminate is set before its batch starts
    raises PmxRunTerminated and is not run. close() (or leaving a `with` block) stops
    taking requests, runs the ones queued, and stops the dispatcher.
    """

    def __init__(self, model_or_session, max_batch_size=32, max_wait_ms=2.0, sess_options=None, on_batch=None):
        if isinstance(model_or_session, InferenceSession):
            if sess_options is not None:
                raise PmxInputError("sess_options apply to a model path; this InferenceSession is already open")
            self._session = model_or_session
        else:
            self._session = InferenceSession(model_or_session, sess_options=sess_options)
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise PmxInputError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if not isinstance(max_wait_ms, (int, float)) or isinstance(max_wait_ms, bool) or not max_wait_ms >= 0:
            raise PmxInputError(f"max_wait_ms must be a non-negative number, got {max_wait_ms!r}")
        self.max_batch_size = min(max_batch_size, self._largest_batch())
        self.max_wait_ms = float(max_wait_ms)
        self._queue = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._async = None
        self.batches_run = 0  # runs made, each of one or more requests
        self._on_batch = on_batch or (lambda rows: None)
        self._dispatcher = threading.Thread(target=self._dispatch, name="pmx-batching", daemon=True)
        self._dispatcher.start()

    # --- what the model allows ----------------------------------------------------------

    def _largest_batch(self):
        """The most rows dim 0 takes (1 << 30 when unbounded); PmxInputError naming the
        first input or output whose dim 0 cannot grow."""
        model = self._session.model
        largest = 1 << 30
        for i in model.inputs:
            t = model.tensors[i]
            top = _batch_top(t)
            if top is None:
                raise PmxInputError(
                    f"{model.path}: input {t.name!r} of shape {list(t.shape)} has a batch dim (dim 0) that "
                    f"cannot grow, so requests cannot be batched: compile the model with a dynamic batch "
                    f"(pmx compile ... --dynamic {t.name}:0), or use InferenceSession"
                )
            largest = min(largest, top)
        for i in model.outputs:
            t = model.tensors[i]
            if _batch_top(t) is None:
                raise PmxInputError(
                    f"{model.path}: output {t.name!r} of shape {list(t.shape)} does not follow the batch dim "
                    f"(dim 0), so batched outputs could not be split back: use InferenceSession"
                )
        return largest

    # --- InferenceSession's API ------------------------------------------------------------

    def get_inputs(self):
        return self._session.get_inputs()

    def get_outputs(self):
        return self._session.get_outputs()

    def get_modelmeta(self):
        return self._session.get_modelmeta()

    def get_session_options(self):
        return self._session.get_session_options()

    @property
    def session(self):
        """The InferenceSession the batches run on."""
        return self._session

    def run(self, output_names=None, input_feed=None, run_options=None):
        """InferenceSession.run for one request, run within a batch: a list of arrays, one
        per requested output, holding this request's rows."""
        return self.submit(output_names, input_feed, run_options).result()

    def run_async(self, output_names, input_feed, callback=None, user_data=None, run_options=None):
        """InferenceSession.run_async: callback(outputs, user_data, error) when the request's
        batch has run ("" on success), or a concurrent.futures.Future without a callback."""
        return callback_or_future(self.submit(output_names, input_feed, run_options), callback, user_data)

    def submit(self, output_names, input_feed, run_options=None):
        """Queue one request; a Future of its outputs. A request the model cannot take
        raises here, before it is queued."""
        request = self._request(output_names, input_feed, compat.check_run_options(run_options))
        with self._ready:
            if self._closed:
                raise PmxInputError("this BatchingSession is closed")
            self._queue.append(request)
            self._ready.notify()
        return request.future

    def close(self):
        """Stop taking requests, run those queued, stop the dispatcher."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        if threading.current_thread() is not self._dispatcher:
            self._dispatcher.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- requests ----------------------------------------------------------------------

    def _request(self, output_names, input_feed, run_options):
        session = self._session
        arrays = session._check_feed({} if input_feed is None else input_feed)
        wanted = tuple(session._wanted_outputs(output_names))
        rows = {arr.shape[0] if arr.ndim else None for arr in arrays.values()}
        if len(rows) != 1 or None in rows:
            shapes = {session.model.tensors[i].name: list(a.shape) for i, a in arrays.items()}
            raise PmxInputError(f"the inputs of one request must share their batch dim (dim 0), got {shapes}")
        key = tuple((i, a.shape[1:], a.dtype) for i, a in sorted(arrays.items()))
        return _Request(arrays, wanted, rows.pop(), key, run_options)

    # --- the dispatcher -----------------------------------------------------------------

    def _dispatch(self):
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _next_batch(self):
        """The requests of the next run: the oldest waiting one, and those of its kind that
        arrive within max_wait_ms of it and fit in max_batch_size rows. None once closed
        and drained."""
        with self._ready:
            while not self._queue:
                if self._closed:
                    return None
                self._ready.wait()
            first = self._queue[0]
            deadline = time.monotonic() + self.max_wait_ms / 1000
            while not self._closed and self._rows_of_kind(first) < self.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ready.wait(left)
            return self._take(first)

    def _rows_of_kind(self, first):
        return sum(r.rows for r in self._queue if r.key == first.key)

    def _take(self, first):
        batch, rows, kept = [], 0, collections.deque()
        for request in self._queue:
            fits = request.key == first.key and (not batch or rows + request.rows <= self.max_batch_size)
            if fits:
                batch.append(request)
                rows += request.rows
            else:
                kept.append(request)
        self._queue = kept
        return batch

    def _run(self, batch):
        batch = [r for r in batch if self._still_wanted(r)]
        if not batch:
            return
        self.batches_run += 1
        if len(batch) == 1:
            self._run_alone(batch[0])
            return
        # the requests were checked when queued; joined, they keep dtypes and non-batch
        # dims, and their rows stay within max_batch_size, which the model's range caps
        arrays = {i: np.concatenate([r.arrays[i] for r in batch]) for i in batch[0].arrays}
        fetched = list(dict.fromkeys(i for r in batch for i in r.wanted))
        total = sum(r.rows for r in batch)
        self._on_batch(total)
        try:
            outputs = dict(zip(fetched, self._session._run_checked(arrays, fetched)))
        except PmxError:
            for request in batch:  # each alone: only the requests that fail by themselves fail
                self._run_alone(request)
            return
        except BaseException as e:  # a bug: every caller hears of it rather than waiting forever
            for request in batch:
                request.future.set_exception(e)
            return
        if any(out.ndim == 0 or out.shape[0] != total for out in outputs.values()):
            for request in batch:  # an output that does not follow the batch: run each alone
                self._run_alone(request)
            return
        start = 0
        for request in batch:
            rows = slice(start, start + request.rows)
            request.future.set_result([outputs[i][rows] for i in request.wanted])
            start += request.rows

    def _still_wanted(self, request):
        """False (and the request answered) when its caller cancelled it or its RunOptions
        ask to terminate before its batch starts."""
        if not request.future.set_running_or_notify_cancel():
            return False
        options = request.run_options
        if options is not None and options.terminate:
            request.future.set_exception(_terminated(options))
            return False
        return True

    def _run_alone(self, request):
        self._on_batch(request.rows)
        try:
            outputs = self._session._run_checked(request.arrays, list(request.wanted), request.run_options)
        except BaseException as e:  # the caller's error, raised by its run() or its Future
            request.future.set_exception(e)
        else:
            request.future.set_result(outputs)
