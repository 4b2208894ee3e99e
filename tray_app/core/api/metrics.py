"""Prometheus metrics for home-lab dashboards, at GET /metrics.

Counters and histograms are updated as things happen; gauges (headroom,
queues, breaker) are read from the /status snapshot when Prometheus scrapes,
so they can't go stale and can't disagree with /status. Each service gets its own registry: two services in one
process (tests, the tray) never share numbers.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..access.usage import PATHS, UsageBook

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
TPS_BUCKETS = (1, 2, 5, 10, 20, 40, 80, 160, 320)
# Fault to a replay's first token: a crash is well under a second, a hang its deadline more.
FAILOVER_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
BREAKER_STATES = ("closed", "open", "half_open")


class ServiceMetrics:
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tray_app_requests", "Admission decisions, by path and route reason",
                                ["path", "reason"], registry=self.registry)
        self.gpu_failures = Counter("tray_app_gpu_failures", "GPU worker failures seen while serving a request",
                                    ["committed"], registry=self.registry)
        self.replays = Counter("tray_app_replays", "Requests re-run once on the CPU after a GPU or peer failure",
                               registry=self.registry)
        self.resumes = Counter("tray_app_resumes", "Answers cut by a GPU failure and continued on the CPU from "
                               "their text", ["streamed"], registry=self.registry)
        self.failover_seconds = Histogram(
            "tray_app_failover_seconds", "From a GPU fault to the first token of the request's replay on the CPU",
            ["fault"], buckets=FAILOVER_BUCKETS, registry=self.registry)
        self.ttft = Histogram("tray_app_time_to_first_token_seconds", "Time to first token per path",
                              ["path"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.tokens_per_second = Histogram("tray_app_tokens_per_second", "Generation speed per path",
                                           ["path"], buckets=TPS_BUCKETS, registry=self.registry)
        # Per library model: where its requests went and how often it was
        # unloaded for another; its loads and load times are live gauges.
        self.model_requests = Counter("tray_app_model_requests", "Admission decisions per model, by path",
                                      ["model", "path"], registry=self.registry)
        self.model_evictions = Counter("tray_app_model_evictions", "GPU unloads to make room for another model",
                                       ["model"], registry=self.registry)
        self.registry.register(_LiveGauges(status))

    def count_usage(self, book: UsageBook) -> None:
        """Serve each key's (or app's) usage since the start: counters, as
        Prometheus wants them; its rate over a day is the day's use."""
        self.registry.register(_UsageCounters(book))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveGauges:
    """Gauges read from the same /status snapshot every other reader gets."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        gpu, ram = status["gpu"], status["ram"]
        known = GaugeMetricFamily("tray_app_vram_known", "1 when free VRAM can be read (0 = unknown)")
        known.add_metric([], 1.0 if gpu.get("available") else 0.0)
        yield known
        if gpu.get("free_mib") is not None and gpu.get("total_mib") is not None:
            yield _gauge("tray_app_vram_total_mib", "GPU memory in total", gpu["total_mib"])
            yield _gauge("tray_app_vram_free_mib", "GPU memory free", gpu["free_mib"])
            yield _gauge("tray_app_vram_headroom_mib", "GPU memory free above the reserve",
                         gpu["free_mib"] - gpu["reserve_mib"])
        yield _gauge("tray_app_ram_available_mib", "Host RAM available", ram["available_mib"])
        yield _gauge("tray_app_ram_headroom_mib", "Host RAM available above the CPU path's floor",
                     ram["available_mib"] - ram["floor_mib"])
        breaker = GaugeMetricFamily("tray_app_breaker_state", "1 for the breaker's current state", labels=["state"])
        for name in BREAKER_STATES:
            breaker.add_metric([name], 1.0 if name == status["breaker"]["state"] else 0.0)
        yield breaker
        degraded = GaugeMetricFamily("tray_app_degraded", "1 while the CPU serves because the GPU path can't")
        degraded.add_metric([], 1.0 if status["degraded"]["active"] else 0.0)
        yield degraded
        depth = GaugeMetricFamily("tray_app_queue_depth", "Requests waiting, per path", labels=["path"])
        age = GaugeMetricFamily("tray_app_queue_oldest_age_seconds", "Age of the oldest waiting request",
                                labels=["path"])
        running = GaugeMetricFamily("tray_app_requests_running", "Requests running, per path", labels=["path"])
        for name, lane in status["queues"].items():
            depth.add_metric([name], lane["depth"])
            age.add_metric([name], lane["oldest_age_s"])
            running.add_metric([name], lane["running"])
        yield from (depth, age, running)
        ready = GaugeMetricFamily("tray_app_worker_ready", "1 when the worker is ready", labels=["role"])
        acceptance = GaugeMetricFamily("tray_app_draft_acceptance",
                                       "Speculative decoding: accepted / drafted tokens over the last minutes",
                                       labels=["role", "type"])
        for worker in status["workers"]:
            ready.add_metric([worker["role"]], 1.0 if worker["state"] == "ready" else 0.0)
            drafts = worker.get("drafts") or {}
            if drafts.get("acceptance") is not None:
                acceptance.add_metric([worker["role"], worker["speculative"]], drafts["acceptance"])
        yield ready
        yield acceptance
        loads = GaugeMetricFamily("tray_app_model_loads", "GPU loads of each model since start", labels=["model"])
        load_s = GaugeMetricFamily("tray_app_model_last_load_seconds", "How long each model's last GPU load took",
                                   labels=["model"])
        loaded = GaugeMetricFamily("tray_app_model_loaded", "1 for where each model is loaded now",
                                   labels=["model", "location"])
        for model in status.get("models", ()):
            loads.add_metric([model["name"]], model["loads"])
            if model["last_load_s"] is not None:
                load_s.add_metric([model["name"]], model["last_load_s"])
            loaded.add_metric([model["name"], model["location"]], 1.0)
        yield from (loads, load_s, loaded)
        up = GaugeMetricFamily("tray_app_peer_up", "1 when the peer server takes requests now", labels=["peer"])
        rtt = GaugeMetricFamily("tray_app_peer_latency_ms", "The last health check's round trip to the peer",
                                labels=["peer"])
        served = GaugeMetricFamily("tray_app_peer_served", "Requests the peer answered", labels=["peer"])
        failures = GaugeMetricFamily("tray_app_peer_failures", "Requests the peer did not answer", labels=["peer"])
        for peer in status.get("peers", ()):
            up.add_metric([peer["name"]], 1.0 if peer["healthy"] else 0.0)
            if peer["latency_ms"] is not None:
                rtt.add_metric([peer["name"]], peer["latency_ms"])
            served.add_metric([peer["name"]], peer["served"])
            failures.add_metric([peer["name"]], peer["failures"])
        yield from (up, rtt, served, failures)
        executions = GaugeMetricFamily("tray_app_duplicate_executions", "Requests that completed more than once")
        executions.add_metric([], status["accounting"]["duplicate_executions"])
        yield executions


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


class _UsageCounters:
    """Usage per key since the start. The key label's values are bounded by
    the book (usage.MAX_NAMES, then "other"), the rest by fixed lists."""

    def __init__(self, book: UsageBook) -> None:
        self._book = book

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("tray_app_usage_requests", "Requests per key (or app) and the path that "
                                       "served them", labels=["key", "path"])
        tokens = CounterMetricFamily("tray_app_usage_tokens", "Tokens per key (or app), path and direction",
                                     labels=["key", "path", "direction"])
        outcomes = CounterMetricFamily("tray_app_usage_outcomes", "Requests per key (or app) that were degraded, "
                                       "refused or cancelled", labels=["key", "outcome"])
        for name, counts in sorted(self._book.since_start.items()):
            for path in PATHS:
                by_path = counts["paths"][path]
                requests.add_metric([name, path], by_path["requests"])
                tokens.add_metric([name, path, "in"], by_path["tokens_in"])
                tokens.add_metric([name, path, "out"], by_path["tokens_out"])
            for outcome in ("degraded", "refused", "cancelled"):
                outcomes.add_metric([name, outcome], counts[outcome])
        yield from (requests, tokens, outcomes)
