"""TRL's ``VLLMClient``, served by the broker: ``GRPOTrainer(vllm_mode="server")`` on a zmq-rollout fleet.

One line before the trainer is built::

    zmq_rollout.integrations.trl.use(broker="tcp://BROKER:5555")

From then on TRL constructs this ``VLLMClient`` wherever it would construct its own (the
trainers' server mode), with TRL 1.16's constructor and methods and the same return shapes
(``trl_shapes``). It generates through a ``RolloutClient`` and pushes weights with
``update_weights``, **one round per trainer step**: tensors given to ``update_named_param(s)``
are held (references, not copies) and pushed together at the end of the step, when TRL calls
``reset_prefix_cache()`` (as it does after every sync), when a ``weight_update()`` block
ends, at ``update_model_params`` or, at the latest, before the next ``generate`` / ``chat``.
The transport follows the tensors' device: CUDA tensors over ``cuda_ipc`` (workers on the
trainer's node), others over ``shm`` (workers on the trainer's host); ``transport="nccl"`` or
``"gloo"`` (with ``master_addr``) for workers on other hosts.

Each round's ``SyncReport`` is kept in ``syncs`` and each generation's weight versions in
``generations``, so a run can check that every batch came from the weights synced before it.

The broker's address: ``broker=`` (here or in ``use``), else ``$ZMQ_ROLLOUT_BROKER``, else a
``tcp://`` ``base_url`` (TRL's ``vllm_server_base_url``). Not served: images
(``image_features``, ``features=``), ``get_sequence_logprobs``, tools and chat templates in
``chat``: each raises ``NotImplementedError`` naming itself.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zmq_rollout.blocking import RolloutClient
from zmq_rollout.errors import BrokerUnavailableError, ConfigError, RolloutTimeoutError
from zmq_rollout.weight_sync import SyncReport

from .trl_shapes import chat_messages, sampling_params, trl_output

__all__ = ["BROKER_ENV", "Generation", "VLLMClient", "restore", "use"]

log = logging.getLogger(__name__)

BROKER_ENV = "ZMQ_ROLLOUT_BROKER"
HISTORY = 10_000
"""Rounds and generations remembered (``syncs``, ``generations``): a long run's memory stays bounded."""

_TRL_MODULES = ("trl.generation.vllm_client", "trl.generation.vllm_generation")
_defaults: dict[str, Any] = {}
_originals: dict[str, Any] = {}


@dataclass
class Generation:
    """One ``generate`` / ``chat`` call: the version last synced and those its samples carry."""

    synced_version: int
    weight_versions: list[int]
    num_samples: int


