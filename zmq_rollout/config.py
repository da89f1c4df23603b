"""Settings of each component, with defaults a demanding user can keep.

Each dataclass is the one source of its settings: the command line (``zmq-rollout broker``,
``worker``, ``generate``, ``status``) is generated from its fields, with each field's
docstring as its ``--help`` (``zmq_rollout.settings``), and so are the arguments of the
worker processes a parent starts. Times are in seconds and their names end in ``_s``.
Every timeout error names the setting here that changes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class BrokerConfig:
    frontend: str = "tcp://*:5555"
    """Where clients (trainers) connect."""
    backend: str = "tcp://*:5556"
    """Where workers connect."""
    heartbeat_interval_s: float = 1.0
    """Seconds between the broker's heartbeats to workers, and its expiry checks."""
    worker_liveness: int = 5
    """A worker silent for heartbeat_interval_s x worker_liveness is purged and its jobs requeued."""
    client_expiry_s: float = 60.0
    """A client silent this long is treated as gone: its queued and running jobs are dropped."""
    max_queue_per_client: int = 100_000
    """Queued (not yet dispatched) jobs per client before its submissions get BUSY."""
    max_queue_total: int = 1_000_000
    """Queued jobs across all clients before any submission gets BUSY (bounds memory)."""
    max_attempts: int = 3
    """A job whose worker dies this many times in a row fails instead of being requeued again."""
    max_stale_restarts: int = 3
    """A job with max_staleness and on_stale="restart" runs again at most this many times, then fails as stale."""
    max_message_bytes: int = 64 << 20
    """Larger client messages are refused with an error (weight data does not pass through the broker)."""
    affinity: bool = True
    """Send a session's next turn (jobs with a session_id) to the worker that served its last, whose prefix
    cache holds its prompt; --no-affinity: least loaded first only (sessions are still counted)."""
    affinity_wait_s: float = 0.05
    """How long a session's turn waits for its worker when that worker is full (others' jobs go on meanwhile);
    then it goes to the least loaded worker. 0: never wait. About the time a busy engine takes to free a credit,
    and less than recomputing a long prefix costs."""
    session_idle_s: float = 300.0
    """A session with no turn for this long is forgotten (its next turn goes anywhere)."""
    max_sessions: int = 100_000
    """Sessions remembered at most (about 300 bytes each: 30 MB at most); beyond it the least recently used is
    forgotten."""
    round_idle_timeout_s: float = 300.0
    """A weight-sync round whose trainer sends no step for this long is aborted (its workers resume)."""
    metrics_port: int | None = None
    """Port of the Prometheus /metrics endpoint (none: no endpoint; 0: any free port)."""
    metrics_host: str = "127.0.0.1"
    """Interface of the /metrics endpoint (0.0.0.0 opens it to every network; the deploy files do)."""
    curve_secret_key: str = ""
    """The broker's keypair file (NAME.key_secret, from zmq-rollout keys generate); with allow_keys, both
    ports accept only CurveZMQ peers (encrypted, authenticated). Empty: plaintext, open to anyone who connects."""
    allow_keys: str = ""
    """A folder of the public key files (*.key) of the clients and workers let in; read again when it changes."""
    busy_poll_us: int | None = None
    """After a pass that handled messages, poll without sleeping for up to this many microseconds: a reply that
    comes back meanwhile (a worker's result for the job just sent) is read by a running broker instead of waking a
    sleeping one, about 150 us less per round trip. Costs up to that much CPU per quiet gap (counted in
    zmq_rollout_broker_busy_poll_seconds_total); it polls only while the machine has a core to spare and its messages
    carry fewer than 8 jobs each. 0: never; default: 250 in its own process, 0 on a thread of another process's
    (BrokerThread), where spinning would take the GIL from that process's threads."""
    pack_step: int | None = None
    """While the broker spends over half of its time working (it, not the engines, sets the pace), a worker takes up
    to this many more credits of jobs before the next gets any, so that jobs travel in blocks (a job costs about
    one message instead of three with many workers); below a quarter, least loaded first again. 1: always least
    loaded first; default: 64 (a default worker's credits) in its own process, 1 on a thread of another
    process's (BrokerThread), whose passes also wait for that process's threads (docs/architecture.md,
    broker/packing.py)."""

    heap_keep_mib: int | None = None
    """Freed memory, in MiB, that the broker's process keeps for its next messages instead of giving it back to the
    kernel (glibc malloc's trim threshold; blocks below it, up to 32 MiB, come from the heap, not a fresh mmap):
    relaying large messages (long rollouts, prompts of token ids) then costs no page faults per pass. 0: the
    allocator's own thresholds; default: 64 in its own process, 0 on a thread of another process's (BrokerThread),
    whose allocator is that program's (broker/heap_keep.py)."""

    def __post_init__(self) -> None:
        keep = self.heap_keep_mib
        if keep is not None and not (type(keep) is int and 0 <= keep <= 1 << 20):
            raise ValueError(f"BrokerConfig.heap_keep_mib must be an int in 0..1048576 (MiB), not {keep!r}")
        for name in ("affinity_wait_s", "session_idle_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"BrokerConfig.{name} must be a finite number of seconds >= 0, got {value!r}")
        if not (isinstance(self.max_sessions, int) and self.max_sessions >= 1):
            raise ValueError(f"BrokerConfig.max_sessions must be a positive integer, got {self.max_sessions!r}")
        if not (type(self.max_stale_restarts) is int and self.max_stale_restarts >= 0):
            raise ValueError(f"BrokerConfig.max_stale_restarts must be an int >= 0, not {self.max_stale_restarts!r}")
        step = self.pack_step
        if step is not None and not (type(step) is int and step >= 1):
            raise ValueError(f"BrokerConfig.pack_step must be an int >= 1 (1: never pack), not {step!r}")
        spin = self.busy_poll_us
        if spin is not None and not (type(spin) is int and 0 <= spin <= 1_000_000):
            raise ValueError(f"BrokerConfig.busy_poll_us must be an int in 0..1000000 (microseconds), not {spin!r}")

    @property
    def worker_expiry_s(self) -> float:
        return self.heartbeat_interval_s * self.worker_liveness


@dataclass
class ClientConfig:
    address: str = "tcp://127.0.0.1:5555"
    """The broker's frontend."""
    timeout_s: float = 600.0
    """Seconds a generate() or submit() call waits for its jobs (inf: no limit)."""
    request_timeout_s: float = 10.0
    """Seconds a control call (status, a sync step beyond its own timeout) waits for the broker."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats; the broker answers each (and drops a client silent past client_expiry_s)."""
    broker_liveness: int = 5
    """The broker counts as lost after heartbeat_interval_s x broker_liveness without a word (a sync step fails)."""
    broker_timeout_s: float = 30.0
    """Pending calls fail with BrokerUnavailableError once the broker has been lost this long."""
    batch_size: int = 512
    """Jobs per SUBMIT message at most when a call submits many (1..4096)."""
    max_message_bytes: int = 64 << 20
    """Bytes per SUBMIT message at most: the broker's max_message_bytes (keep them equal or this smaller)."""
    name: str = ""
    """A label for this client in the broker's status and metrics (default: client)."""
    curve_server_key: str = ""
    """The broker's public key file (BROKER.key), for a broker that requires CurveZMQ (with curve_secret_key)."""
    curve_secret_key: str = ""
    """This client's keypair file (NAME.key_secret, from zmq-rollout keys generate; its .key on the broker's list)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "request_timeout_s", "heartbeat_interval_s", "broker_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
                raise ValueError(f"ClientConfig.{name} must be a positive number of seconds, got {value!r}")
        if not (isinstance(self.batch_size, int) and 0 < self.batch_size <= 4096):
            raise ValueError(f"ClientConfig.batch_size must be an integer in 1..4096, got {self.batch_size!r}")
        if not (isinstance(self.max_message_bytes, int) and self.max_message_bytes >= 1024):
            raise ValueError(f"ClientConfig.max_message_bytes must be at least 1024, got {self.max_message_bytes!r}")


@dataclass
class WorkerConfig:
    broker: str = "tcp://127.0.0.1:5556"
    """The broker's backend."""
    model: str = ""
    """Path of the model (a local folder; nothing is fetched from a hub)."""
    name: str = ""
    """This worker's name in status and results (default: host-pid)."""
    gpus: str = ""
    """Comma-separated GPU ids, e.g. 0,1 (empty: vLLM's default device; the CPU build uses the CPU)."""
    tensor_parallel_size: int = 1
    """GPUs per engine: --gpus 0,1 with 1 runs two engines, with 2 one engine over both."""
    max_num_seqs: int = 64
    """Sequences one engine runs at once (vLLM's max_num_seqs); the worker announces this many credits, plus
    extra_credits."""
    extra_credits: int = 0
    """Credits announced beyond max_num_seqs: jobs that wait in the engine's own queue, so that a sequence that ends
    is followed at the engine's next step, not after a round trip to the broker and the new job's preprocessing
    (the gap when many sequences end together, as at max_tokens). They are jobs the broker can no longer give to an
    idle worker instead, and a wait-mode pause drains them too. 0 by default: on one H100 with the broker on the same
    host, 256 more did not change the 0.5B pairs (benchmarks/README.md, nineteenth session); a remote broker's
    round trip is longer."""
    max_model_len: int = 2048
    """Longest prompt + completion in tokens."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use on a GPU; the KV cache gets what the model leaves (unless kv_cache_gib)."""
    kv_cache_gib: float | None = None
    """KV-cache size in GiB (vLLM's kv_cache_memory_bytes); none: on a GPU from gpu_memory_utilization, on a
    CPU 2 GiB (so several workers fit one machine). Set it when engines share a GPU: it skips vLLM's memory
    profiling, which counts the other engines' memory as its own."""
    dtype: str = "auto"
    """Model dtype (auto: the checkpoint's)."""
    enforce_eager: bool = True
    """No CUDA graphs or torch.compile (faster start; --no-enforce-eager for throughput)."""
    attention_backend: str | None = None
    """vLLM attention backend (e.g. TRITON_ATTN); none lets vLLM choose."""
    heartbeat_interval_s: float = 1.0
    """Seconds between the worker's heartbeats to the broker."""
    broker_liveness: int = 5
    """The worker reconnects fresh after heartbeat_interval_s x broker_liveness of broker silence."""
    metrics_port: int | None = None
    """Port of this worker's /metrics (with --gpus, engine i uses this + i; none: no endpoint)."""
    metrics_host: str = "127.0.0.1"
    """Interface of this worker's /metrics (0.0.0.0 opens it to every network; the deploy files do)."""
    vllm_metrics: bool = True
    """With metrics_port: serve the engine's own vllm: families too. vLLM keeps those statistics in its front end,
    in the worker's process, per step and token (about a tenth more of a busy worker's CPU at 0.5B and 512
    sequences: benchmarks/README.md); --no-vllm-metrics serves only zmq_rollout_worker_*."""
    seed: int = 0
    """vLLM's engine seed."""
    enable_lora: bool = False
    """Serve LoRA adapters pushed with update_lora (jobs name one in lora=)."""
    max_lora_rank: int = 16
    """Largest adapter rank (vLLM accepts 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    max_loras: int = 1
    """Adapters one batch may mix; each pushed adapter stays loaded (max_cpu_loras is 4 times this)."""
    curve_server_key: str = ""
    """The broker's public key file (BROKER.key), for a broker that requires CurveZMQ (with curve_secret_key)."""
    curve_secret_key: str = ""
    """This worker's keypair file (NAME.key_secret, from zmq-rollout keys generate; its .key on the broker's list)."""

    def __post_init__(self) -> None:
        extra = self.extra_credits
        if not (type(extra) is int and 0 <= extra <= 1 << 16):
            raise ValueError(f"WorkerConfig.extra_credits must be an int in 0..65536, not {extra!r}")

    @property
    def broker_expiry_s(self) -> float:
        return self.heartbeat_interval_s * self.broker_liveness
