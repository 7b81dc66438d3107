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

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lora_graph.config import LoraReqConfig
from lora_graph.layers import Linear
from lora_graph.models.blocks import fuse_checkpoint
from lora_graph.pipeline import PipelineModelWithKVCache
from lora_graph.routing import Routing
from lora_graph.step import SeqChunk
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


class BertPipeline(PipelineModelWithKVCache):
    """BERT encoders (``BertModel`` checkpoints, e.g. sentence-transformers'
    all-MiniLM-L6-v2) serving sentence embeddings, each row under its own adapter. No KV
    cache: a step is whole sentences; :meth:`embed` runs a list of them.

    Verified on CUDA on the H200 (2026-12-02): ``tests/test_bert.py::
    test_each_row_matches_peft_on[tiny_bert-cuda]`` passes (a tiny random BERT, each row
    against peft within 1e-4; the MiniLM case skipped there, its wheel not on the device)."""

    def _get_compile_input_types(self) -> dict[str, tuple[str, ...]]:
        return {"tokens": ("T",), "positions": ("T",), "query_start": ("S+1",)}

    def _create_model_config(self, hf_config: Any) -> BertConfig:
        return BertConfig.from_hf(hf_config)

    def _instantiate_module(self, config: BertConfig) -> BertEncoderModel:
        return BertEncoderModel(config)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def lora_targets(self) -> dict[str, LoraTarget]:
        return lora_targets(self.config)

    def lora_ignored_modules(self) -> tuple[str, ...]:
        """The pooler (PEFT's ``dense`` also wraps it): a sentence embedding never reads it."""
        return ("pooler.dense", "bert.pooler.dense")

    def compile_regions(self) -> list[nn.Module]:
        return list(cast(nn.ModuleList, cast(nn.Module, self.model.encoder).layer))

    def weights_adapter(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Drop ``bert.``, the pooler, the task models' heads and the position-id buffer;
        fuse query/key/value into ``qkv`` (weights and biases)."""
        renamed = {
            name: tensor
            for key, tensor in state_dict.items()
            if not (name := key.removeprefix("bert.")).startswith(_HEADS)
            and name != "embeddings.position_ids"
        }
        return fuse_checkpoint(renamed, _FUSED)

    @torch.inference_mode()
    def embed(self, rows: Sequence[tuple[Sequence[int], str | None]]) -> Tensor:
        """Sentence embeddings of ``rows`` (token ids with special tokens, adapter or None),
        float32 ``[len(rows), hidden]``, in steps of at most ``max_num_batched_tokens``
        tokens, ``max_batch_size`` rows and the LoRA pool's slots of distinct adapters.

        Raises:
            ValueError: naming the row, for an unknown adapter, an empty row, a token id
                outside the vocabulary, or a row longer than ``max_seq_len``.
        """
        known = self.manager.loras if self.manager is not None else ()
        vocab = self.config.vocab_size
        limit = min(self.max_seq_len, self.max_num_batched_tokens)
        checked = []
        for i, (ids, adapter) in enumerate(rows):
            try:
                LoraReqConfig(adapter).validate(known)
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
            try:  # Python, NumPy or 0-d tensor integers; not bools or floats
                if any(isinstance(t, bool) for t in ids):
                    raise TypeError
                ids = [operator.index(t) for t in ids]
            except TypeError:
                raise ValueError(f"row {i}: token ids must be integers in [0, {vocab})") from None
            if not 0 < len(ids) <= limit:
                raise ValueError(f"row {i}: {len(ids)} tokens (1 to {limit})")
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"row {i}: token ids must be integers in [0, {vocab})")
            checked.append((ids, adapter))
        rows = checked
        slots = self.manager.config.max_slots if self.manager is not None else 0
        out = torch.empty(len(rows), self.config.hidden_size)
        step: list[SeqChunk] = []

        def run() -> None:
            inputs = self.prepare(step)
            emb = self.execute(inputs)
            for j, c in enumerate(inputs.chunks):
                out[c.owner] = emb[j].float().cpu()
            step.clear()

        for i, (ids, adapter) in enumerate(rows):
            names = {c.adapter for c in step if c.adapter is not None} | {adapter} - {None}
            if step and (
                sum(len(c.token_ids) for c in step) + len(ids) > self.max_num_batched_tokens
                or len(step) == self.max_batch_size
                or len(names) > slots
            ):
                run()
            step.append(SeqChunk(adapter, list(ids), 0, (), owner=i))
        if step:
            run()
        return out
