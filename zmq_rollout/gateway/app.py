"""The gateway's HTTP shell: a FastAPI app around one ``AsyncRolloutClient``.

Every request becomes jobs (``openai_protocol``), the jobs' rollouts a response
(``responses``) or a stream (``streaming``). Errors are answered in one place (``error_of``),
in vLLM's ``ErrorResponse`` shape: a bad request 400, an unknown model 404, a full broker
queue 429 with ``Retry-After``, a lost broker 503, a timeout 504. A request whose HTTP client
goes away cancels its jobs, before or during its stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.types import Receive, Scope, Send

from zmq_rollout import errors
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.gateway import responses as out
from zmq_rollout.gateway import swift, weight_transfer
from zmq_rollout.gateway.config import GatewayConfig
from zmq_rollout.gateway.openai_protocol import Jobs, OpenAIError, OpenAIRequest, parse_chat, parse_completion
from zmq_rollout.gateway.routes import ClientGone, disconnected, unless_gone
from zmq_rollout.gateway.streaming import ChunkBuilder, StreamBroken
from zmq_rollout.metrics import TEXT_FORMAT
from zmq_rollout.rollouts import Prompt, Rollout, StreamRestarted, TokenDelta

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
CLIENT_GONE = 499
"""Counted for a request whose HTTP client went away before its answer (nginx's code)."""


def error_of(exc: BaseException) -> OpenAIError:
    """The HTTP answer to an error: the one place where our error tree meets status codes."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, errors.InvalidRequestError):
        return OpenAIError(str(exc))
    if isinstance(exc, errors.BusyError):
        return OpenAIError(f"the broker's queue is full: {exc}", status=429)
    if isinstance(exc, (errors.BrokerUnavailableError, errors.ClientClosedError, errors.AuthenticationError)):
        return OpenAIError(f"the broker is not available: {exc}", status=503)
    if isinstance(exc, errors.RolloutTimeoutError):
        return OpenAIError(f"{exc} (zmq-rollout gateway --timeout-s)", status=504)
    if isinstance(exc, StreamBroken):
        return OpenAIError(str(exc), status=503)
    return OpenAIError(f"{type(exc).__name__}: {exc}", status=500, err_type="InternalServerError")


def error_response(error: OpenAIError) -> Response:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return Response(_json.encode(error.body()), error.status, headers, media_type="application/json")


def _sse(chunk: Any) -> bytes:
    return b"data: " + _json.encode(chunk) + b"\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that stop, closing their generator (which cancels the jobs), as soon
    as the HTTP client goes away, whether or not a chunk is on its way: under any ASGI server
    (Starlette listens for the disconnect itself only below ASGI spec 2.4)."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({streaming, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, gone):
                task.cancel()
            await asyncio.gather(streaming, gone, return_exceptions=True)
            await self._body.aclose()  # type: ignore[attr-defined]
        if not streaming.cancelled() and streaming.exception() is not None:
            log.warning("a stream ended with %r", streaming.exception())


class _Merged:
    """The stream items of one job per prompt, as ``(prompt index, item)`` in arrival order."""

    _END = object()

    def __init__(self, client: AsyncRolloutClient, prompts: Sequence[Prompt], jobs: Jobs) -> None:
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.left = len(prompts)
        self.tasks = [asyncio.ensure_future(self._run(client, i, prompt, jobs)) for i, prompt in enumerate(prompts)]

    async def _run(self, client: AsyncRolloutClient, i: int, prompt: Prompt, jobs: Jobs) -> None:
        try:
            async for item in client.stream(prompt, jobs.sampling):
                self.queue.put_nowait((i, item))
        except Exception as exc:
            self.queue.put_nowait((i, exc))
        else:
            self.queue.put_nowait((i, self._END))

    async def next(self) -> tuple[int, Any] | None:
        """The next item (None once every job ended); raises a job's error."""
        while self.left:
            i, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is self._END:
                self.left -= 1
                continue
            return i, item
        return None

    async def close(self) -> None:
        """Cancel what still runs: each stream's jobs are cancelled at the broker."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Gateway:
    """The app's state: its client, the model names it last heard of, its metrics."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client: AsyncRolloutClient | None = None
        self._models: tuple[float, dict[str, int]] | None = None
        self._models_call: asyncio.Future[dict[str, int]] | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "zmq_rollout_gateway_requests_total",
            "HTTP requests answered by the gateway, by endpoint and status code (499: the client went away)",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "zmq_rollout_gateway_request_duration_seconds",
            "Request to response (to the stream's first byte), per answered request",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )

    async def start(self) -> None:
        self.client = await AsyncRolloutClient(config=self.config.client_config()).connect()

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()

    # -- models ------------------------------------------------------------------------------
    async def models(self, fresh: bool = False) -> dict[str, int]:
        """Model name → its longest max_model_len, from the broker's status (reused for
        models_ttl_s unless ``fresh``)."""
        if not fresh and self._models is not None and time.monotonic() - self._models[0] < self.config.models_ttl_s:
            return self._models[1]
        if self._models_call is None or self._models_call.done():
            self._models_call = asyncio.ensure_future(self._ask_models())
        return await asyncio.shield(self._models_call)

    async def _ask_models(self) -> dict[str, int]:
        assert self.client is not None
        try:
            status = await self.client.status()
        except errors.RolloutTimeoutError as exc:
            raise errors.BrokerUnavailableError(str(exc)) from None
        names: dict[str, int] = {}
        for w in status.workers:
            names[w.model] = max(names.get(w.model, 0), w.max_model_len)
        self._models = (time.monotonic(), names)
        return names

    async def model_name(self, asked: str | None) -> str:
        """The name a response carries; an unknown model is a 404 (as vLLM's)."""
        names = await self.models()
        if asked is not None and asked not in names:
            names = await self.models(fresh=True)  # a worker of that model may have joined since
        if asked is not None and names and asked not in names:
            raise OpenAIError(f"The model `{asked}` does not exist.", status=404, param="model")
        return asked or next(iter(names), "unknown")

    # -- generation --------------------------------------------------------------------------
    async def complete(self, request: Request, chat: bool) -> Response:
        body = await request.body()
        req: OpenAIRequest
        if chat:
            req, jobs = parse_chat(body, self.config.chat_max_tokens)
        else:
            req, jobs = parse_completion(body)
        model = await self.model_name(req.model)
        top, token_ids = jobs.top, bool(req.return_token_ids)
        if req.stream:
            return await self._stream(request, chat, model, jobs, token_ids, req.include_usage())
        assert self.client is not None
        rollouts: list[Rollout] = await unless_gone(
            request, self.client.generate(jobs.prompts, jobs.sampling, timeout_s=self.config.timeout_s)
        )
        if chat:
            answer = out.chat_response(rollouts, model, top, token_ids)
        else:
            answer = out.completion_response(rollouts, model, jobs.sampling.n, top, token_ids)
        return Response(_json.encode(answer), media_type="application/json")

    async def _stream(
        self, request: Request, chat: bool, model: str, jobs: Jobs, token_ids: bool, include_usage: bool
    ) -> Response:
        assert self.client is not None
        merged = _Merged(self.client, jobs.prompts, jobs)
        try:  # the status code waits for the first item: a refused job is a 400 or 429, not an event
            first = await unless_gone(request, asyncio.wait_for(merged.next(), self.config.timeout_s))
        except BaseException:
            await merged.close()
            raise
        prompt_ids = [p if p and all(isinstance(t, int) for t in p) else None for p in jobs.prompts]
        builder = ChunkBuilder(
            chat=chat,
            model=model,
            n=jobs.sampling.n,
            top=jobs.top,
            token_ids=token_ids,
            include_usage=include_usage,
            prompt_ids=prompt_ids,
        )
        return _EventStream(self._events(builder, merged, first))

    async def _events(
        self, builder: ChunkBuilder, merged: _Merged, item: tuple[int, Any] | None
    ) -> AsyncIterator[bytes]:
        try:
            for chunk in builder.start():
                yield _sse(chunk)
            while item is not None:
                i, x = item
                if isinstance(x, TokenDelta):
                    chunks = builder.delta(i, x)
                elif isinstance(x, StreamRestarted):
                    builder.restarted(i)
                    chunks = []
                else:
                    chunks = builder.final(i, x)
                for chunk in chunks:
                    yield _sse(chunk)
                item = await asyncio.wait_for(merged.next(), self.config.timeout_s)
            for chunk in builder.end():
                yield _sse(chunk)
        except (errors.RolloutError, StreamBroken, asyncio.TimeoutError) as exc:
            if isinstance(exc, asyncio.TimeoutError):
                exc = errors.RolloutTimeoutError(f"no stream item within {self.config.timeout_s} s")
            log.warning("stream %s ended early: %s", builder.id, exc)
            yield _sse(error_of(exc).body())
        finally:
            await merged.close()
        yield b"data: [DONE]\n\n"


