"""Generation: continuous batching over the paged KV cache, each request under its adapter.

Each :meth:`LLMEngine.step` runs one packed step (:mod:`lora_graph.step`) under a token
budget (the pipeline's ``max_step_tokens``, from ``max_num_batched_tokens``), scheduled
first come first served:

1. every running request that is decoding gets its one token; one that needs a page when
   the pool is dry preempts the newest running request (its pages are freed, and it goes
   back to the front of the queue to be recomputed later: prompt plus the tokens it had,
   so its output is unchanged);
2. running requests part-way through their prompt get the next chunk of it;
3. if nothing was preempted, waiting requests are admitted in arrival order while the
   budget, ``max_batch_size``, the free pages (a request takes the pages of its whole
   prompt when admitted, and leaves one page free per running request) and the adapter
   slots allow. A request whose adapter cannot take a slot beside the running ones waits,
   as does every later one that would need a new slot; later ones that need none go ahead
   of it, at most ``max_batch_size`` of them, then it is next (so it is not starved). The
   least recently used adapter not running gives up its slot when one is needed.

Requests leave on EOS, a stop token, ``max_new_tokens`` or ``max_seq_len``; their pages
and adapter hold are returned. With asynchronous scheduling (:class:`LLMEngine`) a step
is scheduled while the one before it still runs: a request whose last token is still on
the device decodes with that token fed on the device, unless that token ends it by
length.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lora_graph.config import AdapterError, AdapterInfo, LoraReqConfig, is_finite_number, is_int
from lora_graph.manager import AdapterRef, LoRAManager, LoRAStatus, ReadAdapter
from lora_graph.pipeline import PipelineModelWithKVCache
from lora_graph.step import SeqChunk


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    Attributes:
        max_new_tokens: the most tokens to generate.
        temperature: 0 for greedy; otherwise logits are divided by it before sampling.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        seed: seeds the request's own generator (None: drawn from ``torch``'s global RNG).
        stop_token_ids: tokens that end the request (kept in the output), besides EOS.
        ignore_eos: keep generating past EOS.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Refuse any value that could make the sampling distribution invalid, so that
        :func:`sample` never fails for a request that was admitted.

        Raises:
            ValueError: naming the first bad field and its value.
        """
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
            )
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {self.temperature!r} is below {MIN_TEMPERATURE}, where sampling is "
                "numerically unstable; use 0 for greedy"
            )
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64) or null, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
            map(is_int, self.stop_token_ids)
        ):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")


# below it, logits / temperature overflows float32 for ordinary logits (vLLM clamps here)
MIN_TEMPERATURE = 1e-2


def check_text(text: str, what: str) -> None:
    """Refuse text no tokenizer can encode, naming ``what`` (a request's prompt, a
    message, an input to embed): a Python ``str`` may hold lone surrogates (a JSON
    ``"\\ud800"`` escape; a command line's undecodable bytes, kept by Python's
    ``surrogateescape``), which are not Unicode scalar values and have no UTF-8 form.

    Raises:
        ValueError: ``"{what} is not valid Unicode text ({reason} at {index})"``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text ({e.reason} at {e.start})") from None


@dataclass
class Request:
    """One generation request: prompt token ids and the adapter it runs under (None: base)."""

    id: str
    prompt_token_ids: list[int]
    adapter: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RequestOutput:
    """A finished request: generated ``token_ids`` (prompt excluded), or ``error``.

    ``arrival_time`` (when :meth:`LLMEngine.add_request` took it) and ``token_times`` (when
    each token was sampled) are ``time.perf_counter()`` seconds.
    """

    id: str
    adapter: str | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", or None with an error
    error: str | None = None
    arrival_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token (None without one)."""
        if self.arrival_time is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time


