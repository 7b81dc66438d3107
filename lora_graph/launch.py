"""Building an engine from the command line's flags: every flag checked from its value
first (:func:`check_engine_flags`), then the model, adapters, capture and tokenizer
(:func:`build_engine`); a refusal is a :class:`CliError` naming the flag or the cause."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch

from lora_graph.config import ADAPTER_NAME, AdapterError, LoRAConfig
from lora_graph.engine import LLMEngine
from lora_graph.manager import NoFreeSlotError


class CliError(Exception):
    """An error reported as one line and exit status 2, without a traceback."""


def build_engine(
    model: str,
    loras: list[str],
    *,
    max_loras: int,
    max_lora_rank: int,
    dtype: str,
    device: str,
    max_batch_size: int,
    max_seq_len: int | None,
    compile_mode: str = "none",
    max_num_batched_tokens: int | None = None,
    kv_cache_tokens: int | None = None,
    gpu_memory_utilization: float = 0.9,
    progress: bool = True,
    enable_lora: bool = False,
    encoder: bool | None = False,
    async_scheduling: bool | None = None,
    enable_prefix_caching: bool = True,
    tensor_parallel_size: int | None = None,
) -> tuple[LLMEngine, Any]:
    """Load the model, tokenizer and adapters; return the engine and the tokenizer.
    ``enable_lora`` sizes adapter slots even when no ``loras`` are given (a server that
    loads adapters at run time). ``encoder`` says which models the command serves: False a
    decoder (generate), True an encoder (embed), None either (serve); another is refused
    from its config, before its weights are read.

    Raises:
        CliError: if the model or an adapter cannot be loaded (the message names which).
    """
    from transformers import AutoConfig, AutoTokenizer

    from lora_graph.architectures import pipeline_class
    from lora_graph.loading.model_files import resolve_model_path
    from lora_graph.memory import MemoryBudgetError
    from lora_graph.pipeline import PipelineModelWithKVCache

    check_engine_flags(  # before anything is loaded or captured
        loras,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_tokens=kv_cache_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
        compile_mode=compile_mode,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
    )

    try:
        model_dir = resolve_model_path(model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        cls = pipeline_class(hf_config.model_type)
        kind = f"model {model!r} ({hf_config.model_type})"
        decoder = issubclass(cls, PipelineModelWithKVCache)
        if encoder is False and not decoder:
            raise CliError(f"{kind} is an encoder; use lora-graph embed")
        if encoder is True and decoder:
            raise CliError(f"{kind} is not an encoder (embed: bert)")
        lora = (
            LoRAConfig(
                max_slots=max_loras, max_rank=max_lora_rank, cpu_capacity=max(16, len(loras))
            )
            if loras or enable_lora
            else None
        )
        # a decoder's KV cache size; an encoder has none
        kv: dict[str, Any] = {"kv_cache_tokens": kv_cache_tokens} if decoder else {}
        pipeline = cls(
            model_dir,
            dtype=dtype,
            device=device,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            max_num_batched_tokens=(
                max(2048, max_batch_size)
                if max_num_batched_tokens is None
                else max_num_batched_tokens
            ),
            gpu_memory_utilization=gpu_memory_utilization,
            lora=lora,
            **kv,
            tensor_parallel_size=tensor_parallel_size,
        )
    except MemoryBudgetError as e:
        raise CliError(_flag_names(str(e))) from e
    except (FileNotFoundError, ValueError, OSError) as e:
        raise CliError(f"model {model!r}: {_flag_names(str(e))}") from e
    eos = _eos_ids(model_dir, hf_config)
    engine = LLMEngine(
        pipeline,
        eos_token_ids=eos,
        async_scheduling=async_scheduling,
        enable_prefix_caching=enable_prefix_caching,
    )
    # adapters first: a bad one is reported before the capture (which does not need them:
    # they are graph inputs)
    for spec in loras:
        name, _, path = spec.partition("=")
        try:
            engine.add_lora(path, name=name)
        except (AdapterError, NoFreeSlotError) as e:
            raise CliError(str(e) if f"{name!r}" in str(e) else f"adapter {name!r}: {e}") from e
    if compile_mode != "none":
        try:
            pipeline.enable_compile(compile_mode, progress=progress)
        except ValueError as e:
            raise CliError(f"--compile {compile_mode}: {e}") from e
    tokenizer = None
    # (transformers 5 builds an empty tokenizer for a directory without tokenizer files)
    if any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        with contextlib.suppress(OSError, ValueError):
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return engine, tokenizer


def check_engine_flags(
    loras: Sequence[str],
    *,
    max_loras: int,
    max_lora_rank: int,
    max_batch_size: int,
    max_seq_len: int | None,
    max_num_batched_tokens: int | None,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    compile_mode: str,
    device: str,
    tensor_parallel_size: int | None = None,
) -> None:
    """Check the engine's flags from their values alone (nothing read, nothing bound).

    Raises:
        CliError: naming the first bad flag: a size below its least, a utilization outside
            (0, 1], ``--compile cudagraph`` without CUDA, a ``--lora`` that is not
            ``NAME=PATH``, a name given twice, or a name a runtime load would refuse
            (1-64 letters, digits, '.', '_', '-').
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and tensor_parallel_size is None:
        raise CliError(
            f"started by torchrun with {world} processes: give --tensor-parallel-size {world} "
            "(without it every process would run the whole job)"
        )
    for flag, value, least in (
        ("--max-loras", max_loras, 1),
        ("--max-lora-rank", max_lora_rank, 1),
        ("--max-batch-size", max_batch_size, 1),
        ("--max-seq-len", max_seq_len, 2),
        ("--max-num-batched-tokens", max_num_batched_tokens, max_batch_size),
        ("--kv-cache-tokens", kv_cache_tokens, 1),
        ("--tensor-parallel-size", tensor_parallel_size, 1),
    ):
        if value is not None and value < least:
            raise CliError(f"{flag} must be at least {least}, got {value}")
    if not 0 < gpu_memory_utilization <= 1:
        raise CliError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if compile_mode == "cudagraph" and (device != "cuda" or not torch.cuda.is_available()):
        raise CliError("--compile cudagraph: cudagraph mode needs a CUDA device (--device cuda)")
    for spec in loras:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CliError(f"--lora {spec!r}: expected NAME=PATH")
        if not ADAPTER_NAME.fullmatch(name):
            raise CliError(
                f"--lora {name[:80]!r}: an adapter name is 1-64 letters, digits, '.', '_' or '-'"
            )
    names = [spec.partition("=")[0] for spec in loras]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CliError(f"--lora: adapter name {repeated[0]!r} is given more than once")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.txt",
                    "vocab.json", "spiece.model", "sentencepiece.bpe.model")  # fmt: skip


