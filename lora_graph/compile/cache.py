"""The graph cache: the packed step captured at start-up per token bucket, with LoRA and
base-only.

The repeated decoder layer is compiled (``torch.compile``, ``fullgraph=True``; one graph
per key serves every layer of one attention type, so start-up compiles a layer, not the
whole stack). A key is a step width (:class:`~lora_graph.compile.keys.CaptureKey`:
``tokens`` positions, ``seqs = min(tokens, max_batch_size)`` requests). Every key runs its
step over views of the pipeline's persistent :class:`~lora_graph.step.StepBuffer` (the
step inputs the model declares) and the manager's persistent routing buffer; the LoRA
layers view the slot pool. ``prepare`` pads a step to its bucket and writes it into the
buffers. In ``inductor`` mode the Python step then runs around the compiled layer graphs;
in ``cudagraph`` mode (CUDA) a ``torch.cuda.CUDAGraph`` captured by hand per key over that
step is replayed, one graph launch a step.

Nothing recompiles after start-up: the backend records every graph it is given, and a
graph compiled while serving is counted in :attr:`GraphCache.recompiles`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from lora_graph.compile.keys import CaptureKey
from lora_graph.routing import Routing
from lora_graph.step import ModelInputs, StepBuffer

Mode = Literal["inductor", "cudagraph"]


# capture keys compiled so far in this process (:meth:`GraphCache.capture`)
_KEYS_CAPTURED = 0


class CapturablePipeline(Protocol):
    """What the graph cache uses of a pipeline (:class:`~lora_graph.pipeline.PipelineModel`
    is one): its sizes and device, the module it runs and the regions it compiles, the
    persistent step buffer, and the persistent routing buffer every LoRA graph reads."""

    device: torch.device
    max_batch_size: int
    max_num_batched_tokens: int
    step_buffer: StepBuffer

    @property
    def model(self) -> nn.Module: ...

    @property
    def lora_backend(self) -> str | None:
        """The LoRA kernels' backend (``LoRAConfig.backend``), None without LoRA."""

    @property
    def routing_buffer(self) -> Routing | None:
        """The persistent routing every LoRA step writes (None without LoRA)."""

    def compile_regions(self) -> Sequence[nn.Module]: ...


@dataclass
class CapturedGraph:
    """One captured step: its key, the ops its compiled regions call, how many region
    graphs its capture compiled (1: every layer shares one), the inputs of its largest
    region graph, and its replay count."""

    key: CaptureKey
    ops: frozenset[str] = frozenset()
    compiles: int = 0
    inputs: int = 0
    replays: int = 0
    runner: Callable[[], Tensor] | None = field(default=None, repr=False)
    #: the step buffer's views the graph was captured over (a replay must read these)
    views: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def lora_ops(self) -> frozenset[str]:
        return frozenset(op for op in self.ops if op.startswith("lora_graph.lora_"))


def _op_names(gm: torch.fx.GraphModule) -> frozenset[str]:
    names = set()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            name = getattr(target, "_name", None) or getattr(target, "__name__", str(target))
            names.add(str(name).replace("::", "."))
    return frozenset(names)


