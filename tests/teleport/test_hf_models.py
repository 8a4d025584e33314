"""Exact teleport on the Hugging Face models labs train, as ``transformers`` builds them (tiny configs, random
weights, no download): GPT-2 (Conv1D projections, a tied head), Llama (RMSNorm, rotary positions, grouped-query
attention, SwiGLU), BERT for classification and ViT for images, each with its SDPA and its eager attention, and
each H·∇L (exact, difference). The batch loss is kept to 1e-9 while every linear projection moves, and the norms
stay, saying why: ``test_uses``' checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn

from tests.teleport.families import OPEN, Case, lm_loss
from tests.teleport.test_uses import assert_exact

pytestmark = pytest.mark.usefixtures("float64")
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def logits_of(loss: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Any, Tensor], Tensor]:
    """A loss on a model output's ``logits`` (a transformers ``ModelOutput``)."""
    return lambda out, y: loss(out.logits, y)


def case(cls: type, config: transformers.PretrainedConfig, attention: str, x: Tensor, y: Tensor,
         loss: Callable[[Tensor, Tensor], Tensor]) -> Case:
    """The model in float64 with every Linear (or GPT-2's Conv1D) weight listed as one that must move: each reads
    fewer batch rows than its inputs, so each has free directions."""
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attention).double().eval()
    params = dict(model.named_parameters())
    moved = [f"{name}.weight" for name, m in model.named_modules()
             if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") and f"{name}.weight" in params]
    return Case(model, x, y, moved, logits_of(loss))


def tokens(vocab: int) -> Tensor:
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1))  # 12 rows < 16 inputs


def gpt2(attention: str) -> Case:
    config = transformers.GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    x = tokens(12)  # ids 12.. of the tied table are never looked up: the head's rows for them may move
    return case(transformers.GPT2LMHeadModel, config, attention, x, x, lm_loss)


def llama(attention: str) -> Case:
    config = transformers.LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    x = tokens(20)
    return case(transformers.LlamaForCausalLM, config, attention, x, x, lm_loss)


def bert(attention: str) -> Case:
    config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16, num_labels=3, **NO_DROPOUT)
    return case(transformers.BertForSequenceClassification, config, attention, tokens(30), torch.tensor([0, 2]),
                F.cross_entropy)


def vit(attention: str) -> Case:
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=24, num_labels=3, **NO_DROPOUT)
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))  # 2 × 5 tokens < 16 inputs
    return case(transformers.ViTForImageClassification, config, attention, images, torch.tensor([0, 2]),
                F.cross_entropy)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit}


@pytest.mark.parametrize("hvp", ["exact", "difference"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_transformers_model_moves_its_projections_exactly_and_leaves_its_norms(name: str, attention: str,
                                                                                 hvp: str) -> None:
    built = MODELS[name](attention)
    assert len(built.moved) >= 5, built.moved
    untouched = assert_exact(built, replace(OPEN, hvp=hvp))
    norms = [n for n, m in built.model.named_modules() if "norm" in type(m).__name__.lower()]
    assert norms and all(f"{n}.weight" in untouched for n in norms), untouched
