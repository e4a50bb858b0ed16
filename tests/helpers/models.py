"""Tiny randomly initialised Llama models (fast), their stand-in tokenizer, a saved model directory, and the
chat-templated prompts of the real embedded model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from specadapt.datasets import load_prompts
from specadapt.engine.models import LoadedModel


def tiny_llama(vocab: int = 32, layers: int = 2, hidden: int = 32, seed: int = 0, max_positions: int = 512,
               init_std: float = 0.4, eos: int | None = None):
    """A random LlamaForCausalLM small enough for unit tests; a large init std makes its outputs peaky."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=init_std, tie_word_embeddings=True, eos_token_id=eos, bos_token_id=None,
        pad_token_id=None, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def stub_tokenizer(vocab: int, eos: int | None = None):
    return SimpleNamespace(eos_token_id=eos, get_vocab=lambda: {f"t{i}": i for i in range(vocab)})


def loaded(model, name="tiny", eos=None) -> LoadedModel:
    vocab = model.config.vocab_size
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    return LoadedModel(name=name, model=model, tokenizer=stub_tokenizer(vocab, eos))


def save_tiny_model_dir(path: Path, vocab_words: list[str], layers: int = 2, max_positions: int = 512, seed: int = 0):
    """Write a tiny Llama + word-level tokenizer (with a ChatML template) as a Hugging Face model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>"] + vocab_words
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    model = tiny_llama(vocab=len(words), layers=layers, max_positions=max_positions, seed=seed, eos=2)
    model.generation_config.eos_token_id = 2
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


WORDS = "the a of to and is in it that for on what number sum find answer two three four five six".split()


def _prompts(model, n):
    out = []
    for p in load_prompts("aime24", limit=n):
        ids = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(list(ids))
    return out
