"""One vLLM AsyncLLM engine, and the translation between our jobs and vLLM's requests.

Only stable AsyncLLM APIs are used (``from_engine_args``, ``generate``, ``abort``,
``reset_prefix_cache``, ``collective_rpc``, ``errored``), so the same code runs on vLLM
0.25.1 (CUDA) and 0.32.0 (CPU); engine arguments newer than 0.25 are feature-detected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.config import WorkerConfig

log = logging.getLogger(__name__)


class InvalidJob(ValueError):
    """The job cannot run on this engine (too long, token id out of range, ...)."""


class EngineStartError(RuntimeError):
    """vLLM's engine did not start; the message names the likely causes and their settings."""

    def __init__(self, config: WorkerConfig, cause: BaseException) -> None:
        kv = "vLLM's choice" if config.kv_cache_gib is None else f"{config.kv_cache_gib} GiB"
        super().__init__(
            f"the vLLM engine for {config.model!r} did not start ({type(cause).__name__}: {cause}). Likely causes: "
            f"(1) memory: the KV cache (--kv-cache-gib, now {kv}) or --gpu-memory-utilization "
            f"({config.gpu_memory_utilization}) does not fit beside the model and the other engines on this machine; "
            f"(2) --model is not a local model folder (config.json and *.safetensors); "
            f"(3) the model is one this vLLM cannot run (architecture, head size, dtype {config.dtype!r}); "
            "vLLM's log above has the root cause"
        )


def engine_args(config: WorkerConfig) -> Any:
    """``AsyncEngineArgs`` for ``config``; arguments this vLLM lacks are left out."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    wanted: dict[str, Any] = {
        "model": config.model,
        "tensor_parallel_size": config.tensor_parallel_size,
        "max_num_seqs": config.max_num_seqs,
        "max_model_len": config.max_model_len,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "kv_cache_memory_bytes": _kv_cache_bytes(config),
        "dtype": config.dtype,
        "enforce_eager": config.enforce_eager,
        "seed": config.seed,
        "logprobs_mode": "processed_logprobs",  # logprobs after temperature/top-k/top-p
        "max_logprobs": p.MAX_TOP_LOGPROBS,
        "disable_log_stats": True,
        "enable_prefix_caching": True,
        "worker_extension_cls": "zmq_rollout.workers.extension.WeightSyncExtension",
    }
    if config.attention_backend:
        wanted["attention_backend"] = config.attention_backend
    if config.enable_lora:
        wanted.update(
            enable_lora=True,
            max_lora_rank=config.max_lora_rank,
            max_loras=config.max_loras,
            max_cpu_loras=4 * config.max_loras,  # pushed adapters are not evicted by a few others
        )
    if _on_cpu():
        # vLLM's CPU runner crashes the whole engine when a *seeded* request's prefill is
        # split into chunks ("CPU Generator does not use offset"). No chunking, and a token
        # budget that holds any whole prompt, keeps seeded sampling safe there.
        wanted["enable_chunked_prefill"] = False
        wanted["max_num_batched_tokens"] = max(config.max_model_len, 2048)
    dropped = sorted(k for k in wanted if k not in fields)
    if dropped:
        log.info("this vLLM has no engine argument(s) %s; left out", ", ".join(dropped))
    return AsyncEngineArgs(**{k: v for k, v in wanted.items() if k in fields})


CPU_KV_CACHE_GIB = 2.0
"""The KV cache of a CPU engine unless ``kv_cache_gib`` says otherwise: vLLM's own default,
``gpu_memory_utilization`` of the machine's RAM per engine, lets two engines OOM one machine."""


def _kv_cache_bytes(config: WorkerConfig) -> int | None:
    gib = config.kv_cache_gib
    if gib is None and _on_cpu():
        gib = CPU_KV_CACHE_GIB
    return None if gib is None else int(gib * (1 << 30))


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def stat_loggers_for(config: WorkerConfig) -> list[Any]:
    """vLLM's ``stat_loggers`` for this worker: its Prometheus logger when the worker serves
    ``/metrics`` with vLLM's families (``WorkerConfig.vllm_metrics``); else none, and vLLM
    keeps no statistics (they cost its front end CPU per step and token)."""
    from .vllm_metrics import stat_loggers

    return stat_loggers() if config.metrics_port is not None and config.vllm_metrics else []


