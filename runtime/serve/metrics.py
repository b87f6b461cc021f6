"""Prometheus metrics of `pmx serve`, one set per server.

With several worker processes the metrics are those of the whole server, not of the
worker that answers the scrape: prometheus_client's multiprocess mode, where each worker
writes its values to files in a directory the parent process makes (and removes at exit)
and a scrape adds them up. The directory's path reaches prometheus_client through the
PROMETHEUS_MULTIPROC_DIR variable, set in each worker process before prometheus_client is
imported there (see server.py); the parent's environment is not touched.
"""

from __future__ import annotations

import os

# seconds from a request's arrival at the handler to its response being ready
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# the model label of requests naming no served model: not the name they gave, so a client
# cannot grow the number of series without bound (model names cannot contain parentheses)
UNKNOWN_MODEL = "(unknown)"
MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


class Metrics:
    """The server's metrics. multiprocess: values go to the directory named by
    PROMETHEUS_MULTIPROC_DIR, which must be set before prometheus_client is first imported."""

    def __init__(self, model_names, multiprocess=False):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.multiprocess = multiprocess
        if multiprocess and not os.environ.get(MULTIPROCESS_DIR_VARIABLE):
            raise RuntimeError(f"multiprocess metrics need {MULTIPROCESS_DIR_VARIABLE} set in this process")
        # multiprocess: unregistered metrics still write their files; each scrape collects them
        registry = None if multiprocess else CollectorRegistry()
        self.registry = registry
        self.requests = Counter(
            "pmx_inference_requests", "Inference requests answered, by model", ["model"], registry=registry
        )
        self.errors = Counter(
            "pmx_inference_errors",
            "Inference requests answered with an error, by model and HTTP status",
            ["model", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "pmx_inference_request_seconds",
            "Seconds from an inference request's arrival to its response, body upload included",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "pmx_inference_batch_size",
            "Rows (dim 0) of each model run: a batch of requests, or one request run alone",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "pmx_inference_queue_depth",
            "Inference requests handed to the model and not yet answered by it (waiting or running)",
            ["model"],
            multiprocess_mode="livesum",
            registry=registry,
        )
        for name in model_names:  # series at zero from the start, for dashboards and rate()
            self.requests.labels(name)
            self.latency.labels(name)
            self.batch_size.labels(name)
            self.queue_depth.labels(name)

    def observe_request(self, model, status, seconds):
        self.requests.labels(model).inc()
        if status >= 400:
            self.errors.labels(model, str(status)).inc()
        self.latency.labels(model).observe(seconds)

    def batch_observer(self, model):
        """on_run(rows) for the model's session: runs on the batching thread."""
        histogram = self.batch_size.labels(model)
        return histogram.observe

    def exposition(self):
        """(body, content type) of GET /metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        if not self.multiprocess:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST


def forget_worker(pid, directory):
    """A worker process has exited: drop its live gauges (queue depth) from the sums."""
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, directory)
