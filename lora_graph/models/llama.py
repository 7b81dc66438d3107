"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3) as plain modules over a paged
KV cache.

One file you can read in one sitting, after gpt-fast's ``model.py``: a dataclass config
with derived sizes, and the pre-norm decoder block composed from the shared blocks of
:mod:`lora_graph.models.blocks` (fused ``qkv_proj`` and ``gate_up_proj`` linears, a paged
KV cache allocated once as buffers, RoPE tables computed once). The checkpoint's Hugging Face
names are mapped onto this layout by :func:`hf_weights_adapter`, so the model never sees
the file format.

A step is packed (:mod:`lora_graph.step`): a flat list of tokens from many requests,
decode tokens and prefill chunks alike, with the requests' block tables; each layer writes
the step's K and V into its pages and attends over them with
:func:`lora_graph.attention.paged_attention`, so a step reads the pages its requests hold
and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_graph.distributed import tp_all_gather, tp_all_reduce
from lora_graph.layers import Embedding, Linear
from lora_graph.models.blocks import (
    AttentionMetadata,
    GatedMLP,
    PagedAttention,
    PagedKVCache,
    RMSNorm,
    fuse_checkpoint,
    residual_add,
    rope_tables,
)
from lora_graph.parallel import TPRank, vocab_rows
from lora_graph.routing import Routing
from lora_graph.targets import LoraTarget


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture sizes of a Llama-family model (field names follow Hugging Face's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # per layer: "full_attention" or "sliding_attention" (transformers' layer_types)
    layer_types: tuple[str, ...] = ()
    # Qwen3: an RMSNorm over each head's q and k (weights [head_dim]) before RoPE
    qk_norm: bool = False
    # RoPE on the first rotary_dim of each head's dims, the rest passed through (Phi-3's
    # partial_rotary_factor); None: all of head_dim
    rotary_dim: int | None = None
    # Phi-3: the checkpoint's q/k/v and gate/up are one module each (qkv_proj, gate_up_proj),
    # so its adapters name those, never q_proj, ..., which the model does not have
    packed_modules: bool = False

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> LlamaConfig:
        """Read a ``transformers`` config of model type llama, mistral, qwen2, qwen3 or phi3.

        Qwen2 always has q/k/v biases (and no o bias); the others follow
        ``attention_bias``. Qwen3 adds the per-head q/k norms (``Qwen3Attention``). Phi-3's
        checkpoint stores q/k/v and gate/up fused already; its sliding window, if set,
        applies to every layer (as Mistral's), and ``partial_rotary_factor`` rotates the
        first ``int(head_dim * factor)`` dims of each head.

        Raises:
            ValueError: for another model type, or a RoPE scaling type or attention
                variant not supported.
        """
        model_type = getattr(hf, "model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model type {model_type!r} ({', '.join(MODEL_TYPES)})")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (this model serves silu)")
        return cls(**hf_fields(hf, model_type))


def hf_fields(hf: Any, model_type: str) -> dict[str, Any]:
    """:class:`LlamaConfig`'s fields from a ``transformers`` config of a Llama-like model:
    sizes, RoPE (default, linear or llama3 scaling; a partial rotary factor), biases, and
    each layer's attention type (``layer_types``; Qwen's ``max_window_layers``; otherwise
    a sliding window, if set, on every layer).

    Raises:
        ValueError: for a RoPE scaling type or attention variant not supported.
    """
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    partial = rope.pop("partial_rotary_factor", None)
    partial = float(partial or getattr(hf, "partial_rotary_factor", None) or 1.0)
    given = rope or dict(getattr(hf, "rope_scaling", None) or {})
    rope_type = given.get("rope_type", given.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    scaling = (
        None if rope_type == "default" else tuple(sorted({**given, "rope_type": rope_type}.items()))
    )
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"unsupported partial_rotary_factor {partial} (head_dim {head_dim})")
    bias = bool(getattr(hf, "attention_bias", False))
    window = getattr(hf, "sliding_window", None)
    qwen = model_type in ("qwen2", "qwen3")
    if qwen and not getattr(hf, "use_sliding_window", False):
        window = None
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    n = hf.num_hidden_layers
    if not layer_types and qwen and window is not None:
        # transformers 4's Qwen2 rule: layers from max_window_layers on slide
        first = getattr(hf, "max_window_layers", n)
        layer_types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(n)
        )
    if not layer_types:  # Mistral: the window, if any, on every layer
        kind = "sliding_attention" if window is not None else "full_attention"
        layer_types = (kind,) * n
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != n:
        raise ValueError(
            f"unsupported attention: layer_types {list(layer_types)} (this model serves "
            f"full_attention and sliding_attention, one per layer)"
        )
    if "sliding_attention" in layer_types and window is None:
        raise ValueError("layer_types names sliding_attention but sliding_window is not set")
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=bias or model_type == "qwen2",
        o_bias=bias and model_type != "qwen2",
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=window,
        layer_types=layer_types,
        qk_norm=model_type == "qwen3",
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        packed_modules=model_type == "phi3",
    )


