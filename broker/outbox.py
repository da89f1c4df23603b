"""Messages the scheduler wants sent, coalesced per destination, in order.

Consecutive items for the same peer and command go out as one message (a list body), which
is what makes the broker's batching free: a worker that finishes 64 jobs in one read gets
its next 64 jobs in one JOBS message. Order per peer is kept exactly: a job's PARTIAL never
overtakes... its FINAL, and a JOBS never follows the CANCEL of its ticket.
"""

from __future__ import annotations

from typing import Any

from zmq_rollout.batching import append
from zmq_rollout.protocol import FINAL, SplicedFinal

CLIENT = 0
WORKER = 1


class Outbox:
    def __init__(self) -> None:
        self._peers: dict[tuple[int, bytes], list[list[Any]]] = {}
        self.finals: dict[bytes, Any] = {}
        """Per client, what ``keep_final`` gave (its FINAL list last), while that list is the
        client's last message: until ``take``, or anything else is queued for that client."""

    def _segments(self, side: int, identity: bytes) -> list[list[Any]]:
        segments = self._peers.get((side, identity))
        if segments is None:
            segments = self._peers[(side, identity)] = []
        return segments

    def _client_segments(self, identity: bytes) -> list[list[Any]]:
        """A client's segments, for something other than its kept FINAL list: that list may no
        longer be its last message, so its entry in ``finals`` goes."""
        if self.finals:
            self.finals.pop(identity, None)
        return self._segments(CLIENT, identity)

    def to_client(self, identity: bytes, command: bytes, item: Any) -> None:
        append(self._client_segments(identity), command, item)

    def to_client_many(self, identity: bytes, command: bytes, items: list[Any]) -> None:
        segments = self._client_segments(identity)
        if segments and segments[-1][0] == command:
            segments[-1][1].extend(items)
        else:
            segments.append([command, list(items)])

    def to_worker(self, identity: bytes, command: bytes, item: Any) -> None:
        append(self._segments(WORKER, identity), command, item)

    def items_to(self, side: int, identity: bytes, command: bytes) -> list[Any]:
        """The list that items of ``command`` (a list-body command) for this peer go into now:
        append to it while nothing else is sent to that peer (one dispatch pass's JOBS, one
        FINAL message's results per client), without a lookup per item."""
        segments = self._segments(side, identity)
        if not segments or segments[-1][0] != command:
            if side == CLIENT:
                self.finals.pop(identity, None)
            segments.append([command, []])
        return segments[-1][1]

    def sealed_finals_to(self, identity: bytes) -> SplicedFinal:
        """``items_to(CLIENT, identity, p.FINAL)`` for results that come sealed: a ``SplicedFinal``
        (``(job_id, sealed)`` pairs, or any result) that ``codec.encode`` writes in one copy. The
        client's last FINAL list if it is one, else a new FINAL after what is already there."""
        segments = self._segments(CLIENT, identity)
        if segments and segments[-1][0] == FINAL and type(segments[-1][1]) is SplicedFinal:
            return segments[-1][1]
        self.finals.pop(identity, None)
        out = SplicedFinal()
        segments.append([FINAL, out])
        return out

    def keep_final(self, identity: bytes, kept: tuple[Any, ...], sealed: bool) -> Any:
        """``kept`` with the client's FINAL list added as its last item (``sealed_finals_to`` with
        ``sealed``, else ``items_to``), kept in ``finals`` while that list is the client's last
        message. So one pass's FINALs, from many workers, go to a client as one message without a
        lookup of its list (and of what the caller keeps with it) per FINAL, nor per client per
        FINAL: with 8 clients, a worker's FINAL holds results for each, 8 in a row."""
        out = self.sealed_finals_to(identity) if sealed else self.items_to(CLIENT, identity, FINAL)
        part = self.finals[identity] = (*kept, out)
        return part

    def forget_final(self, identity: bytes) -> None:
        """Drop what ``keep_final`` kept for ``identity`` (its state is gone or changed)."""
        self.finals.pop(identity, None)

    def take(self) -> list[tuple[int, bytes, bytes, Any]]:
        """Everything pending as ``(side, identity, command, body)``; in order for each peer,
        workers first (their JOBS start work; a client's ACCEPTED can wait microseconds)."""
        peers, self._peers = self._peers, {}
        self.finals.clear()
        ordered = sorted(peers.items(), key=lambda kv: kv[0][0] != WORKER)
        return [(side, ident, cmd, body) for (side, ident), segments in ordered for cmd, body in segments]

    def __len__(self) -> int:
        return len(self._peers)
