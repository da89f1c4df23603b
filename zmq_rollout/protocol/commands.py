"""The frames of a message and the one-byte commands the receiver demuxes on.

Every message is a list of ZeroMQ frames::

    [identity]  only on a ROUTER socket (added/removed by ZeroMQ)
    b"ZR1"      protocol signature and version
    command     one byte, below; the receiver demuxes on it before decoding anything
    header      one msgpack object, the command's body (``zmq_rollout.protocol``)
    blobs...    optional raw frames (no command uses them yet)

or, packed (docs/protocol.md section 2.0), the three middle ones as one frame::

    [identity]
    b"ZR1" + command + header
    blobs...
"""

from __future__ import annotations

SIGNATURE = b"ZR1"

# client -> broker
SUBMIT = b"\x01"  # list[JobSpec]; one or many jobs
CANCEL = b"\x02"  # list[str] job ids (client) / list[int] tickets (broker -> worker)
STATUS = b"\x03"  # nil
HEARTBEAT = b"\x04"  # nil; both ways, client<->broker and worker<->broker
DISCONNECT = b"\x05"  # nil; client->broker "I am leaving"; broker->worker "reconnect fresh"
SYNC = b"\x06"  # SyncStep: one step of a weight-sync round (trainer -> broker)
SEALED_SUBMIT = b"\x07"  # list[SealedJob]: SUBMIT with each job sealed, to a broker that reads it
# broker -> client
ACCEPTED = b"\x11"  # list[str] job ids now queued
PARTIAL = b"\x12"  # list[Delta]; also worker -> broker (keyed by ticket)
FINAL = b"\x13"  # list[Result]; also worker -> broker (keyed by ticket)
ERROR = b"\x14"  # list[ErrorItem]; also worker -> broker (keyed by ticket)
BUSY = b"\x15"  # list[ErrorItem]: the client's queue is full, retry later
STATUS_REPLY = b"\x16"  # StatusReply
SYNC_REPLY = b"\x17"  # SyncReply: the outcome of a SyncStep
# worker -> broker
READY = b"\x21"  # WorkerInfo: register (or re-register) with credits
CREDIT = b"\x22"  # int: the worker's credits changed (absolute number)
CONTROL_ACK = b"\x23"  # ControlAck: answer to a CONTROL step (weight sync)
SEALED_FINAL = b"\x24"  # list[SealedResult]: FINAL with each result sealed, to a broker that reads it
# broker -> worker
JOBS = b"\x31"  # list[Assignment]
CONTROL = b"\x32"  # Control: a step of a weight-sync round, for this worker

COMMAND_NAMES = {
    SUBMIT: "submit",
    CANCEL: "cancel",
    STATUS: "status",
    SYNC: "sync",
    SEALED_SUBMIT: "sealed_submit",
    SYNC_REPLY: "sync_reply",
    HEARTBEAT: "heartbeat",
    DISCONNECT: "disconnect",
    ACCEPTED: "accepted",
    PARTIAL: "partial",
    FINAL: "final",
    ERROR: "error",
    BUSY: "busy",
    STATUS_REPLY: "status_reply",
    READY: "ready",
    CREDIT: "credit",
    CONTROL_ACK: "control_ack",
    SEALED_FINAL: "sealed_final",
    JOBS: "jobs",
    CONTROL: "control",
}
