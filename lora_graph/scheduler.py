"""The scheduler: which requests run in the next packed step, and how many tokens each
computes. It decides and takes pages; it runs nothing (:class:`SchedulerOutput` says what
the step is), so it is tested without a model.

Each step (:mod:`lora_graph.step`) runs under a token budget (the pipeline's
``max_step_tokens``, from ``max_num_batched_tokens``), scheduled first come first served:

1. every running request that is decoding gets its one token; one that needs a page when
   the pool is dry preempts the newest running request (its pages are freed, and it goes
   back to the front of the queue to be recomputed later: prompt plus the tokens it had,
   so its output is unchanged);
2. running requests part-way through their prompt get the next chunk of it;
3. if nothing was preempted, waiting requests are admitted in arrival order while the
   budget, ``max_batch_size``, the free pages (a request takes the pages of its whole
   prompt when admitted, and leaves one page free per running request) and the adapter
   slots allow. A request whose adapter cannot take a slot beside the running ones
   waits, as does every later one that would need a new slot; later ones that need none
   go ahead of it, at most ``max_batch_size`` of them, then it is next (so it is not
   starved). The least recently used adapter not running gives up its slot when one is
   needed. With prefix caching (:mod:`lora_graph.prefix_cache`) an admitted request
   shares the cached pages of its prompt's longest cached prefix under its own identity
   and computes from the first token after them.

With asynchronous scheduling a step is scheduled while the one before it still runs: a
request whose last token is still on the device (``RequestState.pending``) decodes with
that token fed on the device, unless that token ends it by length.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_graph.paging import PagePool
from lora_graph.prefix_cache import PrefixCache
from lora_graph.registry import AdapterRef
from lora_graph.requests import RequestState


@dataclass
class SchedulerOutput:
    """One step, decided: ``scheduled`` holds each request to run and how many of its
    tokens it computes (a decode 1, a prefill chunk more), in step order, with its pages
    taken; ``refused`` the waiting requests taken out of the queue at admission because
    their adapter version was unloaded, with the error to finish them with."""

    scheduled: list[tuple[RequestState, int]] = field(default_factory=list)
    refused: list[tuple[RequestState, str]] = field(default_factory=list)


class Scheduler:
    """The waiting queue, the running list and the KV page pool, and the first come first
    served policy over them (module docstring).

    Args:
        pages: the KV cache's page pool.
        max_batch_size: the most requests running at once.
        max_step_tokens: a step's token budget.
        max_seq_len: the most tokens a request holds (a decode past it is not scheduled).
        admit_adapter: ``(hold, adapters of the running requests) -> bool``: whether a
            request's adapter version can take a slot beside the running ones (it is then
            marked admitted); raises KeyError with the message to refuse it with if its
            version was unloaded before it was first admitted
            (:meth:`lora_graph.manager.LoRAManager.admit`).
        enable_prefix_caching: reuse cached full pages of earlier prompts under the same
            identity (:mod:`lora_graph.prefix_cache`); the engine turns it on by default.
    """

    def __init__(
        self,
        pages: PagePool,
        *,
        max_batch_size: int,
        max_step_tokens: int,
        max_seq_len: int,
        admit_adapter: Callable[[AdapterRef, set[str]], bool],
        enable_prefix_caching: bool = False,
    ) -> None:
        self.pages = pages
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.max_seq_len = max_seq_len
        self.admit_adapter = admit_adapter
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.preemptions = 0
        self.prefix_cache = PrefixCache(pages, enabled=enable_prefix_caching)

    def free_pages(self, seq: RequestState) -> None:
        """Give a request's pages back, its computed full pages keyed first (they stay
        cached while the pool can keep them), last page first (a prefix's tail is taken
        before its head). Its KV cache is recomputed, or found cached, if it runs again."""
        self.prefix_cache.commit(seq)
        self.pages.free(reversed(seq.pages))
        seq.pages = []
        seq.computed = 0
        seq.keyed = 0

    def preempt(self, seq: RequestState) -> None:
        """Take a running request's pages back and queue it first, to be recomputed (its
        prompt and generated tokens) when pages are free again. It keeps its adapter hold
        and its sampling generator, so its output is unchanged."""
        self.running.remove(seq)
        self.free_pages(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """This step's requests and how many of their tokens each computes (module
        docstring), with the pages for them taken; and the waiting requests refused at
        admission (their adapter version was unloaded), out of the queue, for the caller
        to finish."""
        budget = self.max_step_tokens
        refused: list[tuple[RequestState, str]] = []
        scheduled: list[tuple[RequestState, int]] = []
        taken: set[int] = set()  # ids of the sequences scheduled
        preempted = False
        limit = self.max_seq_len
        for seq in list(self.running):  # decodes first: one token each
            if seq not in self.running or seq.known - seq.computed != 1 or budget == 0:
                continue
            if seq.ends_with_pending(limit):
                continue  # its last token is on the device already
            need = self.pages.pages_for(seq.computed + 1) - len(seq.pages)
            while need > self.pages.num_free:
                victims = [s for s in self.running if id(s) not in taken and s is not seq]
                victim = victims[-1] if victims else seq
                self.preempt(victim)
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
            for seq in self._admit(budget, refused):
                n = min(len(seq.tokens) - seq.computed, budget)
                scheduled.append((seq, n))
                budget -= n
        return SchedulerOutput(scheduled, refused)

    def _admit(self, budget: int, refused: list[tuple[RequestState, str]]) -> list[RequestState]:
        """Admit waiting requests (module docstring, 3.) into the running list, each with
        the pages of its whole prompt; return them in order.

        Requests that need no new slot go ahead of the first one waiting for a slot at most
        ``max_batch_size`` times; after that nothing is admitted past it until its adapter
        gets a slot (the running requests drain), so steady traffic on resident adapters
        cannot starve it. The scan stops after ``4 * max_batch_size`` requests that wait."""
        admitted: list[RequestState] = []
        kept: list[RequestState] = []
        names = {s.adapter for s in self.running if s.adapter is not None}
        limit = self.max_batch_size
        first_blocked: RequestState | None = None
        while self.waiting and budget > 0 and len(self.running) < limit:
            seq = self.waiting[0]
            if seq.pending:
                break  # preempted with a token still on the device: next step
            # its prompt's pages, and one spare page a running request (their next
            # tokens), so a new request is not preempted at once by the running ones
            hits = self.prefix_cache.match(seq)
            # (a cached page nobody holds counts as free until this request holds it)
            idle = sum(1 for p in hits if self.pages.refs(p) == 0)
            need = self.pages.pages_for(len(seq.tokens)) - len(hits) + idle
            if need + len(self.running) > self.pages.num_free:
                break  # first come first served: later requests wait for pages too
            self.waiting.popleft()
            if seq.hold is not None:
                fits = False
                if first_blocked is None or seq.adapter in names:
                    try:
                        fits = self.admit_adapter(seq.hold, names)
                    except KeyError as e:  # its version was unloaded while it waited
                        refused.append((seq, e.args[0]))
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
            self.pages.share(hits)
            seq.pages = hits + self.pages.allocate(
                self.pages.pages_for(len(seq.tokens)) - len(hits)
            )
            seq.computed = len(hits) * self.pages.page_size
            seq.keyed = len(hits)
            if seq.cached_tokens is None:
                self.prefix_cache.count(seq, seq.computed)
            self.running.append(seq)
            admitted.append(seq)
            budget -= min(len(seq.tokens) - seq.computed, budget)
        self.waiting.extendleft(reversed(kept))
        return admitted
