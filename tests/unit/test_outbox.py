"""The outbox keeps a client's FINAL list (``Outbox.finals``) only while it is that client's last
message: whatever else is queued for the client drops it, so that a result read later goes
into a FINAL after that message, never before it (order per peer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from zmq_rollout import protocol as p
from zmq_rollout.broker.outbox import CLIENT, WORKER, Outbox

A, B, W = b"client-a", b"client-b", b"worker"


def kept(box: Outbox, identity: bytes = A, sealed: bool = False) -> Any:
    return box.keep_final(identity, ("state",), sealed)


def test_a_kept_final_list_is_found_until_the_outbox_is_taken() -> None:
    box = Outbox()
    part = kept(box)
    assert box.finals[A] is part and part[0] == "state"
    part[-1].append("r1")
    assert box.finals[A] is part  # results going into it keep it
    assert box.take() == [(CLIENT, A, p.FINAL, ["r1"])]
    assert A not in box.finals


@pytest.mark.parametrize(
    "send",
    [
        lambda box: box.to_client(A, p.ERROR, "e"),
        lambda box: box.to_client_many(A, p.ACCEPTED, ["j"]),
        lambda box: box.items_to(CLIENT, A, p.PARTIAL).append("d"),
        lambda box: box.sealed_finals_to(A),  # a sealed list after a plain one: a new FINAL
    ],
    ids=["to_client", "to_client_many", "items_to", "sealed_finals_to"],
)
def test_anything_else_queued_for_the_client_drops_its_kept_list(send: Callable[[Outbox], Any]) -> None:
    box = Outbox()
    kept(box)
    kept(box, B)
    send(box)
    assert A not in box.finals
    assert B in box.finals  # another client's is untouched


def test_messages_to_workers_keep_the_clients_lists() -> None:
    box = Outbox()
    part = kept(box)
    box.items_to(WORKER, A, p.JOBS).append("job")  # a peer id is per side: a worker may share it
    box.to_worker(W, p.HEARTBEAT, None)
    assert box.finals[A] is part


def test_a_result_after_an_error_goes_into_a_final_after_it() -> None:
    box = Outbox()
    kept(box)[-1].append("r1")
    box.to_client(A, p.ERROR, "e")
    kept(box)[-1].append("r2")
    assert box.take() == [(CLIENT, A, p.FINAL, ["r1"]), (CLIENT, A, p.ERROR, ["e"]), (CLIENT, A, p.FINAL, ["r2"])]


def test_forget_final_drops_only_that_client() -> None:
    box = Outbox()
    kept(box)
    kept(box, B)
    box.forget_final(A)
    assert list(box.finals) == [B]
