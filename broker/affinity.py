"""Session affinity: the next turn of an episode goes to the worker that served its last.

A multi-turn episode sends one job per turn, and each turn's prompt is the previous turn's
prompt + its completion + the environment's reply: the engine that ran the previous turn
holds that prefix in its prefix cache. Jobs that carry a ``session_id`` (scoped to their
client, like job ids) are steered there by the scheduler, with these two tables:

- **sessions**: ``(client, session_id)`` -> the worker of its last turn and when that was,
  least recently used first. A record goes on the turn that says ``session_end``, after
  ``session_idle_s`` without a turn, and the oldest goes when ``max_sessions`` are kept, so
  memory stays bounded whatever clients send.
- **held** turns: a turn whose worker is alive and takes jobs but has no free credit waits
  for it at most ``affinity_wait_s``, outside its client's queue (the jobs behind it go on).
  In its client's turn of ``dispatch`` a held job goes first once its worker has room, so
  affinity never takes a turn from another client, and no credit is ever overrun. When the
  wait is over (or the worker is gone) the job goes back to the front of its client's queue
  and its session is unpinned: it goes to the least loaded worker, and the session moves
  there.

Pure like the scheduler (``now`` passed in); plain counters in ``stats.SessionStats``.
Requeued jobs (their worker died) go anywhere; ``affinity=False`` keeps the records and
counters (how often a turn lands on its last worker by chance) but never steers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from zmq_rollout.config import BrokerConfig

from .state import ClientId, Job, WorkerId, WorkerState
from .stats import SessionStats

SessionKey = tuple[ClientId, str]


def fits(w: WorkerState, job: Job) -> bool:
    """``w`` can take ``job`` now (the scheduler's rule): it takes jobs, has the job's weights
    and a free credit, and the job fits its free credits (or it is idle: a job larger than
    all its credits runs alone)."""
    free = w.credits_free
    return (
        w.accepting
        and free > 0
        and (job.cost <= free or w.credits_used == 0)
        and w.weight_version >= job.spec.min_weight_version
    )


@dataclass(slots=True)
class Session:
    worker: WorkerId | None
    """The worker of its last turn; None once a turn stopped waiting for it (unpinned)."""
    last_seen: float


@dataclass(slots=True, eq=False)
class Held:
    """A turn waiting for its session's worker until ``deadline``."""

    job: Job
    client: ClientId
    worker: WorkerId
    deadline: float
    live: bool = True
    """False once it left: sent to its worker, released, dropped with its client."""


class Affinity:
    def __init__(self, config: BrokerConfig, stats: SessionStats) -> None:
        self.config = config
        self.stats = stats
        self.sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # least recently used first
        self._held: dict[WorkerId, dict[ClientId, deque[Held]]] = {}  # by worker, then client: FIFO
        self._deadlines: deque[Held] = deque()  # every held turn in the order held: oldest deadline first
        self._num_held: dict[ClientId, int] = {}

    # -- routing ---------------------------------------------------------------------------
    def target(self, client: ClientId, job: Job, workers: dict[WorkerId, WorkerState]) -> WorkerState | None:
        """The worker ``job`` goes to or waits for: its session's last, if affinity is on, the
        job is not a requeued one (those go anywhere), and that worker is still registered,
        takes jobs and has the job's weights."""
        sid = job.spec.session_id
        if sid is None or not self.config.affinity or job.losses:
            return None
        record = self.sessions.get((client, sid))
        w = None if record is None or record.worker is None else workers.get(record.worker)
        if w is None or not w.accepting or w.weight_version < job.spec.min_weight_version:
            return None
        return w

    def dispatched(self, client: ClientId, job: Job, worker: WorkerId, now: float) -> None:
        """Count where a session's turn went (``affine``: its last worker; ``moved``: another;
        ``new``: no record) and remember it, or drop the record on ``session_end``."""
        spec = job.spec
        sid = spec.session_id
        if sid is None:
            return
        key = (client, sid)
        record = self.sessions.get(key)
        counts = self.stats.dispatches
        if record is None:
            counts["new"] += 1
            if spec.session_end:
                return
            if len(self.sessions) >= self.config.max_sessions:
                self.sessions.popitem(last=False)
                self.stats.dropped["cap"] += 1
            self.sessions[key] = Session(worker, now)
            return
        counts["affine" if record.worker == worker else "moved"] += 1
        if spec.session_end:
            del self.sessions[key]
            self.stats.dropped["ended"] += 1
            return
        record.worker, record.last_seen = worker, now
        self.sessions.move_to_end(key)

    def expire(self, now: float) -> None:
        """Drop the records of sessions without a turn for ``session_idle_s``."""
        sessions, idle = self.sessions, self.config.session_idle_s
        while sessions:
            key, record = next(iter(sessions.items()))
            if now - record.last_seen <= idle:
                return
            del sessions[key]
            self.stats.dropped["idle"] += 1

    # -- held turns ------------------------------------------------------------------------
    def holds(self, client: ClientId) -> bool:
        return client in self._num_held

    @property
    def held_clients(self) -> dict[ClientId, int]:
        """The clients with a turn held, as a live view (``client in held_clients`` is ``holds``,
        for the dispatch loop). Read only."""
        return self._num_held

    def hold(self, client: ClientId, job: Job, worker: WorkerId, now: float) -> bool:
        """Hold ``job`` for its full ``worker`` until ``affinity_wait_s`` from now (False: the
        wait is 0, it goes elsewhere at once)."""
        wait = self.config.affinity_wait_s
        if wait <= 0:
            return False
        entry = Held(job, client, worker, now + wait)
        self._held.setdefault(worker, {}).setdefault(client, deque()).append(entry)
        self._deadlines.append(entry)
        self._num_held[client] = self._num_held.get(client, 0) + 1
        return True

    def ready(self, client: ClientId, heap: Iterable[tuple[float, int, WorkerId, WorkerState]]) -> Held | None:
        """The oldest turn of ``client`` held for a worker of ``heap`` (those with free credits)
        that fits there now."""
        best = None
        for *_, w in heap:
            entry = self.first_held(w.identity, client)
            if entry is not None and fits(w, entry.job) and (best is None or entry.deadline < best.deadline):
                best = entry
        return best

    def first_held(self, worker: WorkerId, client: ClientId) -> Held | None:
        """The oldest turn of ``client`` waiting for ``worker`` (cancelled ones are dropped)."""
        by_client = self._held.get(worker)
        queue = by_client.get(client) if by_client else None
        while queue:
            entry = queue[0]
            if not entry.job.cancelled:
                return entry
            self._leave(entry)
        return None

    def take(self, entry: Held) -> Job:
        """``entry`` goes to its worker now."""
        self._leave(entry)
        self.stats.holds["served"] += 1
        return entry.job

    def next_deadline(self) -> float | None:
        """When the oldest held turn stops waiting (None: none is held)."""
        deadlines = self._deadlines
        while deadlines and not deadlines[0].live:
            deadlines.popleft()
        return deadlines[0].deadline if deadlines else None

    def release_due(self, now: float) -> list[Held]:
        """The held turns whose wait is over, oldest first: their sessions are unpinned, so
        they go to the least loaded worker and their sessions move there."""
        released = []
        deadlines = self._deadlines
        while deadlines and (not deadlines[0].live or deadlines[0].deadline <= now):
            entry = deadlines.popleft()
            if not entry.live:
                continue
            self._leave(entry)
            if entry.job.cancelled:
                continue
            record = self.sessions.get((entry.client, entry.job.spec.session_id))  # type: ignore[arg-type]
            if record is not None and record.worker == entry.worker:
                record.worker = None
            self.stats.holds["released"] += 1
            released.append(entry)
        return released

    def worker_gone(self, worker: WorkerId) -> list[Held]:
        """Release the turns waiting for a purged worker, oldest first (its sessions' records
        name a worker that is no longer there: their next turns go anywhere)."""
        released = []
        for queue in self._held.get(worker, {}).copy().values():
            for entry in list(queue):
                self._leave(entry)
                if not entry.job.cancelled:
                    self.stats.holds["released"] += 1
                    released.append(entry)
        return released

    def client_gone(self, client: ClientId) -> None:
        """Forget the held turns of a client that left (its records go when idle)."""
        for by_client in list(self._held.values()):
            for entry in list(by_client.get(client, ())):
                self._leave(entry)

    def _leave(self, entry: Held) -> None:
        """Take ``entry`` out of the held tables (it is the oldest of its worker and client,
        but for a release of a worker's or a client's whole list)."""
        by_client = self._held[entry.worker]
        queue = by_client[entry.client]
        if queue[0] is entry:
            queue.popleft()
        else:
            queue.remove(entry)
        if not queue:
            del by_client[entry.client]
            if not by_client:
                del self._held[entry.worker]
        entry.live = False
        left = self._num_held[entry.client] - 1
        if left:
            self._num_held[entry.client] = left
        else:
            del self._num_held[entry.client]

    @property
    def num_held(self) -> int:
        return sum(self._num_held.values())
