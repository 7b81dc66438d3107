"""The paged KV cache and packed steps through the engine, against per-request
transformers + peft: chunked prefill, mixed prefill/decode steps, preemption when the pool
runs dry, scattered pages, sliding windows through pages, and every page returned."""

from __future__ import annotations

import pytest
from conftest import make_pipeline, prompts

from lora_graph.engine import LLMEngine, Request, SamplingParams
from lora_graph.paging import OutOfPagesError, PagePool


def _serve(pipe, reqs, fed=None, **engine_kw):
    """Generate, and record each step's chunks: (request id, tokens computed, pages); and
    in ``fed`` the ids of chunks whose token came from the device."""
    engine = LLMEngine(pipe, **engine_kw)
    steps: list[list[tuple[str, int, list[int]]]] = []
    prepare = pipe.prepare

    def recording(chunks, **kw):
        steps.append([(c.owner.request.id, len(c.token_ids), list(c.pages)) for c in chunks])
        if fed is not None:
            fed.extend(c.owner.request.id for c in chunks if c.fed_from is not None)
        return prepare(chunks, **kw)

    pipe.prepare = recording
    try:
        outputs = engine.generate(reqs)
    finally:
        del pipe.prepare
    return engine, outputs, steps


def _check(ref, reqs, outputs):
    for r, out in zip(reqs, outputs, strict=True):
        assert out.error is None, (r.id, out.error)
        want = ref.greedy(r.prompt_token_ids, r.adapter, r.sampling.max_new_tokens)
        assert out.token_ids == want, (r.id, r.adapter)


def _requests(batch, adapters, n):
    sampling = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return [
        Request(str(i), ids, a, sampling)
        for i, (ids, a) in enumerate(zip(batch, adapters, strict=True))
    ]


def test_prompts_longer_than_the_step_are_prefilled_in_chunks_beside_decodes(
    tiny, reference_factory
):
    """A 12-token step budget: prompts of up to 40 tokens take several steps, and steps
    mix one request's prompt chunk with others' decodes under other adapters."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=4, max_num_batched_tokens=12)
    batch = prompts(6, seed=91, min_len=3, max_len=40)
    reqs = _requests(batch, ["A", None, "B", "D", "C", "A"], 8)
    engine, outputs, steps = _serve(pipe, reqs)
    _check(ref, reqs, outputs)
    assert all(sum(n for _, n, _ in step) <= 12 for step in steps)
    long_reqs = [r for r in reqs if len(r.prompt_token_ids) > 12]
    assert long_reqs
    for r in long_reqs:  # its first chunk is only part of its prompt
        first = next(n for step in steps for rid, n, _ in step if rid == r.id)
        assert first < len(r.prompt_token_ids), r.id
    mixed = [s for s in steps if any(n == 1 for _, n, _ in s) and any(n > 1 for _, n, _ in s)]
    assert mixed, "no step mixed a prefill chunk with decodes"
    assert pipe.pages.num_free == pipe.pages.capacity


def test_a_pool_too_small_preempts_and_every_output_is_unchanged(tiny, reference_factory):
    """48 token positions for 4 requests that grow to 20-30 tokens each: the newest is
    preempted (and recomputed later) when the pool runs dry; outputs equal peft's and every
    page is back in the pool at the end."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=4, max_seq_len=40, kv_cache_tokens=48, page_size=4)
    assert pipe.pages.capacity == 12
    batch = prompts(4, seed=92, min_len=8, max_len=14)
    reqs = _requests(batch, ["A", "B", None, "A"], 16)
    engine, outputs, _ = _serve(pipe, reqs)
    _check(ref, reqs, outputs)
    assert engine.preemptions > 0
    assert pipe.pages.num_free == pipe.pages.capacity
    assert not engine.running and not engine.waiting


