"""Server-sent events in vLLM's chunk shapes, from the client's stream items. Pure: events in
(``delta``, ``final``, ``restarted``), chunks out; ``app`` writes them as ``data: ...`` lines.

Token chunks carry the text their tokens add, as the worker's vLLM detokenized it while
streaming, with ``token_ids`` (with ``return_token_ids``) and logprobs; a choice's last chunk
carries what text is left and its ``finish_reason``. Joining the chunks' texts gives the
completion, as with vLLM. What differs from vLLM, because the gateway has no tokenizer:

- with top logprobs asked for (completions ``logprobs`` > 0, chat ``top_logprobs`` > 0) a
  choice comes in one chunk at its end: the streamed tokens carry only the sampled logprob.
- ``prompt_token_ids`` come with the choice's first chunk when the prompt was token ids, else
  with its last (the prompt is tokenized on the worker).
- the last chunk of a choice carries our ``weight_version`` (and ``weight_versions`` for the
  whole sample when it spans a sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmq_rollout.gateway import responses as out
from zmq_rollout.rollouts import Rollout, TokenDelta


class StreamBroken(Exception):
    """The stream cannot go on consistently (the broker restarted after tokens were sent)."""


class ChunkBuilder:
    """The chunks of one streamed request. ``chat``: chat completion chunks, else completion
    chunks. ``prompt_ids``: each prompt's token ids when the request gave them."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        n: int,
        top: int | None,
        token_ids: bool,
        include_usage: bool,
        prompt_ids: Sequence[list[int] | None],
    ) -> None:
        self.chat, self.model, self.n, self.top = chat, model, n, top
        self.token_ids, self.include_usage = token_ids, include_usage
        self.id = out.new_id("chatcmpl" if chat else "cmpl")
        self.created = out.now()
        self.prompt_ids = list(prompt_ids)
        self.sent: dict[int, list[int]] = {}  # choice index -> token ids streamed so far
        self.sent_text: dict[int, list[str]] = {}  # choice index -> text streamed so far, piece by piece
        self.offsets: dict[int, int] = {}  # choice index -> text offset of its next logprob token
        self.prompt_sent: set[int] = set()  # prompts whose prompt_token_ids went out
        self.num_prompt_tokens: dict[int, int] = {}
        self.num_completion_tokens = 0
        self.held = top is not None and top > 0  # top logprobs only come with the final rollout

    # -- events ----------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """Chat opens each choice with its role, as vLLM does."""
        if not self.chat:
            return []
        chunks = []
        for i in range(self.n):
            chunk = self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}])  # fmt: skip
            if i == 0 and self.token_ids and self.prompt_ids[0] is not None:
                chunk["prompt_token_ids"] = self.prompt_ids[0]
                self.prompt_sent.add(0)
            chunks.append(chunk)
        return chunks

    def delta(self, prompt_index: int, d: TokenDelta) -> list[dict[str, Any]]:
        if self.held or not d.token_ids:
            return []
        choice = prompt_index * self.n + d.index
        self.sent.setdefault(choice, []).extend(d.token_ids)
        self.sent_text.setdefault(choice, []).append(d.text)
        logprobs = d.logprobs if len(d.logprobs) == len(d.token_ids) else [float("nan")] * len(d.token_ids)
        return [self._chunk(prompt_index, choice, d.text, d.token_ids, logprobs, None, None)]

    def final(self, prompt_index: int, r: Rollout) -> list[dict[str, Any]]:
        choice = prompt_index * self.n + r.index
        sent = self.sent.pop(choice, [])
        if r.token_ids[: len(sent)] != sent:
            raise StreamBroken("the tokens streamed so far are not the final sample's (the job ran again)")
        said = "".join(self.sent_text.pop(choice, []))
        if not r.text.startswith(said):
            raise StreamBroken("the text streamed so far is not the start of the final sample's text")
        start = len(sent)
        tops = r.top_logprobs[start:] if r.top_logprobs is not None else None
        self.num_prompt_tokens[prompt_index] = len(r.prompt_token_ids)
        self.num_completion_tokens += len(r.token_ids)
        if self.prompt_ids[prompt_index] is None:
            self.prompt_ids[prompt_index] = r.prompt_token_ids
        chunk = self._chunk(
            prompt_index, choice, r.text[len(said) :], r.token_ids[start:], r.logprobs[start:], tops, r.finish_reason
        )
        chunk["choices"][0].update(out.versions(r))
        return [chunk]

    def restarted(self, prompt_index: int) -> None:
        """The prompt's job runs again from its first token (the broker restarted, or its worker
        was lost): a stream that already sent some of its tokens cannot take them back."""
        if any(choice // self.n == prompt_index for choice in self.sent):
            raise StreamBroken("the broker restarted after tokens of this stream were sent; send the request again")

    def end(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        tokens = sum(self.num_prompt_tokens.values())
        return [{**self._envelope([]), "usage": out.usage(tokens, self.num_completion_tokens)}]

    # -- shapes ----------------------------------------------------------------------------
    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(
        self,
        prompt_index: int,
        choice: int,
        text: str,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[dict[int, float]] | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:
        prompt_ids = None
        if self.token_ids and prompt_index not in self.prompt_sent and self.prompt_ids[prompt_index] is not None:
            prompt_ids = self.prompt_ids[prompt_index]
            self.prompt_sent.add(prompt_index)
        lps: dict[str, Any] | None = None
        if self.top is not None and self.chat:
            lps = out.chat_logprobs(token_ids, logprobs, tops, self.top)
        elif self.top is not None:
            offset = self.offsets.get(choice, 0)
            lps = out.completion_logprobs(token_ids, logprobs, tops, self.top, offset)
            self.offsets[choice] = offset + sum(len(t) for t in lps["tokens"])
        ids = token_ids if self.token_ids else None
        if self.chat:
            body: dict[str, Any] = {"index": choice, "delta": {"content": text}, "logprobs": lps,
                                    "finish_reason": finish_reason, "token_ids": ids}  # fmt: skip
            if finish_reason is not None:
                body["stop_reason"] = None
            chunk = self._envelope([body])
            if prompt_ids is not None:
                chunk["prompt_token_ids"] = prompt_ids
            return chunk
        body = {"index": choice, "text": text, "logprobs": lps, "finish_reason": finish_reason, "stop_reason": None,
                "prompt_token_ids": prompt_ids, "token_ids": ids}  # fmt: skip
        return self._envelope([body])
