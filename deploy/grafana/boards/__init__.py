"""The dashboards, by name (the file name under deploy/grafana/dashboards/; the uid is
``zmq-rollout-<name>``). ``panels`` is the vocabulary they are written in."""

from __future__ import annotations

from collections.abc import Callable

from grafana_foundation_sdk.builders import dashboard as db

from .engines import engines
from .fleet import fleet
from .latency import latency
from .weight_sync import weight_sync

DASHBOARDS: dict[str, Callable[[], db.Dashboard]] = {
    "fleet": fleet,
    "latency": latency,
    "weight-sync": weight_sync,
    "engines": engines,
}
