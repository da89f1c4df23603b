"""A JOBS message made fit for a worker older than what the broker's clients send.

The broker forwards each job to its worker in the form the client gave it: token ids as a token
bin (``token_bins.py``) and, from a SEALED_SUBMIT, the job's own bytes (``p.SealedJob``). A
worker whose READY does not list ``p.TOKEN_BINS`` gets the ids as an array; one that does not
list ``p.SEALED_JOBS`` (it would not check a sealed job's ``sampling.n`` against the credits it
was charged), or not both, gets each sealed job opened and checked here, and one that fails is
answered as if that worker had refused it. Paid only for such workers; pure, no sockets.
"""

from __future__ import annotations

from typing import Any

import msgspec

from zmq_rollout import protocol as p
from zmq_rollout.protocol.base import DECODE_ERRORS
from zmq_rollout.protocol.sealed_jobs import cost_mismatch

from .state import WorkerState

_relay_decoder = msgspec.msgpack.Decoder(p.JobRelay)


def needs_fitting(worker: WorkerState) -> bool:
    """Whether JOBS for ``worker`` go through ``fit_jobs``."""
    return not (worker.reads_token_bins and worker.checks_cost)


def fit_jobs(worker: WorkerState, assignments: list[Any]) -> tuple[list[Any], list[p.ErrorItem]]:
    """``assignments`` as ``worker`` reads them, and an ``invalid_request`` error (keyed by ticket)
    for each sealed job that does not open, or whose ``sampling.n`` is not its cost."""
    kept: list[Any] = []
    refused: list[p.ErrorItem] = []
    for assignment in assignments:
        job = assignment.job
        if type(job) is msgspec.Raw:  # a sealed job's bytes, to a worker that cannot take them as they are
            try:
                job = _relay_decoder.decode(job)
            except DECODE_ERRORS as exc:
                refused.append(p.ErrorItem(assignment.ticket, "invalid_request", f"invalid job: {exc}"))
                continue
            n = job.cost()
            if n != assignment.cost:
                refused.append(p.ErrorItem(assignment.ticket, "invalid_request", cost_mismatch(n, assignment.cost)))
                continue
            assignment.job = job
        if not worker.reads_token_bins and isinstance(job, p.JobRelay):
            job.prompt_token_ids = p.as_array(job.prompt_token_ids)  # kept so for a later dispatch (same ids)
        kept.append(assignment)
    return kept, refused
