"""Packed dispatch keeps a block of jobs whole while clients submit blocks (``DispatchHeap.blocks``).

Packing fills a worker by a step of credits before the next gets any. A pass's block of jobs
used to top up first the worker an earlier pass left part-filled, the rest spilling onto
another: two JOBS (and two FINALs) for one block. With ``blocks`` the block goes to a worker
at the start of a step; the part-filled one waits for a pass nothing else can take.
"""

from __future__ import annotations

from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.broker.outbox import WORKER
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig

A = b"client-a"
WORKERS = [f"w{i}".encode() for i in range(4)]


def scheduler(*, blocks: bool, workers: list[bytes] = WORKERS, credits: int = 8) -> Scheduler:
    s = Scheduler(BrokerConfig())
    for w in workers:
        s.worker_ready(w, p.WorkerInfo(w.decode(), "tiny", credits, 0), 0.0)
    s.set_dispatch_step(credits, blocks)
    return s


def submit(s: Scheduler, prefix: str, count: int, now: float) -> dict[bytes, list[Any]]:
    """Submit ``count`` one-credit jobs; the JOBS each worker got for them."""
    specs = [p.JobSpec(f"{prefix}{i}", p.SamplingParams(), prompt="hi", ack=False) for i in range(count)]
    s.submit(A, specs, now)
    return {peer: body for side, peer, command, body in s.outbox.take() if side == WORKER and command == p.JOBS}


def test_a_block_goes_whole_to_a_worker_at_the_start_of_a_step() -> None:
    s = scheduler(blocks=True)
    first = submit(s, "a", 12, now=0.0)
    assert sorted(map(len, first.values())) == [4, 8]
    (part_filled,) = [w for w, sent in first.items() if len(sent) == 4]
    second = submit(s, "b", 8, now=0.1)
    assert [len(sent) for sent in second.values()] == [8]  # one JOBS of the whole block
    assert part_filled not in second and next(iter(second)) not in first  # a worker that had none
    assert s.workers[part_filled].credits_used == 4


def test_without_blocks_the_part_filled_worker_is_topped_up_first() -> None:
    s = scheduler(blocks=False)
    first = submit(s, "a", 12, now=0.0)
    (part_filled,) = [w for w, sent in first.items() if len(sent) == 4]
    second = submit(s, "b", 8, now=0.1)
    assert sorted(map(len, second.values())) == [4, 4]  # topped up, the rest spilled: two JOBS
    assert len(second[part_filled]) == 4


def test_a_part_filled_worker_still_takes_what_no_other_can() -> None:
    """Blocks order the workers, they never hold a free credit back."""
    s = scheduler(blocks=True, workers=WORKERS[:2])
    first = submit(s, "a", 12, now=0.0)
    (part_filled,) = [w for w, sent in first.items() if len(sent) == 4]
    second = submit(s, "b", 6, now=0.1)
    assert {w: len(sent) for w, sent in second.items()} == {part_filled: 4}
    assert s.num_queued == 2 and all(w.credits_free == 0 for w in s.workers.values())


def test_a_part_filled_worker_returns_to_the_front_once_its_jobs_finish() -> None:
    s = scheduler(blocks=True, workers=WORKERS[:2])
    first = submit(s, "a", 12, now=0.0)
    (part_filled,) = [w for w, sent in first.items() if len(sent) == 4]
    results = [p.Result(a.ticket, [1], [p.Sample(0, [2], [-0.5], "stop")], 0, "w") for a in first[part_filled]]
    s.worker_final(part_filled, results, 0.5)
    assert s.outbox.take() and s.workers[part_filled].credits_used == 0
    second = submit(s, "b", 8, now=0.6)
    assert {w: len(sent) for w, sent in second.items()} == {part_filled: 8}


def test_the_benchmark_counts_jobs_per_jobs_message_with_blocks_off_and_on() -> None:
    """``benchmarks/dispatch_blocks.py``: workers that answer in parts fragment packed JOBS
    unless blocks are kept whole; whole answers do not."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "dispatch_blocks.py"
    out = subprocess.run(
        [sys.executable, str(script), "--workers", "64", "--clients", "8", "--passes", "400"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    rows = {line[:16].strip(): line[16:].split() for line in out.splitlines() if line.startswith(("whole", "in parts"))}
    assert rows["whole JOBS"][:2] == ["64.0", "64.0"]
    off, on = (float(v) for v in rows["in parts"][:2])
    assert on == 64.0 and off < 32.0