class Engine:
    """An AsyncLLM plus what the worker needs around it: tokenizing, limits, results."""

    def __init__(self, config: WorkerConfig) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from .vllm_metrics import vllm_registry

        self.config = config
        loggers = stat_loggers_for(config)
        try:
            self.llm = AsyncLLM.from_engine_args(engine_args(config), stat_loggers=loggers or None)
        except Exception as exc:
            raise EngineStartError(config, exc) from exc
        self.vllm_metrics = vllm_registry() if loggers else None
        """Where vLLM's own metrics are (``workers/vllm_metrics.py``); None: not recorded."""
        vcfg = self.llm.vllm_config
        self.max_model_len: int = vcfg.model_config.max_model_len
        self.vocab_size: int = vcfg.model_config.get_vocab_size()
        self.max_num_seqs: int = vcfg.scheduler_config.max_num_seqs
        self.tokenizer = self.llm.get_tokenizer()
        self.weight_version = 0
        self.pause_epoch = 0  # bumped by every pause; a job that sees it change was preempted
        self.pause_mode = ""
        self._running = asyncio.Event()
        self._running.set()
        self._cache_cleared = False
        self._scheduler_paused = False  # vLLM's own pause, which ``resume_scheduler`` may end before ``resume``
        self.loras: dict[str, Any] = {}  # adapter name -> the LoRARequest jobs naming it use
        self._lora_dir: str | None = None

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    def prompt_ids(self, job: p.JobSpec) -> list[int]:
        if job.prompt_token_ids is not None:
            ids = job.prompt_token_ids
        elif job.prompt is not None:
            ids = self.tokenizer.encode(job.prompt)
        else:
            assert job.messages is not None
            text: Any = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in job.messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        keep = job.sampling.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]  # as vLLM's truncate_prompt_tokens: the last ``keep`` tokens
        if max(ids) >= self.vocab_size:
            raise InvalidJob(f"prompt token id {max(ids)} is out of range for a vocabulary of {self.vocab_size}")
        if job.lora is not None and job.lora not in self.loras:
            raise InvalidJob(
                f"LoRA adapter {job.lora!r} is not loaded on this worker "
                + ("(push it with update_lora)" if self.config.enable_lora else "(started without --enable-lora)")
            )
        if len(ids) + job.sampling.max_tokens > self.max_model_len:
            raise InvalidJob(
                f"prompt ({len(ids)} tokens) + max_tokens ({job.sampling.max_tokens}) exceeds the model's "
                f"max_model_len of {self.max_model_len}"
            )
        return list(ids)

    # -- weight syncs ----------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        """Stop generating for a weight sync: ``abort`` cuts requests short (jobs continue
        after ``resume``), ``wait`` drains them, ``keep`` freezes them in place."""
        self.pause_epoch += 1
        self._running.clear()
        self.pause_mode = mode
        self._cache_cleared = False
        self._scheduler_paused = True
        pause_scheduler = getattr(getattr(self.llm, "engine_core", None), "pause_scheduler_async", None)
        if mode == "wait" and pause_scheduler is not None:
            # Our jobs are drained already (SyncParticipant): nothing can be in flight, so
            # skip pause_generation's grace sleep for late outputs (20 ms of every sync).
            await pause_scheduler(mode=mode, clear_cache=True)
            return
        await self.llm.pause_generation(mode=mode, clear_cache=mode != "keep")  # type: ignore[arg-type]

    async def clear_prefix_cache(self) -> None:
        """While paused: drop cached KV (computed under the old weights); ``resume`` then
        skips it. Not in keep mode, whose requests keep their KV by design."""
        if self.paused and self.pause_mode != "keep":
            self._cache_cleared = bool(await self.llm.reset_prefix_cache())

    async def resume_scheduler(self) -> None:
        """Let vLLM's scheduler run again while this worker's own pause holds (jobs still wait
        for ``resume``): for a ``wait``-mode round, whose engine holds no request, sent with the
        last bucket's load so that ``commit`` makes no call into the engine."""
        if self._scheduler_paused:
            self._scheduler_paused = False
            await self.llm.resume_generation()

    async def resume(self) -> None:
        if self._running.is_set():
            return
        if self.pause_mode != "keep" and not self._cache_cleared:
            await self.llm.reset_prefix_cache()  # KV computed under the old weights must not be reused
        self._cache_cleared = False
        await self.resume_scheduler()
        self._running.set()

    async def resumed(self) -> None:
        await self._running.wait()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def sync_in_engine(self, control: p.Control) -> list[Any]:
        """Run a data step of a weight-sync round in every engine worker process (one per
        TP rank; ``WeightSyncExtension.zr_sync``); their results, in rank order."""
        return list(await self.llm.collective_rpc("zr_sync", args=(codec.encode_body(control),)))

    def checkpoint_names(self) -> set[str]:
        """Tensor names in the model folder's safetensors files (what a trainer must send)."""
        from pathlib import Path

        from safetensors import safe_open

        names: set[str] = set()
        for path in sorted(Path(self.config.model).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        return names

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            await self.llm.abort(request_ids)

    def lora_request(self, name: str | None) -> Any:
        return None if name is None else self.loras[name]

    async def load_lora(self, name: str, tensors: dict[str, Any], peft_config: dict[str, Any]) -> int:
        """Put adapter ``name`` into vLLM's LoRA slot for it, replacing what it held.

        vLLM loads adapters from a folder: the tensors and config are written to this
        worker's private folder for ``name`` (swapped in whole, so a reload after eviction
        never reads a half-written one), then ``add_lora`` with ``load_inplace`` replaces the
        slot's weights (older vLLM: remove, then add). The caller pauses generation first.
        """
        import tempfile

        from vllm.lora.request import LoRARequest

        if not self.config.enable_lora:
            raise ValueError("this worker was started without --enable-lora; it cannot load LoRA adapters")
        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="zr-lora-")
        known = self.loras.get(name)
        lora_id = known.lora_int_id if known is not None else len(self.loras) + 1
        path = write_adapter(self._lora_dir, name, tensors, peft_config)
        if "load_inplace" in getattr(LoRARequest, "__struct_fields__", ()):
            request = LoRARequest(name, lora_id, path, load_inplace=True)
        else:
            await self.llm.remove_lora(lora_id)
            request = LoRARequest(name, lora_id, path)
        if not await self.llm.add_lora(request):
            raise RuntimeError(f"vLLM did not load LoRA adapter {name!r}")
        self.loras[name] = LoRARequest(name, lora_id, path)  # jobs must not reload it every step
        log.info("LoRA adapter %r loaded (%d tensors, id %d)", name, len(tensors), lora_id)
        return len(tensors)

    def shutdown(self) -> None:
        import shutil

        self.llm.shutdown()
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)


def write_adapter(root: str, name: str, tensors: dict[str, Any], peft_config: dict[str, Any]) -> str:
    """Write a PEFT adapter folder ``root/<name>`` (safetensors + adapter_config.json) whole:
    into a fresh folder first, then swapped in by rename. Returns its path."""
    import json
    import os
    import shutil
    import tempfile
    import uuid

    from safetensors.torch import save_file

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "adapter"
    path = os.path.join(root, safe)
    staging = tempfile.mkdtemp(dir=root, prefix=f".{safe}.")
    # The tensors must not share memory (save_file refuses that): the worker's own copies do not.
    save_file(
        {k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(staging, "adapter_model.safetensors")
    )
    with open(os.path.join(staging, "adapter_config.json"), "w") as f:
        json.dump(peft_config, f)
    if os.path.exists(path):
        old = os.path.join(root, f".{safe}.old.{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
        os.rename(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, path)
    return path