def test_async_scheduling_reads_tokens_a_step_late_and_changes_no_output(tiny, reference_factory):
    """Asynchronous scheduling (the default: a step's tokens are read back while the next
    one runs, a decode's input token fed on the device) against reading every step back
    at once, on a pool too small (so requests are preempted with a token still on the
    device): a request ending on a stop token (read a step late: its extra row dropped),
    ones ending by max_new_tokens and by max_seq_len (never scheduled past their end), one
    sampling at a temperature beside them (its steps read at once). Both ways the same
    tokens and finish reasons, peft's greedy ones for the greedy requests, every page back."""
    ref = reference_factory(tiny)
    batch = prompts(5, seed=93, min_len=8, max_len=14)
    stop = ref.greedy(batch[1], "B", 16)[5]
    reqs = [
        Request("0", batch[0], "A", SamplingParams(max_new_tokens=16, ignore_eos=True)),
        Request("1", batch[1], "B", SamplingParams(max_new_tokens=16, stop_token_ids=(stop,))),
        Request("2", batch[2], None, SamplingParams(max_new_tokens=3)),
        Request("3", batch[3], "A", SamplingParams(max_new_tokens=16, temperature=0.8, seed=3)),
        Request("4", batch[4], "C", SamplingParams(max_new_tokens=64)),  # to max_seq_len
    ]
    runs = {}
    for mode in (True, False):
        pipe = make_pipeline(tiny, max_batch_size=4, max_seq_len=40, kv_cache_tokens=40,
                             page_size=4)  # fmt: skip
        fed: list[str] = []
        engine, outputs, steps = _serve(pipe, reqs, fed, async_scheduling=mode)
        assert engine.preemptions > 0 and pipe.pages.num_free == pipe.pages.capacity
        assert all(o.error is None for o in outputs)
        runs[mode] = [(o.token_ids, o.finish_reason) for o in outputs], fed, steps
    assert runs[True][0] == runs[False][0]
    out = dict(zip("01234", runs[True][0], strict=True))
    first = ref.greedy(batch[1], "B", 16).index(stop)
    assert out["1"] == (ref.greedy(batch[1], "B", first + 1), "stop")
    assert out["0"] == (ref.greedy(batch[0], "A", 16), "length")
    assert out["2"] == (ref.greedy(batch[2], None, 3), "length")
    assert out["4"] == (ref.greedy(batch[4], "C", 40 - len(batch[4])), "length")
    assert set(runs[True][1]) >= {"0", "1", "2", "4"} and not runs[False][1]
    # a request ending by length runs no row past its end: its steps computed exactly its
    # prompt and all of its tokens but the last (more only when preempted and recomputed)
    for mode in (True, False):
        computed = {}
        for step in runs[mode][2]:
            for rid, n, _ in step:
                computed[rid] = computed.get(rid, 0) + n
        assert computed["2"] >= len(batch[2]) + 2
        if not any(rid == "2" and n > 1 and i > 0 for i, s in enumerate(runs[mode][2])
                   for rid, n, _ in s):  # fmt: skip
            assert computed["2"] == len(batch[2]) + 2


def test_a_request_preempted_with_its_next_token_on_the_device(tiny, reference_factory):
    """Two decoding requests outgrow the pool: the newer one is preempted while the token
    its last step sampled is still on the device (asynchronous scheduling); that token is
    read into it while it waits, and recomputed with the rest. Outputs equal peft's."""
    ref = reference_factory(tiny)
    batch = prompts(2, seed=94, min_len=12, max_len=12)
    reqs = _requests(batch, ["B", "A"], 24)
    pipe = make_pipeline(tiny, max_batch_size=2, max_seq_len=40, kv_cache_tokens=40, page_size=4)
    engine = LLMEngine(pipe)
    pending_at_preemption = []
    preempt = engine.scheduler.preempt

    def recording(seq):
        pending_at_preemption.append(seq.pending)
        preempt(seq)

    engine.scheduler.preempt = recording
    _check(ref, reqs, engine.generate(reqs))
    assert 1 in pending_at_preemption
    assert pipe.pages.num_free == pipe.pages.capacity


def test_a_preempted_sampled_request_draws_the_same_tokens(tiny):
    """Seeded sampling through preemption: the request keeps its generator, so its tokens
    equal those of the same requests served with a pool large enough for all."""
    batch = prompts(4, seed=96, min_len=8, max_len=14)
    sampling = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    reqs = [
        Request(str(i), ids, a, sampling)
        for i, (ids, a) in enumerate(zip(batch, ["A", None, "B", "C"], strict=True))
    ]
    small = make_pipeline(tiny, max_batch_size=4, max_seq_len=40, kv_cache_tokens=48, page_size=4)
    tight, tight_out, _ = _serve(small, reqs)
    roomy_out = LLMEngine(make_pipeline(tiny, max_batch_size=4, max_seq_len=40)).generate(reqs)
    assert tight.preemptions > 0
    assert [o.token_ids for o in tight_out] == [o.token_ids for o in roomy_out]


