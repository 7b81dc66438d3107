"""Generation: continuous batching over the paged KV cache, each request under its adapter.

:class:`LLMEngine` takes requests (:mod:`lora_graph.requests`), asks its
:class:`~lora_graph.scheduler.Scheduler` what the next packed step is (first come first
served under a token budget, preempting when the page pool runs dry; that module's
docstring), runs it through the pipeline (:mod:`lora_graph.step`), samples
(:mod:`lora_graph.sampling`) and streams the tokens. Requests leave on EOS, a stop token,
``max_new_tokens`` or ``max_seq_len``; their pages and adapter hold are returned. With
asynchronous scheduling (:class:`LLMEngine`) a step is scheduled while the one before it
still runs: a request whose last token is still on the device decodes with that token fed
on the device, unless that token ends it by length.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from typing import cast

import torch
from torch import Tensor

from lora_graph.config import AdapterError, AdapterInfo, LoraReqConfig
from lora_graph.manager import LoRAManager, LoRAStatus, ReadAdapter
from lora_graph.paging import PagePool
from lora_graph.pipeline import PipelineModel, PipelineModelWithKVCache
from lora_graph.prefix_cache import identity_root
from lora_graph.requests import (
    MAX_LOGPROBS,
    MIN_TEMPERATURE,
    Request,
    RequestOutput,
    RequestState,
    SamplingParams,
    TokenLogprob,
    check_text,
)
from lora_graph.sampling import Staging, generator_seed, sample
from lora_graph.scheduler import Scheduler
from lora_graph.step import SeqChunk
from lora_graph.step_logits import (
    InFlight,
    grammar_refuses,
    logprob_of,
    process_rows,
    queue_logprobs,
    record_prompt_logprobs,
    row_error,
)

__all__ = [
    "MIN_TEMPERATURE",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "check_text",
    "default_async_scheduling",
    "sample",
]


def default_async_scheduling(device: torch.device) -> bool:
    """Whether :class:`LLMEngine` schedules asynchronously when not told: on CUDA, where a
    step is queued and runs while the host goes on; not on the CPU, where a step runs to
    its end before the call returns, so nothing would overlap and each token would only
    reach the caller a step later."""
    return device.type == "cuda"


class LLMEngine:
    """Serves requests through a pipeline, continuously batched in packed steps.

    Asynchronous scheduling (``async_scheduling``, by default on CUDA; vLLM's option of the
    same name): :meth:`step` queues a step on the device, then reads back the *previous* step's
    sampled tokens while this one runs, so the host's scheduling and input building for a
    step overlaps the device's work on the one before instead of leaving the device idle.
    A decoding request's next input token, not yet on the host when its next step is
    built, is copied on the device from the previous step's greedy tokens
    (``SeqChunk.fed_from``). A request that ends by length is not scheduled past its end;
    one that ends on a token the host reads one step late (EOS, a stop token, NaN logits)
    has run one extra row, discarded. A step with a row that samples at a temperature is
    read at once (its logits come to the host for :func:`sample`). Outputs are the same
    either way.

    Args:
        pipeline: the loaded model (its ``max_batch_size`` bounds the running requests,
            its ``max_step_tokens`` a step's tokens, its page pool their KV cache).
        eos_token_ids: tokens that end a request unless ``ignore_eos``.
        async_scheduling: overlap each step's host work with the previous step's device
            work (above); False reads every step's tokens before the next is scheduled;
            None: :func:`default_async_scheduling` of the pipeline's device.
        enable_prefix_caching: reuse the KV cache pages of earlier prompts' full pages
            under the same base or adapter version (:mod:`lora_graph.prefix_cache`);
            vLLM's option of the same name, on by default as there.

    Threading: an engine is not thread-safe. One thread owns it (a server's
    :class:`~lora_graph.server.EngineLoop`) and calls every method, except
    :meth:`read_lora`, which only reads and normalises files (nothing served changes) and
    may run on any thread so that stepping goes on meanwhile. Code above the engine (the
    server, the command line) uses this class's adapter API (:meth:`list_loras`,
    :meth:`check_lora`, :meth:`add_lora`, :meth:`remove_lora`, ...), never the pipeline's
    LoRA manager.
    """

    def __init__(
        self,
        pipeline: PipelineModel,
        *,
        eos_token_ids: tuple[int, ...] = (),
        async_scheduling: bool | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.eos_token_ids = frozenset(eos_token_ids)
        # an encoder (no KV cache) generates nothing: its engine holds an empty pool
        self.pages = (
            pipeline.pages if isinstance(pipeline, PipelineModelWithKVCache) else PagePool(2, 1)
        )
        self.scheduler = Scheduler(
            self.pages,
            max_batch_size=pipeline.max_batch_size,
            max_step_tokens=pipeline.max_step_tokens,
            max_seq_len=pipeline.max_seq_len,
            admit_adapter=lambda hold, names: self._manager().admit(hold, names),
            enable_prefix_caching=enable_prefix_caching,
        )
        if pipeline.manager is not None:  # a version forgotten: its cached pages dropped
            pipeline.manager.registry.on_forget = self._forget_version
        self.finished: dict[str, RequestOutput] = {}
        # steps with a prefill chunk in them, and steps of decodes only
        self.steps = {"prefill": 0, "decode": 0}
        self.tokens_generated = 0
        self._live: set[str] = set()  # ids of the waiting and running requests
        self._new_tokens: list[tuple[str, int]] = []
        if async_scheduling is None:
            async_scheduling = default_async_scheduling(pipeline.device)
        self.async_scheduling = async_scheduling
        self._in_flight: InFlight | None = None
        # two pinned buffers the in-flight steps' [2, S] tokens are copied into, in turn
        # (flat: a step's [2, S] is a contiguous prefix, so the copy needs no staging)
        pin = pipeline.device.type == "cuda"
        self._readback = [
            torch.zeros(2 * pipeline.max_batch_size, dtype=torch.int64, pin_memory=pin)
            for _ in range(2)
        ]
        # and the greedy rows' packed log-probabilities, for the requests that ask
        self._logprob_readback = [
            torch.zeros(
                pipeline.max_batch_size * (2 + 2 * MAX_LOGPROBS),
                dtype=torch.float32,
                pin_memory=pin,
            )
            for _ in range(2)
        ]
        # a step's small host-to-device inputs (indices, histories, grammar bitmasks)
        vocab = pipeline.config.vocab_size
        self._staging = Staging(
            pipeline.device,
            pipeline.max_batch_size * ((vocab + 31) // 32 + 4 * pipeline.max_seq_len + 16),
        )
        #: the log-probabilities of the tokens the last :meth:`step` returned, one each
        #: (None for a request that did not ask)
        self.step_logprobs: list[TokenLogprob | None] = []
        self._new_logprobs: list[TokenLogprob | None] = []
        #: the prompt logprobs of the requests whose first token the last :meth:`step`
        #: returned, by request id (those that asked only)
        self.step_prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self._new_prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        #: the prompt tokens reused from the prefix cache of the requests whose first token
        #: the last :meth:`step` returned, by request id
        self.step_cached_tokens: dict[str, int] = {}
        self._new_cached_tokens: dict[str, int] = {}
        self._steps_run = 0

    @property
    def waiting(self) -> deque[RequestState]:
        """Requests waiting to be admitted (or readmitted after a preemption), in order."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[RequestState]:
        """Requests admitted and holding pages, oldest first."""
        return self.scheduler.running

    @property
    def preemptions(self) -> int:
        """Requests preempted so far (their pages taken back, recomputed later)."""
        return self.scheduler.preemptions

    # ---- adapters and capabilities ------------------------------------------------------
    @property
    def supports_lora(self) -> bool:
        """Whether the engine was built with adapter slots (a LoRA config)."""
        return self.pipeline.manager is not None

    @property
    def is_encoder(self) -> bool:
        """Whether the model is an encoder (sentence embeddings through :meth:`embed`, no
        generation)."""
        return not isinstance(self.pipeline, PipelineModelWithKVCache)

    @property
    def max_seq_len(self) -> int:
        """The most tokens a request may hold, prompt and generated."""
        return self.pipeline.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.pipeline.config.vocab_size

    def list_loras(self) -> list[str]:
        """The names requests may use (adapters being unloaded excluded), in load order."""
        manager = self.pipeline.manager
        return list(manager.loras) if manager is not None else []

    def is_lora(self, name: str) -> bool:
        """Whether ``name`` is a loaded adapter (one being unloaded is not)."""
        manager = self.pipeline.manager
        return manager is not None and manager.is_lora(name)

    def _manager(self) -> LoRAManager:
        manager = self.pipeline.manager
        if manager is None:
            raise ValueError("this engine was built without LoRA support")
        return manager

    def check_lora(self, path: str, *, name: str | None = None) -> AdapterInfo:
        """Validate the adapter at ``path`` from its config and header, as a load would
        (:meth:`LoRAManager.check_adapter`).

        Raises:
            AdapterError: naming the cause; ValueError: without LoRA support.
        """
        return self._manager().check_adapter(path, name=name)

    def read_lora(self, path: str, *, name: str) -> ReadAdapter:
        """Read, validate and normalise an adapter's files without serving it (any thread;
        :meth:`LoRAManager.read_adapter`); :meth:`add_lora` then serves it.

        Raises:
            AdapterError: naming the cause; ValueError: without LoRA support.
        """
        return self._manager().read_adapter(path, name=name)

    def add_lora(
        self, lora: ReadAdapter | str, *, name: str | None = None, pin: bool = False
    ) -> LoRAStatus:
        """Serve an adapter: one :meth:`read_lora` read, or a path (``"name=path"``, or the
        path and ``name``) read now. A known name with other weights is replaced: requests
        that arrived before keep the version they were bound to.

        Raises:
            AdapterError: naming the cause; NoFreeSlotError: a pin that does not fit;
            ValueError: without LoRA support.
        """
        manager = self._manager()
        if isinstance(lora, str):
            return manager.load_adapter(lora, name=name, pin=pin)
        return manager.add_adapter(lora, pin=pin)

    def remove_lora(self, name: str) -> LoRAStatus:
        """Stop serving ``name``: requests running on it finish on it; requests bound to it
        that have not started finish with ``error="adapter 'name' was unloaded"``.

        Raises:
            KeyError: if ``name`` is not loaded; ValueError: without LoRA support.
        """
        manager = self._manager()
        status = manager.unload_adapter(name)
        if not self.has_unfinished():  # idle: the last batch is over, free it now (its slot,
            self._drain()  # host copy and cached pages stayed until another step ran)
            manager.batch_finished()
        return status

    def _forget_version(self, version: int) -> None:
        self.pages.forget(identity_root(version))

    @property
    def enable_prefix_caching(self) -> bool:
        return self.scheduler.prefix_cache.enabled

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (vLLM's ``reset_prefix_cache``): later requests compute
        their prompts from scratch. Pages held by running requests stay theirs. Returns the
        pages forgotten."""
        return self.pages.forget_all()

    def prefix_cache_counts(self) -> dict[str, tuple[int, int]]:
        """Prompt tokens ``(cached, computed)`` by adapter name (``"base"``), counted at
        each request's first admission."""
        counts = self.scheduler.prefix_cache.counts
        return {name: (cached, computed) for name, (cached, computed) in counts.items()}

    def lora_slot_counts(self) -> tuple[int, int, int]:
        """Slot activations so far: ``(hits, loads, evictions)`` (zeros without LoRA)."""
        manager = self.pipeline.manager
        if manager is None:
            return (0, 0, 0)
        return (manager.slots.hits, manager.slots.loads, manager.slots.evictions)

    def embed(self, rows: list[tuple[list[int], str | None]]) -> Tensor:
        """Sentence embeddings of an encoder, ``[rows, hidden]`` float32, one
        ``(token ids, adapter)`` row each (``BertPipeline.embed``).

        Raises:
            ValueError: for a model that is not an encoder, or a bad row (named).
        """
        embed = getattr(self.pipeline, "embed", None)
        if not self.is_encoder or embed is None:
            raise ValueError("the model is not an encoder")
        return cast(Tensor, embed(rows))

    # ---- admission --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Validate and queue a request. A bad one finishes at once with an ``error``
        naming the cause; nothing else is affected. A request naming an adapter is bound
        now to the version the name stands for (:meth:`LoRAManager.acquire`): a later
        reload does not change what serves it; an unload before it is first admitted
        finishes it with ``error="adapter 'x' was unloaded"``.

        Raises:
            ValueError: if a request of this id is unfinished, or its output has not been
                collected from :attr:`finished` (the two would overwrite each other).
        """
        if request.id in self._live or request.id in self.finished:
            raise ValueError(
                f"request id {request.id!r} is "
                + ("in flight" if request.id in self._live else "finished but not collected")
            )
        try:
            self._validate(request)
        except ValueError as e:
            self.finished[request.id] = RequestOutput(
                request.id, request.adapter, error=str(e), arrival_time=time.perf_counter()
            )
            return
        s = request.sampling
        generator = None
        if s.temperature > 0:
            generator = torch.Generator()
            seed = s.seed if s.seed is not None else int(torch.randint(0, 2**62, ()).item())
            generator.manual_seed(generator_seed(seed))
        seq = RequestState(request, generator, list(request.prompt_token_ids))
        seq.arrival = time.perf_counter()
        if s.grammar is not None:
            seq.matcher = s.grammar.matcher()
        if s.prompt_logprobs is not None:  # (the first token's stays None)
            seq.prompt_logprobs = [None] * len(request.prompt_token_ids)
        if request.adapter is not None:
            # bound now to the version its name stands for: a reload before it runs does
            # not change what serves it, an unload refuses it
            seq.hold = self._manager().acquire(request.adapter)
        self.waiting.append(seq)
        self._live.add(request.id)

    def abort_request(self, request_id: str) -> bool:
        """Stop a waiting or running request: it finishes with ``error="aborted"`` (and the
        tokens it had), its pages are freed, and its adapter is no longer held by it.
        Returns False if no such request is unfinished. Its output holds the tokens
        :meth:`step` has returned for it (one a step in flight sampled is dropped)."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request.id == request_id:
                    queue.remove(seq)
                    self._finish(seq, self._output(seq, error="aborted"))
                    return True
        return False

    def _validate(self, request: Request) -> None:
        if self.is_encoder:
            raise ValueError("the model is an encoder: it embeds (embed), it does not generate")
        manager = self.pipeline.manager
        LoraReqConfig(request.adapter).validate(manager.loras if manager is not None else ())
        if not isinstance(request.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {request.sampling!r}")
        request.sampling.validate()
        if request.cache_salt is not None and (
            not isinstance(request.cache_salt, str) or not request.cache_salt
        ):
            raise ValueError("cache_salt must be a non-empty string")
        prompt = request.prompt_token_ids
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of integers, got {prompt!r}"[:200])
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.pipeline.config.vocab_size
        integral = (isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)
        if not all(integral) or not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not all(type(t) is int for t in prompt):  # (numpy's integers: Python ints from here)
            request.prompt_token_ids = [int(t) for t in prompt]
        bad_stop = [t for t in request.sampling.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad_stop[0]}")
        bad_bias = [t for t, _ in request.sampling.logit_bias if not 0 <= t < vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad_bias[0]}")
        if len(prompt) >= self.pipeline.max_seq_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; at most {self.pipeline.max_seq_len - 1} "
                "fit (max_seq_len)"
            )

    @staticmethod
    def _output(
        seq: RequestState, *, reason: str | None = None, error: str | None = None
    ) -> RequestOutput:
        """The output of a request leaving with finish ``reason`` or ``error``: the tokens
        it generated and its timings."""
        s = seq.request.sampling
        return RequestOutput(
            seq.request.id,
            seq.request.adapter,
            list(seq.generated),
            reason,
            error,
            arrival_time=seq.arrival,
            token_times=list(seq.token_times),
            logprobs=list(seq.logprobs) if s.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if s.prompt_logprobs is not None else None,
            cached_tokens=seq.cached_tokens or 0,
        )

    def _finish(self, seq: RequestState, output: RequestOutput) -> None:
        """A request leaves (it is out of the queues already): its output, and what it held
        given back."""
        seq.done = True
        self._release(seq)
        self._live.discard(seq.request.id)
        self.finished[seq.request.id] = output

    def _release(self, seq: RequestState) -> None:
        """Give back what a leaving request held: its pages and its adapter version."""
        self._free_pages(seq)
        if seq.hold is not None:
            self._manager().release(seq.hold)
            seq.hold = None

    def _free_pages(self, seq: RequestState) -> None:
        self.scheduler.free_pages(seq)

    # ---- stepping ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Whether a request is waiting or running. (A step in flight whose requests all
        finished, their last rows dropped, is not unfinished work.)"""
        return bool(self.waiting or self.running)

    def step(self) -> list[tuple[str, int]]:
        """Schedule and run one packed step; return the tokens produced since the last
        call, ``(request id, token)`` in step order (a caller streams them): with
        ``async_scheduling``, those of the step before this one (this one's are read on
        the next call, or at once if a row samples at a temperature).

        An adapter whose weights cannot be read back into a slot (its file was deleted or
        changed after it left the host tier) fails its own requests with an ``error``; the
        others are served on.
        """
        previous, self._in_flight = self._in_flight, None
        try:
            decided = self.scheduler.schedule()
            for seq, error in decided.refused:  # their version was unloaded while they waited
                self._finish(seq, self._output(seq, error=error))
            scheduled = decided.scheduled
            if scheduled:
                try:
                    self._in_flight = self._run(scheduled, previous)
                except AdapterError as e:
                    if e.adapter is None:
                        raise
                    self._fail_adapter(e.adapter, str(e))
        finally:  # (a step that raised changed nothing: the one before is still read)
            if previous is not None:
                self._read_back(previous)
        current = self._in_flight
        if current is not None and (current.hot or not self.async_scheduling):
            self._drain()
        out, self._new_tokens = self._new_tokens, []
        self.step_logprobs, self._new_logprobs = self._new_logprobs, []
        self.step_prompt_logprobs, self._new_prompt_logprobs = self._new_prompt_logprobs, {}
        self.step_cached_tokens, self._new_cached_tokens = self._new_cached_tokens, {}
        return out

    def _drain(self) -> None:
        """Read back the step in flight, if any."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._read_back(step)

    def _fail_adapter(self, key: str, error: str) -> None:
        """Finish every request routed to adapter version ``key`` with ``error``."""
        for queue in (self.running, self.waiting):
            for seq in [s for s in queue if s.adapter == key]:
                queue.remove(seq)
                self._finish(seq, self._output(seq, error=error))

    def _run(
        self, scheduled: list[tuple[RequestState, int]], previous: InFlight | None
    ) -> InFlight:
        """Queue one step on the device and its greedy tokens' copy to the host. Nothing of
        the engine's state changes until all of it is queued (a step that raises is run
        again from scratch), except that a step whose rows process their logits (penalties,
        a grammar) reads ``previous`` back once its forward is queued, for those rows'
        last tokens: their processing then sees their whole history, and the host's wait
        still overlaps the device's forward."""
        fed = {}  # a decoding request's input token still on the device: its previous row
        if previous is not None:
            fed = {id(q): row for q, row in zip(previous.seqs, previous.rows, strict=True)}
        chunks = []
        for s, n in scheduled:
            tokens = s.tokens[s.computed : s.computed + n]
            row = None
            if len(tokens) < n:  # a decode whose input the previous step sampled
                row, tokens = fed[id(s)], [0]
            chunks.append(SeqChunk(s.adapter, tokens, s.computed, s.pages, s, row))
        self._staging.begin(self._steps_run)
        inputs = self.pipeline.prepare(
            chunks, fed_tokens=previous.device[1] if previous is not None else None
        )
        logits = self.pipeline.execute(inputs)
        # requests whose tokens are all computed sample their next one: on the device, the
        # NaN check and the greedy token of every row, copied to the host without waiting
        rows = [
            i
            for i, c in enumerate(inputs.chunks)
            if c.owner.computed + len(c.token_ids) == c.owner.known
        ]
        seqs = [inputs.chunks[i].owner for i in rows]
        width = len(inputs.chunks)
        raw = logits  # (what logprobs report)
        if previous is not None and any(
            s.pending and s.request.sampling.processes_logits for s in seqs
        ):
            # a row's penalties and grammar mask need its last token, still in the previous
            # step: read that step now, while this one's forward runs on the device
            self._read_back(previous)
        processed = [(i, s) for i, s in zip(rows, seqs, strict=True)
                     if s.request.sampling.processes_logits and not s.done]  # fmt: skip
        flags = torch.isnan(logits[:width]).any(dim=-1).long()  # bit 1: NaN logits
        if processed:  # their rows only; every other row is the step's own, bit for bit
            eos = set(self.eos_token_ids)
            logits = process_rows(logits, width, processed, eos, self._staging)
            flags = flags + 2 * torch.isneginf(logits).all(dim=-1)  # bit 2: nothing allowed
        device = torch.stack((flags, logits[:width].argmax(dim=-1)))
        host = self._readback[self._steps_run % 2][: 2 * width].view(2, width)
        host.copy_(device, non_blocking=host.is_pinned())
        hot = {i: logits[i].float().cpu() for i, s in zip(rows, seqs, strict=True)
               if s.request.sampling.temperature > 0}  # fmt: skip
        step = InFlight(seqs, rows, device, host, None, hot)
        step.raw_hot = {i: raw[i].float().cpu() for i, s in processed
                        if i in hot and s.request.sampling.logprobs is not None}  # fmt: skip
        queue_logprobs(step, raw, self._staging, self._logprob_readback[self._steps_run % 2])
        if host.is_pinned():
            step.done = torch.cuda.Event()
            step.done.record()
        self._steps_run += 1
        record_prompt_logprobs(self.pipeline, inputs)
        self.steps["decode" if all(n == 1 for _, n in scheduled) else "prefill"] += 1
        for c in inputs.chunks:
            if c.owner.done:  # finished by the read-back above: its pages are given back
                continue
            c.owner.computed += len(c.token_ids)
            self.scheduler.prefix_cache.commit(c.owner)  # (read by later steps only)
        for s in seqs:
            s.pending += 1
        return step

    def _read_back(self, step: InFlight) -> None:
        """Read a queued step's sampled tokens (waiting for the device if it has not got
        there): append each to its request, stream it, finish the requests that end. A
        step is read once (a later call does nothing)."""
        if step.read:
            return
        step.read = True
        if step.done is not None:
            step.done.synchronize()
        bad_rows, greedy = step.host.tolist()
        now = time.perf_counter()
        for row, seq in zip(step.rows, step.seqs, strict=True):
            seq.pending -= 1
            if seq.done:  # finished while this step ran (aborted, or ended a step earlier)
                continue
            error = row_error(bad_rows[row])
            token = greedy[row]
            if error is None and row in step.hot:
                try:
                    token = sample(step.hot[row], seq.request.sampling, seq.generator)
                except (ValueError, RuntimeError) as e:  # its own constraints: it alone fails
                    error = f"sampling failed for this request: {e}"
            if error is not None:
                self._leave(seq)
                self._finish(seq, self._output(seq, error=error))
                continue
            if grammar_refuses(seq, token):
                self._leave(seq)
                error = f"token {token} does not continue the request's grammar"
                self._finish(seq, self._output(seq, error=error))
                continue
            logprob = logprob_of(step, row, token, seq.request.sampling.logprobs)
            if logprob is not None:
                seq.logprobs.append(logprob)
            self.tokens_generated += 1
            seq.tokens.append(token)
            seq.generated.append(token)
            seq.token_times.append(now)
            self._new_tokens.append((seq.request.id, token))
            self._new_logprobs.append(logprob)
            if len(seq.generated) == 1:
                self._new_cached_tokens[seq.request.id] = seq.cached_tokens or 0
                if seq.request.sampling.prompt_logprobs is not None:
                    self._new_prompt_logprobs[seq.request.id] = list(seq.prompt_logprobs)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._leave(seq)
                self._finish(seq, self._output(seq, reason=reason))

    def _leave(self, seq: RequestState) -> None:
        """Take a request out of its queue (running, or waiting after a preemption)."""
        (self.running if seq in self.running else self.waiting).remove(seq)

    def _finish_reason(self, seq: RequestState, token: int) -> str | None:
        s = seq.request.sampling
        if (token in self.eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():  # its grammar is complete
            return "stop"
        if len(seq.generated) >= s.max_new_tokens or len(seq.tokens) >= self.pipeline.max_seq_len:
            return "length"
        return None

    def generate(self, requests: list[Request], *, progress: bool = False) -> list[RequestOutput]:
        """Serve every request to completion; outputs in the order of ``requests``. Other
        requests in flight are served alongside; their outputs stay in :attr:`finished`.

        Args:
            progress: show a progress bar (tqdm, on stderr) of finished requests and
                generated tokens per second.

        Raises:
            ValueError: if two requests share an id, or one's id is in flight or has an
                uncollected output (nothing is queued then).
        """
        from tqdm.auto import tqdm

        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        taken = [i for i in ids if i in self._live or i in self.finished]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is in flight or not collected")
        for r in requests:
            self.add_request(r)
        pending = set(ids)
        with tqdm(
            total=len(ids), desc="requests", unit="req", disable=not progress, dynamic_ncols=True
        ) as bar:
            tokens = self.tokens_generated
            while True:
                done = {i for i in pending if i in self.finished}
                pending -= done
                bar.update(len(done))
                if not pending:
                    break
                self.step()
                rate = (self.tokens_generated - tokens) / max(bar.format_dict["elapsed"], 1e-3)
                bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        return [self.finished.pop(i) for i in ids]
