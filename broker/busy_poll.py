"""How long the broker's socket loop polls without sleeping, learnt from when messages come.

A broker that sleeps between messages pays a wake-up and cold caches for each one (about
100 us on these VMs); one that keeps polling for a while after a busy pass reads a quick reply
(a worker's result for the job just sent) at once. Polling costs CPU when nothing comes, so
the window adapts, as Linux's haltpoll governor does: it doubles while messages come within it
or within its maximum after a sleep, and halves, down to nothing, while they come more than
four maxima apart. A broker whose workers answer in milliseconds stops spinning; one in a
ping-pong keeps the whole window. And it polls only while the machine has a core to spare
(``IdleCores``): on a machine its clients and workers keep busy, a spinning broker would take
their CPU; and only while its messages carry few jobs each (``JobsPerMessage``): a wake-up
saved is worth the same to a message of 64 jobs as to one of one, but spread over 64 jobs it is
worth little, while the polling costs as much CPU per message (with 64-job messages, polling
was a quarter of the broker's CPU per job, ``benchmarks/README.md``).
"""

from __future__ import annotations

import os

from .own_process import owns_process

BUSY_POLL_US = 250
"""``BrokerConfig.busy_poll_us`` of a broker in its own process: on these VMs a sleeping broker
takes about 100 us longer to handle a message than a running one (its wake-up, and a CPU
whose caches went cold), and a one-job round trip needs two of them."""
GROW_START_S = 20e-6
"""The window a grown-from-nothing window starts at; below it a halved window is 0."""
SHRINK_AFTER = 4
"""The window halves after a sleep longer than this many maximum windows: replies that come a
little late (a round trip's jitter) leave it as it is."""
SPARE_CORES = 1.0
"""Idle cores (the broker's own polling counted as idle) the machine must have had over the
last heartbeat interval for the broker to poll without sleeping."""
SPIN_BELOW_JOBS_PER_MESSAGE = 8.0
"""The broker polls without sleeping only while the messages it read over the last heartbeat
interval carried fewer jobs than this on average (``JobsPerMessage``). One-job SUBMITs and
their FINALs carry 1 to 2; batched clients' 64-job messages, and their workers' answers, tens."""


class BusyPoll:
    """The window, in seconds. ``window_s()`` before each wait; then ``hit()`` if a message
    came while polling, or ``slept(seconds)`` with how long the sleep after it lasted;
    ``spare(cores)`` now and then with the machine's idle cores."""

    def __init__(self, max_s: float) -> None:
        if not max_s >= 0:
            raise ValueError(f"busy poll window must be >= 0 s, got {max_s!r}")
        self.max_s = max_s
        self.window = max_s
        self.allowed = True

    def window_s(self) -> float:
        return self.window if self.allowed else 0.0

    def spare(self, idle_cores: float | None, jobs_per_message: float | None = None) -> None:
        """The machine had ``idle_cores`` idle lately, and the messages read lately carried
        ``jobs_per_message`` (None: unknown, poll as learnt)."""
        self.allowed = (idle_cores is None or idle_cores >= SPARE_CORES) and (
            jobs_per_message is None or jobs_per_message < SPIN_BELOW_JOBS_PER_MESSAGE
        )

    def hit(self) -> None:
        """A message came while polling: polling paid off; keep (or widen) the window."""
        self._grow()

    def slept(self, seconds: float) -> None:
        """Nothing came while polling (or the window was 0), and the sleep after it lasted
        ``seconds`` (to a message or the loop's timeout)."""
        if seconds <= self.max_s:
            self._grow()  # a wider window would have caught it
        elif seconds > SHRINK_AFTER * self.max_s:  # messages come too far apart to wait for
            self.window = 0.0 if self.window / 2 < GROW_START_S else self.window / 2

    def _grow(self) -> None:
        if self.max_s > 0:
            self.window = min(self.max_s, max(GROW_START_S, 2 * self.window))


class JobsPerMessage:
    """How many jobs the messages the broker read carried, between two calls of ``sample``:
    jobs submitted plus jobs completed (a job comes in once and its result once) over messages
    read (every command counts: heartbeats too). None while no message came."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def sample(self, jobs: int, messages: int) -> float | None:
        """``jobs``: submitted + completed so far; ``messages``: messages read so far."""
        last, self._last = self._last, (jobs, messages)
        if last is None or messages <= last[1]:
            return None
        return (jobs - last[0]) / (messages - last[1])


def cpu_times(stat: str) -> tuple[float, float]:
    """(idle, total) jiffies of all CPUs from the text of /proc/stat (idle includes iowait)."""
    fields = stat.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError("not /proc/stat: its first line starts with 'cpu'")
    values = [float(v) for v in fields[1:]]
    return values[3] + (values[4] if len(values) > 4 else 0.0), sum(values[:8])


class IdleCores:
    """The machine's idle cores between two calls of ``sample``, read from /proc/stat (Linux);
    None where it cannot be read. The broker's own polling counts as idle: it would have been,
    and it yields to any process that wants the CPU."""

    def __init__(self, path: str = "/proc/stat", cores: int | None = None) -> None:
        self.path = path
        self.cores = cores or os.cpu_count() or 1
        self._last: tuple[float, float, float, float] | None = None

    def sample(self, now: float, own_spin_s: float) -> float | None:
        """Idle cores since the last call (``now``: monotonic seconds; ``own_spin_s``: the
        broker's polling time so far)."""
        try:
            with open(self.path) as f:
                idle, total = cpu_times(f.read())
        except (OSError, ValueError, IndexError):
            return None
        last, self._last = self._last, (now, idle, total, own_spin_s)
        if last is None or total <= last[2] or now <= last[0]:
            return None
        return idle_cores(idle - last[1], total - last[2], own_spin_s - last[3], now - last[0], self.cores)


def idle_cores(idle_jiffies: float, total_jiffies: float, spin_s: float, interval_s: float, cores: int) -> float:
    """Idle cores over an interval of ``interval_s`` from its idle and total jiffies (all cores)
    and the seconds the broker polled in it."""
    return cores * idle_jiffies / total_jiffies + min(spin_s / interval_s, 1.0)


def busy_poll_s(configured_us: int | None) -> float:
    """Seconds to poll without sleeping after a busy pass, for a broker whose
    ``BrokerConfig.busy_poll_us`` is ``configured_us``, on this thread: by default
    ``BUSY_POLL_US`` on the main thread, which a broker's own process runs it on, and 0 on any
    other, whose process's threads would wait for the GIL meanwhile."""
    if configured_us is None:
        configured_us = BUSY_POLL_US if owns_process() else 0
    return configured_us / 1e6