# the Hugging Face model types this family reads
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, kv_cache: PagedKVCache, window: int | None, *,
                 reduce: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(config, kv_cache, window, reduce=reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, bias=config.mlp_bias, reduce=reduce
        )

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata,
        routing: Routing | None,
    ) -> Tensor:  # fmt: skip
        x = residual_add(x, self.self_attn(self.input_layernorm(x), cos, sin, attn, routing))
        return residual_add(x, self.mlp(self.post_attention_layernorm(x), routing))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head, over a paged KV cache.

    A variant overrides :attr:`layer_class` (its decoder block, built as
    ``layer_class(config, kv_cache, window)``), :meth:`make_norm`, :meth:`embed` and
    :meth:`final_logits` (``gemma2.py`` does all four).

    Args:
        config: the architecture.
        num_pages: KV cache pages per layer (:mod:`lora_graph.paging`; page 0 is scratch).
        page_size: token positions per page.
        max_seq_len: positions of the RoPE tables (the longest request).
        dtype: parameter, activation and KV cache dtype.
        tp: this rank of a tensor-parallel group (None: the whole model): the layers hold
            its heads (K/V heads replicated when fewer than the ranks) and its part of the
            MLP (:func:`shard_config`), each attention and MLP output summed over the ranks;
            the embedding holds its vocabulary range (vocabulary-parallel: a token outside
            it embeds as zeros, then summed; padded when the size does not divide the
            vocabulary, :func:`lora_graph.parallel.vocab_rows`); the LM head is whole on
            every rank (replicated, untied).
        vocab_parallel_head: under ``tp``, the LM head holds this rank's vocabulary rows
            instead, the logits gathered from every rank (:meth:`final_logits`).

    Raises:
        ValueError: if the heads or the MLP do not split over ``tp``.
    """

    def __init__(self, config: LlamaConfig, *, num_pages: int, page_size: int,
                 max_seq_len: int, dtype: torch.dtype,
                 tp: TPRank | None = None, vocab_parallel_head: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.tp = tp
        self.vocab_parallel_head = tp is not None and vocab_parallel_head
        local = config if tp is None else shard_config(config, tp)
        vocab = config.vocab_size
        start, stop, rows = (0, vocab, vocab) if tp is None else vocab_rows(vocab, tp)
        self.vocab_start, self.vocab_local = start, stop - start  # (the rest: zero padding)
        self.embed_tokens = Embedding(rows, config.hidden_size)
        reduce = {} if tp is None else {"reduce": True}  # (a variant's layer may lack it)
        self.layers = nn.ModuleList(
            self.layer_class(
                local,
                PagedKVCache(
                    num_pages, page_size, local.num_key_value_heads, local.head_dim, dtype
                ),
                local.window(i),
                **reduce,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.make_norm(config.hidden_size)
        head_rows = rows if self.vocab_parallel_head else vocab
        self.lm_head = Linear(config.hidden_size, head_rows, bias=False)
        if config.tie_word_embeddings and tp is None:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(config, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    layer_class: type[nn.Module] = DecoderLayer

    def make_norm(self, dim: int) -> nn.Module:
        """The final norm."""
        return RMSNorm(dim, self.config.rms_norm_eps)

    def embed(self, tokens: Tensor, routing: Routing | None) -> Tensor:
        """``[T]`` int64 tokens to ``[T, hidden]`` (the embedding, with its LoRA delta;
        under tensor parallelism each rank's vocabulary range, summed; a group of one rank
        holds the whole vocabulary, so no token is masked: vLLM skips the mask there too)."""
        if self.tp is None:
            return self.embed_tokens(tokens, routing)
        if self.tp.size == 1:
            return tp_all_reduce(self.embed_tokens(tokens, routing))
        local = tokens - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        x = self.embed_tokens(torch.where(inside, local, 0), routing)
        return tp_all_reduce(torch.where(inside[:, None], x, 0))

    def final_logits(self, logits: Tensor) -> Tensor:
        """The LM head's output to the returned float32 logits (a vocabulary-parallel
        head's: every rank's vocabulary range gathered first)."""
        if self.vocab_parallel_head:
            logits = tp_all_gather(logits)
        return logits.float()

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        slot_mapping: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_start: Tensor,
        logits_index: Tensor | None = None,
        routing: Routing | None = None,
    ) -> Tensor:
        """One packed step (the inputs are :mod:`lora_graph.step`'s, int32).

        Args:
            tokens, positions, slot_mapping: ``[T]`` the step's tokens, their positions,
                and where their K and V go in the paged cache.
            block_tables, seq_lens, query_start: ``[S, P]``, ``[S]``, ``[S + 1]``: each
                request's pages, length after the step, and token offsets in the step.
            logits_index: ``[S]`` the token whose logits each request returns, or None for
                the logits of every token.
            routing: the step's LoRA routing (:mod:`lora_graph.routing`), handed to every
                LoRA layer; None for a base-only step.

        Returns:
            float32 logits ``[S, vocab]`` (``[T, vocab]`` when ``logits_index`` is None);
            every token's hidden state before the final norm stays in ``step_hidden``
            ``[T, hidden]``.
        """
        x = self.embed(tokens.long(), routing)
        positions = positions.long()
        cos = cast(Tensor, self.rope_cos)[positions].to(x.dtype)
        sin = cast(Tensor, self.rope_sin)[positions].to(x.dtype)
        # int64 once for every layer's KV write
        attn = AttentionMetadata(slot_mapping.long(), block_tables, seq_lens, query_start)
        for layer in self.layers:
            x = layer(x, cos, sin, attn, routing)
        # every token's final hidden state, before the norm: the pipeline's logits_at reads
        # other positions' logits from it (a captured graph's replay refills it in place)
        self.step_hidden = x
        if logits_index is None:
            # [1, T, hidden]: a per-segment LM head routes a 3-D input by token
            return self.final_logits(self.lm_head(self.norm(x)[None], routing)[0])
        return self.final_logits(self.lm_head(self.norm(x[logits_index.long()]), routing))


def shard_config(config: LlamaConfig, tp: TPRank) -> LlamaConfig:
    """The sizes one rank of ``tp`` holds: ``heads / size`` query heads, ``max(1, kv_heads /
    size)`` K/V heads (a K/V head shared by ``size / kv_heads`` ranks when fewer), and
    ``intermediate / size`` of the MLP (Megatron-LM's split).

    The vocabulary need not split: the embedding pads it (:func:`lora_graph.parallel.
    vocab_rows`).

    Raises:
        ValueError: naming the size that does not split over ``tp.size`` ranks.
    """
    n, kv = tp.size, config.num_key_value_heads
    for what, value in (
        ("attention heads", config.num_attention_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % n:
            raise ValueError(f"tensor parallel size {n} does not divide the {value} {what}")
    if kv % n and n % kv:
        raise ValueError(
            f"tensor parallel size {n} neither divides nor is a multiple of the {kv} "
            "key/value heads"
        )
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=max(1, kv // n),
        intermediate_size=config.intermediate_size // n,
    )


def lora_targets(config: LlamaConfig) -> dict[str, LoraTarget]:
    """The four LoRA target families of a Llama layer, fused as the model fuses them, then
    the token embedding (``embedding``) and the LM head (``per_segment``: it sees each
    request's last token). With tied embeddings the two stay separate targets: an LM-head
    delta changes the logits only, never the input embedding (as in PEFT). An adapter names
    q/k/v and gate/up as the model's checkpoint does: separate modules (Llama's), or one
    packed module each (``qkv_proj``, ``gate_up_proj``: Phi-3's; ``packed_modules``)."""
    c = config
    packed = c.packed_modules
    attn, mlp = "model.layers.{layer}.self_attn.{slice}", "model.layers.{layer}.mlp.{slice}"
    return {
        "qkv_proj": LoraTarget(
            c.hidden_size,
            (c.q_size, c.kv_size, c.kv_size),
            "column",
            ("q_proj", "k_proj", "v_proj"),
            slice_units=(c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads),
            slice_packs=(("qkv_proj", ("q_proj", "k_proj", "v_proj")),) if packed else None,
            module_path="layers.{layer}.self_attn.qkv_proj",
            checkpoint_names=(attn,),
        ),
        "o_proj": LoraTarget(
            c.q_size, (c.hidden_size,), "row", ("o_proj",),
            module_path="layers.{layer}.self_attn.o_proj", checkpoint_names=(attn,),
        ),
        "gate_up_proj": LoraTarget(
            c.hidden_size,
            (c.intermediate_size,) * 2,
            "column",
            ("gate_proj", "up_proj"),
            slice_packs=(("gate_up_proj", ("gate_proj", "up_proj")),) if packed else None,
            module_path="layers.{layer}.mlp.gate_up_proj",
            checkpoint_names=(mlp,),
        ),
        "down_proj": LoraTarget(
            c.intermediate_size, (c.hidden_size,), "row", ("down_proj",),
            module_path="layers.{layer}.mlp.down_proj", checkpoint_names=(mlp,),
        ),
        "embed_tokens": LoraTarget(
            c.vocab_size, (c.hidden_size,), "none", ("embed_tokens",), layers=(0,),
            kind="embedding", module_path="embed_tokens", checkpoint_names=("model.embed_tokens",),
        ),
        "lm_head": LoraTarget(
            c.hidden_size, (c.vocab_size,), "column", ("lm_head",), layers=(0,),
            per_segment=True, module_path="lm_head", checkpoint_names=("lm_head",),
        ),
    }  # fmt: skip


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def hf_weights_adapter(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a Hugging Face Llama/Mistral/Qwen2/Qwen3/Phi-3 state dict to
    :class:`LlamaModel`'s names.

    Drops the ``model.`` prefix and concatenates q/k/v into ``qkv_proj`` and gate/up into
    ``gate_up_proj`` (weights and biases), in slice order (Phi-3 stores them fused).
    """
    renamed = {
        key.removeprefix("model."): tensor
        for key, tensor in state_dict.items()
        if "rotary_emb" not in key
    }
    return fuse_checkpoint(renamed, _FUSED)
