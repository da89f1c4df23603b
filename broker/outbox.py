"""Messages the scheduler wants sent, coalesced per destination and command.

Items for the same peer and command within one pass of the broker loop go out as one
message (a list body), which is what makes the broker's batching free: a worker that
finishes 64 jobs in one read gets its next 64 jobs in one JOBS message.
"""

from __future__ import annotations

from typing import Any

from zmq_rollout import protocol as p

CLIENT = 0
WORKER = 1

# Commands whose body is a single object rather than a list of items.
_SINGLE = frozenset({p.HEARTBEAT, p.DISCONNECT, p.STATUS_REPLY, p.CONTROL})


class Outbox:
    def __init__(self) -> None:
        self._pending: dict[tuple[int, bytes, bytes], Any] = {}

    def _put(self, side: int, identity: bytes, command: bytes, item: Any) -> None:
        key = (side, identity, command)
        if command in _SINGLE:
            self._pending[key] = item
            return
        items = self._pending.get(key)
        if items is None:
            self._pending[key] = [item]
        else:
            items.append(item)

    def to_client(self, identity: bytes, command: bytes, item: Any) -> None:
        self._put(CLIENT, identity, command, item)

    def to_client_many(self, identity: bytes, command: bytes, items: list[Any]) -> None:
        key = (CLIENT, identity, command)
        existing = self._pending.get(key)
        if existing is None:
            self._pending[key] = list(items)
        else:
            existing.extend(items)

    def to_worker(self, identity: bytes, command: bytes, item: Any) -> None:
        self._put(WORKER, identity, command, item)

    def drain(self) -> list[tuple[int, bytes, bytes, Any]]:
        """Everything pending as ``(side, identity, command, body)``, in insertion order."""
        pending, self._pending = self._pending, {}
        return [(side, ident, cmd, body) for (side, ident, cmd), body in pending.items()]

    def __len__(self) -> int:
        return len(self._pending)
