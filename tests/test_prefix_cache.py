"""Prefix caching keyed by adapter identity (:mod:`lora_graph.prefix_cache`): a shared
prompt's full pages are computed once per base or adapter *version* and reused only under
it; every output equals a cold run's (the cache off) and peft's."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_pipeline, prompts

from lora_graph.engine import LLMEngine, Request, SamplingParams
from lora_graph.paging import PagePool
from lora_graph.prefix_cache import BASE_ROOT, identity_root, page_key

PAGE = 4


def _greedy(rid: str, ids: list[int], adapter: str | None, n: int = 6, **kw) -> Request:
    return Request(rid, ids, adapter, SamplingParams(max_new_tokens=n, ignore_eos=True, **kw))


def _version(engine: LLMEngine, name: str) -> int:
    return engine.pipeline.manager.registry.get(name).version


def test_page_pool_shares_keeps_evicts_and_forgets():
    pool = PagePool(6, PAGE)  # 5 pages
    a = pool.allocate(3)
    owner = identity_root(7)
    keys = [bytes([i]) * 32 for i in range(3)]
    assert all(pool.cache(p, k, owner) for p, k in zip(a[:2], keys, strict=False))
    assert not pool.cache(a[2], keys[0], owner)  # the key is another page's: it stays first
    assert pool.lookup(keys[0]) == a[0] and pool.lookup(keys[2]) is None
    pool.share([a[0]])
    assert pool.refs(a[0]) == 2
    with pytest.raises(ValueError, match="not cached"):
        pool.share([a[2]])
    pool.free(reversed(a))  # a[2] (never keyed) is free, a[1] idle and cached, a[0] held
    assert pool.num_free == 4 and pool.num_cached == 2 and pool.refs(a[0]) == 1
    pool.free([a[0]])
    assert pool.num_free == 5
    # the never-keyed pages go first, then idle cached ones, least recently released first
    taken = pool.allocate(4)
    assert a[0] not in taken and a[1] in taken and pool.lookup(keys[1]) is None
    assert pool.evictions == 1 and pool.lookup(keys[0]) == a[0]
    pool.free(taken)
    assert pool.forget(owner) == 1 and pool.lookup(keys[0]) is None
    assert pool.num_free == pool.capacity and pool.num_cached == 0


def test_keys_chain_over_a_typed_identity():
    tokens = [5, 6, 7, 8]
    base = page_key(BASE_ROOT, tokens)
    assert base == page_key(identity_root(None), tokens)
    assert len({base, page_key(identity_root(1), tokens), page_key(identity_root(2), tokens)}) == 3
    # a parent's key chains into its child's: the same page after another prefix differs
    assert page_key(page_key(BASE_ROOT, [1, 2, 3, 4]), tokens) != page_key(
        page_key(BASE_ROOT, [1, 2, 3, 9]), tokens
    )


def _phase(engine: LLMEngine, shared: list[int], adapter: str | None, tag: str, tails):
    """One request alone (it may only hit pages of its own identity), then three more on
    the same prefix together; returns the outputs in order."""
    first = engine.generate([_greedy(f"{tag}0", shared + tails[0], adapter)])
    rest = engine.generate(
        [_greedy(f"{tag}{i}", shared + tail, adapter) for i, tail in enumerate(tails[1:], 1)]
    )
    return first + rest


def test_isolation_across_adapters_base_and_a_reload(tiny, reference_factory):
    """Prompts sharing 3 full pages under A, B, base, A reloaded under the same name with
    other weights (C's), then A's new version again: each output equals a cold run's and
    peft's token for token, and a request hits only pages its own identity computed, even
    when its tokens equal another identity's cached pages."""
    ref = reference_factory(tiny)
    g = random.Random(3)
    shared = prompts(1, seed=310, min_len=14, max_len=14)[0]  # 3 full pages and 2 tokens
    tails = [[g.randrange(3, 128) for _ in range(g.randrange(1, 6))] for _ in range(4)]
    runs = {}
    for caching in (True, False):
        pipe = make_pipeline(tiny, page_size=PAGE, load=("A", "B"))
        engine = LLMEngine(pipe, enable_prefix_caching=caching)
        out = []
        old_a = _version(engine, "A")
        for tag, adapter in (("a", "A"), ("b", "B"), ("n", None)):
            out.append(_phase(engine, shared, adapter, tag, tails))
        engine.add_lora(str(tiny.adapters["C"]), name="A")  # A's new version
        assert _version(engine, "A") != old_a
        old_key = page_key(identity_root(old_a), shared[:PAGE])
        assert engine.pages.lookup(old_key) is None  # the old version's pages are dropped
        out.append(_phase(engine, shared, "A", "c", tails))
        out.append(_phase(engine, shared, "A", "d", tails))
        runs[caching] = out
        assert engine.pages.num_free == engine.pages.capacity
    hot, cold = runs[True], runs[False]
    for phase, (peft_name, h, c) in enumerate(zip(["A", "B", None, "C", "C"], hot, cold,
                                                  strict=True)):  # fmt: skip
        assert [o.token_ids for o in h] == [o.token_ids for o in c], phase
        for o, tail in zip(h, tails, strict=True):
            assert o.token_ids == ref.greedy(shared + tail, peft_name, 6), (phase, o.id)
        assert all(o.cached_tokens == 0 for o in c)
        # the first request of a phase finds another identity's pages only (no hit), the
        # later ones share the 3 pages; in the last phase every prompt was computed before
        # under this version: all its full pages but the one of its last token are reused
        if phase < 4:
            assert [o.cached_tokens for o in h] == [0, 12, 12, 12], phase
        else:
            assert [o.cached_tokens for o in h] == [(14 + len(t) - 1) // 4 * 4 for t in tails]


def test_unloading_drops_a_versions_pages(tiny):
    pipe = make_pipeline(tiny, page_size=PAGE, load=("A", "B"))
    engine = LLMEngine(pipe)
    shared = prompts(1, seed=311, min_len=13, max_len=13)[0]
    engine.generate([_greedy("b", shared, "B"), _greedy("n", shared, None)])
    key = page_key(identity_root(_version(engine, "B")), shared[:PAGE])
    cached = engine.pages.num_cached
    assert engine.pages.lookup(key) is not None
    engine.remove_lora("B")  # freed once no request holds it and no batch names it
    # B's 4 full pages (13 prompt tokens and 5 of its 6 generated ones computed) dropped at
    # once on an idle engine (a helper found them kept until another step ran)
    assert engine.pages.lookup(key) is None and engine.pages.num_cached == cached - 4
    assert "B" not in engine.list_loras() and pipe.manager.slots.slot_of("B") is None
    engine.generate([_greedy("n2", shared, None)])
    assert engine.pages.lookup(page_key(BASE_ROOT, shared[:PAGE])) is not None
    engine.add_lora(str(tiny.adapters["B"]), name="B")  # the same weights, loaded again
    out = engine.generate([_greedy("b2", shared, "B")])
    assert out[0].cached_tokens == 0  # a new version: its own pages only


def test_cache_salt_separates_tenants(tiny):
    """vLLM's ``cache_salt``: the same prompt under the same adapter shares pages only with
    requests of the same salt; an empty salt is refused."""
    shared = prompts(1, seed=317, min_len=13, max_len=13)[0]
    engine = LLMEngine(make_pipeline(tiny, page_size=PAGE))

    def cached(rid: str, salt: str | None) -> int:
        req = _greedy(rid, shared, "A")
        req.cache_salt = salt
        out = engine.generate([req])[0]
        assert out.error is None, out.error
        return out.cached_tokens

    assert [cached("0", None), cached("1", "t1"), cached("2", "t1"), cached("3", "t2"),
            cached("4", None)] == [0, 0, 12, 0, 12]  # fmt: skip
    bad = _greedy("5", shared, "A")
    bad.cache_salt = ""
    assert engine.generate([bad])[0].error == "cache_salt must be a non-empty string"
    # an unload drops the salted pages with the version's own
    key = page_key(identity_root(_version(engine, "A"), "t1"), shared[:PAGE])
    assert engine.pages.lookup(key) is not None
    engine.remove_lora("A")
    engine.generate([_greedy("n", shared, None)])
    assert engine.pages.lookup(key) is None


def test_a_version_retired_twice_into_one_alias_drops_every_page(tiny):
    """A's weights W1 held by a running request when reloaded with W2, then W1 again while
    it still runs, then W2: the two retired W1 versions share one routing key
    (``A@<digest>``); once nothing holds them and A is unloaded, no page of any of its
    versions stays cached (found by a helper's trial: the merged version's pages stayed)."""
    engine = LLMEngine(make_pipeline(tiny, page_size=PAGE, max_batch_size=4))
    shared = prompts(1, seed=318, min_len=13, max_len=13)[0]
    paths = [tiny.adapters["A"], tiny.adapters["C"]] * 2
    for i, path in enumerate(paths):
        engine.add_lora(str(path), name="A")
        engine.add_request(_greedy(f"r{i}", shared + [3 + i], "A", 30))
        for _ in range(3):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    engine.remove_lora("A")
    engine.generate([_greedy("n", [5], None, 1)])  # (a step without A: its unload done)
    assert engine.pages.num_cached == 0


@pytest.mark.parametrize("kind", ["qwen2_window", "phi3", "gemma2"])
def test_sliding_window_layers_reuse_cached_pages(tiny_factory, reference_factory, kind):
    """Windows of 4-6 tokens, a shared prefix of 4 full pages (16 tokens) past them: the
    pages that left a layer's window are kept (every layer shares the block table), so a
    request reusing them equals peft's and a cold run's."""
    t = tiny_factory(kind)
    ref = reference_factory(t)
    shared = prompts(1, seed=312, min_len=17, max_len=17)[0]
    reqs = [_greedy(f"{i}", shared + [10 + i] * i, a, 8) for i, a in enumerate(["A", "A", None])]
    reqs.append(_greedy("3", shared, None, 8))
    engine = LLMEngine(make_pipeline(t, page_size=PAGE, max_num_batched_tokens=8))
    out = [engine.generate([r])[0] for r in reqs]
    assert [o.cached_tokens for o in out] == [0, 16, 0, 16]
    for r, o in zip(reqs, out, strict=True):
        assert o.token_ids == ref.greedy(r.prompt_token_ids, r.adapter, 8), r.id


def test_prompt_logprobs_compute_every_position(tiny):
    """A request asking for prompt logprobs reuses nothing (it returns every position's
    logprob, so it computes them); its pages are cached for the next request all the same.
    Its logprobs equal a cold engine's."""
    shared = prompts(1, seed=313, min_len=13, max_len=13)[0]
    engine = LLMEngine(make_pipeline(tiny, page_size=PAGE))
    engine.generate([_greedy("warm", shared, "A")])
    asked = _greedy("lp", shared, "A", prompt_logprobs=2)
    out = engine.generate([asked])[0]
    cold = LLMEngine(make_pipeline(tiny, page_size=PAGE), enable_prefix_caching=False)
    want = cold.generate([asked])[0]
    assert out.cached_tokens == 0 and out.token_ids == want.token_ids
    assert out.prompt_logprobs[0] is None and all(lp is not None for lp in out.prompt_logprobs[1:])
    for a, b in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert engine.generate([_greedy("after", shared, "A")])[0].cached_tokens == 12


def test_counts_per_adapter(tiny):
    shared = prompts(1, seed=314, min_len=9, max_len=9)[0]  # 2 full pages
    engine = LLMEngine(make_pipeline(tiny, page_size=PAGE))
    for i in range(3):
        engine.generate([_greedy(f"a{i}", shared, "A"), _greedy(f"n{i}", shared + [7], None)])
    counts = engine.prefix_cache_counts()
    assert counts == {"A": (16, 27 - 16), "base": (16, 30 - 16)}


def test_prefix_caching_off_reuses_nothing(tiny):
    shared = prompts(1, seed=315, min_len=13, max_len=13)[0]
    engine = LLMEngine(make_pipeline(tiny, page_size=PAGE), enable_prefix_caching=False)
    out = [engine.generate([_greedy(str(i), shared, "A")])[0] for i in range(2)]
    assert [o.cached_tokens for o in out] == [0, 0] and engine.pages.num_cached == 0


def _churn_run(tiny, waves, caching: bool):
    """Serve ``waves`` (each: requests, the ids to abort after two steps, an adapter event
    applied while they run) through a pool of 24 pages; returns the outputs by id and the
    engine."""
    pipe = make_pipeline(
        tiny, page_size=PAGE, max_batch_size=32, max_seq_len=48, kv_cache_tokens=320,
        max_num_batched_tokens=256, load=("A", "B"),
    )  # fmt: skip
    engine = LLMEngine(pipe, enable_prefix_caching=caching)
    for reqs, aborts, event in waves:
        for r in reqs:
            engine.add_request(r)
        engine.step()
        engine.step()
        for rid in aborts:
            engine.abort_request(rid)
        if event == "reload A":  # A's weights swapped between A's and C's files
            name = "C" if engine.pipeline.manager.registry.get("A").rank == 8 else "A"
            engine.add_lora(str(tiny.adapters[name]), name="A")
        elif event == "unload B":
            engine.remove_lora("B")
        elif event == "load B":
            engine.add_lora(str(tiny.adapters["B"]), name="B")
        for _ in range(12):  # the next wave arrives while this one runs
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return dict(engine.finished), engine


def _churn_waves():
    g = random.Random(316)
    heads = [prompts(1, seed=320 + i, min_len=4 * (1 + i % 4), max_len=4 * (1 + i % 4))[0]
             for i in range(6)]  # fmt: skip
    events = [None, None, "reload A", None, "unload B", "load B"]
    waves, n = [], 0
    for w in range(12):  # every adapter event twice
        reqs = []
        for _ in range(100):
            adapter = g.choice([None, "A", "B"])
            tail = [g.randrange(3, 128) for _ in range(g.randrange(1, 7))]
            new = g.choice([1, 1, 2, 2, 3, 24])
            reqs.append(_greedy(f"r{n}", g.choice(heads) + tail, adapter, new))
            n += 1
        aborts = [r.id for r in g.sample(reqs, 3)]
        waves.append((reqs, aborts, events[w % len(events)]))
    return waves


def test_randomized_churn_with_the_cache_equals_without(tiny):
    """1,200 requests on 6 shared prefixes (1-4 full pages) under base, A and B, with aborts,
    a pool small enough to preempt, and adapter churn while requests run (A reloaded with
    other weights and back, B unloaded and loaded again): every request finishing in both
    runs has the same tokens with the cache on as off, the cache hits, and every page is
    back in the pool, unheld, at the end."""
    waves = _churn_waves()
    hot, engine = _churn_run(tiny, waves, True)
    cold, cold_engine = _churn_run(tiny, waves, False)
    assert len(hot) == len(cold) == 1200
    both = [i for i in hot if hot[i].error is None and cold[i].error is None]
    assert len(both) > 900
    assert [hot[i].token_ids for i in both] == [cold[i].token_ids for i in both]
    assert sum(o.cached_tokens for o in hot.values()) > 3_000
    assert engine.preemptions > 0
    for e in (engine, cold_engine):
        assert e.pages.num_free == e.pages.capacity
        assert all(e.pages.refs(p) == 0 for p in range(e.pages.num_pages))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["gqa", "qwen2_window"])
def test_gpu_cuda_graphs_reuse_cached_pages(tiny_factory, reference_factory, kind):
    """On CUDA with captured graphs, the Triton attention kernel and asynchronous
    scheduling: prompts on a shared 3-page prefix under A, base and A reloaded with C's
    weights; hits only within one identity, outputs equal peft's (float32) and the cache
    off."""
    t = tiny_factory(kind)
    ref = reference_factory(t)
    shared = prompts(1, seed=330, min_len=14, max_len=14)[0]
    tails = [[9], [10, 11], [12, 13, 14], [15]]
    runs = {}
    for caching in (True, False):
        pipe = make_pipeline(t, device="cuda", page_size=PAGE, max_num_batched_tokens=16,
                             load=("A", "B"))  # fmt: skip
        pipe.enable_compile("cudagraph", token_buckets=(8, 16), progress=False)
        engine = LLMEngine(pipe, enable_prefix_caching=caching)
        out = [_phase(engine, shared, "A", "a", tails), _phase(engine, shared, None, "n", tails)]
        engine.add_lora(str(t.adapters["C"]), name="A")
        out.append(_phase(engine, shared, "A", "c", tails))
        assert sum(g.replays for g in pipe.graphs.graphs.values()) > 0
        runs[caching] = out
    for phase, (name, hot, cold) in enumerate(zip(["A", None, "C"], runs[True], runs[False],
                                                  strict=True)):  # fmt: skip
        assert [o.cached_tokens for o in hot] == [0, 12, 12, 12], phase
        assert [o.token_ids for o in hot] == [o.token_ids for o in cold], phase
        for o, tail in zip(hot, tails, strict=True):
            assert o.token_ids == ref.greedy(shared + tail, name, 6), (phase, o.id)


def test_a_request_ended_by_the_mid_step_read_back_commits_nothing(tiny, reference_factory):
    """Asynchronous scheduling reads the previous step back in the middle of a step when a
    row processes its logits (a penalty, ``logit_bias``, a grammar); a request that read
    back ends (its stop token) gave its pages back, yet the step went on to count it computed
    and commit its pages: with one-token pages an IndexError out of ``step`` (a helper's
    find), with larger ones a write into a freed request."""
    ref = reference_factory(tiny)
    ids = prompts(3, seed=331)
    want = [ref.greedy(p, a, 6) for p, a in zip(ids, ["A", None, "B"], strict=True)]
    unused = next(t for t in range(100) if t not in want[0])
    stop = want[0][2]
    engine = LLMEngine(make_pipeline(tiny, page_size=1, load=("A", "B")), async_scheduling=True)
    biased = SamplingParams(6, logit_bias=((unused, -100.0),), stop_token_ids=(stop,))
    outs = engine.generate(
        [Request("stops", ids[0], "A", biased)]
        + [Request(f"r{i}", ids[i], a, SamplingParams(6)) for i, a in ((1, None), (2, "B"))]
    )
    assert outs[0].token_ids == want[0][: want[0].index(stop) + 1]
    assert outs[0].finish_reason == "stop"
    assert [o.token_ids for o in outs[1:]] == want[1:]
    assert engine.pages.num_free == engine.pages.capacity  # (cached pages count as free)