def _shared_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of ``generate`` and ``serve`` that :func:`check_engine_flags`
    and :func:`build_engine` both take, by their names there."""
    return dict(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        compile_mode=args.compile,
        device=args.device,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
    )


def check_engine_args(args: argparse.Namespace) -> None:
    """:func:`check_engine_flags` on the engine options ``generate`` and ``serve`` share
    (``serve`` checks them before it binds its port).

    Raises:
        CliError: naming the first bad flag.
    """
    check_engine_flags(args.lora, **_shared_options(args))


def engine_from_args(args: argparse.Namespace, **extra: Any) -> tuple[LLMEngine, Any]:
    """:func:`build_engine` with the engine options ``generate`` and ``serve`` share."""
    return build_engine(
        args.model,
        args.lora,
        dtype=args.dtype,
        progress=args.progress,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=args.enable_prefix_caching,
        **_shared_options(args),
        **extra,
    )


_FLAGS = ("max_batch_size", "max_seq_len", "max_num_batched_tokens", "kv_cache_tokens",
          "gpu_memory_utilization")  # fmt: skip


def _flag_names(message: str) -> str:
    """A pipeline's message with its argument names as this command's flags."""
    for name in _FLAGS:
        message = message.replace(name, "--" + name.replace("_", "-"))
    return message


def _eos_ids(model_dir: str, hf_config: Any) -> tuple[int, ...]:
    from transformers import GenerationConfig

    eos: Any = getattr(hf_config, "eos_token_id", None)
    with contextlib.suppress(OSError):  # no generation_config.json
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id or eos
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
