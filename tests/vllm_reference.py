"""Direct vLLM, no broker and none of our worker code: the integration tests' reference.

Run as a script: reads ``{"model": ..., "jobs": [[prompt_token_ids, sampling_dict], ...]}``
as JSON on stdin and prints one line ``REFERENCE {"outputs": [[token_ids per sample], ...]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def main() -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from zmq_rollout.local import LOCAL_WORKER_DEFAULTS

    request = json.load(sys.stdin)
    args = {k: v for k, v in LOCAL_WORKER_DEFAULTS.items() if v is not None}
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=request["model"], enforce_eager=True, **args))
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