def create_app(config: GatewayConfig | None = None) -> FastAPI:
    """The app: its client connects at startup and closes at shutdown (the ASGI lifespan)."""
    gateway = Gateway(config or GatewayConfig())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="zmq-rollout gateway", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    async def answer(endpoint: str, request: Request, work: Awaitable[Response]) -> Response:
        start = time.perf_counter()
        try:
            response = await work
        except ClientGone:
            gateway.requests.labels(endpoint, str(CLIENT_GONE)).inc()
            return Response(status_code=CLIENT_GONE)
        except Exception as exc:
            error = error_of(exc)
            if error.status >= 500 and error.status not in (503, 504):
                log.exception("%s failed", endpoint)
            response = error_response(error)
        gateway.requests.labels(endpoint, str(response.status_code)).inc()
        gateway.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer("/v1/completions", request, gateway.complete(request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer("/v1/chat/completions", request, gateway.complete(request, chat=True))

    async def model_list() -> Response:
        names = await gateway.models()
        created = out.now()
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": created, "owned_by": "zmq-rollout", "root": name,
             "parent": None, "max_model_len": length or None, "permission": []}
            for name, length in names.items()
        ]  # fmt: skip
        return Response(_json.encode({"object": "list", "data": data}), media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await answer("/v1/models", request, model_list())

    async def health_check() -> Response:
        await gateway.models()  # the broker answers STATUS: it is there
        return Response(status_code=200)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await answer("/health", request, health_check())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=TEXT_FORMAT)

    swift.add_routes(app, gateway, answer)  # ms-swift's rollout contract: /infer/, /health/, ...
    weight_transfer.add_routes(app, gateway, answer)  # vLLM's weight-update endpoints (TRL)
    return app


def serve(config: GatewayConfig) -> None:
    """Run the gateway until interrupted (uvicorn; its own logs at warning)."""
    import uvicorn

    log.info("gateway for the broker at %s on http://%s:%d", config.broker, config.host, config.port)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning")
