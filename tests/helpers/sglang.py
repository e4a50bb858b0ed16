"""Stand-ins for the SGLang plugin's tests (core suite and tests_sglang/ alike): sampler inputs in SGLang's
layout, an EAGLE-3 draft with SGLang's parameter names, dense models in SGLang's fused layout, and TTS rounds."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from specadapt.sglang.tts import SGLangTTS


def _sglang_chain_inputs(batch=4, num_drafts=3, vocab=7, seed=0, base=0):
    g = torch.Generator().manual_seed(seed)
    slots = num_drafts + 1
    target = torch.softmax(torch.randn(batch, slots, vocab, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(batch, num_drafts, vocab, generator=g) * 2, -1)
    drafts = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(batch, num_drafts)
    candidates = torch.cat([torch.randint(vocab, (batch, 1), generator=g), drafts], 1)
    retrive_index = base + torch.arange(batch * slots).reshape(batch, slots)
    coins = torch.rand(batch, slots, generator=g)
    final = torch.rand(batch, generator=g)
    return candidates, retrive_index, coins, final, target, draft


class _Eagle3StandIn(nn.Module):
    """Parameters named and shaped as SGLang's LlamaForCausalLMEagle3 (TP = 1), plain tensors."""

    def __init__(self, vocab=40, hidden=16, heads=4, kv_heads=2, inter=24, draft_vocab=12, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        hd = hidden // heads
        self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden,
                                      head_dim=hd, rms_norm_eps=1e-6, rope_theta=10000.0)
        m = nn.Module()
        m.embed_tokens = nn.Embedding(vocab, hidden)
        m.fc = nn.Linear(3 * hidden, hidden, bias=False)
        layer = nn.Module()
        layer.input_layernorm = _Norm(hidden)
        layer.hidden_norm = _Norm(hidden)
        layer.post_attention_layernorm = _Norm(hidden)
        attn = nn.Module()
        attn.qkv_proj = nn.Linear(2 * hidden, (heads + 2 * kv_heads) * hd, bias=False)
        attn.o_proj = nn.Linear(heads * hd, hidden, bias=False)
        layer.self_attn = attn
        mlp = nn.Module()
        mlp.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        layer.mlp = mlp
        m.layers = nn.ModuleList([layer])
        m.norm = _Norm(hidden)
        self.model = m
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.hot_token_id = torch.arange(draft_vocab) * 3  # target ids of the draft vocabulary
        self.requires_grad_(False)


class _Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


def distil_rounds(tts: SGLangTTS, snapshot, accepted, rounds: int) -> list[float]:
    """``rounds`` rounds of the same verify outcome (``snapshot()`` -> a fresh snapshot, ``accepted`` per request,
    no history carried over): the loss on each round's examples before that round's update."""
    losses = []
    for _ in range(rounds):
        snap = snapshot()
        tts.history.clear()
        tts.record(snap, accepted)
        with torch.no_grad():
            losses.append(float(tts._loss(tts.updater.shadow, tts._pending)))
        tts.on_round_start()
    return losses


_SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def _hf(family: str, tied: bool = False):
    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[family])
    if family == "llama":
        cfg = LlamaConfig(**_SMALL, tie_word_embeddings=tied)
        model = LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = Qwen2Config(**_SMALL, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = Qwen3Config(**_SMALL, head_dim=8, tie_word_embeddings=tied)
        model = Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # non-trivial norms, so a missed norm fails the comparison
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _sglang_layout(hf_model, family: str) -> nn.Module:
    """A module named and laid out as SGLang's model class (fused qkv_proj / gate_up_proj), copying hf_model."""
    sd = hf_model.state_dict()
    cfg = hf_model.config
    draft = type(_ARCH[family], (nn.Module,), {})()
    draft.config = cfg
    params = {
        "model.embed_tokens.weight": sd["model.embed_tokens.weight"],
        "model.norm.weight": sd["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        params["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        params[pre + "input_layernorm.weight"] = sd[pre + "input_layernorm.weight"]
        params[pre + "post_attention_layernorm.weight"] = sd[pre + "post_attention_layernorm.weight"]
        params[pre + "self_attn.qkv_proj.weight"] = torch.cat([sd[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        if pre + "self_attn.q_proj.bias" in sd:
            params[pre + "self_attn.qkv_proj.bias"] = torch.cat([sd[pre + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        params[pre + "self_attn.o_proj.weight"] = sd[pre + "self_attn.o_proj.weight"]
        for norm in ("q_norm", "k_norm"):
            if pre + f"self_attn.{norm}.weight" in sd:
                params[pre + f"self_attn.{norm}.weight"] = sd[pre + f"self_attn.{norm}.weight"]
        params[pre + "mlp.gate_up_proj.weight"] = torch.cat([sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]])
        params[pre + "mlp.down_proj.weight"] = sd[pre + "mlp.down_proj.weight"]
    return with_parameters(draft, {name: value.clone() for name, value in params.items()})


def with_parameters(module: nn.Module, params: dict) -> nn.Module:
    """``module`` with frozen Parameters at the dotted names of ``params`` (sub-modules created on the way): a
    stand-in carrying SGLang's parameter names."""
    for name, value in params.items():
        *path, leaf = name.split(".")
        owner = module
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
    return module
