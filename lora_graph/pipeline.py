"""The base class for a model with a static KV cache, served with per-request LoRA."""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lora_graph.config import LoRAConfig
from lora_graph.layout import SlotLayout
from lora_graph.manager import LoRAManager
from lora_graph.routing import HasAdapter, Routing
from lora_graph.targets import LoraModuleRef, LoraTarget

if TYPE_CHECKING:
    from lora_graph.compile.cache import GraphCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` (or a dtype) to a ``torch.dtype``.

    Raises:
        ValueError: for any other name.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (one of {', '.join(_DTYPES)})") from None


def resolve_model_path(path: str) -> str:
    """A local model directory, or a Hugging Face repo id fetched with
    ``huggingface_hub.snapshot_download`` (which honours ``HF_HUB_OFFLINE`` and its cache).

    Raises:
        FileNotFoundError: if ``path`` is neither a directory with ``config.json`` nor a
            repo id that can be fetched.
    """
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        return path
    if path.startswith(("/", ".", "~")) or os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such model directory")
    if path.count("/") != 1:
        raise FileNotFoundError(f"{path}: not a model directory or a Hugging Face repo id")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        )
    except Exception as e:  # the hub raises many kinds; the cause goes into the message
        raise FileNotFoundError(
            f"{path}: not a local directory, and fetching it from the Hugging Face hub failed ({e})"
        ) from e


def read_checkpoint(model_dir: str) -> dict[str, Tensor]:
    """All tensors of the model's checkpoint: ``model.safetensors``, the shards a
    ``model.safetensors.index.json`` names, or, where there is no safetensors checkpoint,
    ``pytorch_model.bin`` or the shards of ``pytorch_model.bin.index.json`` (read with
    ``torch.load(weights_only=True)``, which unpickles tensors and plain containers only).

    Raises:
        FileNotFoundError: if the directory has none of them.
        ValueError: if a file cannot be read as its format (the message names it).
    """
    from safetensors.torch import load_file

    def read(path: str) -> dict[str, Tensor]:
        try:
            if path.endswith(".bin"):
                return torch.load(path, map_location="cpu", weights_only=True)
            return load_file(path)
        except (
            Exception
        ) as e:  # safetensors and torch.load raise many kinds; the cause goes into the message
            raise ValueError(
                f"{path}: not a readable {'torch' if path.endswith('.bin') else 'safetensors'} "
                f"checkpoint ({e})"
            ) from e

    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if os.path.isfile(os.path.join(model_dir, single)):
            return read(os.path.join(model_dir, single))
        if os.path.isfile(os.path.join(model_dir, index)):
            try:
                with open(os.path.join(model_dir, index)) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"{os.path.join(model_dir, index)}: not a checkpoint index ({e})"
                ) from e
            state: dict[str, Tensor] = {}
            for shard in shards:
                state.update(read(os.path.join(model_dir, shard)))
            return state
    raise FileNotFoundError(
        f"{model_dir}: no model.safetensors, pytorch_model.bin or their sharded index"
    )


class MemoryBudgetError(ValueError):
    """The requested sizes do not fit the device's free memory; the message says what would
    be allocated and what fits."""


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory where ``device``'s tensors live: ``torch.cuda.mem_get_info`` on CUDA,
    ``MemAvailable`` of ``/proc/meminfo`` on the CPU; None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class ModelInputs:
    """One step's inputs, in the compiled step's order.

    ``tokens``/``positions`` ``[B, T]`` int64, ``cache_rows`` ``[B]`` int64,
    ``logits_index`` ``[B]`` int64 or None (all positions), ``prefill`` the phase, and
    ``routing`` the step's LoRA routing (:mod:`lora_graph.routing`), or None for a
    base-only step.
    """

    tokens: Tensor
    positions: Tensor
    cache_rows: Tensor
    logits_index: Tensor | None
    prefill: bool
    routing: Routing | None = None


class PipelineModelWithKVCache(abc.ABC):
    """A model architecture with a static KV cache, served with per-request LoRA.

    A subclass implements :meth:`_create_model_config` (the architecture's config from the
    Hugging Face one) and :meth:`_instantiate_module`, and declares its LoRA targets
    (:meth:`lora_targets`, :meth:`lora_module_map`, :meth:`lora_module_path`) and
    :meth:`weights_adapter` (checkpoint key renaming). :meth:`load_model` builds the module,
    wraps it with the LoRA manager, and loads the checkpoint through the adapter.

    Args:
        model_path: a Hugging Face model directory or repo id.
        dtype: parameter and activation dtype.
        device: where the model runs.
        max_batch_size: KV cache rows (requests in flight).
        max_seq_len: positions per KV cache row.
        lora: the adapter pool's config, or None to serve the base model only.
        weights: a checkpoint state dict (Hugging Face names) to load instead of reading
            the directory's safetensors (benchmarks build models in memory).

    Raises:
        FileNotFoundError, ValueError: for a model that cannot be found or is not supported.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        max_batch_size: int = 8,
        max_seq_len: int = 512,
        lora: LoRAConfig | None = None,
        weights: dict[str, Tensor] | None = None,
    ) -> None:
        from transformers import AutoConfig

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
        self.model_dir = resolve_model_path(model_path)
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.config = self._create_model_config(self.hf_config)
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None and max_seq_len > limit:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings {limit}"
            )
        self._check_memory(lora)
        self.manager: LoRAManager | None = None
        if lora is not None:
            self.manager = LoRAManager(
                lora,
                targets=self.lora_targets(),
                module_map=self.lora_module_map,
                module_path=self.lora_module_path,
                num_layers=self.num_layers,
                dtype=self.dtype,
                device=self.device,
            )
        self._weights = weights
        self.model = self.load_model()
        self._weights = None
        self.graphs: GraphCache | None = None
        if self.manager is not None:
            self.manager.load_configured()

    def _check_memory(self, lora: LoRAConfig | None) -> None:
        """Refuse sizes whose KV cache and adapter slots cannot be allocated, before
        allocating them (a typo such as ``max_batch_size=1000000`` would otherwise end in an
        allocator traceback).

        Raises:
            MemoryBudgetError: saying what would be allocated, what is free, and the largest
                ``max_batch_size`` that fits.
        """
        kv = self.kv_cache_bytes()
        slots = 0
        if lora is not None:
            targets = self.lora_targets()
            if lora.targets is not None:
                targets = {k: v for k, v in targets.items() if k in lora.targets}
            itemsize = (lora.dtype or self.dtype).itemsize
            slots = (
                SlotLayout(targets, self.num_layers, lora.max_rank).numel
                * lora.num_slots
                * itemsize
            )
        free = free_memory_bytes(self.device)
        if free is None or kv + slots <= free:
            return
        per_row = kv // self.max_batch_size
        fits = max(0, (free - slots) // per_row) if per_row else 0
        gib = 2**30
        raise MemoryBudgetError(
            f"the KV cache for max_batch_size {self.max_batch_size} x max_seq_len "
            f"{self.max_seq_len} needs {kv / gib:.1f} GiB"
            + (f" and the adapter slots {slots / gib:.1f} GiB" if slots else "")
            + f", but {free / gib:.1f} GiB is free on {self.device.type}"
            + (f"; at most max_batch_size {fits} fits at this max_seq_len" if fits else "")
        )

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this pipeline allocates (0 if the architecture has none)."""
        return 0

    # ---- what an architecture declares ----------------------------------------------
    @abc.abstractmethod
    def _create_model_config(self, hf_config: Any) -> Any:
        """The architecture's config from the Hugging Face config."""

    @abc.abstractmethod
    def _instantiate_module(self, config: Any) -> nn.Module:
        """The root module, parameters in the default dtype and device."""

    @property
    @abc.abstractmethod
    def num_layers(self) -> int: ...

    @abc.abstractmethod
    def lora_targets(self) -> dict[str, LoraTarget]: ...

    @abc.abstractmethod
    def lora_module_map(self, module: str) -> LoraModuleRef | None: ...

    @abc.abstractmethod
    def lora_module_path(self, target: str, layer: int) -> str: ...

    @abc.abstractmethod
    def compile_regions(self) -> Sequence[nn.Module]:
        """The repeated blocks ``torch.compile`` compiles (the decoder layers)."""

    @abc.abstractmethod
    def weights_adapter(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]: ...

    # ---- building ---------------------------------------------------------------------
    def load_model(self) -> nn.Module:
        """Build the module, wrap it for LoRA, and load the checkpoint into it.

        Raises:
            ValueError: if the checkpoint lacks a weight the module needs.
        """
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                module = self._instantiate_module(self.config)
        finally:
            torch.set_default_dtype(previous)
        adapter: Callable[[dict[str, Tensor]], dict[str, Tensor]] = self.weights_adapter
        root: nn.Module = module
        if self.manager is not None:
            root = self.manager.wrap(module)
            adapter = self.manager.lora_weight_adapter(self.weights_adapter)
        checkpoint = self._weights if self._weights is not None else read_checkpoint(self.model_dir)
        state = {k: v.to(self.device, self.dtype) for k, v in adapter(checkpoint).items()}
        try:
            missing, unexpected = root.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a size mismatch: config.json and the weights disagree
            detail = str(e).strip().splitlines()[-1].strip()
            raise ValueError(
                f"{self.model_dir}: the checkpoint does not fit config.json ({detail})"
            ) from e
        tied = (
            {k for k in missing if k.endswith(("lm_head.weight", "lm_head.base.weight"))}
            if getattr(self.config, "tie_word_embeddings", False)
            else set()
        )
        if set(missing) - tied:
            raise ValueError(
                f"{self.model_dir}: checkpoint lacks {sorted(set(missing) - tied)[:5]}"
            )
        if unexpected:
            raise ValueError(
                f"{self.model_dir}: checkpoint has weights the model does not use: "
                f"{sorted(unexpected)[:5]}"
            )
        return root.eval().requires_grad_(False)

    def enable_compile(
        self,
        mode: str,
        *,
        decode_buckets: Sequence[int] | None = None,
        prefill_lengths: Sequence[int] | None = None,
        progress: bool = True,
    ) -> GraphCache:
        """Capture the step per bucket, with LoRA and base-only, and serve through it.

        Args:
            mode: ``"inductor"`` (``torch.compile``) or ``"cudagraph"`` (CUDA graphs over it).
            decode_buckets: decode batch sizes (default: powers of two up to
                ``max_batch_size``, and ``max_batch_size``).
            prefill_lengths: prompt length buckets of single-request prefill graphs
                (default: 64 and 256, capped at ``max_seq_len``); longer prompts and
                batched prefills run eagerly.
        """
        from lora_graph.compile.cache import GraphCache

        if decode_buckets is None:
            decode_buckets = sorted(
                {
                    min(2**i, self.max_batch_size)
                    for i in range(self.max_batch_size.bit_length() + 1)
                }
            )
        if prefill_lengths is None:
            prefill_lengths = sorted({min(t, self.max_seq_len) for t in (64, 256)})
        self.graphs = GraphCache(
            self,
            mode=mode,  # type: ignore[arg-type]
            decode_buckets=decode_buckets,
            prefill_lengths=prefill_lengths,
        )
        self.graphs.capture(progress=progress)
        return self.graphs

    def decode_width(self, rows: int) -> int:
        """The batch width a decode step of ``rows`` rows is padded to (its bucket)."""
        return self.graphs.decode_width(rows) if self.graphs is not None else rows

    # ---- running ----------------------------------------------------------------------
    def prepare(
        self,
        rows: Sequence[HasAdapter],
        *,
        tokens: Tensor,
        positions: Tensor,
        cache_rows: Tensor,
        logits_index: Tensor | None,
        prefill: bool,
    ) -> ModelInputs:
        """Make the rows' adapters active and build the step's inputs.

        ``rows`` are the batch rows in step order (sorted by adapter, base last), one per
        row of ``tokens``. A step where no row names an adapter gets no LoRA inputs.
        """
        routing = None
        if self.manager is not None:
            self.manager.activate_batch(rows)
        if any(r.adapter is not None for r in rows):
            if self.manager is None:
                raise ValueError("a row names an adapter but LoRA is not enabled")
            seq = tokens.shape[1]
            routing = self.manager.route(rows, [i * seq for i in range(len(rows) + 1)])
        return ModelInputs(tokens, positions, cache_rows, logits_index, prefill, routing)

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> Tensor:
        """Run one step; float32 logits ``[B, vocab]`` (``[B, T, vocab]`` without
        ``logits_index``). A step whose key was captured replays its graph (the logits are
        then valid until the next replay); others run eagerly."""
        if self.graphs is not None:
            graph = self.graphs.lookup(inputs)
            if graph is not None:
                return self.graphs.run(inputs, graph)
            # an uncaptured shape: run, don't compile
            with torch.compiler.set_stance("force_eager"):
                return self._execute_eager(inputs)
        return self._execute_eager(inputs)

    def _execute_eager(self, inputs: ModelInputs) -> Tensor:
        return self.model(
            inputs.tokens,
            inputs.positions,
            inputs.cache_rows,
            inputs.logits_index,
            inputs.prefill,
            inputs.routing,
        )
