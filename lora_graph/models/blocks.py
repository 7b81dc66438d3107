"""Shared blocks of decoder models over a paged KV cache: norms, rotary embeddings, the
KV cache and attention over it, gated MLPs. A model file composes them as its paper's block
diagram does (``llama.py``, ``gemma2.py``); module attribute names follow Hugging Face's
(``self_attn.qkv_proj``, ``mlp.down_proj``), so LoRA target paths and checkpoint names
line up.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lora_graph.attention import (
    apply_rope,
    paged_attention,
    rope_kv_write,
)
from lora_graph.layers import Linear
from lora_graph.routing import Routing


def rope_inv_freq(config: Any) -> Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32) of a config with ``head_dim``,
    ``rotary_dim`` (None: all of ``head_dim``), ``rope_theta`` and ``rope_scaling``
    (None, or sorted items with ``rope_type`` linear or llama3).

    Llama-3 scaling follows ``transformers``' ``_compute_llama3_parameters``: wavelengths
    above ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
    those below ``.../high_freq_factor`` kept, and the band between interpolated.
    """
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = dict(config.rope_scaling or ())
    if scaling.get("rope_type") == "linear":
        return inv_freq / scaling["factor"]
    if scaling.get("rope_type") == "llama3":
        factor, low, high = (
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
        )
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def residual_add(x: Tensor, y: Tensor) -> Tensor:
    """``x + y`` for a residual stream ``x`` and a linear's output ``y`` (same shape and
    dtype), bit for bit: a half-precision add is computed in float32 and rounded once, as
    PyTorch's own. Written as that float32 add so that ``torch.compile`` on a GPU does not
    lower ``x + mm(...)`` to ``addmm``, whose cuBLAS call first copies ``x`` into its output
    (a device copy a layer, twice, in the captured decode step); the add then fuses into the
    next norm's kernel instead."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return (x.float() + y.float()).to(x.dtype)
    return x + y


class RMSNorm(nn.Module):
    """RMSNorm (Zhang and Sennrich 2019) as Llama's: normalised in float32, cast back to
    the input's dtype, then times ``weight`` ``[dim]``.

    ``offset=1.0`` is Gemma's: times ``1 + weight``, in float32, then cast (the weights are
    stored as the offset from 1)."""

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def rope_tables(config: Any, max_seq_len: int) -> tuple[Tensor, Tensor]:
    """``cos``, ``sin`` ``[max_seq_len, rotary_dim]`` float32 (:func:`rope_inv_freq`), as
    transformers' rotary embedding computes them (frequencies repeated twice)."""
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class PagedKVCache(nn.Module):
    """One layer's K and V pages (:mod:`lora_graph.paging`), allocated once. The buffers are
    flat, ``[num_pages * page_size, kv_heads, head_dim]``, written in place at flat
    positions by :func:`lora_graph.attention.rope_kv_write` (as gpt-fast's cache: a store
    through a view of a buffer makes ``torch.compile`` copy the whole buffer, every step);
    :meth:`pages` views them as ``[num_pages, page_size, kv_heads, head_dim]`` for
    reading."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.page_size = page_size
        shape = (num_pages * page_size, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def pages(self) -> tuple[Tensor, Tensor]:
        """K and V as ``[num_pages, page_size, kv_heads, head_dim]`` views."""
        k, v = cast(Tensor, self.k), cast(Tensor, self.v)
        shape = (-1, self.page_size, *k.shape[1:])
        return k.view(shape), v.view(shape)


class AttentionMetadata(NamedTuple):
    """The step's attention inputs (:mod:`lora_graph.step`), handed to every layer."""

    slot_mapping: Tensor  # [T] int64, where each token's K/V goes
    block_tables: Tensor  # [S, P] each request's pages
    seq_lens: Tensor  # [S] each request's length after the step
    query_start: Tensor  # [S + 1] the requests' token offsets