class GraphCache:
    """Captures and replays a pipeline's packed step per token bucket.

    Args:
        pipeline: a loaded pipeline (:class:`CapturablePipeline`).
        mode: ``"inductor"`` (``torch.compile``, ``fullgraph=True``) or ``"cudagraph"``
            (the same, then captured by hand in a ``torch.cuda.CUDAGraph``; CUDA only).
        token_buckets: step widths in tokens to capture (each at most the pipeline's
            ``max_num_batched_tokens``).

    Raises:
        ValueError: for a bucket wider than ``max_num_batched_tokens``, a largest bucket
            narrower than ``max_batch_size``, or ``cudagraph`` off CUDA.
    """

    def __init__(
        self,
        pipeline: CapturablePipeline,
        *,
        mode: Mode = "inductor",
        token_buckets: Sequence[int] = (8,),
    ) -> None:
        if mode not in ("inductor", "cudagraph"):
            raise ValueError(f"mode must be inductor or cudagraph, got {mode!r}")
        if mode == "cudagraph" and pipeline.device.type != "cuda":
            raise ValueError("cudagraph mode needs a CUDA device")
        if pipeline.lora_backend == "triton" and pipeline.device.type != "cuda":
            # the LoRA layers call the Triton interpreter's launches directly
            raise ValueError(
                "LoRAConfig backend='triton' off CUDA runs Triton's interpreter, which "
                "torch.compile cannot trace: serve it without compiling, or compile with "
                "backend 'auto' or 'torch'"
            )
        token_buckets = sorted(set(token_buckets))
        if not token_buckets or token_buckets[0] < 1:
            raise ValueError(f"token buckets must be positive, got {token_buckets}")
        if token_buckets[-1] > pipeline.max_num_batched_tokens:
            raise ValueError(
                f"token bucket {token_buckets[-1]} exceeds max_num_batched_tokens "
                f"{pipeline.max_num_batched_tokens}"
            )
        if token_buckets[-1] < pipeline.max_batch_size:
            raise ValueError(
                f"the largest token bucket ({token_buckets[-1]}) must hold a decode step of "
                f"every running request (max_batch_size {pipeline.max_batch_size})"
            )
        self.pipeline = pipeline
        self.mode = mode
        self.token_buckets = token_buckets
        self.graphs: dict[CaptureKey, CapturedGraph] = {}
        self.recompiles = 0
        self._capturing: CaptureKey | None = None
        self._mempool = torch.cuda.graph_pool_handle() if mode == "cudagraph" else None
        self.regions = list(pipeline.compile_regions())
        # torch.compile keeps its backend alive in process-wide caches: hand it a weak
        # reference, so that dropping the pipeline frees its weights, KV cache and slots
        cache = weakref.ref(self)

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
            owner = cache()
            if owner is None:
                raise RuntimeError("the GraphCache of this compiled region was dropped")
            return owner._backend(gm, example_inputs)

        for region in self.regions:
            region.compile(backend=backend, fullgraph=True, dynamic=False)

    # ---- keys ---------------------------------------------------------------------------
    def all_keys(self) -> list[CaptureKey]:
        """Every key captured: each bucket with LoRA (when the pipeline has adapter slots)
        and base-only."""
        keys = [self._key(t) for t in self.token_buckets]
        with_lora = self.pipeline.routing_buffer is not None
        return [k2 for k in keys for k2 in ((k, k.base_only()) if with_lora else (k.base_only(),))]

    def _key(self, tokens: int) -> CaptureKey:
        return CaptureKey(tokens, min(tokens, self.pipeline.max_batch_size))

    def width(self, tokens: int, seqs: int) -> tuple[int, int]:
        """The width ``(T, S)`` a step of ``tokens`` tokens from ``seqs`` requests is padded
        to: its bucket, or its own size if no bucket holds it (it then runs eagerly)."""
        for t in self.token_buckets:
            key = self._key(t)
            if t >= tokens and key.seqs >= seqs:
                return key.tokens, key.seqs
        return tokens, seqs

    def key_for(self, inputs: ModelInputs) -> CaptureKey:
        """The capture key of a step: its width, base-only if it has no LoRA inputs."""
        tokens, seqs = inputs.width
        return CaptureKey(tokens, seqs, lora=inputs.routing is not None)

    # ---- capture ------------------------------------------------------------------------
    def _step(self, inputs: dict[str, Tensor], routing: Routing | None) -> Tensor:
        return self.pipeline.model(**inputs, routing=routing)

    def _backend(
        self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]
    ) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        if self._capturing is None:
            self.recompiles += 1
        else:
            graph = self.graphs[self._capturing]
            graph.ops = graph.ops | _op_names(gm)
            graph.inputs = max(
                graph.inputs, sum(1 for node in gm.graph.nodes if node.op == "placeholder")
            )
            graph.compiles += 1
        return cast(Callable[..., Any], compile_fx(gm, example_inputs))

    def _static_args(self, key: CaptureKey) -> tuple[dict[str, Tensor], Routing | None]:
        views = self.pipeline.step_buffer.views((key.tokens, key.seqs))
        return views, (self.pipeline.routing_buffer if key.lora else None)

    def capture(self, *, progress: bool = True) -> None:
        """Compile (and on ``cudagraph``, capture) every key, with a progress bar."""
        keys = self.all_keys()
        # dynamo's recompile limit counts the compiles of the step's code object over every
        # pipeline this process has captured (each model instance recompiles it): raised to
        # cover every capture so far, so a second or tenth pipeline does not hit it
        global _KEYS_CAPTURED
        _KEYS_CAPTURED += len(keys)
        limit = 4 * _KEYS_CAPTURED + 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        # the buffers hold a valid empty step while capturing: no requests, every token
        # writing the scratch page, no LoRA rows
        top = self._key(self.token_buckets[-1])
        self.pipeline.step_buffer.fill([], (top.tokens, top.seqs))
        for key in tqdm(
            keys, desc=f"capturing {len(keys)} graphs ({self.mode})", disable=not progress
        ):
            self._capture_one(key)

    @torch.inference_mode()
    def _capture_one(self, key: CaptureKey) -> None:
        graph = self.graphs[key] = CapturedGraph(key)
        views, routing = self._static_args(key)
        graph.views = views
        fn = functools.partial(self._step, views, routing)
        self._capturing = key
        try:
            if self.mode == "inductor":
                fn()
                graph.runner = fn
                return
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self._mempool):
                out = fn()
            # the tokens' hidden states the captured forward left (a decoder's step_hidden),
            # refilled in place by each replay
            hidden = getattr(self.pipeline.model, "step_hidden", None)
            model = self.pipeline.model

            def replay(g: torch.cuda.CUDAGraph = cuda_graph, out: Tensor = out) -> Tensor:
                g.replay()
                if hidden is not None:
                    model.step_hidden = hidden
                return out

            graph.runner = replay
        finally:
            self._capturing = None

    # ---- replay ---------------------------------------------------------------------------
    def lookup(self, inputs: ModelInputs) -> CapturedGraph | None:
        """The captured graph of a step, or None (every token's logits wanted, or a width
        no bucket holds)."""
        if inputs.all_logits:
            return None
        return self.graphs.get(self.key_for(inputs))

    @torch.inference_mode()
    def run(self, inputs: ModelInputs, graph: CapturedGraph | None = None) -> Tensor:
        """Replay the graph of a step whose inputs ``prepare`` wrote into the buffers at
        its bucket's width. Returns logits ``[S, vocab]``, valid until the next replay.

        Raises:
            KeyError: if the step's width was not captured: run such steps eagerly.
            RuntimeError: if the step's inputs are not the buffers the graph was captured
                over (a replay would read stale buffers and serve wrong tokens).
        """
        graph = graph or self.lookup(inputs)
        if graph is None or graph.runner is None:
            raise KeyError("no captured graph for this step")
        self._check_captured_inputs(inputs, graph)
        graph.replays += 1
        if self.mode == "cudagraph":
            return graph.runner()
        with torch.compiler.set_stance("fail_on_recompile"):
            return graph.runner()

    def _check_captured_inputs(self, inputs: ModelInputs, graph: CapturedGraph) -> None:
        """Each of the step's inputs must be the captured view itself (same storage, offset,
        shape and strides), and a LoRA step's routing the persistent routing buffer."""
        for name, view in graph.views.items():
            given = inputs.inputs.get(name)
            if given is None or not (
                given.data_ptr() == view.data_ptr()
                and given.shape == view.shape
                and given.stride() == view.stride()
            ):
                raise RuntimeError(
                    f"{graph.key}: the step's {name!r} is not the buffer its graph was captured "
                    "over (build replayed steps with the pipeline's prepare)"
                )
        if inputs.routing is not None and inputs.routing is not self.pipeline.routing_buffer:
            raise RuntimeError(f"{graph.key}: the step's routing is not the persistent buffer")
