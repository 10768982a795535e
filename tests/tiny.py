"""Tiny seeded random models and a byte-level tokenizer, built in the tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>"]
# Like Qwen3's template, a variable (``enable_thinking``) changes the assistant's opening when a request sets it,
# and an unknown role is refused (``raise_exception``, which transformers gives templates)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant', 'tool', 'function'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<s>{{ message['role'] }}: {{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: "
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """259 tokens: 3 specials (ids 0-2, eos = 2) then one token per byte."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIALS)}
    for char in sorted(alphabet):
        vocab[char] = len(vocab)
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    settings: dict[str, object] = {
        "vocab_size": 259,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    settings.update(overrides)
    return LlamaConfig(**settings)


def save_tiny_llama(directory: Path, seed: int = 0, scale: float = 4.0, **overrides: object) -> Path:
    """A random Llama whose weights are scaled up so its distributions are peaked, not uniform."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory


def save_tiny_qwen3(directory: Path, seed: int = 1) -> Path:
    """A random Qwen3 (per-head query and key norms, a head size other than hidden / heads), its norms' weights
    spread around 1 so that reading them wrong changes the output, its LM head scaled up as the tiny Llama's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory


def save_tiny_gpt2(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=259, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        bos_token_id=1, eos_token_id=2)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory
