"""What the broker knows about each job, client and worker (plain records, no behaviour).

Vocabulary: a worker announces **credits** (the sequences its engine runs at once, vLLM's
``max_num_seqs``); a job costs ``sampling.n`` credits while it runs. A job is **queued**
(in its client's queue) or **running** (on one worker, under a ticket).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from zmq_rollout import protocol as p

WorkerId = bytes
ClientId = bytes


class Submission:
    """What the jobs of one SUBMIT share: when it came (``at``), and how many of them the dispatch
    pass under way took and the FINAL being read finished. Those counts let each pass and each
    FINAL observe the queue wait and the latency once per submission time, not once per job
    (``tally``): a job bumps its submission's count, and the first bump lists the submission."""

    __slots__ = ("at", "finished", "taken")

    def __init__(self, at: float) -> None:
        self.at = at
        self.taken = 0
        self.finished = 0


def tally_taken(submissions: list[Submission], now: float, histogram: Any) -> None:
    """Observe ``now - at`` for each job of ``submissions`` a dispatch pass took; zero the counts."""
    for sub in submissions:
        histogram.observe_many(now - sub.at, sub.taken)
        sub.taken = 0


def tally_finished(submissions: list[Submission], now: float, histogram: Any) -> None:
    """Observe ``now - at`` for each job of ``submissions`` a FINAL finished; zero the counts."""
    for sub in submissions:
        histogram.observe_many(now - sub.at, sub.finished)
        sub.finished = 0


class AnsweredIds:
    """The ids of a client's jobs answered in its first ``client_expiry_s`` here, in the order
    they were answered (``ClientState.finished``). Every result appends one (``ids``, the hot
    path); only a resubmission looks one up, after a broker restart. So the ids go into a list,
    and a set is built from it at the first lookup and brought up to date at each later one.
    Appending costs ~40 ns a job. A set insert cost 90-200 ns into a set of up to 100,000 ids,
    and was the broker's costliest line at 180k jobs/s (6% of its samples)."""

    __slots__ = ("_index", "_indexed", "ids")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._index: set[str] = set()
        self._indexed = 0  # how many of ``ids`` are in ``_index``

    def __contains__(self, job_id: object) -> bool:
        ids = self.ids
        if self._indexed < len(ids):
            self._index.update(ids[self._indexed :])  # a slice: islice would walk the indexed ones
            self._indexed = len(ids)
        return job_id in self._index

    def __len__(self) -> int:
        return len(self.ids)


class Job(msgspec.Struct, gc=False, eq=False):
    """One job as the broker keeps it. A msgspec Struct, not a dataclass: one is made per job
    submitted, and a Struct is made in C (68 ns against a slotted dataclass's 188 ns). Compared
    by identity (``eq=False``), as the dataclass was; no garbage-collector tracking (``gc=False``):
    a job refers to no object that refers back to it."""

    client: ClientId
    spec: p.JobSpec | p.JobRelay | p.SealedJob
    submission: Submission
    """Its SUBMIT's: when it came (``submission.at``)."""
    cost: int
    """Credits it occupies on a worker while it runs: its ``sampling.n``."""
    wire: Any
    """What its worker's JOBS carries as the job: ``spec`` itself, or a ``SealedJob``'s bytes."""
    ticket: int = 0
    worker: WorkerId = b""
    """The worker it runs on, under ``ticket``; ``b""`` while it is queued."""
    dispatched_version: int = 0
    """Its worker's weight version when dispatched: a result of another version crossed a sync."""
    losses: int = 0
    """Workers lost while it ran on them: it fails once they reach ``max_attempts``. Counted at
    each loss, not at each dispatch (a restart for staleness is no loss; the hot path, dispatch,
    writes one field less)."""
    restarts: int = 0
    """Times it ran again because it finished too stale (``JobSpec.max_staleness``)."""
    cancelled: bool = False


@dataclass(eq=False, slots=True)
class ClientState:
    identity: ClientId
    name: str
    last_seen: float
    queue: deque[Job] = field(default_factory=deque)
    jobs: dict[str, Job] = field(default_factory=dict)
    """job_id -> Job, each of its jobs here: queued (in ``queue``, or held for its session's
    worker; ``job.worker`` is ``b""``) or running (on ``job.worker`` under ``job.ticket``). One
    dict, not one per state: a dispatch moves no entry."""
    num_queued: int = 0
    """How many of ``jobs`` are queued."""
    since: float = 0.0
    """When this broker first heard of it (this session)."""
    finished: AnsweredIds | None = None
    """Ids of its jobs answered in its first ``client_expiry_s`` here (then None): a client that
    notices a restart sends its unfinished jobs again, at its first heartbeat reply, and one it
    sent while the old broker was down may have finished here already."""

    @property
    def queued(self) -> dict[str, Job]:
        """Its queued jobs by id, built on each call from ``jobs`` (tests and debugging; the scheduler
        keeps ``num_queued`` and reads ``jobs`` itself)."""
        return {jid: job for jid, job in self.jobs.items() if not job.worker}

    @property
    def running(self) -> dict[str, Job]:
        """Its running jobs by id, built on each call from ``jobs`` (tests and debugging; the scheduler
        keeps ``num_queued`` and reads ``jobs`` itself)."""
        return {jid: job for jid, job in self.jobs.items() if job.worker}


@dataclass(eq=False, slots=True)
class WorkerState:
    identity: WorkerId
    info: p.WorkerInfo
    last_seen: float
    credits: int
    credits_used: int = 0
    running: dict[int, Job] = field(default_factory=dict)  # ticket -> Job
    weight_version: int = 0
    accepting: bool = True
    """False while a weight-sync round holds it, or while it is stale."""
    last_pick: int = 0
    """The ticket of the last job dispatched to it (ties in load go to the longest idle)."""
    jobs_sent_at: float = -math.inf
    """When a dispatch pass last sent it jobs: any message tells it the broker lives, so the
    next ``tick`` within a heartbeat interval of that sends it no HEARTBEAT."""
    reads_token_bins: bool = False
    """Its READY lists ``p.TOKEN_BINS``: its jobs may carry token ids as a token bin; else the
    socket loop sends them as arrays (``older_workers.py``)."""
    checks_cost: bool = False
    """Its READY lists ``p.SEALED_JOBS``: it checks each job's ``sampling.n`` against the credits
    charged, so a sealed job's bytes go to it as they came; else the socket loop opens them
    (``older_workers.py``)."""

    @property
    def credits_free(self) -> int:
        return self.credits - self.credits_used


def peer_name(identity: bytes) -> str:
    """A readable name for a peer: its identity if printable (our clients set one), else hex."""
    text = identity.decode("ascii", "replace")
    return text if text.isprintable() and "\ufffd" not in text else identity.hex()
