"""The base class for a model over a paged KV cache, served with per-request LoRA."""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lora_graph.config import LoRAConfig
from lora_graph.layout import SlotLayout
from lora_graph.manager import LoRAManager
from lora_graph.paging import PagePool
from lora_graph.step import STEP_INPUTS, ModelInputs, SeqChunk, StepBuffer
from lora_graph.targets import LoraModuleRef, LoraTarget, module_map, module_path

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


class PipelineModelWithKVCache(abc.ABC):
    """A model architecture over a paged KV cache, served with per-request LoRA in packed
    steps (:mod:`lora_graph.step`).

    A subclass implements :meth:`_create_model_config` (the architecture's config from the
    Hugging Face one) and :meth:`_instantiate_module`, and declares its LoRA target table
    (:meth:`lora_targets`: the module map and paths derive from it), its
    :meth:`weights_adapter` (checkpoint key renaming), its step inputs
    (:meth:`_get_compile_input_types`) and the
    bytes of KV cache a token takes (:meth:`kv_bytes_per_token`). :meth:`load_model`
    builds the module, wraps it with the LoRA manager, and loads the checkpoint through
    the adapter.

    Args:
        model_path: a Hugging Face model directory or repo id.
        dtype: parameter and activation dtype.
        device: where the model runs.
        max_batch_size: the most requests in one step (and running at once).
        max_seq_len: the longest request (prompt plus generated tokens).
        max_num_batched_tokens: the most tokens in one step (prefill chunks plus decodes).
        page_size: token positions per KV cache page.
        kv_cache_tokens: token positions of the KV cache pool, or None to size it: on CUDA
            from ``gpu_memory_utilization``, elsewhere ``max_batch_size * max_seq_len``
            (every request at full length). Either way at most that many are allocated.
        gpu_memory_utilization: on CUDA, the fraction of the device's memory this pipeline
            may use (weights, adapter slots, activations and the KV cache), as vLLM's
            option of the same name.
        lora: the adapter pool's config, or None to serve the base model only.
        weights: a checkpoint state dict (Hugging Face names) to load instead of reading
            the directory's safetensors (benchmarks build models in memory).

    Raises:
        FileNotFoundError, ValueError: for a model that cannot be found or is not supported
            (or a CUDA device for an architecture not :attr:`verified_on_cuda`).
        MemoryBudgetError: if the KV cache cannot hold one request of ``max_seq_len``.
    """

    #: False for an architecture whose CUDA parity test (against ``transformers`` + ``peft``)
    #: has not passed on a GPU yet: a CUDA device is then refused at start-up.
    verified_on_cuda: bool = True

    def __init__(
        self,
        model_path: str,
        *,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        max_batch_size: int = 8,
        max_seq_len: int = 512,
        max_num_batched_tokens: int = 2048,
        page_size: int = 16,
        kv_cache_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        lora: LoRAConfig | None = None,
        weights: dict[str, Tensor] | None = None,
    ) -> None:
        from transformers import AutoConfig

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
        if max_num_batched_tokens < max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_batch_size ({max_batch_size}): every running request decodes each step"
            )
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        if kv_cache_tokens is not None and kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be at least 1, got {kv_cache_tokens}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        self.model_dir = resolve_model_path(model_path)
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not self.verified_on_cuda:
            raise ValueError(
                f"{type(self).__name__} is not verified on CUDA yet (its GPU parity test has "
                "not passed); serve it on the CPU (--device cpu)"
            )
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.config = self._create_model_config(self.hf_config)
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None and max_seq_len > limit:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings {limit}"
            )
        self.num_kv_pages = 2  # what the module is built with while it is only measured
        self.num_kv_pages = self._size_kv_cache(lora, kv_cache_tokens, gpu_memory_utilization)
        self.pages = PagePool(self.num_kv_pages, page_size)
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
                ignored_modules=self.lora_ignored_modules(),
                tied_modules=self.lora_tied_modules(),
            )
        self._weights = weights
        self.model = self.load_model()
        self._weights = None
        self.step_buffer = StepBuffer(
            self._get_compile_input_types(),
            max_tokens=max_num_batched_tokens,
            max_seqs=max_batch_size,
            max_pages=self.pages.pages_for(max_seq_len),
            page_size=page_size,
            device=self.device,
        )
        self.graphs: GraphCache | None = None
        if self.manager is not None:
            self.manager.load_configured()

    def _slot_bytes(self, lora: LoRAConfig | None) -> int:
        if lora is None:
            return 0
        targets = self.lora_targets()
        if lora.targets is not None:
            targets = {k: v for k, v in targets.items() if k in lora.targets}
        itemsize = (lora.dtype or self.dtype).itemsize
        return SlotLayout(targets, self.num_layers, lora.max_rank).numel * lora.num_slots * itemsize

    def _weight_bytes(self) -> int:
        """Parameter bytes of the module, counted on the meta device (nothing allocated)."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                module = self._instantiate_module(self.config)
        finally:
            torch.set_default_dtype(previous)
        seen = {id(p): p for p in module.parameters()}  # tied weights once
        return sum(p.numel() * p.element_size() for p in seen.values())

    def _activation_bytes(self) -> int:
        """A generous bound on a step's activations at ``max_num_batched_tokens``."""
        hidden = getattr(self.config, "hidden_size", 0)
        inter = getattr(self.config, "intermediate_size", 0)
        vocab = getattr(self.config, "vocab_size", 0)
        per_token = (8 * hidden + 4 * inter) * 4  # float32 temporaries
        return self.max_num_batched_tokens * per_token + 2 * self.max_batch_size * vocab * 4

    def _size_kv_cache(
        self, lora: LoRAConfig | None, kv_cache_tokens: int | None, utilization: float
    ) -> int:
        """KV cache pages (the scratch page included) for the memory budget, and refuse
        sizes that cannot be allocated before allocating them (a typo such as
        ``kv_cache_tokens=10**9`` would otherwise end in an allocator traceback).

        Raises:
            MemoryBudgetError: saying what would be allocated, what is free, and what fits.
        """
        page_bytes = self.kv_bytes_per_token() * self.page_size
        per_request = -(-self.max_seq_len // self.page_size)
        most = self.max_batch_size * per_request + 1  # every request at full length
        slots = self._slot_bytes(lora)
        gib = 2**30
        if kv_cache_tokens is None and self.device.type == "cuda" and page_bytes:
            free, total = torch.cuda.mem_get_info(self.device)
            budget = (
                utilization * total
                - (total - free)
                - self._weight_bytes()
                - slots
                - self._activation_bytes()
            )
            pages = min(most, int(budget // page_bytes))
            if pages < per_request + 1:
                raise MemoryBudgetError(
                    f"gpu_memory_utilization {utilization} leaves {max(budget, 0) / gib:.2f} GiB "
                    f"for the KV cache on {self.device}, less than one request of max_seq_len "
                    f"{self.max_seq_len} needs ({(per_request + 1) * page_bytes / gib:.2f} GiB)"
                )
            return pages
        pages = most
        if kv_cache_tokens is not None:
            pages = min(most, -(-kv_cache_tokens // self.page_size) + 1)
            if pages < per_request + 1:
                raise ValueError(
                    f"kv_cache_tokens {kv_cache_tokens} cannot hold one request of max_seq_len "
                    f"{self.max_seq_len}"
                )
        kv = pages * page_bytes
        free_now = free_memory_bytes(self.device)
        if free_now is None or kv + slots <= free_now:
            return pages
        fits = max(0, (free_now - slots) // page_bytes - 1) * self.page_size if page_bytes else 0
        raise MemoryBudgetError(
            f"the KV cache of {(pages - 1) * self.page_size} token positions (max_batch_size "
            f"{self.max_batch_size} x max_seq_len {self.max_seq_len}, or kv_cache_tokens) "
            f"needs {kv / gib:.1f} GiB"
            + (f" and the adapter slots {slots / gib:.1f} GiB" if slots else "")
            + f", but {free_now / gib:.1f} GiB is free on {self.device.type}"
            + (f"; at most kv_cache_tokens {fits} fits" if fits else "")
        )

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token position takes over all layers (0: no KV cache)."""
        return 0

    def _get_compile_input_types(self) -> dict[str, tuple[str, ...]]:
        """The step inputs the module's forward takes as keywords besides ``routing``, each
        with its shape in terms of the step's width (:data:`lora_graph.step.STEP_INPUTS`;
        all int32): the step buffer and every captured graph are built from this
        declaration, so an architecture changes neither ``lora_graph/compile/`` nor the engine.
        Default: all of them (a decoder over the paged KV cache)."""
        return dict(STEP_INPUTS)

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

    def lora_module_map(self, module: str) -> LoraModuleRef | None:
        """Where a checkpoint module's adapter lands (None: nowhere), from the target
        table's ``checkpoint_names`` (:func:`lora_graph.targets.module_map`)."""
        if getattr(self, "_module_map", None) is None:
            self._module_map = module_map(self.lora_targets(), self.num_layers)
        return self._module_map(module)

    def lora_ignored_modules(self) -> tuple[str, ...]:
        """Checkpoint modules whose LoRA pairs cannot change what the model serves, skipped
        when an adapter has them (default: none; every unmapped module is refused)."""
        return ()

    def lora_tied_modules(self) -> dict[str, str]:
        """Checkpoint modules the model ties to its input embedding, each to the
        embedding's module, as PEFT finds them (``_get_module_names_tied_with_embedding``):
        the ``lm_head`` target's module tied to the ``embed_tokens`` target's when the
        checkpoint's ``tie_word_embeddings`` is true; else none."""
        targets = self.lora_targets()
        if not getattr(self.hf_config, "tie_word_embeddings", False):
            return {}
        if "lm_head" not in targets or "embed_tokens" not in targets:
            return {}
        return {targets["lm_head"].checkpoint_names[0]: targets["embed_tokens"].checkpoint_names[0]}

    def lora_module_path(self, target: str, layer: int) -> str:
        """A target's module path at ``layer``, from the table's ``module_path``."""
        return module_path(self.lora_targets())(target, layer)

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
        # a tied weight (one parameter under several names, as tied embeddings and LM head)
        # is loaded when the checkpoint has it under any of its names, as transformers does
        names: dict[int, list[str]] = {}
        for name, param in root.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        tied = {
            k
            for group in names.values()
            if len(group) > 1 and any(n in state for n in group)
            for k in group
        }
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
        token_buckets: Sequence[int] | None = None,
        progress: bool = True,
    ) -> GraphCache:
        """Capture the packed step per token bucket, with LoRA and base-only, and serve
        through it.

        Args:
            mode: ``"inductor"`` (``torch.compile``) or ``"cudagraph"`` (CUDA graphs over it).
            token_buckets: step sizes in tokens to capture (default: powers of two up to
                ``max_num_batched_tokens``, and ``max_num_batched_tokens``). A step is
                padded to the smallest bucket that holds it.
        """
        from lora_graph.compile.cache import GraphCache

        if token_buckets is None:
            top = self.max_num_batched_tokens
            token_buckets = sorted({min(2**i, top) for i in range(top.bit_length() + 1)})
        self.graphs = GraphCache(
            self,
            mode=mode,  # type: ignore[arg-type]
            token_buckets=token_buckets,
        )
        self.graphs.capture(progress=progress)
        return self.graphs

    @property
    def max_step_tokens(self) -> int:
        """The most tokens the scheduler puts in one step: ``max_num_batched_tokens``, or
        the largest captured bucket if that is smaller (no step then runs uncaptured)."""
        if self.graphs is not None:
            return min(self.max_num_batched_tokens, self.graphs.token_buckets[-1])
        return self.max_num_batched_tokens

    # ---- running ----------------------------------------------------------------------
    def prepare(
        self,
        chunks: Sequence[SeqChunk],
        *,
        all_logits: bool = False,
        fed_tokens: Tensor | None = None,
    ) -> ModelInputs:
        """Make the chunks' adapters active and build the step's inputs (a chunk with a
        ``fed_from`` row gets its token from ``fed_tokens`` on the device:
        :meth:`StepBuffer.fill`).

        The chunks are put in step order (sorted by adapter, base last:
        :attr:`ModelInputs.chunks`, one logits row each). A step where no chunk names an
        adapter gets no LoRA inputs. With ``all_logits`` the step returns every token's
        logits and runs eagerly.

        Raises:
            ValueError: if a chunk names an adapter and LoRA is not enabled, or the step
                does not fit (more than ``max_num_batched_tokens`` tokens or
                ``max_batch_size`` requests, pages not covering a chunk).
        """
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        chunks = list(chunks)
        if any(c.adapter is not None for c in chunks) and self.manager is None:
            raise ValueError("a chunk names an adapter but LoRA is not enabled")
        if self.manager is not None:
            chunks = self.manager.sort_lora_batch(chunks)
            self.manager.activate_batch(chunks)
        offsets = [0]
        for c in chunks:
            offsets.append(offsets[-1] + len(c.token_ids))
        n = offsets[-1]
        if all_logits or self.graphs is None:
            width = (n, len(chunks))
        else:
            width = self.graphs.width(n, len(chunks))
        inputs = self.step_buffer.fill(chunks, width, fed_tokens)
        routing = None
        if self.manager is not None and any(c.adapter is not None for c in chunks):
            routing = self.manager.route(chunks, offsets)
        return ModelInputs(inputs, routing, chunks, width, all_logits)

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> Tensor:
        """Run one step; float32 logits ``[S, vocab]``, row ``i`` for ``inputs.chunks[i]``
        (rows past the chunks are padding), or ``[T, vocab]`` with ``all_logits``. A step
        whose width was captured replays its graph (the logits are then valid until the
        next replay); others run eagerly."""
        if self.graphs is not None and not inputs.all_logits:
            graph = self.graphs.lookup(inputs)
            if graph is not None:
                return self.graphs.run(inputs, graph)
            # an uncaptured width: run, don't compile
            with torch.compiler.set_stance("force_eager"):
                return self._execute_eager(inputs)
        return self._execute_eager(inputs)

    def _execute_eager(self, inputs: ModelInputs) -> Tensor:
        kwargs: dict[str, Tensor | None] = dict(inputs.inputs)
        if inputs.all_logits:
            kwargs["logits_index"] = None
        return self.model(**kwargs, routing=inputs.routing)