class VLLMClient:
    """TRL 1.16's ``VLLMClient`` over a zmq-rollout broker (the module's docstring says how)."""

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
        *,
        broker: str | None = None,
        transport: str | None = None,
        master_addr: str | None = None,
        pause: str | None = None,
        sync_timeout_s: float | None = None,
    ) -> None:
        self.broker = _broker_address(broker, base_url)
        self.base_url = self.broker
        self.host, self.server_port, self.group_port = host, server_port, group_port
        self.transport: str | None = transport or _defaults.get("transport")
        self.master_addr = master_addr or _defaults.get("master_addr")
        self.pause: str = pause or _defaults.get("pause") or "wait"
        self.sync_timeout_s: float = sync_timeout_s or _defaults.get("sync_timeout_s") or 60.0
        self.communicator: str | None = None
        self.syncs: deque[SyncReport] = deque(maxlen=HISTORY)
        self.generations: deque[Generation] = deque(maxlen=HISTORY)
        self.weight_version = 0
        self._pending: dict[str, Any] = {}
        self._updating_weights = False
        self._client = RolloutClient(self.broker, name="trl")
        atexit.register(self.close)
        try:
            self.check_server(connection_timeout)
            status = self._client.status()
        except BaseException:
            self.close()
            raise
        self.model = status.workers[0].model
        self.weight_version = status.fleet_version

    # -- the server ------------------------------------------------------------------------

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        """Wait until the broker answers with at least one worker; ``ConnectionError`` after
        ``total_timeout`` seconds (TRL's meaning: the server is up when it can generate)."""
        deadline = time.monotonic() + total_timeout
        while True:
            try:
                if self._client.status().workers:
                    return
                why = "it has no worker yet"
            except (BrokerUnavailableError, RolloutTimeoutError) as exc:
                why = str(exc)
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"the zmq-rollout broker at {self.broker} is not ready after {total_timeout} s: {why}. "
                    "Start it with `zmq-rollout broker` and workers with `zmq-rollout worker`."
                )
            time.sleep(min(retry_interval, max(0.0, deadline - time.monotonic())))

    def get_world_size(self) -> int:
        """The number of workers (each one engine); TRL's is the one server's ranks."""
        return len(self._client.status().workers)

    def get_server_info(self) -> dict[str, Any]:
        """The part of vLLM's ``/server_info`` that TRL reads: workers report processed logprobs."""
        status = self._client.status()
        max_len = max((w.max_model_len for w in status.workers), default=0)
        return {
            "model_config": {"model": self.model, "logprobs_mode": "processed_logprobs", "max_model_len": max_len},
            "weight_transfer_config": {"backend": self.transport or "auto"},
        }

    # -- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        features: list[dict[str, Any] | None] | None = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Completions of ``prompts`` (text or token ids), ``n`` each, as TRL's ``generate``."""
        if features is not None and any(f is not None for f in features):
            raise NotImplementedError("image features (multimodal prompts) are not served by zmq-rollout yet")
        params = sampling_params(
            n=n,
            repetition_penalty=repetition_penalty,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured_outputs_regex=structured_outputs_regex,
            generation_kwargs=generation_kwargs,
        )
        return self._run(list(prompts), params, logprobs)

    def chat(
        self,
        messages: list[list[dict[str, Any]]],
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        chat_template: str | None = None,
        max_concurrent_requests: int = 64,
    ) -> dict[str, Any]:
        """Completions of conversations (the workers apply the model's chat template), as TRL's ``chat``."""
        for name, value in (("chat_template_kwargs", chat_template_kwargs), ("tools", tools)):
            if value:
                raise NotImplementedError(f"chat(..., {name}=...) is not served by zmq-rollout yet")
        if chat_template is not None:
            raise NotImplementedError("chat(..., chat_template=...) is not served by zmq-rollout yet")
        params = sampling_params(
            n=n,
            repetition_penalty=repetition_penalty,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured_outputs_regex=structured_outputs_regex,
            generation_kwargs=generation_kwargs,
        )
        return self._run([chat_messages(c) for c in messages], params, logprobs)

    def _run(self, prompts: list[Any], params: Any, logprobs: int | None) -> dict[str, Any]:
        self._flush()  # weights handed over must be live before anything is sampled
        rollouts = self._client.generate(prompts, params, min_weight_version=self.weight_version)
        versions = sorted({r.weight_version for r in rollouts})
        self.generations.append(Generation(self.weight_version, versions, len(rollouts)))
        return trl_output(rollouts, params.n, logprobs)

    def image_features(self, images: Any, max_concurrent_requests: int = 64) -> Any:
        raise NotImplementedError("image_features (multimodal prompts) is not served by zmq-rollout yet")

    def get_sequence_logprobs(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("get_sequence_logprobs (prompt logprobs) is not served by zmq-rollout yet")

    # -- weights ---------------------------------------------------------------------------

    def init_communicator(self, device: Any = 0) -> None:
        """Note the trainer's device; nothing to join (the round sets its transport up itself)."""
        self.communicator = str(device)

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """Groups ``update_named_param`` calls: one round when the block ends."""
        self._updating_weights = True
        try:
            yield
        finally:
            self._updating_weights = False
        self._flush()

    def update_named_param(self, name: str, weights: Any) -> None:
        """Hold ``weights`` for the step's round (see the module docstring for when it goes)."""
        self._pending[name] = weights.detach()

    def update_named_params(self, metadata: Any, named_params: Iterable[tuple[str, Any]]) -> None:
        """Hold every ``(name, tensor)`` for the step's round; ``metadata`` is TRL's, unused."""
        for name, tensor in named_params:
            self.update_named_param(name, tensor)

    def update_model_params(self, model: Any) -> None:
        """Push the model's parameters (and anything held) in one round now."""
        self.update_named_params(None, ((name, p.data) for name, p in model.named_parameters()))
        self._flush()

    def reset_prefix_cache(self) -> None:
        """TRL calls this after each sync: the round goes now. Workers reset their prefix cache
        themselves when weights change, so there is nothing else to do."""
        self._flush()

    def close_communicator(self) -> None:
        """Forget the device; tensors still held are dropped."""
        self._pending.clear()
        self.communicator = None

    def close(self) -> None:
        """Close the broker connection (also at exit)."""
        atexit.unregister(self.close)
        self._client.close()

    def _flush(self) -> None:
        if not self._pending or self._updating_weights:
            return
        pairs = list(self._pending.items())
        self._pending.clear()
        transport = self.transport or ("cuda_ipc" if any(t.is_cuda for _, t in pairs) else "shm")
        report = self._client.update_weights(
            pairs, transport=transport, pause=self.pause, timeout_s=self.sync_timeout_s, master_addr=self.master_addr
        )
        self.syncs.append(report)
        self.weight_version = report.version
        if report.workers_evicted:
            log.warning("weight sync %d evicted %s", report.version, report.workers_evicted)
        log.info(
            "weights version %d: %d tensors over %s in %.2f s", report.version, len(pairs), transport, report.seconds
        )


def _broker_address(broker: str | None, base_url: str | None) -> str:
    address = broker or _defaults.get("broker") or os.environ.get(BROKER_ENV)
    if not address and base_url and base_url.startswith("tcp://"):
        address = base_url
    if not address:
        raise ConfigError(
            f"no zmq-rollout broker address: pass use(broker='tcp://HOST:5555'), set ${BROKER_ENV}, "
            "or give TRL a tcp:// vllm_server_base_url"
        )
    return address


def use(broker: str | None = None, **options: Any) -> type[VLLMClient]:
    """Have TRL build this ``VLLMClient`` wherever it builds its own (``vllm_mode="server"``).

    ``broker``: the broker's client address (else ``$ZMQ_ROLLOUT_BROKER`` or a ``tcp://``
    ``vllm_server_base_url``). ``options``: defaults for the constructor's own keywords
    (``transport``, ``master_addr``, ``pause``, ``sync_timeout_s``). ``restore()`` undoes it.
    """
    import importlib

    unknown = set(options) - {"transport", "master_addr", "pause", "sync_timeout_s"}
    if unknown:
        raise TypeError(f"use() got unknown options {sorted(unknown)}")
    _defaults.clear()
    _defaults.update({"broker": broker, **options})
    for name in _TRL_MODULES:
        module = importlib.import_module(name)
        _originals.setdefault(name, module.VLLMClient)
        module.VLLMClient = VLLMClient  # type: ignore[attr-defined]
    return VLLMClient


def restore() -> None:
    """Give TRL its own ``VLLMClient`` back."""
    import importlib

    for name, original in _originals.items():
        importlib.import_module(name).VLLMClient = original  # type: ignore[attr-defined]
    _originals.clear()
    _defaults.clear()
