"""Settings of each component, with defaults a demanding user can keep.

Every timeout error names the setting here that changes it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BrokerConfig:
    frontend: str = "tcp://*:5555"
    """Where clients (trainers) connect."""
    backend: str = "tcp://*:5556"
    """Where workers connect."""
    heartbeat_interval: float = 1.0
    """Seconds between the broker's heartbeats to workers, and its expiry checks."""
    worker_liveness: int = 5
    """A worker silent for ``heartbeat_interval * worker_liveness`` seconds is purged and its jobs requeued."""
    client_expiry: float = 60.0
    """A client silent this long is treated as gone: its queued and running jobs are dropped."""
    max_queue_per_client: int = 100_000
    """Queued (not yet dispatched) jobs per client before its submissions get BUSY."""
    max_queue_total: int = 1_000_000
    """Queued jobs across all clients before any submission gets BUSY (bounds memory)."""
    max_attempts: int = 3
    """A job whose worker dies this many times in a row fails instead of being requeued again."""
    max_message_bytes: int = 64 << 20
    """Larger messages are refused with an error (weight data does not pass through the broker)."""
    round_idle_timeout: float = 300.0
    """A weight-sync round whose trainer sends no step for this long is aborted (its workers resume)."""
    metrics_port: int | None = None
    """Port of the Prometheus ``/metrics`` endpoint (None: no endpoint)."""
    metrics_host: str = "0.0.0.0"
    """Interface of the ``/metrics`` endpoint (127.0.0.1 keeps it local)."""

    @property
    def worker_expiry(self) -> float:
        return self.heartbeat_interval * self.worker_liveness


@dataclass
class ClientConfig:
    address: str = "tcp://127.0.0.1:5555"
    """The broker's frontend."""
    timeout: float | None = 600.0
    """Seconds a ``generate``/``result`` call waits for its jobs (None: no limit)."""
    request_timeout: float = 10.0
    """Seconds a control call (``status``) waits for the broker's answer."""
    heartbeat_interval: float = 5.0
    """Seconds between the client's heartbeats; the broker drops a client's jobs after ``client_expiry``."""
    batch_size: int = 512
    """Jobs per SUBMIT message when a call submits many."""
    name: str = ""
    """A label for this client in the broker's status and metrics."""


@dataclass
class WorkerConfig:
    broker: str = "tcp://127.0.0.1:5556"
    """The broker's backend."""
    model: str = ""
    """Path of the model (a local folder; nothing is fetched from a hub)."""
    name: str = ""
    """This worker's name in status and results (default: host-pid)."""
    gpus: str = ""
    """Comma-separated GPU ids; empty: no GPU (the CPU build of vLLM)."""
    tensor_parallel_size: int = 1
    """GPUs per engine. ``--gpus 0,1`` with TP 1 runs two engines, with TP 2 one engine."""
    max_num_seqs: int = 64
    """Sequences one engine runs at once; the worker announces this many credits per engine."""
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory for vLLM (on CPU: fraction of RAM for the KV cache)."""
    dtype: str = "auto"
    enforce_eager: bool = True
    attention_backend: str | None = None
    """vLLM attention backend (e.g. TRITON_ATTN); None lets vLLM choose."""
    heartbeat_interval: float = 1.0
    broker_liveness: int = 5
    """The worker reconnects fresh after ``heartbeat_interval * broker_liveness`` seconds of broker silence."""
    metrics_port: int | None = None
    seed: int = 0
    enable_lora: bool = False
    """Serve LoRA adapters pushed with ``update_lora`` (jobs name one in ``lora``)."""
    max_lora_rank: int = 16
    """Largest adapter rank (vLLM accepts 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    max_loras: int = 1
    """Adapters one batch may mix; each pushed adapter stays loaded (``max_cpu_loras`` 4 times this)."""
