"""Direct vLLM, no broker and no worker: the integration tests' reference.

The engine is built with the worker's engine settings (``engine_args``, configuration only),
so the only difference left is the service between the client and the engine.

Run as a script: reads ``{"model": ..., "jobs": [[prompt_token_ids, sampling_dict], ...],
"groups": [sizes]}`` (groups optional)
as JSON on stdin and prints one line ``REFERENCE {"outputs": [[token_ids per sample], ...],
"texts": [[text per sample], ...]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


async def main() -> None:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from zmq_rollout.config import WorkerConfig
    from zmq_rollout.local import LOCAL_WORKER_DEFAULTS
    from zmq_rollout.workers.engine import engine_args

    request = json.load(sys.stdin)
    llm = AsyncLLM.from_engine_args(engine_args(WorkerConfig(model=request["model"], **LOCAL_WORKER_DEFAULTS)))
    try:

        async def one(i: int, ids: list[int], sampling: dict) -> list[tuple[list[int], str]]:
            # With n > 1, vLLM yields each sample's output as it goes (samples that finish early,
            # at a stop string, are not repeated in later outputs): keep the latest per index.
            latest: dict[int, Any] = {}
            params = dict(sampling)
            if params.get("logit_bias"):  # JSON made its keys strings
                params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
            if params.get("structured_outputs") is not None:
                from vllm.sampling_params import StructuredOutputsParams

                params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
            async for out in llm.generate({"prompt_token_ids": ids}, SamplingParams(**params), f"ref-{i}"):
                for c in out.outputs:
                    latest[c.index] = c
            assert len(latest) == sampling.get("n", 1) and all(c.finish_reason for c in latest.values())
            return [(list(c.token_ids), c.text) for _, c in sorted(latest.items())]

        # "groups": sizes of consecutive slices of the jobs to run one after another (each slice
        # at once), as the tests' calls ran them: on a GPU the batch's make-up can tip a near tie
        jobs = list(enumerate(request["jobs"]))
        sizes = request.get("groups") or [len(jobs)]
        got = []
        for size in sizes:
            chunk, jobs = jobs[:size], jobs[size:]
            got += await asyncio.gather(*(one(i, ids, s) for i, (ids, s) in chunk))
    finally:
        llm.shutdown()
    outputs = [[ids for ids, _ in job] for job in got]
    texts = [[text for _, text in job] for job in got]
    print("REFERENCE " + json.dumps({"outputs": outputs, "texts": texts}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
