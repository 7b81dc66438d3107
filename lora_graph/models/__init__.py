"""Model architectures, importable as ``lora_graph.models``."""

from __future__ import annotations

from lora_graph.models.bert import BertPipeline
from lora_graph.models.gemma2 import Gemma2Pipeline
from lora_graph.models.llama import LlamaConfig, LlamaModel, LlamaPipeline
from lora_graph.pipeline import PipelineModelWithKVCache

PIPELINES = {
    "llama": LlamaPipeline,
    "mistral": LlamaPipeline,
    "qwen2": LlamaPipeline,
    "qwen3": LlamaPipeline,
    "phi3": LlamaPipeline,
    "gemma2": Gemma2Pipeline,
    "bert": BertPipeline,
}


def pipeline_class(model_type: str) -> type[PipelineModelWithKVCache]:
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


__all__ = [
    "PIPELINES",
    "BertPipeline",
    "Gemma2Pipeline",
    "LlamaConfig",
    "LlamaModel",
    "LlamaPipeline",
    "pipeline_class",
]
