"""Jobs the broker forwards unread: sealed by the client (SEALED_SUBMIT), opened by the worker.

``SealedJob`` travels client -> broker: the job whole, as a SUBMIT would carry it, beside copies
of the fields the broker reads (docs/protocol.md section 5.9). ``SealedAssignment`` is what a
worker decodes JOBS into, each job opened on its own by ``unseal``, which also checks that a
job runs no more sequences than the broker charged it credits for.
"""

from __future__ import annotations

from typing import Annotated, cast

import msgspec

from .base import DECODE_ERRORS, MAX_N, Struct
from .jobs import Assignment, ErrorItem, IdText, JobSpec, OnStale, VersionInt

_encode = msgspec.msgpack.Encoder().encode


class SealedJob(Struct):
    """client -> broker, in SEALED_SUBMIT: a job whole, as a SUBMIT would carry it (``job``: the
    ``JobSpec``'s own encoding, inline), beside copies of the fields the broker reads. The
    broker decodes only these and forwards ``job``'s bytes to its worker as they came: no object
    per field it does not read, and no encoding on the way out (``benchmarks/sealed_jobs.py``).
    The worker checks the job as it checks any (``unseal``), and that its ``sampling.n`` is the
    ``n`` its credits were charged (``SealedAssignment.cost``); a client whose copies differ from
    its job otherwise misroutes only its own jobs. Sent only to a broker whose HEARTBEAT answer
    says ``Liveness.sealed_jobs`` (docs/protocol.md section 5.9)."""

    job_id: IdText
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
    """The job's ``sampling.n``: the credits it occupies on a worker."""
    job: msgspec.Raw
    ack: bool = True
    stream: bool = False
    session_id: IdText | None = None
    session_end: bool = False
    min_weight_version: VersionInt = 0
    max_staleness: VersionInt | None = None
    on_stale: OnStale = "abort"
    resubmitted: bool = False

    def cost(self) -> int:
        """Credits this job occupies on a worker: one per sequence."""
        return self.n

    @classmethod
    def of(cls, job: JobSpec, encoded: bytes) -> SealedJob:
        """``job``, whose SUBMIT encoding is ``encoded``, sealed with its copies."""
        return cls(
            job.job_id, job.sampling.n, msgspec.Raw(encoded), job.ack, job.stream, job.session_id,
            job.session_end, job.min_weight_version, job.max_staleness, cast(OnStale, job.on_stale), job.resubmitted,
        )  # fmt: skip


def sealed_job(job: JobSpec, encoded: bytes) -> bytes:
    """``SealedJob.of(job, encoded)``, encoded as a client sends it: without the trailing fields
    that are their defaults (a trainer's usual job is ``[job_id, n, job]``, or with ``ack``
    false one item more). Half the client's cost of sealing a job, and a fifth less of the
    broker's decoding, against every field written."""
    if (
        job.stream
        or job.session_id is not None
        or job.session_end
        or job.min_weight_version
        or job.max_staleness is not None
        or job.on_stale != "abort"
        or job.resubmitted
    ):
        return _encode(SealedJob.of(job, encoded))
    if job.ack:
        return _encode((job.job_id, job.sampling.n, msgspec.Raw(encoded)))
    return _encode((job.job_id, job.sampling.n, msgspec.Raw(encoded), False))


SEALED_JOBS = "sealed_jobs"
"""The capability a worker lists in READY (``WorkerInfo.capabilities``) when it checks each
job's ``sampling.n`` against ``SealedAssignment.cost``: the broker forwards a ``SealedJob``'s
bytes only to such a worker, and opens them for any other (``broker/older_workers.py``)."""


class SealedAssignment(Struct):
    """What a worker decodes JOBS into: each ``job`` still raw, opened on its own by ``unseal``,
    so that a job it cannot run (the broker checks only part of a job, ``JobRelay``) is answered
    with an error instead of failing the message and the jobs beside it."""

    ticket: int
    job: msgspec.Raw
    cost: int = 0
    """The credits the broker charged for the job: its ``sampling.n`` must be this (0: unsaid, from
    a broker before this field, or an ``Assignment`` built in Python)."""


_job_decoder = msgspec.msgpack.Decoder(JobSpec)


def unseal(sealed: SealedAssignment) -> Assignment | ErrorItem:
    """The ``Assignment``, or an ``invalid_request`` error keyed by its ticket: a job that does not
    decode, or whose ``sampling.n`` is not the credits it was charged (a ``SealedJob`` whose
    ``n`` differs from its job's)."""
    try:
        job = _job_decoder.decode(sealed.job)
    except DECODE_ERRORS as exc:
        return ErrorItem(sealed.ticket, "invalid_request", f"invalid job: {exc}")
    if sealed.cost and job.sampling.n != sealed.cost:
        return ErrorItem(sealed.ticket, "invalid_request", cost_mismatch(job.sampling.n, sealed.cost))
    return Assignment(sealed.ticket, job)


def cost_mismatch(n: int, charged: int) -> str:
    """The error for a sealed job whose ``sampling.n`` is not the ``n`` it was submitted with."""
    return f"invalid job: its sampling.n is {n}, but it was submitted (SEALED_SUBMIT) with n={charged}"
