"""Incremental chat tokenization: a conversation's ids built turn by turn equal the ids of the
whole conversation rendered at once, for ChatML (the tiny model's) and a Qwen2.5-style
template; a template that rewrites history is refused, naming why."""

from __future__ import annotations

from typing import Any

import pytest

from zmq_rollout.chat_tokens import ChatTokens
from zmq_rollout.errors import ChatTemplateError
from zmq_rollout.tiny_model import _build_tokenizer

# Qwen2.5's template, tools left out: a default system message when there is none.
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Shortens every assistant message but the last (as Qwen3's template drops the reasoning of
# earlier turns): earlier messages render differently once new ones follow.
REWRITES_HISTORY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer(template: str | None = None) -> Any:
    tok = _build_tokenizer(4096)
    if template is not None:
        tok.chat_template = template
    return tok


def build_turn_by_turn(chat: ChatTokens, conversation: list[dict[str, str]], eos: bool) -> list[int]:
    """Ids as run_episodes builds them: the first prompt, then per assistant turn the model's
    ids (its text, then <|im_end|> if it stopped on it) and what the template adds after."""
    first_assistant = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    ids = chat.prompt(conversation[:first_assistant])
    i = first_assistant
    while i < len(conversation):
        generated = chat.encode(conversation[i]["content"]) + ([258] if eos else [])
        ids += generated
        i += 1
        following = []
        while i < len(conversation) and conversation[i]["role"] != "assistant":
            following.append(conversation[i])
            i += 1
        if following:
            ids += chat.close_turn(generated) + chat.messages(following)
    return ids


CONVERSATION = [
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "It is"},
    {"role": "user", "content": "Say the number."},
    {"role": "assistant", "content": "84"},
]


@pytest.mark.parametrize("template", [None, QWEN25], ids=["chatml", "qwen2.5"])
@pytest.mark.parametrize("eos", [True, False], ids=["stopped-on-im_end", "cut-by-length"])
def test_turn_by_turn_ids_equal_the_whole_conversation(template: str | None, eos: bool) -> None:
    chat = ChatTokens(tokenizer(template))
    ids = build_turn_by_turn(chat, CONVERSATION, eos)
    whole = chat.encode(chat.tokenizer.apply_chat_template(CONVERSATION, tokenize=False))
    # The whole rendering closes the last assistant message; the trajectory ends where the
    # model stopped (its <|im_end|>, or its last token when cut by length).
    assert whole[: len(ids)] == ids
    assert whole[len(ids) :] == ([10] if eos else [258, 10])


def test_close_turn_adds_only_what_the_model_did_not_generate() -> None:
    chat = ChatTokens(tokenizer())
    assert chat.assistant_end == "<|im_end|>\n" and chat.assistant_end_ids == [258, 10]
    assert chat.close_turn([97, 98, 258]) == [10]  # stopped on <|im_end|>: only the newline
    assert chat.close_turn([97, 98]) == [258, 10]  # cut by length: the whole end
    assert chat.close_turn([]) == [258, 10]


def test_qwen25_tool_message_is_wrapped_as_the_template_says() -> None:
    chat = ChatTokens(tokenizer(QWEN25))
    text = chat.tokenizer.decode(chat.messages([{"role": "tool", "content": "84"}]))
    assert text == "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_history_is_refused() -> None:
    chat = ChatTokens(tokenizer(REWRITES_HISTORY))
    with pytest.raises(ChatTemplateError, match="renders earlier messages differently"):
        chat.messages([{"role": "user", "content": "next"}])


def test_no_chat_template_is_refused() -> None:
    tok = tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokens(tok)


def test_a_template_that_does_not_end_with_the_generation_prompt_is_refused() -> None:
    odd = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>>{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="cannot be split"):
        ChatTokens(tokenizer(odd))
