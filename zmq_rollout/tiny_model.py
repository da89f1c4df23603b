"""Build a tiny, randomly initialised Qwen2 checkpoint for tests and demos.

``make_tiny_model(path)`` writes a directory that vLLM and transformers load like
any Hugging Face model: ``config.json``, ``generation_config.json``,
``model.safetensors`` and a byte-level BPE tokenizer (256 byte tokens, no merges,
plus ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``) with a ChatML chat
template. Nothing is downloaded; the same ``seed`` gives byte-identical weights.

torch, transformers and tokenizers are imported inside the function so that
importing this module stays cheap.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "make_tiny_model"]

#: Special tokens, appended after the 256 byte tokens (ids 256, 257, 258).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: ChatML: ``<|im_start|>role\ncontent<|im_end|>\n`` per message.
CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _build_tokenizer(model_max_length: int) -> object:
    """A ``PreTrainedTokenizerFast``: byte-level BPE, token id == byte value."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """Write a random tiny Qwen2 model plus tokenizer into ``path`` and return it.

    ``hidden_size / num_heads`` is the head dimension; it must be a whole number
    of at least 64 (the smallest that vLLM's attention backends accept), and
    ``num_heads`` must be a multiple of ``num_kv_heads``. Raises ``ValueError``
    otherwise. The vocabulary has 259 ids (256 bytes + 3 specials); eos is
    ``<|im_end|>`` (258) and pad is ``<|endoftext|>`` (256).
    """
    if num_heads <= 0 or num_kv_heads <= 0 or hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
    head_dim = hidden_size // num_heads
    if head_dim < 64:
        raise ValueError(f"head_dim = hidden_size / num_heads = {head_dim}; must be >= 64")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(max_position_embeddings)
    eot_id, im_end_id = 256, 258
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [256, 257, 258]  # type: ignore[attr-defined]

    config = Qwen2Config(
        vocab_size=256 + len(SPECIAL_TOKENS),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=im_end_id,
        pad_token_id=eot_id,
    )
    torch_dtype = getattr(torch, dtype)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch_dtype)
    finally:
        torch.random.set_rng_state(rng_state)  # leave the caller's RNG untouched
    model.generation_config = GenerationConfig(bos_token_id=eot_id, eos_token_id=im_end_id, pad_token_id=eot_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    # Portable across transformers 4.x/5.x: a class name both know, and the
    # template inline too (older versions ignore chat_template.jinja).
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    tok_cfg.pop("backend", None)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    return out
