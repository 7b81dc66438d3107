"""Each architecture's pipeline: the :class:`~lora_graph.pipeline.PipelineModel` subclass
that says which config, module, LoRA target table and checkpoint renaming serve a Hugging
Face ``model_type`` (:data:`PIPELINES`).

The modules and configs themselves live in :mod:`lora_graph.models`, which imports nothing
from the runner: a model there is plain ``torch.nn`` over the layers and attention below
it. Adding an architecture is a module file there and a subclass here
(``docs/adding_an_architecture.md``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_graph.config import LoraReqConfig
from lora_graph.models import bert, llama
from lora_graph.models.bert import BertConfig, BertEncoderModel
from lora_graph.models.gemma2 import Gemma2Config, Gemma2Model
from lora_graph.models.llama import LlamaConfig, LlamaModel
from lora_graph.parallel import TPRank
from lora_graph.pipeline import PipelineModel, PipelineModelWithKVCache
from lora_graph.step import SeqChunk
from lora_graph.targets import LoraTarget


class LlamaPipeline(PipelineModelWithKVCache):
    """Llama 2/3, Mistral, Qwen2, Qwen3 and Phi-3 checkpoints in Hugging Face format."""

    config_class: type[LlamaConfig] = LlamaConfig
    model_class: type[LlamaModel] = LlamaModel
    supports_tensor_parallel = True

    def _create_model_config(self, hf_config: Any) -> LlamaConfig:
        return self.config_class.from_hf(hf_config)

    def _instantiate_module(self, config: LlamaConfig) -> LlamaModel:
        return self.model_class(
            config,
            num_pages=self.num_kv_pages,
            page_size=self.page_size,
            max_seq_len=self.max_seq_len,
            dtype=self.dtype,
            tp=self.tp,
            vocab_parallel_head=self.vocab_parallel_lm_head,
        )

    def _check_shards(self, tp: TPRank) -> None:
        llama.shard_config(self.config, tp)
        vocab = self.config.vocab_size
        if self.vocab_parallel_lm_head and vocab % tp.size:
            raise ValueError(
                f"vocab_parallel_lm_head: tensor parallel size {tp.size} does not divide the "
                f"{vocab} vocab_size (the LM head whole on every rank, the default, serves it)"
            )

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def lora_targets(self) -> dict[str, LoraTarget]:
        return llama.lora_targets(self.config)

    def weights_adapter(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        return llama.hf_weights_adapter(state_dict)

    def kv_bytes_per_token(self) -> int:
        c = self.config if self.tp is None else llama.shard_config(self.config, self.tp)
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def compile_regions(self) -> list[nn.Module]:
        return list(cast(nn.ModuleList, self.model.layers))


class Gemma2Pipeline(LlamaPipeline):
    """Gemma 2 checkpoints in Hugging Face format.

    Verified on CUDA on the H200 (2026-12-02):
    ``tests/test_architectures.py::test_gpu_mixed_batch_matches_peft`` passes for Gemma 2
    against a reference that runs eager attention (transformers 5.17's default SDPA drops
    the attention soft cap, and a reference without it differs by 0.44).
    """

    config_class = Gemma2Config
    model_class = Gemma2Model
    supports_tensor_parallel = False  # (its embedding scale and soft caps: not yet sharded)


class BertPipeline(PipelineModel):
    """BERT encoders (``BertModel`` checkpoints, e.g. sentence-transformers'
    all-MiniLM-L6-v2) serving sentence embeddings, each row under its own adapter. No KV
    cache: a step is whole sentences; :meth:`embed` runs a list of them.

    Verified on CUDA on the H200 (2026-12-02): ``tests/test_bert.py::
    test_each_row_matches_peft_on[tiny_bert-cuda]`` passes (a tiny random BERT, each row
    against peft within 1e-4; the MiniLM case skipped there, its wheel not on the device)."""

    def _create_model_config(self, hf_config: Any) -> BertConfig:
        return BertConfig.from_hf(hf_config)

    def _instantiate_module(self, config: BertConfig) -> BertEncoderModel:
        return BertEncoderModel(config)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def lora_targets(self) -> dict[str, LoraTarget]:
        return bert.lora_targets(self.config)

    def lora_ignored_modules(self) -> tuple[str, ...]:
        """The pooler (PEFT's ``dense`` also wraps it): a sentence embedding never reads it."""
        return ("pooler.dense", "bert.pooler.dense")

    def compile_regions(self) -> list[nn.Module]:
        return list(cast(nn.ModuleList, cast(nn.Module, self.model.encoder).layer))

    def weights_adapter(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        return bert.hf_weights_adapter(state_dict)

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


#: The pipeline class serving each Hugging Face ``model_type``.
PIPELINES: dict[str, type[PipelineModel]] = {
    "llama": LlamaPipeline,
    "mistral": LlamaPipeline,
    "qwen2": LlamaPipeline,
    "qwen3": LlamaPipeline,
    "phi3": LlamaPipeline,
    "gemma2": Gemma2Pipeline,
    "bert": BertPipeline,
}


def pipeline_class(model_type: str) -> type[PipelineModel]:
    """The pipeline class serving a Hugging Face ``model_type``.

    Raises:
        ValueError: for a model type no pipeline serves.
    """
    try:
        return PIPELINES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model type {model_type!r} (supported: {', '.join(PIPELINES)})"
        ) from None
