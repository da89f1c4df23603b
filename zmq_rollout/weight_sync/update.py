"""``update_weights`` and ``update_lora``: one round each, from the trainer's side.

    begin (pause every worker) → [check_names] → the transport's data steps → commit

A step that some worker does not answer in time evicts that worker; the round completes for
the others and the ``SyncReport`` names whom it lost. Nothing blocks forever. Errors leave
here as the error tree's: bad arguments as ``InvalidRequestError``, failures of the round or
of the data plane (an OS error, a collective that broke) as ``SyncError``, always after the
round was aborted, so no worker stays paused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.errors import InvalidRequestError, RolloutError, SyncError

from .buckets import named_tensors, pack, plan_buckets, tensor_specs
from .round import StepSender, SyncReport, SyncRound, run_round
from .transport import Shipment, WeightTransport

DEFAULT_BUCKET_BYTES = 1 << 30
LORA_BUCKET_BYTES = 8 << 20
MAX_LORA_BUCKET_BYTES = 48 << 20  # under the broker's default max_message_bytes (64 MiB)


@contextlib.contextmanager
def _in_error_tree() -> Iterator[None]:
    """Translate lower-layer errors into the error tree (the one boundary for weight sync)."""
    try:
        yield
    except RolloutError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidRequestError(f"{type(exc).__name__}: {exc}") from exc
    except (OSError, RuntimeError) as exc:
        raise SyncError(f"weight sync failed: {type(exc).__name__}: {exc}") from exc


def _begin_args(pause: str, timeout_s: float) -> None:
    """Check what ``begin`` will carry before anything is sent (ValueError if it is wrong)."""
    p.SyncStep(0, p.Begin(pause), timeout_s)


async def update_weights(
    sender: StepSender,
    transport: WeightTransport,
    source: Any,
    *,
    pause: str = "wait",
    version: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float = 60.0,
    check_names: bool = False,
    direct_load: bool = True,
) -> SyncReport:
    """Push ``source`` (an ``nn.Module`` or ``(name, tensor)`` pairs, checkpoint names) into
    every worker over ``transport``; returns when the new version is live on every worker
    that stayed. See ``AsyncRolloutClient.update_weights`` for the arguments."""
    started = time.monotonic()
    with _in_error_tree():
        _begin_args(pause, timeout_s)
        shipment = Shipment.plan(source, bucket_bytes, direct_load)
        if not shipment.buckets:
            raise InvalidRequestError("update_weights got no tensors to send")

        async def transfer(rnd: SyncRound) -> None:
            if check_names:
                _raise_on_mismatch(await rnd.step(p.CheckNames(list(shipment.tensors))))
            await transport.send(rnd, shipment)

        rnd, target = await run_round(sender, pause, version, timeout_s, transfer, lambda: transport.prepare(shipment))
    seconds = time.monotonic() - started
    return SyncReport(
        target,
        transport.name,
        seconds,
        shipment.nbytes,
        len(shipment.buckets),
        rnd.members,
        rnd.evicted,
        rnd.step_seconds,
    )


async def update_lora(
    sender: StepSender,
    tensors: Any,
    peft_config: Any,
    *,
    name: str = "default",
    pause: str = "wait",
    version: int | None = None,
    timeout_s: float = 60.0,
    bucket_bytes: int = LORA_BUCKET_BYTES,
) -> SyncReport:
    """Push a LoRA adapter into every worker's vLLM LoRA slot ``name``, replacing it in place.

    Adapters are small: the bytes travel inside the steps (msgpack ``bin``, ``bucket_bytes``
    per step), so this works wherever the broker reaches, with no shared memory or
    collective. Each worker writes the adapter to its private folder and has vLLM load it
    into the slot; the round then commits a new version, which every rollout after it carries.
    """
    import msgspec
    import torch

    started = time.monotonic()
    with _in_error_tree():
        _begin_args(pause, timeout_s)
        p.LoadLora(name, {})  # checks the name
        pairs = list(tensors.items()) if isinstance(tensors, Mapping) else named_tensors(tensors)
        pairs = [(str(n), t.detach().to("cpu")) for n, t in pairs]
        if not pairs:
            raise InvalidRequestError("update_lora got no tensors to send")
        to_dict = getattr(peft_config, "to_dict", None)
        config = msgspec.to_builtins(to_dict() if to_dict is not None else peft_config, enc_hook=str)
        if not isinstance(config, dict) or "r" not in config:
            raise InvalidRequestError("peft_config must be a PEFT LoRA config (a dict with 'r', 'lora_alpha', ...)")
        buckets = plan_buckets(tensor_specs(pairs), bucket_bytes)
        too_big = [b for b in buckets if b.nbytes > MAX_LORA_BUCKET_BYTES]
        if too_big:
            raise InvalidRequestError(f"a LoRA tensor of {too_big[0].nbytes} bytes exceeds {MAX_LORA_BUCKET_BYTES}")
        by_name = dict(pairs)

        async def transfer(rnd: SyncRound) -> None:
            for i, bucket in enumerate(buckets):
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
                pack(bucket, by_name, buf)
                await rnd.step(p.LoraBucket(name, bucket, buf.numpy().tobytes(), first=i == 0))
            await rnd.step(p.LoadLora(name, config))

        rnd, target = await run_round(sender, pause, version, timeout_s, transfer)
    seconds = time.monotonic() - started
    total = sum(b.nbytes for b in buckets)
    return SyncReport(target, "inline", seconds, total, len(buckets), rnd.members, rnd.evicted, rnd.step_seconds)


def _raise_on_mismatch(reply: p.SyncReply) -> None:
    for ack in reply.acks:
        result = ack.result
        if not isinstance(result, p.NameCheck):
            continue
        missing, unknown = result.missing, result.unknown
        if missing or unknown:
            raise InvalidRequestError(
                f"tensor names do not match worker {ack.name}'s checkpoint: "
                f"missing {missing[:20]}{'...' if len(missing) > 20 else ''}, "
                f"unknown {unknown[:20]}{'...' if len(unknown) > 20 else ''}"
            )
