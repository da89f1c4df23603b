"""Reading a Prometheus ``/metrics`` endpoint from outside: samples by name, rates between two reads.

What ``zmq-rollout top`` sees of the broker and the workers. Nothing here raises on a bad
endpoint: one that does not answer, or answers with something that is not the text format,
is a ``Scrape`` with an ``error``, and every lookup in it finds nothing.
"""

from __future__ import annotations

import http.client
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Labels = dict[str, str]


@dataclass(frozen=True)
class Scrape:
    """One read of a ``/metrics`` endpoint: its samples by sample name (a counter's with its
    ``_total``, a histogram's ``_sum`` and ``_count``), or what went wrong."""

    url: str
    at: float
    """``time.monotonic()`` when it was read."""
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)
    error: str = ""

    def find(self, name: str, **labels: str) -> list[tuple[Labels, float]]:
        """The samples of ``name`` that carry ``labels`` (and maybe others)."""
        return [(ls, v) for ls, v in self.samples.get(name, ()) if all(ls.get(k) == w for k, w in labels.items())]

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of the samples of ``name`` that carry ``labels``; None if there are none."""
        found = self.find(name, **labels)
        return sum(v for _, v in found) if found else None

    def first(self, names: Sequence[str], **labels: str) -> float | None:
        """The largest sample of the first of ``names`` that has one carrying ``labels``."""
        for name in names:
            found = self.find(name, **labels)
            if found:
                return max(v for _, v in found)
        return None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The samples of ``name`` summed by the value of ``label``."""
        out: dict[str, float] = {}
        for ls, v in self.samples.get(name, ()):
            if label in ls:
                out[ls[label]] = out.get(ls[label], 0.0) + v
        return out

    def label_values(self, keys: Iterable[str]) -> dict[str, str]:
        """Each value that any sample has under one of ``keys``, with the key it is under."""
        keys = tuple(keys)
        return {ls[k]: k for rows in self.samples.values() for ls, _ in rows for k in keys if k in ls}


def parse_metrics(url: str, text: str, at: float) -> Scrape:
    """The Prometheus text format into a ``Scrape``; text it cannot parse is an error, not a raise."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[Labels, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except Exception as exc:  # the parser raises several kinds; a bad endpoint must not end the caller
        return Scrape(url, at, error=f"cannot parse it: {exc}")
    return Scrape(url, at, samples)


def fetch_metrics(url: str, timeout_s: float) -> Scrape:
    """Read one endpoint; one that does not answer within ``timeout_s`` is a ``Scrape`` with an error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return Scrape(url, time.monotonic(), error=str(getattr(exc, "reason", None) or exc))
    return parse_metrics(url, text, time.monotonic())


def _apart(now: Scrape | None, before: Scrape | None) -> tuple[Scrape, Scrape] | None:
    """The two reads, if both are good and ``now`` is the later one."""
    if now is None or before is None or now.error or before.error or now.at <= before.at:
        return None
    return now, before


def rate(now: Scrape | None, before: Scrape | None, names: str | Sequence[str], **labels: str) -> float | None:
    """Per second, of a counter between two reads of one endpoint (the first of ``names`` found
    in both); None without two good reads, or across a counter reset (a restarted process)."""
    pair = _apart(now, before)
    if pair is None:
        return None
    later, earlier = pair
    for name in (names,) if isinstance(names, str) else names:
        a, b = earlier.total(name, **labels), later.total(name, **labels)
        if a is not None and b is not None:
            return (b - a) / (later.at - earlier.at) if b >= a else None
    return None


def histogram_mean(now: Scrape | None, name: str, before: Scrape | None = None) -> float | None:
    """The mean of histogram ``name``'s observations: all of them, or, given the read ``before``,
    those made since; None if there are none (or no good reads)."""
    if now is None or now.error:
        return None
    total, count = now.total(name + "_sum"), now.total(name + "_count")
    if before is not None:
        pair = _apart(now, before)
        if pair is None:
            return None
        total0, count0 = before.total(name + "_sum") or 0.0, before.total(name + "_count") or 0.0
        if total is None or count is None or count <= count0 or total < total0:
            return None
        return (total - total0) / (count - count0)
    return total / count if total is not None and count else None
