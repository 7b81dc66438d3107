"""The graph cache: every bucket captured at start-up, with LoRA and base-only.

The repeated decoder layer is compiled (``torch.compile``, ``fullgraph=True``; one graph
per key serves every layer, so start-up compiles a layer, not the whole stack). Every key
runs its step over views of one set of persistent input buffers (tokens, positions, KV
cache rows, logits index), allocated once at the largest bucket; the LoRA inputs are the
manager's persistent routing buffer and the slot pool the LoRA layers view. A step is
padded up to its bucket and copied into the buffers. In ``inductor`` mode the Python step
then runs around the compiled layer graphs; in ``cudagraph`` mode (CUDA) a
``torch.cuda.CUDAGraph`` captured by hand per key over that step is replayed, one graph
launch a step.

Nothing recompiles after start-up: the backend records every graph it is given, and a
graph compiled while serving is counted in :attr:`GraphCache.recompiles`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm

from lora_graph.compile.keys import CaptureKey, LoraBaseOnly, is_base_only, node_capture_key
from lora_graph.routing import Routing

Mode = Literal["inductor", "cudagraph"]


@dataclass
class CapturedGraph:
    """One captured step: its key, the ops its compiled regions call, how many region
    graphs its capture compiled (1: every layer shares one), the inputs of its largest
    region graph, and its replay count."""

    key: Any
    ops: frozenset[str] = frozenset()
    compiles: int = 0
    inputs: int = 0
    replays: int = 0
    runner: Callable[[], Tensor] | None = field(default=None, repr=False)

    @property
    def lora_ops(self) -> frozenset[str]:
        return frozenset(op for op in self.ops if op.startswith("lora_graph."))


def _op_names(gm: torch.fx.GraphModule) -> frozenset[str]:
    names = set()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            name = getattr(target, "_name", None) or getattr(target, "__name__", str(target))
            names.add(str(name).replace("::", "."))
    return frozenset(names)


class GraphCache:
    """Captures and replays a pipeline's step per capture key.

    Args:
        pipeline: a loaded :class:`~lora_graph.pipeline.PipelineModelWithKVCache`.
        mode: ``"inductor"`` (``torch.compile``, ``fullgraph=True``) or ``"cudagraph"``
            (the same, then captured by hand in a ``torch.cuda.CUDAGraph``; CUDA only).
        decode_buckets: decode batch sizes to capture (each at most ``max_batch_size``).
        prefill_lengths: prompt length buckets for single-request prefill graphs.

    Raises:
        ValueError: for a bucket larger than the KV cache allows, or ``cudagraph`` off CUDA.
    """

    def __init__(
        self,
        pipeline: Any,
        *,
        mode: Mode = "inductor",
        decode_buckets: Sequence[int] = (1, 2, 4, 8),
        prefill_lengths: Sequence[int] = (32,),
    ) -> None:
        if mode not in ("inductor", "cudagraph"):
            raise ValueError(f"mode must be inductor or cudagraph, got {mode!r}")
        if mode == "cudagraph" and pipeline.device.type != "cuda":
            raise ValueError("cudagraph mode needs a CUDA device")
        decode_buckets = sorted(set(decode_buckets))
        prefill_lengths = sorted(set(prefill_lengths))
        if decode_buckets[-1] > pipeline.max_batch_size:
            raise ValueError(
                f"decode bucket {decode_buckets[-1]} exceeds max_batch_size "
                f"{pipeline.max_batch_size}"
            )
        if prefill_lengths and prefill_lengths[-1] > pipeline.max_seq_len:
            raise ValueError(
                f"prefill length {prefill_lengths[-1]} exceeds max_seq_len {pipeline.max_seq_len}"
            )
        self.pipeline = pipeline
        self.mode = mode
        self.decode_buckets = decode_buckets
        self.prefill_lengths = prefill_lengths
        self.graphs: dict[Any, CapturedGraph] = {}
        self.recompiles = 0
        self._capturing: Any = None
        dev = pipeline.device
        rows = max(decode_buckets)
        cols = max(prefill_lengths, default=1)
        self._tokens = torch.zeros(rows, cols, dtype=torch.long, device=dev)
        self._positions = torch.zeros(rows, cols, dtype=torch.long, device=dev)
        self._cache_rows = torch.arange(rows, dtype=torch.long, device=dev)
        self._logits_index = torch.zeros(rows, dtype=torch.long, device=dev)
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
    def all_keys(self) -> list[Any]:
        keys: list[Any] = [CaptureKey("decode", b) for b in self.decode_buckets]
        keys += [CaptureKey("prefill", 1, t) for t in self.prefill_lengths]
        with_lora = self.pipeline.manager is not None
        return [
            k2 for k in keys for k2 in ((k, LoraBaseOnly(k)) if with_lora else (LoraBaseOnly(k),))
        ]

    def decode_width(self, n: int) -> int:
        """The decode bucket a batch of ``n`` rows is padded to.

        Raises:
            ValueError: if ``n`` exceeds the largest bucket.
        """
        for b in self.decode_buckets:
            if b >= n:
                return b
        raise ValueError(
            f"a decode batch of {n} rows exceeds the largest bucket {self.decode_buckets[-1]}"
        )

    def prefill_length(self, n: int) -> int | None:
        """The prefill length bucket a prompt of ``n`` tokens is padded to (None: too long
        for any bucket; such a prompt runs eagerly)."""
        return next((t for t in self.prefill_lengths if t >= n), None)

    def key_for(self, inputs: Any) -> Any:
        """The capture key of a step: its phase and bucket, base-only if no LoRA inputs."""
        b, t = inputs.tokens.shape
        key = (
            CaptureKey("prefill", b, self.prefill_length(t) or t)
            if inputs.prefill
            else CaptureKey("decode", self.decode_width(b))
        )
        return key if inputs.routing is not None else LoraBaseOnly(key)

    # ---- capture ------------------------------------------------------------------------
    def _step(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache_rows: Tensor,
        logits_index: Tensor,
        routing: Routing | None = None,
        *,
        prefill: bool,
    ) -> Tensor:
        return self.pipeline.model(tokens, positions, cache_rows, logits_index, prefill, routing)

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
        return compile_fx(gm, example_inputs)

    def _static_args(self, key: Any) -> tuple[Any, ...]:
        k = node_capture_key(key)
        args = (
            self._tokens[: k.batch, : k.seq_len],
            self._positions[: k.batch, : k.seq_len],
            self._cache_rows[: k.batch],
            self._logits_index[: k.batch],
        )
        if is_base_only(key):
            return args
        return (*args, self.pipeline.manager.routing.routing)

    def capture(self, *, progress: bool = True) -> None:
        """Compile (and on ``cudagraph``, capture) every key, with a progress bar."""
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, 4 * len(self.all_keys())
        )
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(
                torch._dynamo.config.recompile_limit, 4 * len(self.all_keys())
            )
        keys = self.all_keys()
        for key in tqdm(
            keys, desc=f"capturing {len(keys)} graphs ({self.mode})", disable=not progress
        ):
            self._capture_one(key)

    @torch.inference_mode()
    def _capture_one(self, key: Any) -> None:
        graph = self.graphs[key] = CapturedGraph(key)
        args = self._static_args(key)
        fn = functools.partial(self._step, prefill=node_capture_key(key).phase == "prefill")
        self._capturing = key
        try:
            if self.mode == "inductor":
                fn(*args)
                graph.runner = lambda: fn(*args)
                return
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self._mempool):
                out = fn(*args)

            def replay(g: torch.cuda.CUDAGraph = cuda_graph, out: Tensor = out) -> Tensor:
                g.replay()
                return out

            graph.runner = replay
        finally:
            self._capturing = None

    # ---- replay ---------------------------------------------------------------------------
    def lookup(self, inputs: Any) -> CapturedGraph | None:
        """The captured graph of a step, or None (no per-row logits index, a batch wider
        than every bucket, a prefill of several rows, a prompt longer than every bucket)."""
        if inputs.logits_index is None:
            return None
        try:
            return self.graphs.get(self.key_for(inputs))
        except ValueError:
            return None

    @torch.inference_mode()
    def run(self, inputs: Any, graph: CapturedGraph | None = None) -> Tensor:
        """Copy a step into the buffers of its key and replay that graph.

        The batch must already be padded to its decode bucket (the engine pads with free
        KV cache rows; :meth:`decode_width`); a prefill row is padded here to its length
        bucket. Returns logits ``[B, vocab]``, valid until the next replay.

        Raises:
            KeyError: if the step's key was not captured (a prefill of several rows, or
                a prompt longer than every bucket): run such steps eagerly.
        """
        graph = graph or self.lookup(inputs)
        if graph is None or graph.runner is None:
            raise KeyError("no captured graph for this step")
        k = node_capture_key(graph.key)
        if inputs.tokens.shape[0] != k.batch:
            raise ValueError(
                f"a {graph.key} step needs {k.batch} rows, got {inputs.tokens.shape[0]}"
            )
        t = inputs.tokens.shape[1]
        self._tokens[: k.batch, :t].copy_(inputs.tokens, non_blocking=True)
        self._positions[: k.batch, :t].copy_(inputs.positions, non_blocking=True)
        if t < k.seq_len:  # right padding of a prefill row: positions go on, tokens are 0
            self._tokens[: k.batch, t : k.seq_len].zero_()
            self._positions[: k.batch, t : k.seq_len].copy_(
                torch.arange(t, k.seq_len, device=self._positions.device)
            )
        self._cache_rows[: k.batch].copy_(inputs.cache_rows, non_blocking=True)
        self._logits_index[: k.batch].copy_(inputs.logits_index, non_blocking=True)
        graph.replays += 1
        if self.mode == "cudagraph":
            return graph.runner()
        with torch.compiler.set_stance("fail_on_recompile"):
            return graph.runner()