class PagedAttention(nn.Module):
    """Self-attention of one layer over the paged KV cache: the fused ``qkv_proj``, optional
    per-head q/k RMSNorms (Qwen3), RoPE, the K/V written into this layer's pages, paged
    attention (:func:`lora_graph.attention.paged_attention`) and ``o_proj``.

    Args:
        config: a model config with ``hidden_size``, ``num_attention_heads``,
            ``num_key_value_heads``, ``head_dim``, ``q_size``, ``kv_size``, ``qkv_bias``,
            ``o_bias``, ``qk_norm`` and ``rms_norm_eps``.
        kv_cache: this layer's pages.
        window: this layer's sliding window (None: full attention).
        scale: the softmax scale (None: ``head_dim ** -0.5``).
        softcap: the attention logits' soft cap (0: none; Gemma 2's).
        reduce: tensor parallel: ``config`` holds this rank's heads, and ``o_proj``'s
            partial output (row-parallel) is summed over the ranks
            (:meth:`lora_graph.layers.LoRALinear.reduced`).
    """

    def __init__(self, config: Any, kv_cache: PagedKVCache, window: int | None, *,
                 scale: float | None = None, softcap: float = 0.0,
                 reduce: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.window = window
        self.reduce = reduce
        self.qkv_proj = Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.kv_cache = kv_cache
        self.scale = config.head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: Tensor, routing: Routing | None) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` ``[T, hidden]`` to q ``[T, heads, head_dim]``, k and v ``[T, kv_heads,
        head_dim]``, before RoPE: the fused projection, split, and the per-head q/k norms
        if the model has them. A model that changes q/k/v here (OLMo's ``clip_qkv``, a
        full-width q/k norm) overrides this method."""
        c = self.config
        n = x.shape[0]
        q, k, v = self.qkv_proj(x, routing).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(n, c.num_attention_heads, c.head_dim)
        k = k.view(n, c.num_key_value_heads, c.head_dim)
        v = v.view(n, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata,
        routing: Routing | None,
    ) -> Tensor:  # fmt: skip
        c = self.config
        n = x.shape[0]
        q, k, v = self.project(x, routing)
        k_cache, v_cache = cast(Tensor, self.kv_cache.k), cast(Tensor, self.kv_cache.v)
        q = rope_kv_write(q, k, v, cos, sin, attn.slot_mapping, k_cache, v_cache)
        k_pages, v_pages = self.kv_cache.pages()
        cap = (self.softcap,) if self.softcap else ()
        out = paged_attention(
            q,
            k_pages,
            v_pages,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start,
            self.scale,
            self.window or 0,
            *cap,
        )
        if self.reduce:
            return self.o_proj.reduced(out.view(n, c.q_size), routing)
        return self.o_proj(out.view(n, c.q_size), routing)


def _gelu_tanh_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    """``down_proj(act(gate) * up)`` with gate and up fused in ``gate_up_proj``: SwiGLU
    (``act="silu"``, Llama's; the LoRA expand and the activation fused on the GPU) or
    GeGLU with the tanh approximation (``act="gelu_tanh"``, Gemma's
    ``gelu_pytorch_tanh``) (Shazeer 2020, "GLU Variants Improve Transformer").

    With ``reduce`` (tensor parallel) ``intermediate_size`` is this rank's share and
    ``down_proj``'s partial output is summed over the ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 act: str = "silu", reduce: bool = False) -> None:  # fmt: skip
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {act!r}")
        self.act = act
        self.reduce = reduce
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor, routing: Routing | None) -> Tensor:
        if self.act == "silu":
            h = self.gate_up_proj.silu_and_mul(x, routing)
        else:
            h = _gelu_tanh_and_mul(self.gate_up_proj(x, routing))
        if self.reduce:
            return self.down_proj.reduced(h, routing)
        return self.down_proj(h, routing)


def fuse_checkpoint(
    state_dict: dict[str, Tensor], fused: dict[str, tuple[str, int]]
) -> dict[str, Tensor]:
    """A checkpoint with separate projections fused as the model fuses them: a key
    ``<parent>.<module>.<param>`` whose ``module`` is in ``fused`` (``{"k_proj":
    ("qkv_proj", 1)}``) joins ``<parent>.<fused name>.<param>``, the pieces concatenated
    along the output rows in slice order; other keys pass through."""
    out: dict[str, Tensor] = {}
    parts: dict[str, dict[int, Tensor]] = {}
    for key, tensor in state_dict.items():
        path, _, param = key.rpartition(".")
        parent, _, module = path.rpartition(".")
        if module in fused:
            name, index = fused[module]
            parts.setdefault(f"{parent}.{name}.{param}", {})[index] = tensor
        else:
            out[key] = tensor
    for key, pieces in parts.items():
        out[key] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    return out


__all__ = [
    "AttentionMetadata",
    "GatedMLP",
    "PagedAttention",
    "PagedKVCache",
    "RMSNorm",
    "apply_rope",
    "fuse_checkpoint",
    "residual_add",
    "rope_inv_freq",
    "rope_tables",
]
