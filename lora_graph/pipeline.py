"""The pipeline base classes: a model architecture served with per-request LoRA in packed
steps, and the runner that builds, prepares and executes its step.

:class:`PipelineModel` is the runner (:meth:`~PipelineModel.load_model`,
:meth:`~PipelineModel.prepare`, :meth:`~PipelineModel.execute`,
:meth:`~PipelineModel.enable_compile`) and what an architecture declares (its config, its
module, its LoRA target table, its checkpoint renaming); an encoder subclasses it.
:class:`PipelineModelWithKVCache` adds the paged KV cache a decoder needs. Reading files is
:mod:`lora_graph.loading`'s job, sizing memory :mod:`lora_graph.memory`'s, and the captured
graphs :mod:`lora_graph.compile`'s.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
from torch import Tensor, nn

from lora_graph import memory
from lora_graph.config import LoRAConfig
from lora_graph.loading.model_files import (
    Select,
    parse_dtype,
    read_checkpoint,
    resolve_model_path,
    select_state,
)
from lora_graph.manager import LoRAManager
from lora_graph.paging import PagePool
from lora_graph.parallel import TPRank
from lora_graph.routing import Routing
from lora_graph.step import STEP_INPUTS, ModelInputs, SeqChunk, StepBuffer
from lora_graph.targets import LoraModuleRef, LoraTarget, module_map, module_path
from lora_graph.tensor_parallel import (
    RankLink,
    check_group_size,
    checkpoint_shares,
    served_targets,
)

if TYPE_CHECKING:
    from lora_graph.compile.cache import GraphCache


class PipelineModel(abc.ABC):
    """A model architecture served with per-request LoRA in packed steps
    (:mod:`lora_graph.step`), without a KV cache: an encoder, whose step is whole
    sentences. :class:`PipelineModelWithKVCache` adds the KV cache.

    A subclass implements :meth:`_create_model_config` (the architecture's config from the
    Hugging Face one) and :meth:`_instantiate_module`, and declares its LoRA target table
    (:meth:`lora_targets`: the module map and paths derive from it), its
    :meth:`weights_adapter` (checkpoint key renaming) and its step inputs
    (:meth:`_get_compile_input_types`). :meth:`load_model` builds the module, wraps it
    with the LoRA manager, and loads the checkpoint through the adapter.

    Args:
        model_path: a Hugging Face model directory or repo id.
        dtype: parameter and activation dtype.
        device: where the model runs.
        max_batch_size: the most requests in one step (and running at once).
        max_seq_len: the longest request (prompt plus generated tokens); None: the model's
            context (``max_position_embeddings``), for a model with a KV cache bounded by
            what its memory holds (:func:`lora_graph.memory.fit_seq_len`;
            :attr:`max_seq_len_note` says which).
        max_num_batched_tokens: the most tokens in one step (prefill chunks plus decodes).
        gpu_memory_utilization: on CUDA, the fraction of the device's memory this pipeline
            may use (weights, adapter slots, activations and the KV cache), as vLLM's
            option of the same name.
        lora: the adapter pool's config, or None to serve the base model only.
        weights: a checkpoint state dict (Hugging Face names) to load instead of reading
            the directory's safetensors (benchmarks build models in memory), or any
            mapping of names to tensors: under tensor parallelism each rank reads every
            tensor once and keeps its share (a mapping that makes each tensor when read,
            ``bench/decode.py``'s ``RandomWeights``, serves a model larger than one device).
        tensor_parallel_size: serve the model sharded over this many ranks (tensor
            parallelism, Megatron-LM's split: :mod:`lora_graph.parallel`), one process and
            one device each (``cuda:0..N-1``; on the CPU, gloo): this object is rank 0 and
            starts the others itself (:mod:`lora_graph.distributed`); each reads only its
            share of the checkpoint and of every adapter. None: no process group (1 runs
            the distributed path on one rank). Only architectures with
            :attr:`supports_tensor_parallel`.
        vocab_parallel_lm_head: under tensor parallelism, split the LM head by vocabulary
            (each rank its rows, the logits gathered: an all-gather a step) instead of
            keeping it whole on every rank (the default: no collective after the head, but
            every rank reads all of it). Its LoRA B rows split with it.

    Raises:
        FileNotFoundError, ValueError: for a model that cannot be found or is not supported
            (or a CUDA device for an architecture not :attr:`verified_on_cuda`).
        MemoryBudgetError: if the sizes do not fit the device (:mod:`lora_graph.memory`).
    """

    #: False for an architecture whose CUDA parity test (against ``transformers`` + ``peft``)
    #: has not passed on a GPU yet: a CUDA device is then refused at start-up.
    verified_on_cuda: bool = True

    #: whether the architecture shards over tensor-parallel ranks (``tensor_parallel_size``)
    supports_tensor_parallel: bool = False

    def __init__(
        self,
        model_path: str,
        *,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        gpu_memory_utilization: float = 0.9,
        lora: LoRAConfig | None = None,
        weights: Mapping[str, Tensor] | None = None,
        tensor_parallel_size: int | None = None,
        vocab_parallel_lm_head: bool = False,
    ) -> None:
        from transformers import AutoConfig

        from lora_graph import distributed

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_seq_len is not None and max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
        if max_num_batched_tokens < max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_batch_size ({max_batch_size}): every running request decodes each step"
            )
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
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.config = self._create_model_config(self.hf_config)
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        self.max_seq_len_from_model = max_seq_len is None
        #: whether the model's context was lowered to fit the KV cache (:meth:`_plan_memory`)
        self.max_seq_len_bounded = False
        if max_seq_len is None:
            if limit is None:
                raise ValueError(
                    "the model's config has no max_position_embeddings: give max_seq_len"
                )
            max_seq_len = int(limit)
        self.max_seq_len: int = max_seq_len
        #: how max_seq_len was chosen, for a start-up line
        self.max_seq_len_note = (
            f"max_seq_len {max_seq_len} (the model's context)"
            if self.max_seq_len_from_model
            else f"max_seq_len {max_seq_len}"
        )
        if limit is not None and max_seq_len > limit:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings {limit}"
            )
        # tensor parallelism: this process's rank and its link to the others (None: none)
        self.tp: TPRank | None = None
        self.link: RankLink | None = None
        self.vocab_parallel_lm_head = vocab_parallel_lm_head
        self._closed = False  # a tensor-parallel pipeline after close(): its shards are gone
        if distributed.worker_assignment() is not None or tensor_parallel_size is not None:
            size = 1 if tensor_parallel_size is None else tensor_parallel_size
            self._check_tensor_parallel(size)
            self.link = RankLink(
                size,
                self.device,
                (type(self), (model_path,), dict(
                    dtype=self.dtype, device=device, max_batch_size=max_batch_size,
                    max_seq_len=None if self.max_seq_len_from_model else max_seq_len,
                    max_num_batched_tokens=max_num_batched_tokens,
                    gpu_memory_utilization=gpu_memory_utilization, lora=lora, weights=weights,
                    tensor_parallel_size=size, vocab_parallel_lm_head=vocab_parallel_lm_head,
                    **getattr(self, "_init_kwargs", {}),
                )),
            )  # fmt: skip
            self.device, self.tp = self.link.device, self.link.tp
            if self.tp.rank == 0:
                distributed.on_close(self.close)
            self.max_seq_len_note += f", tensor parallel size {size}"
        self._plan_memory(lora)
        self.manager: LoRAManager | None = None
        if lora is not None:
            self.manager = LoRAManager(
                lora,
                targets=self._served_targets(),
                module_map=self.lora_module_map,
                module_path=self.lora_module_path,
                num_layers=self.num_layers,
                dtype=self.dtype,
                device=self.device,
                ignored_modules=self.lora_ignored_modules(),
                tied_modules=self.lora_tied_modules(),
                tp=self.tp,
            )
        self._weights = weights
        self.model = self.load_model()
        self._weights = None
        self.step_buffer = StepBuffer(
            self._get_compile_input_types(),
            max_tokens=max_num_batched_tokens,
            max_seqs=max_batch_size,
            max_pages=self._max_pages_per_request(),
            page_size=self._page_size(),
            device=self.device,
        )
        self.graphs: GraphCache | None = None
        if self.link is not None:
            self.link.connect(self)
        if self.manager is not None and (self.tp is None or self.tp.rank == 0):
            self.manager.load_configured()
        if self.link is not None and self.link.torchrun and self.link.tp.rank > 0:
            self.serve_worker()  # a worker started by torchrun: serves rank 0 here, then ends

    # ---- tensor parallelism -------------------------------------------------------------
    def _check_tensor_parallel(self, size: int) -> None:
        """Refuse a tensor-parallel size this architecture, its sizes or the devices do not
        allow, before any process is started.

        Raises:
            ValueError: naming the cause.
        """
        if not self.supports_tensor_parallel:
            raise ValueError(f"{type(self).__name__} does not support tensor parallelism yet")
        check_group_size(size, self.device)
        self._check_shards(TPRank(0, size))

    def _check_shards(self, tp: TPRank) -> None:  # noqa: B027 (optional: an architecture's)
        """Raise ValueError if the model's sizes do not split over ``tp.size`` ranks."""

    def _served_targets(self) -> dict[str, LoraTarget]:
        """The LoRA targets as served (:func:`lora_graph.tensor_parallel.served_targets`)."""
        return served_targets(self.lora_targets(), self.tp, self.vocab_parallel_lm_head)

    def serve_worker(self) -> NoReturn:
        """A worker rank's loop: run each command rank 0 sends until it says stop
        (:meth:`RankLink.serve`), leave the group, and end this process
        (:func:`lora_graph.distributed.exit_worker`)."""
        from lora_graph import distributed

        assert self.link is not None
        self.link.serve(self)
        self.link.close()
        distributed.exit_worker()

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the group (nothing without one).
        Also done at exit."""
        from lora_graph import distributed

        if self.link is not None:
            self.link.close()
            self.link, self.tp, self._closed = None, None, True
            if self.close in distributed._CLOSE:
                distributed._CLOSE.remove(self.close)

    # ---- memory -------------------------------------------------------------------------
    def _slot_bytes(self, lora: LoRAConfig | None) -> int:
        return memory.slot_bytes(lora, self.lora_targets(), self.num_layers, self.dtype)

    def _plan_memory(self, lora: LoRAConfig | None) -> None:
        """Size what the pipeline allocates beyond its weights before building anything
        (here: the slot pool must fit the free memory).

        Raises:
            MemoryBudgetError: if it does not fit.
        """
        memory.check_slots_fit(self.device, self._slot_bytes(lora))

    def _max_pages_per_request(self) -> int:
        return 1

    def _page_size(self) -> int:
        return 1

    def _get_compile_input_types(self) -> dict[str, tuple[str, ...]]:
        """The step inputs the module's forward takes as keywords besides ``routing``, each
        with its shape in terms of the step's width (:data:`lora_graph.step.STEP_INPUTS`;
        all int32): the step buffer and every captured graph are built from this
        declaration, so an architecture changes neither ``lora_graph/compile/`` nor the engine.
        Default: the tokens, their positions and each request's first token (no KV cache)."""
        return {name: STEP_INPUTS[name] for name in ("tokens", "positions", "query_start")}

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

        def read(select: Select | None) -> dict[str, Tensor]:
            if self._weights is None:
                return read_checkpoint(self.model_dir, select)
            return dict(self._weights) if select is None else select_state(self._weights, select)

        if self.tp is None:
            checkpoint = read(None)
        else:  # this rank's shares; the LM head untied
            checkpoint = checkpoint_shares(
                read, self._served_targets(), self.num_layers, self.tp, self.lora_tied_modules()
            )
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
        with self._command():
            if self.link is not None and self.link.sends:
                self.link.send_capture(mode, list(token_buckets))
            self.graphs = GraphCache(
                self,
                mode=mode,  # type: ignore[arg-type]
                token_buckets=token_buckets,
            )
            self.graphs.capture(progress=progress)
        return self.graphs

    @property
    def lora_backend(self) -> str | None:
        """The LoRA kernels' backend (``LoRAConfig.backend``), None without LoRA."""
        return self.manager.config.backend if self.manager is not None else None

    @property
    def routing_buffer(self) -> Routing | None:
        """The persistent routing every LoRA step writes and every LoRA graph reads (None
        without LoRA)."""
        return self.manager.routing.routing if self.manager is not None else None

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
        if self._closed:
            raise RuntimeError(
                "this tensor-parallel pipeline was closed: its model is only this rank's "
                "shard now (build a new one)"
            )
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
        with self._command():  # (the collectives inside the step too)
            if self.link is not None and self.link.sends:
                self.link.send_step(inputs)
            return self._execute(inputs)

    def _command(self) -> contextlib.AbstractContextManager[None]:
        """Around one command rank 0 of a group sends and runs its part of
        (:meth:`RankLink.guard`); nothing elsewhere."""
        if self.link is not None and self.link.sends:
            return self.link.guard()
        return contextlib.nullcontext()

    def _execute(self, inputs: ModelInputs) -> Tensor:
        if self.graphs is not None and not inputs.all_logits:
            graph = self.graphs.lookup(inputs)
            if graph is not None:
                return self.graphs.run(inputs, graph)
            # an uncaptured width: run, don't compile
            with torch.compiler.set_stance("force_eager"):
                return self._execute_eager(inputs)
        return self._execute_eager(inputs)

    @torch.inference_mode()
    def logits_at(self, inputs: ModelInputs, rows: Sequence[int]) -> Tensor:
        """Float32 logits ``[R, vocab]`` of the step's tokens ``rows`` (indices into the
        step's tokens, in step order), from the hidden states the last :meth:`execute` of
        ``inputs`` left (``step_hidden``; captured or eager alike), through the final norm
        and the LM head with each row's adapter. Only those rows pay the LM head; the step
        itself ran as any other.

        Raises:
            ValueError: if the model keeps no hidden states (not a decoder).
        """
        hidden = getattr(self.model, "step_hidden", None)
        if hidden is None:
            raise ValueError("this model keeps no per-token hidden states")
        index = torch.tensor(list(rows), dtype=torch.long)
        routing = None
        if inputs.routing is not None and self.manager is not None:
            # each chunk's rows among ``rows``: a routing by token over them alone
            ends = list(itertools.accumulate(len(c.token_ids) for c in inputs.chunks))
            counts = [0] * len(inputs.chunks)
            k = 0
            for r in rows:
                while r >= ends[k]:
                    k += 1
                counts[k] += 1
            offsets = [0, *itertools.accumulate(counts)]
            routing = self.manager.route(inputs.chunks, offsets)
        with self._command():
            if self.link is not None and self.link.sends and self.vocab_parallel_lm_head:
                # every rank's head computes its vocabulary range of these rows
                self.link.send_logits_at(index, routing is not None)
            return self.head_logits(index, routing)

    def head_logits(self, index: Tensor, routing: Routing | None) -> Tensor:
        """Float32 logits of the step's tokens ``index`` (``[R]`` int64, host or device)
        from the last step's hidden states, through the final norm and the LM head
        (:meth:`logits_at`'s computation, which a worker rank repeats)."""
        model = cast(Any, self.model)
        x = model.step_hidden[index.to(model.step_hidden.device, non_blocking=True)]
        return cast(Tensor, model.final_logits(model.lm_head(model.norm(x)[None], routing)[0]))

    def _execute_eager(self, inputs: ModelInputs) -> Tensor:
        kwargs: dict[str, Tensor | None] = dict(inputs.inputs)
        if inputs.all_logits:
            kwargs["logits_index"] = None
        return self.model(**kwargs, routing=inputs.routing)


class PipelineModelWithKVCache(PipelineModel):
    """A model architecture over a paged KV cache (a decoder): a :class:`PipelineModel`
    whose module holds the KV cache pages :attr:`pages` allocates.

    A subclass also says how many bytes of KV cache a token takes
    (:meth:`kv_bytes_per_token`); the pool's size comes from :func:`lora_graph.memory.
    kv_cache_pages`, before the module is built (:attr:`num_kv_pages`).

    Args:
        page_size: token positions per KV cache page.
        kv_cache_tokens: token positions of the KV cache pool, or None to size it: on CUDA
            from ``gpu_memory_utilization``, elsewhere ``max_batch_size * max_seq_len``
            (every request at full length). Either way at most that many are allocated.
        **kwargs: :class:`PipelineModel`'s.

    Raises:
        MemoryBudgetError: if the KV cache cannot hold one request of ``max_seq_len``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        page_size: int = 16,
        kv_cache_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        if kv_cache_tokens is not None and kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be at least 1, got {kv_cache_tokens}")
        self.page_size = page_size
        self.kv_cache_tokens = kv_cache_tokens
        self._init_kwargs = {"page_size": page_size, "kv_cache_tokens": kv_cache_tokens}
        self.num_kv_pages = 2  # what the module is built with while it is only measured
        super().__init__(model_path, **kwargs)

    def _plan_memory(self, lora: LoRAConfig | None) -> None:
        config = self.config

        def fixed_bytes() -> int:
            return memory.weight_bytes(
                lambda: self._instantiate_module(config), self.dtype
            ) + memory.activation_bytes(
                hidden_size=getattr(config, "hidden_size", 0),
                intermediate_size=getattr(config, "intermediate_size", 0),
                vocab_size=getattr(config, "vocab_size", 0),
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_batch_size=self.max_batch_size,
            )

        page_bytes = self.kv_bytes_per_token() * self.page_size
        if self.max_seq_len_from_model:
            context = self.max_seq_len
            if self.kv_cache_tokens is None:  # (off CUDA: bounded for a long context)
                self.kv_cache_tokens = memory.cpu_kv_cache_tokens(
                    self.device, page_bytes, self.page_size, self._slot_bytes(lora),
                    max_batch_size=self.max_batch_size, context=context,
                )  # fmt: skip
            self.max_seq_len = memory.fit_seq_len(
                context=context,
                device=self.device,
                page_bytes=page_bytes,
                page_size=self.page_size,
                kv_cache_tokens=self.kv_cache_tokens,
                gpu_memory_utilization=self.gpu_memory_utilization,
                slots=self._slot_bytes(lora),
                fixed_bytes=fixed_bytes,
            )
            if self.max_seq_len < context:
                self.max_seq_len_bounded = True
                given = self._init_kwargs["kv_cache_tokens"]
                bound = (
                    f"kv_cache_tokens {given}" if given is not None
                    else "the memory left for the KV cache"
                )  # fmt: skip
                self.max_seq_len_note = (
                    f"max_seq_len {self.max_seq_len} (the model's context {context} bounded by "
                    f"{bound}; give --max-seq-len or --kv-cache-tokens to choose)"
                ) + (f", tensor parallel size {self.tp.size}" if self.tp is not None else "")
        num_kv_pages = memory.kv_cache_pages(
            device=self.device,
            page_bytes=page_bytes,
            page_size=self.page_size,
            max_seq_len=self.max_seq_len,
            max_batch_size=self.max_batch_size,
            kv_cache_tokens=self.kv_cache_tokens,
            gpu_memory_utilization=self.gpu_memory_utilization,
            slots=self._slot_bytes(lora),
            fixed_bytes=fixed_bytes,
        )
        self.num_kv_pages = num_kv_pages
        if self.tp is not None:  # rank 0 hands out the pages of every rank's cache
            from lora_graph.distributed import agree_min

            self.max_seq_len, self.num_kv_pages = agree_min(
                [self.max_seq_len, num_kv_pages], self.device
            )
        self.pages = PagePool(self.num_kv_pages, self.page_size)

    def _max_pages_per_request(self) -> int:
        return self.pages.pages_for(self.max_seq_len)

    def _page_size(self) -> int:
        return self.page_size

    @abc.abstractmethod
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token position takes over all layers."""

    def _get_compile_input_types(self) -> dict[str, tuple[str, ...]]:
        """Default: all of :data:`lora_graph.step.STEP_INPUTS` (a decoder over the paged KV
        cache)."""
        return dict(STEP_INPUTS)
