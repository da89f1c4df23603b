"""The trainer's side of the gateway's weight-update endpoints: TRL's weight methods, over gloo.

``WeightTransferClient`` pushes weights the way TRL's ``VLLMClient`` does to a vLLM server
(``init_communicator``, ``weight_update()``, ``update_named_param(s)``,
``update_model_params``, ``reset_prefix_cache``), through ``zmq-rollout gateway
--weight-transfer-backend gloo`` (``zmq_rollout.gateway.weight_transfer`` maps the calls onto
a broker sync round). The trainer is rank 0 of a gloo group with every worker rank: it hosts
the rendezvous on ``master_address:master_port`` (by default a fresh free port per update,
told to the gateway at ``/init_weight_transfer_engine`` before ``/start_weight_update``),
opens the group on a round's first broadcast and closes it at the round's end, and broadcasts in vLLM's packed layout
(``zmq_rollout.gateway.weight_bodies.chunks``, the same function the gateway plans with).
Tensors may live anywhere (gloo sends from host memory; CUDA tensors are copied there).

::

    client = WeightTransferClient("http://GATEWAY:8000", master_address="TRAINER-IP")
    client.init_communicator()
    client.update_model_params(model)       # start, one broadcast per chunk, finish: a new version
    client.weight_version                   # what completions now carry

Errors are the error tree's: ``InvalidRequestError`` (a 400), ``BrokerUnavailableError`` (503),
``SyncError`` (the rest: the gateway aborted the round, or the group broke).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from zmq_rollout.errors import BrokerUnavailableError, InvalidRequestError, RolloutError, SyncError
from zmq_rollout.gateway.weight_bodies import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    GROUP_NAME,
    InitInfo,
    UpdateInfo,
    chunks,
)
from zmq_rollout.weight_sync.buckets import Bucket, dtype_name, named_tensors, pack
from zmq_rollout.weight_sync.collective import CollectiveGroup

if TYPE_CHECKING:
    import httpx
    import torch

__all__ = ["WeightTransferClient"]

T = TypeVar("T")


def _raise_for(response: httpx.Response, what: str) -> Any:
    """The answer's JSON, or its error as the error tree's (the one place HTTP errors are translated)."""
    if response.status_code == 200:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    text = f"{what}: {response.status_code} {message}"
    if response.status_code == 400:
        raise InvalidRequestError(text)
    if response.status_code == 503:
        raise BrokerUnavailableError(text)
    raise SyncError(text)


class WeightTransferClient:
    """Weight updates through a zmq-rollout gateway (the module's docstring says how).

    ``master_address``: an address of this trainer that every worker can reach;
    ``master_port``: where it hosts the group's rendezvous (0: a free one, chosen anew for
    each update); ``packed``, ``packed_buffer_size_bytes``: vLLM's wire layout;
    ``timeout_s``: the group's timeout (keep it at the gateway's ``--weight-transfer-timeout-s``);
    ``check_names``: the gateway compares each update's names with the workers' checkpoints
    before anything loads (a mismatch is an ``InvalidRequestError`` and the fleet serves on;
    without it, a name the engine cannot load fails the round mid-load).
    """

    def __init__(
        self,
        base_url: str,
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        timeout_s: float = 120.0,
        check_names: bool = False,
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.master_address, self.master_port = master_address, master_port
        self.packed, self.packed_buffer_size_bytes = packed, packed_buffer_size_bytes
        self.timeout_s, self.check_names = timeout_s, check_names
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self.init: InitInfo | None = None
        self.group: CollectiveGroup | None = None
        self.weight_version: int | None = None
        """The version the last finished update committed."""
        self._updating = False

    # -- TRL's VLLMClient methods ------------------------------------------------------------
    def get_world_size(self) -> int:
        return int(_raise_for(self.http.get("/get_world_size"), "/get_world_size")["world_size"])

    def init_communicator(self, device: Any = "cpu") -> None:
        """Tell the gateway where this trainer's group meets (``device`` is TRL's; gloo sends from the CPU)."""
        config = _raise_for(self.http.get("/server_info", params={"config_format": "json"}), "/server_info")
        transfer = config["vllm_config"].get("weight_transfer_config")
        if not transfer or transfer.get("backend") != "gloo":
            raise SyncError(
                f"the gateway at {self.base_url} serves no gloo weight transfer ({transfer!r}): start it with "
                "--weight-transfer-backend gloo, and give it workers"
            )
        self._init_engine()

    def _init_engine(self) -> None:
        """``/init_weight_transfer_engine`` with the fleet's size now, and a free port unless one was given."""
        port = self.master_port or _free_port(self.master_address)
        self.init = InitInfo(
            self.master_address,
            port,
            self.get_world_size() + 1,
            packed=self.packed,
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            check_names=self.check_names,
        )
        answer = self.http.post("/init_weight_transfer_engine", json=self.init.body())
        _raise_for(answer, "/init_weight_transfer_engine")

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """One update (one new version) for every ``update_named_param(s)`` call inside."""
        self.start_weight_update()
        self._updating = True
        try:
            yield
        except BaseException:
            self._give_up()
            raise
        finally:
            self._updating = False
        self.finish_weight_update()

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        self.update_named_params(None, [(name, weights)])

    def update_named_params(self, metadata: Any, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast ``(name, tensor)`` pairs (checkpoint names); outside ``weight_update()``
        they are an update of their own. ``metadata``: TRL's ``(name, dtype, shape)`` list, or
        None to read it from the tensors (they are held until sent, then)."""
        if metadata is None:
            pairs = list(named_params)
            metadata = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in pairs]
            named_params = pairs
        names, dtypes, shapes = (list(column) for column in zip(*metadata, strict=True)) if metadata else ([], [], [])
        if self.init is None:
            raise InvalidRequestError("call init_communicator() first")
        try:  # what the gateway would refuse, refused here, before any round begins
            update = UpdateInfo.parse(UpdateInfo(names, dtypes, shapes).body())
            buckets = chunks(update, self.init)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        own = not self._updating
        if own:
            self.start_weight_update()
        try:
            self._send(update, buckets, iter(named_params))
        except BaseException:
            if own:
                self._give_up()
            else:
                self._close_group()
            raise
        if own:
            self.finish_weight_update()

    def update_model_params(self, model: torch.nn.Module) -> None:
        """Every tensor of ``model`` (its ``state_dict``, tied weights once), in one update."""
        self.update_named_params(None, named_tensors(model))

    def reset_prefix_cache(self) -> bool:
        return bool(_raise_for(self.http.post("/reset_prefix_cache"), "/reset_prefix_cache")["success"])

    def close_communicator(self) -> None:
        self._close_group()
        if self.init is not None:
            self.init = None
            with contextlib.suppress(RolloutError, OSError):
                _raise_for(self.http.post("/shutdown_weight_transfer_engine"), "/shutdown_weight_transfer_engine")

    def close(self) -> None:
        self.close_communicator()
        self.http.close()

    # -- the round -------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Begin an update. With ``master_port=0`` each round meets on a fresh port (a group that
        never formed, after a refused update, may hold the last one until its timeout), and
        with the fleet's size at that moment (workers may have come or gone)."""
        if self.init is None:
            raise InvalidRequestError("call init_communicator() first")
        if not self.master_port:
            self._init_engine()
        _raise_for(self.http.post("/start_weight_update", json={}), "/start_weight_update")

    def finish_weight_update(self, weight_version: int | None = None) -> int:
        """Commit the update; returns its version (``weight_version``, or the fleet's + 1)."""
        self._close_group()
        body = {} if weight_version is None else {"weight_version": str(weight_version)}
        answer = _raise_for(self.http.post("/finish_weight_update", json=body), "/finish_weight_update")
        self.weight_version = int(answer["weight_version"])
        return self.weight_version

    def _send(self, update: UpdateInfo, buckets: list[Bucket], pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        """``/update_weights`` while this side opens the group (a round's first broadcast) and
        broadcasts each chunk; the gateway has the workers receive them."""
        import torch

        init = self.init
        assert init is not None
        limit = self.timeout_s * (len(buckets) + 4)  # the gateway's steps are bounded each by timeout_s
        opening = self.group is None and bool(buckets)  # the gateway has the workers join on a round's first chunk
        listen = socket.create_server((init.master_address, init.master_port)) if opening else None
        posted = _in_thread(self.http.post, "/update_weights", json=update.body(), timeout=limit)
        if listen is not None:
            self.group = self._open_group(posted, listen)
        if buckets:
            group = self.group
            assert group is not None
            buf = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)
            for bucket in buckets:
                tensors = {}
                for meta in bucket.tensors:
                    name, tensor = next(pairs, (None, None))
                    if name != meta.name or tensor is None:
                        raise InvalidRequestError(f"tensor {name!r} came where the metadata says {meta.name!r}")
                    tensors[name] = tensor
                try:
                    pack(bucket, tensors, buf)
                except ValueError as exc:
                    raise InvalidRequestError(str(exc)) from None
                try:
                    group.broadcast(buf[: bucket.nbytes], 0)
                except RuntimeError as exc:
                    raise SyncError(f"broadcast of chunk {bucket.index} failed: {exc}") from exc
        _raise_for(posted.result(), "/update_weights")

    def _open_group(self, posted: concurrent.futures.Future[Any], listen: socket.socket) -> CollectiveGroup:
        """Rank 0 of the round's group, formed while the gateway has the workers join; if the
        gateway answers first (it refused the update), its error, at once. The group's thread
        is a daemon: one that nobody joins times out alone, and never holds up an exit."""
        init = self.init
        assert init is not None
        made = _in_thread(
            CollectiveGroup, init.master_address, init.master_port, 0, init.world_size, "gloo", self.timeout_s,
            GROUP_NAME, True, listen_socket=listen,
        )  # fmt: skip
        done, _ = concurrent.futures.wait([made, posted], return_when=concurrent.futures.FIRST_COMPLETED)
        if made not in done:
            _raise_for(posted.result(), "/update_weights")  # an error: nobody joins
            raise SyncError("/update_weights answered before the workers joined the group")
        try:
            return made.result()
        except RuntimeError as exc:
            raise SyncError(f"the trainer could not form the weight-transfer group: {exc}") from exc

    def _give_up(self) -> None:
        """Leave an update that will not be finished: the group closes, and ``/resume`` ends the
        round at once if nothing was loaded yet (else the gateway aborts it: the failed call
        did, or its timeout will)."""
        self._close_group()
        with contextlib.suppress(RolloutError, OSError, ValueError):
            self.http.post("/resume")

    def _close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


def _in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
    """``fn(*args, **kwargs)`` on a daemon thread (a call blocked in a rendezvous or a request
    must not hold up the process's exit, as a pool's threads would)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="weight-transfer", daemon=True).start()
    return future


def _free_port(host: str) -> int:
    with socket.create_server((host, 0)) as s:
        return int(s.getsockname()[1])
