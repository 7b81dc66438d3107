"""Gemma 2 (``Gemma2ForCausalLM``; Gemma Team 2024, "Gemma 2: Improving Open Language
Models at a Practical Size") over the paged KV cache, from the shared blocks.

What differs from Llama, each as ``transformers``' ``modeling_gemma2.py`` computes it:

- RMSNorms scale by ``1 + weight`` (in float32, then cast), and a layer has four: before
  and after attention, before and after the MLP (the "after" ones normalise the block's
  output before it joins the residual);
- the MLP is GeGLU with the tanh approximation of GELU (``gelu_pytorch_tanh``);
- the embedding is scaled by ``sqrt(hidden_size)`` (rounded to the model dtype), its LoRA
  delta too (as PEFT's LoRA embedding does for Gemma's scaled embedding); embeddings tied;
- attention scales by ``query_pre_attn_scalar ** -0.5`` and soft-caps its logits
  (``attn_logit_softcapping``), the final logits are soft-capped too
  (``final_logit_softcapping``): ``cap * tanh(x / cap)``;
- sliding and full attention alternate by layer (``layer_types``). Each compiled layer
  graph specialises on its window, so a compiled step holds two layer graphs (sliding,
  full), whatever the depth.

LoRA targets, module names and the checkpoint layout are Llama's (``llama.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_graph.models.blocks import (
    AttentionMetadata,
    GatedMLP,
    PagedAttention,
    PagedKVCache,
    RMSNorm,
)
from lora_graph.models.llama import LlamaConfig, LlamaModel, hf_fields
from lora_graph.routing import Routing


@dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
    """:class:`LlamaConfig` plus Gemma 2's attention scale and soft caps (0: none)."""

    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0

    @classmethod
    def from_hf(cls, hf: Any) -> Gemma2Config:
        """Read a ``transformers`` ``Gemma2Config``.

        Raises:
            ValueError: for another model type, an activation other than
                ``gelu_pytorch_tanh``, bidirectional attention, or what
                :func:`lora_graph.models.llama.hf_fields` refuses.
        """
        model_type = getattr(hf, "model_type", None)
        if model_type != "gemma2":
            raise ValueError(f"unsupported model type {model_type!r} (gemma2)")
        act = getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {act!r} (gelu_pytorch_tanh)")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("unsupported: use_bidirectional_attention (this model is causal)")
        return cls(
            **hf_fields(hf, model_type),
            query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
            attn_logit_softcapping=float(hf.attn_logit_softcapping or 0.0),
            final_logit_softcapping=float(hf.final_logit_softcapping or 0.0),
        )


class Gemma2DecoderLayer(nn.Module):
    """``x + post_norm(attn(pre_norm(x)))``, then ``x + post_norm(mlp(pre_norm(x)))``."""

    def __init__(self, config: Gemma2Config, kv_cache: PagedKVCache, window: int | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.self_attn = PagedAttention(
            config,
            kv_cache,
            window,
            scale=config.query_pre_attn_scalar**-0.5,
            softcap=config.attn_logit_softcapping,
        )
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        self.mlp = GatedMLP(h, config.intermediate_size, act="gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata,
        routing: Routing | None,
    ) -> Tensor:  # fmt: skip
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn, routing)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x), routing)
        return x + self.post_feedforward_layernorm(m)


class Gemma2Model(LlamaModel):
    """:class:`LlamaModel` with Gemma 2's layers, offset norm, scaled embedding and capped
    logits."""

    layer_class = Gemma2DecoderLayer

    def __init__(self, config: Gemma2Config, *, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(config, dtype=dtype, **kwargs)
        # transformers rounds the scale to the weights' dtype before multiplying
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=dtype)
        self.register_buffer("embed_scale", normalizer, persistent=False)

    def make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps, offset=1.0)

    def embed(self, tokens: Tensor, routing: Routing | None) -> Tensor:
        x = self.embed_tokens(tokens, routing)
        return x * self.embed_scale.to(x.dtype)

    def final_logits(self, logits: Tensor) -> Tensor:
        cap = cast(Gemma2Config, self.config).final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
