"""Direct vLLM, no broker and no worker: the integration tests' reference.

The engine is built with the worker's engine settings (``engine_args``, configuration only),
so the only difference left is the service between the client and the engine.

Run as a script: reads ``{"model": ..., "jobs": [[prompt_token_ids, sampling_dict], ...]}``
as JSON on stdin and prints one line ``REFERENCE {"outputs": [[token_ids per sample], ...]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def main() -> None:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from zmq_rollout.config import WorkerConfig
    from zmq_rollout.local import LOCAL_WORKER_DEFAULTS
    from zmq_rollout.workers.engine import engine_args

    request = json.load(sys.stdin)
    llm = AsyncLLM.from_engine_args(engine_args(WorkerConfig(model=request["model"], **LOCAL_WORKER_DEFAULTS)))
    try:

        async def one(i: int, ids: list[int], sampling: dict) -> list[list[int]]:
            final = None
            async for out in llm.generate({"prompt_token_ids": ids}, SamplingParams(**sampling), f"ref-{i}"):
                final = out
            assert final is not None and final.finished
            return [list(c.token_ids) for c in sorted(final.outputs, key=lambda c: c.index)]

        outputs = await asyncio.gather(*(one(i, ids, s) for i, (ids, s) in enumerate(request["jobs"])))
    finally:
        llm.shutdown()
    print("REFERENCE " + json.dumps({"outputs": outputs}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
