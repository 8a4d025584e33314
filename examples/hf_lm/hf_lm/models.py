"""Hugging Face causal LMs built from a config (random weights, no download), returned as they are: Teleport Lab
reads their ``ModelOutput`` as its logits."""

from __future__ import annotations

import transformers


def llama(vocab_size: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 128, max_len: int = 256) -> transformers.LlamaForCausalLM:
    """A Llama: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP, an untied head."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      intermediate_size=intermediate, max_position_embeddings=max_len,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


def gpt2(vocab_size: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4,
         max_len: int = 256) -> transformers.GPT2LMHeadModel:
    """A GPT-2: learned positions, Conv1D projections, the embedding tied to the head."""
    config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                                     n_positions=max_len, bos_token_id=None, eos_token_id=None, use_cache=False)
    return transformers.GPT2LMHeadModel(config)
