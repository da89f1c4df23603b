"""The zmq-rollout wire protocol, version 1 (``ZR1``): commands and message bodies.

One module per part of the contract, all re-exported here (``from zmq_rollout import
protocol as p``; ``p.SUBMIT``, ``p.JobSpec``, ``p.Commit``):

- ``commands``: the frames and the one-byte commands;
- ``base``: the Struct base every body derives from, the limits, the range checks;
- ``jobs``: jobs and their answers (SUBMIT, JOBS, PARTIAL, FINAL, ERROR);
- ``sealed_jobs``: jobs the broker forwards unread (SEALED_SUBMIT; JOBS as a worker opens them);
- ``relays``: answers as the broker relays them without decoding their tokens (SEALED_FINAL);
- ``fleet``: READY and STATUS_REPLY;
- ``steps``: the steps of a weight-sync round, one tagged Struct each, and what they carry;
- ``sync``: the messages of a round (SYNC, SYNC_REPLY, CONTROL, CONTROL_ACK).

docs/protocol.md documents each for implementers in other languages; its examples are
generated from these Structs (``scripts/protocol_examples.py``).
"""

from .base import (
    MAX_JOB_ID,
    MAX_JOBS_PER_MESSAGE,
    MAX_LORA_NAME,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_STOP,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    MAX_VERSION,
    Struct,
    encode_trimmed,
)
from .commands import (
    ACCEPTED,
    BUSY,
    CANCEL,
    COMMAND_NAMES,
    CONTROL,
    CONTROL_ACK,
    CREDIT,
    DISCONNECT,
    ERROR,
    FINAL,
    HEARTBEAT,
    JOBS,
    PARTIAL,
    READY,
    SEALED_FINAL,
    SEALED_SUBMIT,
    SIGNATURE,
    STATUS,
    STATUS_REPLY,
    SUBMIT,
    SYNC,
    SYNC_REPLY,
)
from .fleet import ClientStatus, JobTotals, Liveness, StatusReply, WorkerInfo, WorkerStatus
from .jobs import (
    Assignment,
    AssignmentRelay,
    ChatMessage,
    Delta,
    ErrorItem,
    JobRelay,
    JobSpec,
    Result,
    Sample,
    SamplingParams,
    StructuredOutput,
)
from .relays import (
    SEAL_MIN_TOKENS,
    DeltaRelay,
    ResultRelay,
    SealedResult,
    SplicedFinal,
    final_item,
    seal,
    splice_into,
    worth_sealing,
)
from .sealed_jobs import SEALED_JOBS, SealedAssignment, SealedJob, sealed_job, unseal
from .steps import (
    BACKENDS,
    DTYPE_SIZES,
    PAUSE_MODES,
    SYNC_OPS,
    UNKNOWN_LAYOUT,
    Abort,
    AckResult,
    AnySyncOp,
    Begin,
    BeginUpdate,
    Bucket,
    CheckNames,
    Commit,
    CudaIpcHandle,
    FinishUpdate,
    IpcSource,
    JoinGroup,
    LeaveGroup,
    LoadIpc,
    LoadIpcTensors,
    LoadLora,
    LoadShm,
    LoraBucket,
    NameCheck,
    ReceiveBucket,
    SyncOp,
    TensorMeta,
)
from .sync import Control, ControlAck, Evicted, SyncReply, SyncStep, WorkerAck
from .token_bins import TOKEN_BINS, as_array, from_bin, to_bin

__all__ = [
    "ACCEPTED", "BACKENDS", "BUSY", "CANCEL", "COMMAND_NAMES", "CONTROL", "CONTROL_ACK", "CREDIT",
    "DISCONNECT", "DTYPE_SIZES", "ERROR", "FINAL", "HEARTBEAT", "JOBS", "MAX_JOBS_PER_MESSAGE", "MAX_JOB_ID",
    "MAX_LORA_NAME", "MAX_MESSAGES", "MAX_N", "MAX_PROMPT_CHARS", "MAX_PROMPT_TOKENS", "MAX_STOP", "MAX_TOKENS",
    "MAX_TOP_LOGPROBS", "MAX_VERSION", "PARTIAL", "PAUSE_MODES", "READY", "SEALED_FINAL", "SEALED_JOBS",
    "SEALED_SUBMIT", "SEAL_MIN_TOKENS",
    "SIGNATURE", "STATUS", "STATUS_REPLY", "SUBMIT", "SYNC", "SYNC_OPS", "SYNC_REPLY", "TOKEN_BINS", "UNKNOWN_LAYOUT",
    "Abort", "AckResult", "AnySyncOp", "Assignment", "AssignmentRelay", "Begin", "BeginUpdate", "Bucket",
    "ChatMessage", "CheckNames", "ClientStatus", "Commit", "Control", "ControlAck", "CudaIpcHandle", "Delta",
    "DeltaRelay", "ErrorItem", "Evicted", "FinishUpdate", "IpcSource", "JobRelay", "JobSpec", "JobTotals", "JoinGroup",
    "LeaveGroup", "Liveness", "LoadIpc", "LoadIpcTensors",
    "LoadLora", "LoadShm", "LoraBucket", "NameCheck", "ReceiveBucket", "Result", "ResultRelay", "Sample",
    "SamplingParams", "SealedAssignment", "SealedJob", "SealedResult", "SplicedFinal", "StatusReply", "Struct",
    "StructuredOutput", "SyncOp", "SyncReply", "SyncStep", "TensorMeta",
    "WorkerAck", "WorkerInfo", "WorkerStatus", "as_array", "encode_trimmed", "final_item", "from_bin", "seal",
    "sealed_job", "splice_into", "to_bin", "unseal", "worth_sealing",
]  # fmt: skip
