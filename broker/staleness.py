"""How old the weights behind each completed sample are, counted as results pass the broker.

The broker relays a worker's samples as raw msgpack (``ResultRelay``) and knows only the
result's ``weight_version``. Per sample, the staleness is the fleet's version minus the
sample's. A result of the version its worker had when the job was dispatched is ``n``
samples of that version, counted by the scheduler inline (the hot path: an integer add
while that is the fleet's version, else one histogram add; no decode). Only a result of
another version (a sync came while it ran) is decoded, as far as ``SampleVersions``: a
sample that carries per-token ``weight_versions`` counts with its oldest token's version
and adds its span (newest minus oldest) to ``BrokerStats.version_span``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from zmq_rollout import codec

from .stats import BrokerStats


class SampleVersions(msgspec.Struct, array_like=True, gc=False):
    """The broker's view of a ``Sample`` (same wire layout): its versions, nothing decoded else."""

    index: int
    token_ids: msgspec.Raw
    logprobs: msgspec.Raw
    finish_reason: msgspec.Raw
    top_logprobs: msgspec.Raw = msgspec.Raw(b"\xc0")
    weight_versions: list[int] | None = None
    text: msgspec.Raw = msgspec.Raw(b"\xc0")


_decoder = msgspec.msgpack.Decoder(list[SampleVersions])


def observe_crossing(stats: BrokerStats, samples: Any, num_samples: int, version: int, fleet: int) -> None:
    """Count the samples of a result whose ``version`` is not its worker's at dispatch (the
    scheduler counts the others itself). ``samples``: the raw list (``msgspec.Raw``; or
    ``Sample``s, from tests), ``num_samples`` long; ``fleet``: the fleet's version now."""
    try:
        decoded = samples if isinstance(samples, list) else _decoder.decode(samples)
    except codec.DECODE_ERRORS:  # the client finds out; count them at the result's version
        stats.staleness.observe_many(max(0, fleet - version), num_samples)
        return
    for sample in decoded:
        versions = sample.weight_versions
        oldest = version
        if versions:
            oldest = min(versions)
            stats.version_span.observe(max(versions) - oldest)
        stats.staleness.observe(max(0, fleet - oldest))


def oldest_version(samples: Any, dispatched: int) -> int:
    """The version of a crossing result's oldest token: the oldest of its samples' per-token
    versions, where each sample has them; else ``dispatched`` (its worker's version at
    dispatch: no token is older). ``samples`` as in ``observe_crossing``."""
    try:
        decoded = samples if isinstance(samples, list) else _decoder.decode(samples)
    except codec.DECODE_ERRORS:
        return dispatched
    oldest = []
    for sample in decoded:
        versions = sample.weight_versions
        if not versions:
            return dispatched
        oldest.append(min(versions))
    return max(dispatched, min(oldest)) if oldest else dispatched
