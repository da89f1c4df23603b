"""vLLM's own metrics (the ``vllm:`` families) on the worker's ``/metrics``, labelled by worker.

vLLM records its engine statistics (requests running and waiting, KV-cache usage, prefix-cache
queries and hits, prompt and generation tokens, time to first token, inter-token latency,
preemptions, ...) through ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``), which
registers them in prometheus_client's default ``REGISTRY``, labelled ``model_name`` and
``engine`` (the engine's index inside one ``AsyncLLM``: always 0 here, one engine per
process). The worker hands vLLM that logger (``AsyncLLM.from_engine_args(stat_loggers=...)``,
a supported argument since vLLM 0.10) while ``disable_log_stats`` stays set: vLLM then
records statistics for this logger only and prints no periodic log lines.

The worker serves its own registry; ``VllmCollector`` re-serves the ``vllm:`` families of the
default registry there with a ``worker`` label added, at scrape time: two engines on one host
(``--gpus 0,1``, one process and one port each) have the same ``model_name`` and ``engine``
and differ in ``worker``. Nothing else of the default registry (process, GC) is served.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

PREFIX = "vllm:"


def stat_loggers() -> list[Any]:
    """The ``stat_loggers`` to start ``AsyncLLM`` with: vLLM's Prometheus logger (none in a vLLM without it)."""
    try:
        from vllm.v1.metrics.loggers import PrometheusStatLogger
    except ImportError:
        return []
    return [PrometheusStatLogger]


def vllm_registry() -> CollectorRegistry:
    """Where ``PrometheusStatLogger`` registers (the default registry; vLLM's multiprocess mode,
    for several API servers over one engine, is not used by a worker)."""
    return REGISTRY


class VllmCollector:
    """The ``vllm:`` families of ``source``, each sample with ``worker`` added to its labels."""

    def __init__(self, worker: str, source: CollectorRegistry) -> None:
        self.worker = worker
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(PREFIX):
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "worker": self.worker}, s.value, s.timestamp, s.exemplar)
            yield out
