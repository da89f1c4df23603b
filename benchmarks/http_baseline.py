"""The HTTP baseline: what rollout servers mostly are today (an OpenAI-style JSON endpoint).

FastAPI + uvicorn (uvloop and httptools when installed, as ``uvicorn`` picks them by
default), one ``POST /generate`` taking a JSON list of requests and returning one echoed
result per request, validated by pydantic models like a real server's. The driver is
aiohttp with a fixed number of POSTs in flight. The same 100-byte prompts and the same
result shape as the echo double's. With lean doubles (``roles.LEAN``, the default), the client
makes each body from a text template and counts the results of an answer by their ``job_id``
keys, as the broker cases' clients splice bytes and count from headers; with ``--doubles
echo`` it builds dicts and parses the answer.
"""

import asyncio
import json
import socket
import time
from typing import Annotated, Any

import roles
from pydantic import BaseModel, Field
from roles import PROMPT, role


class Sampling(BaseModel):
    n: Annotated[int, Field(ge=1, le=256)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: int = -1
    max_tokens: Annotated[int, Field(ge=1)] = 16
    seed: int | None = None


class Request(BaseModel):
    job_id: Annotated[str, Field(min_length=1, max_length=128)]
    prompt: Annotated[str, Field(min_length=1)]
    sampling: Sampling = Sampling()


class Sample(BaseModel):
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class Result(BaseModel):
    job_id: str
    prompt_token_ids: list[int]
    samples: list[Sample]
    weight_version: int
    worker_id: str


def make_app() -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/generate", response_model=list[Result])
    async def generate(requests: list[Request]) -> list[Result]:
        out = []
        for r in requests:
            ids = [len(r.prompt)]
            samples = [
                Sample(index=i, token_ids=ids, logprobs=[0.0], finish_reason="length") for i in range(r.sampling.n)
            ]
            out.append(
                Result(
                    job_id=r.job_id,
                    prompt_token_ids=ids,
                    samples=samples,
                    weight_version=0,
                    worker_id="http-echo",
                )
            )
        return out

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    return app


@role
def http_server(report: Any, tag: str) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(), log_level="warning", access_log=False)
    report.put(("ready", tag, f"http://127.0.0.1:{sock.getsockname()[1]}"))
    uvicorn.Server(config).run(sockets=[sock])  # uvicorn stops on SIGTERM


_JOB_HEAD = '{"job_id":"'
_JOB_TAIL = '","prompt":' + json.dumps(PROMPT) + ',"sampling":{"n":1,"max_tokens":16}}'
_JSON = {"Content-Type": "application/json"}


def post_body(ids: list[str]) -> dict[str, Any]:
    """aiohttp's arguments for a POST of one request per job id (plain ids: no escaping)."""
    if roles.LEAN:
        text = "[" + ",".join(_JOB_HEAD + i + _JOB_TAIL for i in ids) + "]"
        return {"data": text.encode(), "headers": _JSON}
    return {"json": [{"job_id": i, "prompt": PROMPT, "sampling": {"n": 1, "max_tokens": 16}} for i in ids]}


def count_results(body: bytes) -> int:
    """The results in an answer: its ``job_id`` keys (lean), or the parsed list's length."""
    return body.count(b'"job_id"') if roles.LEAN else len(json.loads(body))


@role
def http_client(report: Any, tag: str, url: str, batch: int, inflight: int, go: Any, clock: Any) -> None:
    """``inflight`` concurrent POST loops, each POST carrying ``batch`` requests."""
    import aiohttp

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> dict[str, int]:
        connector = aiohttp.TCPConnector(limit=inflight)
        async with aiohttp.ClientSession(connector=connector) as session:
            for _ in range(200):  # uvicorn takes a moment to start serving
                try:
                    async with session.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            report.put(("ready", tag, None))
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            t_begin, t_end = clock[0], clock[1]
            done = [0]

            async def loop(lane: int) -> None:
                seq = 0
                while time.monotonic() < t_end:
                    ids = [f"{tag}-{lane}-{seq + i:x}" for i in range(batch)]
                    seq += batch
                    async with session.post(f"{url}/generate", **post_body(ids)) as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"POST /generate: HTTP {resp.status}: {await resp.text()}")
                        answered = count_results(await resp.read())
                    if t_begin <= time.monotonic() < t_end:
                        done[0] += answered

            await asyncio.gather(*(loop(lane) for lane in range(inflight)))
            return {"jobs": done[0], "errors": 0}

    report.put(("done", tag, asyncio.run(main())))
