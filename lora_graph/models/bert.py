"""A BERT encoder for sentence embeddings (``BertModel``; Devlin et al. 2019), each row of a
batch under its own LoRA adapter, with no KV cache.

A step packs whole sentences (one chunk each, no pages): the tokens of every row in one
flat list, attention bidirectional within each row (a block-diagonal mask), and the
output is each row's mean-pooled, L2-normalised last hidden state, as sentence-transformers'
``Transformer -> Pooling(mean) -> Normalize`` pipeline computes it (all-MiniLM-L6-v2's).
Token type ids are 0 (one sentence a row). As ``transformers``' ``modeling_bert.py``:
post-norm layers (``LayerNorm(x + sublayer(x))``), GELU (erf), learned absolute
positions.

LoRA targets, fused as the model fuses them: ``qkv`` (PEFT's ``query``, ``key``,
``value``), ``attn_out`` (``attention.output.dense``), ``intermediate``
(``intermediate.dense``), ``output`` (``output.dense``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lora_graph.layers import Linear
from lora_graph.models.blocks import fuse_checkpoint
from lora_graph.routing import Routing
from lora_graph.targets import LoraTarget


@dataclass(frozen=True)
class BertConfig:
    """Architecture sizes of a BERT encoder (field names follow Hugging Face's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: Any) -> BertConfig:
        """Read a ``transformers`` ``BertConfig``.

        Raises:
            ValueError: for another model type, an activation other than ``gelu``, or
                position embeddings other than ``absolute``.
        """
        if getattr(hf, "model_type", None) != "bert":
            raise ValueError(f"unsupported model type {hf.model_type!r} (bert)")
        if hf.hidden_act != "gelu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r} (gelu)")
        kind = getattr(hf, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"unsupported position_embedding_type {kind!r} (absolute)")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            max_position_embeddings=hf.max_position_embeddings,
            type_vocab_size=hf.type_vocab_size,
            layer_norm_eps=hf.layer_norm_eps,
        )


class _Dense(nn.Module):
    """A linear, then (``norm``) ``LayerNorm(x + residual)`` (BERT's ``*Output`` blocks)."""

    def __init__(self, n_in: int, n_out: int, eps: float | None) -> None:
        super().__init__()
        self.dense = Linear(n_in, n_out, bias=True)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(n_out, eps=eps)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.qkv = Linear(c.hidden_size, 3 * c.hidden_size, bias=True)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(c)
        self.output = _Dense(c.hidden_size, c.hidden_size, c.layer_norm_eps)


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.attention = _Attention(c)
        self.intermediate = _Dense(c.hidden_size, c.intermediate_size, None)
        self.output = _Dense(c.intermediate_size, c.hidden_size, c.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor, routing: Routing | None) -> Tensor:
        c, n = self.config, x.shape[0]
        qkv = self.attention.self.qkv(x, routing).view(n, 3, c.num_attention_heads, c.head_dim)
        q, k, v = (qkv[:, i].transpose(0, 1) for i in range(3))  # [H, T, D]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
        out = self.attention.output
        x = out.LayerNorm(x + out.dense(a.reshape(n, c.hidden_size), routing))
        h = F.gelu(self.intermediate.dense(x, routing))
        return self.output.LayerNorm(x + self.output.dense(h, routing))


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))


class BertEncoderModel(nn.Module):
    """Embeddings and encoder layers over a packed step; returns sentence embeddings."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(self, tokens: Tensor, positions: Tensor, query_start: Tensor,
                routing: Routing | None = None) -> Tensor:  # fmt: skip
        """One packed step of whole sentences.

        Args:
            tokens, positions: ``[T]`` int32, each row's tokens and their positions.
            query_start: ``[S + 1]`` int32, the rows' token offsets (tokens from
                ``query_start[S]`` on are padding).
            routing: the step's LoRA routing (by token), or None.

        Returns:
            float32 ``[S, hidden]``: each row's mean-pooled, L2-normalised embedding (a row
            with no tokens: 0).
        """
        e = self.embeddings
        t = tokens.shape[0]
        tokens, positions = tokens.long(), positions.long()
        x = e.word_embeddings(tokens) + e.position_embeddings(positions)
        x = e.LayerNorm(x + e.token_type_embeddings.weight[0])
        # each token's row (padding tokens: one more row of their own), and the mask that
        # keeps attention inside a row
        row = torch.searchsorted(query_start[1:].long(), torch.arange(t, device=x.device),
                                 right=True)  # fmt: skip
        mask = row[:, None] == row[None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask, routing)
        s = query_start.shape[0] - 1
        sums = torch.zeros(s + 1, x.shape[1], dtype=torch.float32, device=x.device)
        sums.index_add_(0, row, x.float())
        counts = torch.bincount(row, minlength=s + 1)[:s].clamp(min=1)
        return F.normalize(sums[:s] / counts[:, None], p=2, dim=-1)


def lora_targets(c: BertConfig) -> dict[str, LoraTarget]:
    """The encoder's LoRA targets; checkpoint names with and without the ``bert.`` prefix
    (``BertModel``'s and the task models')."""
    h, i = c.hidden_size, c.intermediate_size
    heads = c.num_attention_heads
    layer = "encoder.layer.{layer}."

    def names(rest: str) -> tuple[str, ...]:
        return (layer + rest, "bert." + layer + rest)

    return {
        "qkv": LoraTarget(
            h, (h, h, h), "column", ("query", "key", "value"), slice_units=(heads,) * 3,
            module_path=layer + "attention.self.qkv",
            checkpoint_names=names("attention.self.{slice}"),
        ),
        "attn_out": LoraTarget(
            h, (h,), "row", module_path=layer + "attention.output.dense",
            checkpoint_names=names("attention.output.dense"),
        ),
        "intermediate": LoraTarget(
            h, (i,), "column", module_path=layer + "intermediate.dense",
            checkpoint_names=names("intermediate.dense"),
        ),
        "output": LoraTarget(
            i, (h,), "row", module_path=layer + "output.dense",
            checkpoint_names=names("output.dense"),
        ),
    }  # fmt: skip


_FUSED = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
# heads a sentence embedding does not use: BertModel's pooler, the task models' heads
_HEADS = ("pooler.", "cls.", "classifier.", "qa_outputs.")


def hf_weights_adapter(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a Hugging Face BERT state dict to :class:`BertEncoderModel`'s names: drop
    ``bert.``, the pooler, the task models' heads and the position-id buffer; fuse
    query/key/value into ``qkv`` (weights and biases)."""
    renamed = {
        name: tensor
        for key, tensor in state_dict.items()
        if not (name := key.removeprefix("bert.")).startswith(_HEADS)
        and name != "embeddings.position_ids"
    }
    return fuse_checkpoint(renamed, _FUSED)