@dataclass(eq=False)  # compared by identity: two requests may hold equal tokens
class _Sequence:
    request: Request
    generator: torch.Generator | None
    tokens: list[int]  # prompt and generated tokens
    generated: list[int] = field(default_factory=list)
    hold: AdapterRef | None = None  # the adapter version it was admitted under
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # its block table
    computed: int = 0  # tokens whose K and V are in its pages
    bypassed: int = 0  # later requests admitted while it waited for a slot
    pending: int = 0  # tokens sampled on the device that the host has not read yet
    done: bool = False  # finished (a step still in flight skips it)

    @property
    def known(self) -> int:
        """Its length counting the tokens still on the device."""
        return len(self.tokens) + self.pending

    def ends_with_pending(self, max_seq_len: int) -> bool:
        """Whether the tokens still on the device end it by length (it is not run again)."""
        return self.pending > 0 and (
            len(self.generated) + self.pending >= self.request.sampling.max_new_tokens
            or self.known >= max_seq_len
        )

    @property
    def adapter(self) -> str | None:
        """The routing key of its rows: the adapter version it holds once admitted."""
        return self.hold.key if self.hold is not None else self.request.adapter


@dataclass(eq=False)
class _InFlight:
    """A step whose sampled tokens the host has not read yet (asynchronous scheduling):
    ``rows[j]`` is the logits row of ``seqs[j]``; ``device`` holds ``[2, S]`` (NaN flag,
    greedy token) per row on the step's device, ``host`` its copy, complete once ``done``
    (a CUDA event; None on the CPU) has passed; ``hot`` the float32 logits of the rows that
    sample at a temperature (read at once)."""

    seqs: list[_Sequence]
    rows: list[int]
    device: Tensor
    host: Tensor
    done: torch.cuda.Event | None
    hot: dict[int, Tensor]


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
        pipeline: PipelineModelWithKVCache,
        *,
        eos_token_ids: tuple[int, ...] = (),
        async_scheduling: bool | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pages = pipeline.pages
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.finished: dict[str, RequestOutput] = {}
        # steps with a prefill chunk in them, and steps of decodes only
        self.steps = {"prefill": 0, "decode": 0}
        self.preemptions = 0
        self.tokens_generated = 0
        self._live: set[str] = set()  # ids of the waiting and running requests
        self._new_tokens: list[tuple[str, int]] = []
        if async_scheduling is None:
            async_scheduling = default_async_scheduling(pipeline.device)
        self.async_scheduling = async_scheduling
        self._in_flight: _InFlight | None = None
        # two pinned buffers the in-flight steps' [2, S] tokens are copied into, in turn
        # (flat: a step's [2, S] is a contiguous prefix, so the copy needs no staging)
        pin = pipeline.device.type == "cuda"
        self._readback = [
            torch.zeros(2 * pipeline.max_batch_size, dtype=torch.int64, pin_memory=pin)
            for _ in range(2)
        ]
        self._steps_run = 0

    # ---- adapters and capabilities ------------------------------------------------------
    @property
    def supports_lora(self) -> bool:
        """Whether the engine was built with adapter slots (a LoRA config)."""
        return self.pipeline.manager is not None

    @property
    def is_encoder(self) -> bool:
        """Whether the model is an encoder (sentence embeddings through :meth:`embed`, no
        generation)."""
        return hasattr(self.pipeline, "embed")

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
        return self._manager().unload_adapter(name)

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
        if embed is None:
            raise ValueError("the model is not an encoder")
        return embed(rows)

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
            generator.manual_seed(
                s.seed if s.seed is not None else int(torch.randint(0, 2**62, ()).item())
            )
        seq = _Sequence(request, generator, list(request.prompt_token_ids))
        seq.arrival = time.perf_counter()
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
        manager = self.pipeline.manager
        LoraReqConfig(request.adapter).validate(manager.loras if manager is not None else ())
        request.sampling.validate()
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.pipeline.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        bad_stop = [t for t in request.sampling.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad_stop[0]}")
        if len(prompt) >= self.pipeline.max_seq_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; at most {self.pipeline.max_seq_len - 1} "
                "fit (max_seq_len)"
            )

    @staticmethod
    def _output(
        seq: _Sequence, *, reason: str | None = None, error: str | None = None
    ) -> RequestOutput:
        """The output of a request leaving with finish ``reason`` or ``error``: the tokens
        it generated and its timings."""
        return RequestOutput(
            seq.request.id,
            seq.request.adapter,
            list(seq.generated),
            reason,
            error,
            arrival_time=seq.arrival,
            token_times=list(seq.token_times),
        )

    def _finish(self, seq: _Sequence, output: RequestOutput) -> None:
        """A request leaves (it is out of the queues already): its output, and what it held
        given back."""
        seq.done = True
        self._release(seq)
        self._live.discard(seq.request.id)
        self.finished[seq.request.id] = output

    def _release(self, seq: _Sequence) -> None:
        """Give back what a leaving request held: its pages and its adapter version."""
        self._free_pages(seq)
        if seq.hold is not None:
            self._manager().release(seq.hold)
            seq.hold = None

    def _free_pages(self, seq: _Sequence) -> None:
        self.pages.free(seq.pages)
        seq.pages = []
        seq.computed = 0

    def _preempt(self, seq: _Sequence) -> None:
        """Take a running request's pages back and queue it first, to be recomputed (its
        prompt and generated tokens) when pages are free again. It keeps its adapter hold
        and its sampling generator, so its output is unchanged."""
        self.running.remove(seq)
        self._free_pages(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    # ---- scheduling ---------------------------------------------------------------------
    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """This step's requests and how many of their tokens each computes (module
        docstring), with the pages for them taken."""
        budget = self.pipeline.max_step_tokens
        scheduled: list[tuple[_Sequence, int]] = []
        taken: set[int] = set()  # ids of the sequences scheduled
        preempted = False
        limit = self.pipeline.max_seq_len
        for seq in list(self.running):  # decodes first: one token each
            if seq not in self.running or seq.known - seq.computed != 1 or budget == 0:
                continue
            if seq.ends_with_pending(limit):
                continue  # its last token is on the device already
            need = self.pages.pages_for(seq.computed + 1) - len(seq.pages)
            while need > self.pages.num_free:
                victims = [s for s in self.running if id(s) not in taken and s is not seq]
                victim = victims[-1] if victims else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            seq.pages += self.pages.allocate(need)
            scheduled.append((seq, 1))
            taken.add(id(seq))
            budget -= 1
        for seq in self.running:  # then the next chunk of prompts being prefilled
            if budget == 0:
                break
            if id(seq) in taken or len(seq.tokens) <= seq.computed:
                continue  # (decoding: its next token is on the device, or ends it)
            n = min(len(seq.tokens) - seq.computed, budget)
            scheduled.append((seq, n))
            taken.add(id(seq))
            budget -= n
        if not preempted:
            for seq in self._admit(budget):
                n = min(len(seq.tokens), budget)
                scheduled.append((seq, n))
                budget -= n
        return scheduled

    def _admit(self, budget: int) -> list[_Sequence]:
        """Admit waiting requests (module docstring, 3.) into the running list, each with
        the pages of its whole prompt; return them in order.

        Requests that need no new slot go ahead of the first one waiting for a slot at most
        ``max_batch_size`` times; after that nothing is admitted past it until its adapter
        gets a slot (the running requests drain), so steady traffic on resident adapters
        cannot starve it. The scan stops after ``4 * max_batch_size`` requests that wait."""
        admitted: list[_Sequence] = []
        kept: list[_Sequence] = []
        names = {s.adapter for s in self.running if s.adapter is not None}
        limit = self.pipeline.max_batch_size
        first_blocked: _Sequence | None = None
        while self.waiting and budget > 0 and len(self.running) < limit:
            seq = self.waiting[0]
            if seq.pending:
                break  # preempted with a token still on the device: next step
            # its prompt's pages, and one spare page a running request (their next
            # tokens), so a new request is not preempted at once by the running ones
            if self.pages.pages_for(len(seq.tokens)) + len(self.running) > self.pages.num_free:
                break  # first come first served: later requests wait for pages too
            self.waiting.popleft()
            if seq.hold is not None:
                fits = False
                if first_blocked is None or seq.adapter in names:
                    try:
                        fits = self._manager().admit(seq.hold, names)
                    except KeyError as e:  # its version was unloaded while it waited
                        self._finish(seq, self._output(seq, error=e.args[0]))
                        continue
                if not fits:  # its adapter cannot take a slot beside the running ones yet
                    first_blocked = first_blocked or seq
                    kept.append(seq)
                    if len(kept) >= 4 * limit:
                        break
                    continue
                names.add(seq.hold.key)
            if first_blocked is not None:
                if first_blocked.bypassed >= limit:
                    kept.append(seq)  # (an adapter's new hold is kept for its next turn)
                    break
                first_blocked.bypassed += 1
            seq.bypassed = 0
            seq.pages = self.pages.allocate(self.pages.pages_for(len(seq.tokens)))
            self.running.append(seq)
            admitted.append(seq)
            budget -= min(len(seq.tokens), budget)
        self.waiting.extendleft(reversed(kept))
        return admitted

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
            scheduled = self._schedule()
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

    def _run(self, scheduled: list[tuple[_Sequence, int]], previous: _InFlight | None) -> _InFlight:
        """Queue one step on the device and its greedy tokens' copy to the host. Nothing of
        the engine's state changes until all of it is queued: a step that raises is run
        again from scratch."""
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
        device = torch.stack(
            (torch.isnan(logits[:width]).any(dim=-1).long(), logits[:width].argmax(dim=-1))
        )
        host = self._readback[self._steps_run % 2][: 2 * width].view(2, width)
        self._steps_run += 1
        host.copy_(device, non_blocking=host.is_pinned())
        done = None
        if host.is_pinned():
            done = torch.cuda.Event()
            done.record()
        hot = {i: logits[i].float().cpu() for i, s in zip(rows, seqs, strict=True)
               if s.request.sampling.temperature > 0}  # fmt: skip
        self.steps["decode" if all(n == 1 for _, n in scheduled) else "prefill"] += 1
        for c in inputs.chunks:
            c.owner.computed += len(c.token_ids)
        for s in seqs:
            s.pending += 1
        return _InFlight(seqs, rows, device, host, done, hot)

    def _read_back(self, step: _InFlight) -> None:
        """Read a queued step's sampled tokens (waiting for the device if it has not got
        there): append each to its request, stream it, finish the requests that end."""
        if step.done is not None:
            step.done.synchronize()
        bad_rows, greedy = step.host.tolist()
        now = time.perf_counter()
        for row, seq in zip(step.rows, step.seqs, strict=True):
            seq.pending -= 1
            if seq.done:  # finished while this step ran (aborted, or ended a step earlier)
                continue
            if bad_rows[row]:  # a fault of the model's numerics (a half-precision overflow)
                self._leave(seq)
                self._finish(
                    seq, self._output(seq, error="the model produced NaN logits for this request")
                )
                continue
            token = (
                greedy[row]
                if row not in step.hot
                else sample(step.hot[row], seq.request.sampling, seq.generator)
            )
            self.tokens_generated += 1
            seq.tokens.append(token)
            seq.generated.append(token)
            seq.token_times.append(now)
            self._new_tokens.append((seq.request.id, token))
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._leave(seq)
                self._finish(seq, self._output(seq, reason=reason))

    def _leave(self, seq: _Sequence) -> None:
        """Take a request out of its queue (running, or waiting after a preemption)."""
        (self.running if seq in self.running else self.waiting).remove(seq)

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        s = seq.request.sampling
        if (token in self.eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids:
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


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from float32 ``logits [vocab]``: argmax at temperature 0, else a draw
    from the temperature-scaled distribution restricted by top-k then top-p.

    The logits are shifted so their maximum is 0 before the division by the temperature,
    so no value overflows: the most likely token always keeps a positive probability.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False  # the most likely token always stays (top_p may round to 0 in float32)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
