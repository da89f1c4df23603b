"""Coalescing outgoing items into as few messages as order allows (broker and worker)."""

from __future__ import annotations

from typing import Any

from zmq_rollout import protocol as p

# Commands whose body is a single object rather than a list of items.
SINGLE = frozenset({p.HEARTBEAT, p.DISCONNECT, p.STATUS_REPLY, p.CONTROL, p.SYNC_REPLY, p.CONTROL_ACK})


def append(segments: list[list[Any]], command: bytes, item: Any) -> None:
    """Add ``item`` to ``segments`` (``[command, body]`` pairs in send order), merging it into
    the last segment when that has the same command."""
    if command in SINGLE:
        if not (command == p.HEARTBEAT and segments and segments[-1][0] == command):
            segments.append([command, item])  # a second heartbeat in a row says nothing new
    elif segments and segments[-1][0] == command:
        segments[-1][1].append(item)
    else:
        segments.append([command, [item]])
