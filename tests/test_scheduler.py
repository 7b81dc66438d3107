"""The scheduler on its own, without a model: a page pool, requests and an adapter rule
in, a :class:`SchedulerOutput` out (what the step runs, in what order, with what pages)."""

from __future__ import annotations

import pytest

from lora_graph.paging import PagePool
from lora_graph.registry import AdapterRef
from lora_graph.requests import Request, RequestState, SamplingParams
from lora_graph.scheduler import Scheduler


def _state(rid: str, n: int, adapter: str | None = None, max_new: int = 8) -> RequestState:
    req = Request(rid, list(range(3, 3 + n)), adapter, SamplingParams(max_new_tokens=max_new))
    seq = RequestState(req, None, list(req.prompt_token_ids))
    if adapter is not None:
        seq.hold = AdapterRef(adapter, "digest", adapter)
    return seq


def _scheduler(
    pages: int = 64, *, batch: int = 4, budget: int = 16, slots: int = 8, unloaded=()
) -> Scheduler:
    def admit(hold: AdapterRef, names: set[str]) -> bool:
        if hold.key in unloaded and not hold.admitted:
            raise KeyError(f"adapter {hold.name!r} was unloaded")
        if len(names | {hold.key}) > slots:
            return False
        hold.admitted = True
        return True

    return Scheduler(
        PagePool(pages, 4),
        max_batch_size=batch,
        max_step_tokens=budget,
        max_seq_len=64,
        admit_adapter=admit,
    )


def _decoded(s: Scheduler, seq: RequestState) -> None:
    """What the engine does after a step: the chunk's tokens computed, one sampled."""
    seq.computed = len(seq.tokens)
    seq.tokens.append(7)
    seq.generated.append(7)


def test_prompts_are_chunked_under_the_budget_and_decodes_go_first():
    s = _scheduler(budget=10)
    a, b = _state("a", 6), _state("b", 9)
    s.waiting.extend([a, b])
    out = s.schedule()
    assert [(q.request.id, n) for q, n in out.scheduled] == [("a", 6), ("b", 4)]
    assert s.running == [a, b] and not s.waiting
    assert len(a.pages) == 2 and len(b.pages) == 3  # the pages of its whole prompt
    _decoded(s, a)
    b.computed = 4
    out = s.schedule()  # a decodes (1 token) before b's next chunk (5 tokens)
    assert [(q.request.id, n) for q, n in out.scheduled] == [("a", 1), ("b", 5)]


def test_a_dry_pool_preempts_the_newest_running_request():
    s = _scheduler(pages=5, budget=64)  # 4 usable pages of 4 positions
    a, b = _state("a", 4), _state("b", 4)
    s.waiting.extend([a, b])
    s.schedule()
    assert s.running == [a, b] and s.pages.num_free == 2
    for seq in (a, b):
        _decoded(s, seq)
    s.pages.allocate(2)  # the pool runs dry: a's next token has no page
    out = s.schedule()
    assert s.preemptions == 1 and s.running == [a] and list(s.waiting) == [b]
    assert [(q.request.id, n) for q, n in out.scheduled] == [("a", 1)]
    assert b.pages == [] and b.computed == 0  # recomputed later, prompt and token


def test_a_request_whose_adapter_has_no_slot_waits_and_later_ones_go_ahead():
    s = _scheduler(slots=1, budget=64)
    x, y, base = _state("x", 3, "X"), _state("y", 3, "Y"), _state("base", 3)
    s.waiting.extend([x, y, base])
    out = s.schedule()
    assert [q.request.id for q, _ in out.scheduled] == ["x", "base"]
    assert list(s.waiting) == [y] and y.bypassed == 1


def test_a_waiting_request_of_an_unloaded_version_is_handed_back_refused():
    s = _scheduler(unloaded={"X"})
    x, base = _state("x", 3, "X"), _state("base", 3)
    s.waiting.extend([x, base])
    out = s.schedule()
    assert [(q.request.id, e) for q, e in out.refused] == [("x", "adapter 'X' was unloaded")]
    assert [q.request.id for q, _ in out.scheduled] == ["base"] and not s.waiting


@pytest.mark.parametrize("batch", [1, 2])
def test_max_batch_size_bounds_the_running_requests(batch):
    s = _scheduler(batch=batch, budget=64)
    s.waiting.extend(_state(str(i), 3) for i in range(4))
    out = s.schedule()
    assert len(out.scheduled) == batch and len(s.running) == batch and len(s.waiting) == 4 - batch
