"""Both of the broker's ports fuzzed at once while a good client's jobs run (``zmq_rollout.fuzzing``).

The short run of ``benchmarks/fuzz.py``: a few thousand hostile messages per port, from a
fixed seed (``ZMQ_ROLLOUT_FUZZ_SEED`` picks another; a failure names the seed that replays it).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from zmq_rollout import SamplingParams
from zmq_rollout.fuzz_peers import Hammer, rss_bytes
from zmq_rollout.fuzz_templates import PORTS, TABLES, templates
from zmq_rollout.fuzzing import Fuzzer

SEED = int(os.environ.get("ZMQ_ROLLOUT_FUZZ_SEED", "2026"))
MAX_MESSAGE = 1 << 20  # the broker's max_message_bytes here: oversize messages stay cheap
MESSAGES_PER_PORT = 3000
ROUNDS = 12  # the good client submits a few jobs before each round of fuzzing
RSS_GROWTH_LIMIT = 12 << 20
"""Bytes the process may grow by between the first round and the end, when the broker holds
no fuzz peer any more. Everything of this test shares the process, and glibc's allocator is
set to give every block of 128 KiB or more back at once (``allocator_returns_big_blocks``):
with its default, the threshold rises after each 1 MiB message and the slack that leaves
(up to 13 MiB over seeds 1 to 12) would hide a leak. A broker that kept each message a
client sent grows by about 29 MiB here (tried: ~27 MB of frontend messages, 24 of them of
1 MiB), so the limit catches a leak of that order, not a few bytes per message; the
structural check (the broker forgets every fuzz peer) catches records kept per peer."""


def allocator_returns_big_blocks() -> None:
    """glibc: a fixed mmap threshold of 128 KiB (``mallopt(M_MMAP_THRESHOLD)``), so that RSS
    follows what is held. Elsewhere (no glibc) nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD


def held_rss() -> int:
    """This process's RSS after a collection and glibc's ``malloc_trim``: what it holds, not
    what its allocator keeps free. Late in a whole-suite run (after the integration tier, in
    the same process) that free slack moved this test's growth by several MiB (12.5 MiB in one
    clean-clone CI run, 4.7 in the unit tier alone); a leak is held, and still counts."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


@contextlib.contextmanager
def seed_on_failure(seed: int) -> Iterator[None]:
    try:
        yield
    except BaseException:
        print(f"fuzz seed {seed}: replay with ZMQ_ROLLOUT_FUZZ_SEED={seed}")
        raise


def test_both_ports_fuzzed_while_a_good_client_runs_jobs(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="zmq_rollout.broker")  # one warning per bad message
    allocator_returns_big_blocks()
    broker = start_broker(max_message_bytes=MAX_MESSAGE, client_expiry_s=3.0)
    doubles = [start_double(broker, credits=8) for _ in range(2)]
    client = start_client(broker.frontend, timeout_s=60)
    front = Hammer(
        broker.frontend,
        Fuzzer("frontend", SEED, oversize_bytes=(MAX_MESSAGE + 1,)),
        max_message_bytes=MAX_MESSAGE,
    )
    back = Hammer(broker.backend, Fuzzer("backend", SEED))
    sampling = SamplingParams(n=2, max_tokens=4)
    prompts = [[7000 + 10 * i + j for j in range(2 + i % 5)] for i in range(8 * ROUNDS)]
    futures = []
    with seed_on_failure(SEED):
        try:
            for r in range(ROUNDS):
                futures += [client.submit(prompt, sampling) for prompt in prompts[8 * r : 8 * r + 8]]
                front.run(MESSAGES_PER_PORT // ROUNDS)
                back.run(MESSAGES_PER_PORT // ROUNDS)
                assert broker.thread.alive, f"the broker's loop died after {front.sent + back.sent} messages"
                if r == 0:
                    rss_warm = held_rss()
            rollouts = [f.result(timeout=60) for f in futures]
            front.drain()
            back.drain()
        finally:
            front.close()
            back.close()
        assert broker.thread.alive

        # Every good job: once, whole and right (the doubles echo the prompt's first 4 ids).
        names = {d.name for d in doubles}
        for prompt, result in zip(prompts, rollouts, strict=True):
            assert [r.index for r in result] == [0, 1]
            for r in result:
                assert (r.prompt_token_ids, r.token_ids, r.logprobs) == (prompt, prompt[:4], [0.0] * len(prompt[:4]))
                assert (r.finish_reason, r.weight_version) == ("length", 0) and r.worker_id in names
        dispatched = Counter(a.job.job_id for d in doubles for a in d.received)
        assert all(dispatched[result[0].job_id] == 1 for result in rollouts), "a good job ran twice"

        # Every bad message counted: from workers exactly one each (the broker has no size
        # limit of its own there); from clients at least one each (a SUBMIT counts per bad job).
        assert back.rejected > MESSAGES_PER_PORT // 2 and front.rejected > MESSAGES_PER_PORT // 2
        wait_until(lambda: broker.malformed().get("worker", 0) == back.rejected, 10, "every bad worker message counted")
        malformed = broker.malformed()
        from_clients = malformed.get("invalid", 0) + malformed.get("invalid_job", 0) + malformed.get("oversize", 0)
        assert from_clients >= front.rejected, malformed
        assert all(malformed.get(reason, 0) > 0 for reason in ("invalid", "invalid_job", "oversize")), malformed
        assert front.replies["error"] > 0 and back.replies["disconnect"] > 0
        assert front.undecodable == back.undecodable == 0, "the broker sent something that does not decode"

        # Nothing of the fuzz peers stays: fuzz workers expire (1 s), fuzz clients too (3 s).
        def only_good_peers() -> bool:
            status = broker.status()
            workers = {w.name for w in status.workers}
            clients = {c.name for c in status.clients if not c.name.startswith("status-probe")}
            return workers == names and clients == {client.identity}

        wait_until(only_good_peers, 15, "the broker to forget every fuzz peer")
        # ...nor their message form: only the doubles (split, as they speak) are remembered.
        wait_until(
            lambda: {i.decode(errors="replace").rsplit("-", 1)[0] for i in broker.thread.broker.split_peers} <= names,
            5,
            "the broker to forget the form of every fuzz peer",
        )
        growth = held_rss() - rss_warm
        print(
            f"seed {SEED}: frontend {front.sent} messages ({front.rejected} bad), backend {back.sent} "
            f"({back.rejected} bad); malformed {malformed}; RSS growth {growth / 2**20:.1f} MiB"
        )
        assert growth < RSS_GROWTH_LIMIT


def test_a_seed_replays_the_same_messages_and_every_command_is_a_template() -> None:
    for port in PORTS:
        a, b = Fuzzer(port, SEED), Fuzzer(port, SEED)
        assert [a.message() for _ in range(500)] == [b.message() for _ in range(500)]
        assert set(a.counts) >= {"valid", "mutate", "bitflip", "truncate", "random", "direction", "frames"}
        assert a.packed > 100  # both forms are fuzzed
    for table, commands in TABLES.items():
        assert {command for command, _ in templates(table)} == set(commands), table