def test_scattered_pages_after_churn(tiny, reference_factory):
    """Requests of different lengths come and go, so later ones get pages that are not
    contiguous nor in order; they still match."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=3, max_seq_len=48, page_size=4)
    batch = prompts(9, seed=93, min_len=3, max_len=20)
    adapters = ["A", None, "B", "C", "A", None, "D", "B", None]
    reqs = [
        Request(str(i), ids, a, SamplingParams(max_new_tokens=3 + 4 * (i % 3), ignore_eos=True))
        for i, (ids, a) in enumerate(zip(batch, adapters, strict=True))
    ]
    engine, outputs, steps = _serve(pipe, reqs)
    for r, out in zip(reqs, outputs, strict=True):
        assert out.token_ids == ref.greedy(r.prompt_token_ids, r.adapter, len(out.token_ids))
        assert len(out.token_ids) == r.sampling.max_new_tokens
    tables = [pages for step in steps for _, _, pages in step]
    assert any(pages != sorted(pages) for pages in tables), "no request got scattered pages"
    assert pipe.pages.num_free == pipe.pages.capacity


@pytest.mark.parametrize("page_size", [4, 16])
def test_sliding_window_through_pages(tiny_factory, reference_factory, page_size):
    """Qwen2 with a window of 4 on layer 1 only: prompts and generations far past the
    window, prefilled in chunks across pages, match transformers."""
    t = tiny_factory("qwen2_window")
    ref = reference_factory(t)
    pipe = make_pipeline(t, max_batch_size=3, max_num_batched_tokens=8, page_size=page_size)
    batch = prompts(3, seed=94, min_len=10, max_len=25)
    reqs = _requests(batch, ["A", None, "B"], 12)
    _, outputs, _ = _serve(pipe, reqs)
    _check(ref, reqs, outputs)


def test_abort_returns_the_pages(tiny):
    pipe = make_pipeline(tiny, max_batch_size=2, page_size=4)
    engine = LLMEngine(pipe)
    for i, ids in enumerate(prompts(3, seed=95, min_len=10, max_len=12)):
        engine.add_request(
            Request(str(i), ids, "A", SamplingParams(max_new_tokens=20, ignore_eos=True))
        )
    engine.step()
    engine.step()
    assert pipe.pages.num_free < pipe.pages.capacity
    for i in range(3):
        assert engine.abort_request(str(i))
    assert pipe.pages.num_free == pipe.pages.capacity


def test_page_pool_bookkeeping():
    pool = PagePool(5, 16)
    assert pool.capacity == pool.num_free == 4 and pool.pages_for(17) == 2
    pages = pool.allocate(3)
    assert 0 not in pages and len(set(pages)) == 3
    with pytest.raises(OutOfPagesError, match="2 pages wanted, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1  # a refused allocation takes nothing
    pool.free(pages[:1])
    with pytest.raises(ValueError, match="is not held"):
        pool.free(pages[:1])
    with pytest.raises(ValueError, match="is not held"):
        pool.free([0])  # the scratch page is never handed out
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(1, 16)


def test_capture_refuses_buckets_narrower_than_the_running_batch(tiny):
    """Every running request decodes each step: a largest token bucket below
    ``max_batch_size`` would leave some of them unscheduled, step after step."""
    pipe = make_pipeline(tiny, max_batch_size=8, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match=r"largest token bucket \(4\) must hold .* 8"):
        pipe.enable_compile("inductor", token_buckets=(2, 4), progress=False)
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens 16"):
        pipe.enable_compile("inductor", token_buckets=(8, 32), progress=False)


def test_step_buffer_pads_a_step_to_its_bucket():
    """Two requests (a 3-token prefill chunk after 2 cached tokens, one decode token) padded
    to 8 tokens x 4 requests: padding tokens write the scratch page, padding requests have
    no tokens and length 0, every view keeps its address from step to step."""
    import torch

    from lora_graph.step import STEP_INPUTS, SeqChunk, StepBuffer

    buf = StepBuffer(
        STEP_INPUTS, max_tokens=8, max_seqs=4, max_pages=3, page_size=2, device=torch.device("cpu")
    )
    chunks = [SeqChunk("A", [11, 12, 13], 2, [5, 3, 7]), SeqChunk(None, [14], 4, [2, 6, 4])]
    v = buf.fill(chunks, (8, 4))
    assert v["tokens"].tolist() == [11, 12, 13, 14, 0, 0, 0, 0]
    assert v["positions"].tolist() == [2, 3, 4, 4, 0, 0, 0, 0]
    # position p of a request lives in page pages[p // 2] at offset p % 2
    assert v["slot_mapping"].tolist() == [3 * 2, 3 * 2 + 1, 7 * 2, 4 * 2, 0, 0, 0, 0]
    assert v["block_tables"].tolist() == [[5, 3, 7], [2, 6, 4], [0, 0, 0], [0, 0, 0]]
    assert v["seq_lens"].tolist() == [5, 5, 0, 0]
    assert v["query_start"].tolist() == [0, 3, 4, 4, 4]
    assert v["logits_index"].tolist() == [2, 3, 0, 0]
    again = buf.fill(chunks[1:], (8, 4))
    assert all(again[k].data_ptr() == v[k].data_ptr() for k in v)
    assert again["block_tables"].tolist()[1] == [0, 0, 0]  # last step's rows are cleared
    with pytest.raises(ValueError, match="do not hold 5 positions"):
        buf.fill([SeqChunk(None, [1, 2, 3], 2, [5, 3])], (8, 4))
    with pytest.raises(ValueError, match="does not fit width"):
        buf.fill(chunks, (2, 4))
    with pytest.raises(ValueError, match="another shape"):
        StepBuffer({"tokens": ("S",)}, max_tokens=8, max_seqs=4, max_pages=3, page_size=2,
                   device=torch.device("cpu"))  # fmt: skip
    # a decode's token still on the device (fed_from: its row of fed_tokens) goes in its place
    fed = [SeqChunk("A", [11, 12, 13], 2, [5, 3, 7]), SeqChunk(None, [0], 4, [2, 6, 4], None, 2),
           SeqChunk(None, [0], 1, [1], None, 0)]  # fmt: skip
    v = buf.fill(fed, (8, 4), torch.tensor([70, 71, 72]))
    assert v["tokens"].tolist() == [11, 12, 13, 72, 70, 0, 0, 0]
    with pytest.raises(ValueError, match="there is no fed_tokens"):
        buf.fill(fed, (8, 4))
    with pytest.raises(ValueError, match="only a one-token chunk"):
        buf.fill([SeqChunk(None, [1, 2], 0, [1], None, 0)], (8, 4), torch.tensor([70]))


def test_kv_pool_sized_from_gpu_memory_utilization(tiny, monkeypatch):
    """The CUDA sizing rule (:func:`lora_graph.memory.kv_cache_pages`), with the device's
    memory faked: the pool gets what ``gpu_memory_utilization`` leaves after what is in use,
    the weights, the slots and an activation bound, at most every request at full length;
    too little is refused. The weights are counted on the meta device as the built module
    holds them."""
    import torch

    from lora_graph import memory
    from lora_graph.memory import MemoryBudgetError

    pipe = make_pipeline(tiny, max_batch_size=4, max_seq_len=64, page_size=16)
    page_bytes = pipe.kv_bytes_per_token() * 16
    weights = memory.weight_bytes(lambda: pipe._instantiate_module(pipe.config), pipe.dtype)
    built = {id(p): p for p in pipe.model.parameters()}.values()
    assert weights == sum(p.numel() * p.element_size() for p in built) > 0
    act = 10**6
    total, used = 10 * 2**30, 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used, total))

    def pages(fraction: float) -> int:
        return memory.kv_cache_pages(
            device=torch.device("cuda"),
            page_bytes=page_bytes,
            page_size=16,
            max_seq_len=64,
            max_batch_size=4,
            kv_cache_tokens=None,
            gpu_memory_utilization=fraction,
            slots=0,
            fixed_bytes=lambda: weights + act,
        )

    most = 4 * 4 + 1  # 4 requests of 4 pages, and the scratch page
    assert pages(0.9) == most  # plenty: capped
    # a budget of 10 pages: what is left after use, weights and activations
    assert pages((used + weights + act + 10 * page_bytes + page_bytes // 2) / total) == 10
    with pytest.raises(MemoryBudgetError, match="less than one request of max_seq_len 64"):
        pages((used + weights + act + 2 * page_bytes) / total)


def test_cpu_kv_cache_cap_for_a_long_context(monkeypatch):
    """Off CUDA a model's default context sizes the pool as every request at full length;
    a context too long for that is bounded to a quarter of the free memory
    (:func:`lora_graph.memory.cpu_kv_cache_tokens`), never below a page per request."""
    import torch

    from lora_graph import memory

    cpu, page_bytes, page_size = torch.device("cpu"), 1024, 16  # 64 B a token position
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 4 * 2**20)  # 1 MiB usable

    def cap(context: int, batch: int = 2, slots: int = 0, device=cpu):
        return memory.cpu_kv_cache_tokens(device, page_bytes, page_size, slots,
                                          max_batch_size=batch, context=context)  # fmt: skip

    assert cap(2**20) == 2**20 // 64  # a quarter of 4 MiB over 64 B a position
    assert cap(2**20, slots=2**19) == 2**19 // 64  # (the adapter slots come off first)
    assert cap(2**13) is None  # every request at full length fits: no bound
    assert cap(2**20, batch=2**20) is None  # under a page a request: refused later, as before
    assert cap(2**20, device=torch.device("cuda")) is None  # (CUDA sizes by utilization)
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: None)
    assert cap(2**20) is None
