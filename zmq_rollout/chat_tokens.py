"""A conversation's token ids, turn by turn, never re-tokenized from text.

A multi-turn episode's prompt for turn *k* is exactly the ids of turn *k - 1*'s prompt, plus
the ids the model generated, plus the ids of what came after: the end of the assistant's
message the model did not generate itself (Qwen2's ``<|im_end|>`` is generated, the ``\\n``
after it is not) and the environment's new messages, with the next assistant header. Those
last ids are found by rendering the chat template *incrementally*: the template applied to a
fixed probe conversation plus the new messages, minus the template applied to the probe
alone; the difference is tokenized alone. docs/multi_turn.md says why and when a template
cannot be split (``ChatTemplateError``).

Pure: a Hugging Face tokenizer in, lists of ints out; no sockets, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmq_rollout.errors import ChatTemplateError

Message = dict[str, Any]

# A probe conversation whose rendering every new turn's rendering must extend. Plain ASCII
# with no template syntax, so no template treats it specially.
_PROBE_USER: Message = {"role": "user", "content": "probe question"}
_PROBE_ANSWER = "probe answer"


class ChatTokens:
    """The token ids of a chat's pieces, for one tokenizer and its chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat template; multi-turn episodes need one to turn the "
                "environment's messages into tokens"
            )
        header = self._render([_PROBE_USER], generation_prompt=True)
        closed = self._render([_PROBE_USER, {"role": "assistant", "content": _PROBE_ANSWER}], generation_prompt=False)
        opened = header + _PROBE_ANSWER
        if not closed.startswith(opened):
            raise ChatTemplateError(
                "the chat template does not render an assistant message as its generation prompt "
                f"followed by the content (rendered {closed[len(header) - 20 :]!r}); it cannot be split into turns"
            )
        self._probe = closed
        self.assistant_end = closed[len(opened) :]
        """What the template puts after an assistant message's content (``<|im_end|>\\n``)."""
        self.assistant_end_ids: list[int] = self.encode(self.assistant_end)
        self.eos_ids: set[int] = _eos_ids(tokenizer)

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        """``text`` tokenized alone, special tokens as the template wrote them, no BOS added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The first turn's prompt: the messages and the assistant's generation header."""
        return self.encode(self._render(messages, generation_prompt=True))

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        """The ids the template puts after an assistant message that the model did not generate.

        If the model stopped on an end-of-message token that begins the template's assistant
        end (``<|im_end|>``), the rest of it (``\\n``); if it stopped for length or on a stop
        string, all of it."""
        end = self.assistant_end_ids
        if generated and end and generated[-1] == end[0] and generated[-1] in self.eos_ids:
            return end[1:]
        return list(end)

    def messages(self, messages: Sequence[Message]) -> list[int]:
        """New messages after a closed assistant turn, and the next assistant header."""
        if not messages:
            raise ValueError("no messages to add")
        full = self._render(
            [_PROBE_USER, {"role": "assistant", "content": _PROBE_ANSWER}, *messages], generation_prompt=True
        )
        if not full.startswith(self._probe):
            raise ChatTemplateError(
                "the chat template renders earlier messages differently once new ones follow "
                "(it rewrites history, e.g. drops reasoning from past turns), so a turn's tokens "
                "cannot be appended; see docs/multi_turn.md"
            )
        return self.encode(full[len(self._probe) :])


def _eos_ids(tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(name) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        unk = getattr(tokenizer, "unk_token_id", None)
        if isinstance(tid, int) and tid != unk:
            ids.add(tid)
    return ids
