"""A request is bound to the adapter version its name stood for when it arrived: a reload
before it runs does not change what serves it, and an unload before it runs refuses it
(``"adapter 'x' was unloaded"``); one that already runs finishes on its version. Checked
against transformers + peft running each version alone."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_pipeline, prompts

from lora_graph.engine import LLMEngine, Request, SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_a_queued_request_keeps_the_version_of_its_arrival(tiny, reference_factory):
    """max_batch_size 1: ``q`` waits behind ``r`` while ``x`` is reloaded with other
    weights; ``q`` is served with the weights ``x`` had when it arrived, and a request
    arriving after the reload with the new ones."""
    ref = reference_factory(tiny)
    engine = LLMEngine(make_pipeline(tiny, load=(), max_batch_size=1))
    m = engine.pipeline.manager
    m.load_adapter(str(tiny.adapters["A"]), name="x")
    ids = prompts(3, seed=61)
    engine.add_request(Request("r", ids[0], "x", GREEDY))
    engine.add_request(Request("q", ids[1], "x", GREEDY))
    engine.step()
    m.load_adapter(str(tiny.adapters["C"]), name="x")
    engine.add_request(Request("after", ids[2], "x", GREEDY))
    _drain(engine)
    assert engine.finished["r"].token_ids == ref.greedy(ids[0], "A", 4)
    assert engine.finished["q"].token_ids == ref.greedy(ids[1], "A", 4)
    assert engine.finished["after"].token_ids == ref.greedy(ids[2], "C", 4)
    assert [e.name for e in m.registry.entries()] == ["x"] and not m.registry.held_keys()


@pytest.mark.parametrize("reload", [False, True], ids=["unload", "unload then reload"])
def test_a_queued_request_of_an_unloaded_version_is_refused(tiny, reference_factory, reload):
    """The issue's case: ``x`` unloaded (and at once loaded again with other weights)
    while requests on it wait: the running one finishes on the old weights, the waiting
    ones are refused with the documented error, none is served by the new weights."""
    ref = reference_factory(tiny)
    engine = LLMEngine(make_pipeline(tiny, load=(), max_batch_size=1))
    m = engine.pipeline.manager
    m.load_adapter(str(tiny.adapters["A"]), name="x")
    ids = prompts(4, seed=62)
    for i in range(4):
        engine.add_request(Request(f"r{i}", ids[i], "x", GREEDY))
    engine.step()
    m.unload_adapter("x")
    if reload:
        m.load_adapter(str(tiny.adapters["C"]), name="x")
    _drain(engine)
    assert engine.finished["r0"].token_ids == ref.greedy(ids[0], "A", 4)
    for i in (1, 2, 3):
        out = engine.finished[f"r{i}"]
        assert out.error == "adapter 'x' was unloaded" and out.token_ids == []
        assert out.arrival_time is not None
    assert m.loras == (["x"] if reload else [])
    assert [e.name for e in m.registry.entries()] == m.loras and not m.registry.held_keys()


def test_a_preempted_request_finishes_on_its_unloaded_version(tiny, reference_factory):
    """A request that ran, then was preempted (pages ran dry), is not refused when its
    adapter is unloaded while it waits to be recomputed: it was admitted under it."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(
        tiny, load=(), max_batch_size=2, max_seq_len=40, kv_cache_tokens=40, page_size=4
    )
    engine = LLMEngine(pipe)
    m = pipe.manager
    m.load_adapter(str(tiny.adapters["A"]), name="x")
    ids = prompts(2, seed=63, min_len=12, max_len=12)
    long = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine.add_request(Request("a", ids[0], None, long))
    engine.add_request(Request("b", ids[1], "x", long))
    while engine.preemptions == 0:
        assert engine.has_unfinished()
        engine.step()
    m.unload_adapter("x")
    _drain(engine)
    assert engine.finished["b"].token_ids == ref.greedy(ids[1], "A", 24)
    assert engine.finished["a"].token_ids == ref.greedy(ids[0], None, 24)
    assert m.loras == [] and not m.registry.entries()


def test_load_unload_reload_racing_hundreds_of_requests(tiny, reference_factory):
    """Random traffic on two names and the base, with loads, unloads and same-name reloads
    (three weight sets) between steps, two requests at most running: every request is
    served by the version current at its arrival (its tokens equal that version alone),
    refused as unloaded only if that version was unloaded after it arrived, or refused at
    arrival as unknown when its name was not loaded; and nothing is left held."""
    _race(tiny, reference_factory(tiny), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_load_unload_reload_racing_requests(tiny, reference_factory):
    """The same on CUDA (float32; pinned host images copied into slots asynchronously
    while steps run, asynchronous scheduling)."""
    _race(tiny, reference_factory(tiny), "cuda")


def _race(tiny, ref, device: str) -> None:
    engine = LLMEngine(make_pipeline(tiny, load=(), max_batch_size=2, max_slots=2, device=device))
    m = engine.pipeline.manager
    rng = random.Random(7)
    weights = ["A", "B", "C"]
    current: dict[str, str] = {}  # name -> weight set now loaded
    epoch = {"x": 0, "y": 0}  # bumped by each unload of a name
    bound: dict[str, tuple[str | None, str | None, int]] = {}
    pool = prompts(5, seed=64)
    expected_cache: dict[tuple, list[int]] = {}

    def expected(p: int, w: str | None, n: int) -> list[int]:
        key = (p, w, n)
        if key not in expected_cache:
            expected_cache[key] = ref.greedy(pool[p], w, n)
        return expected_cache[key]

    requests: dict[str, tuple[int, int]] = {}
    for i in range(300):
        op = rng.random()
        name = rng.choice(["x", "y"])
        if op < 0.06:
            w = rng.choice(weights)
            m.load_adapter(str(tiny.adapters[w]), name=name)
            current[name] = w
        elif op < 0.10 and name in current:
            m.unload_adapter(name)
            del current[name]
            epoch[name] += 1
        else:
            rid = f"q{i}"
            adapter = rng.choice([None, "x", "y", "x", "y"])
            p, n = rng.randrange(len(pool)), rng.choice([1, 2, 4])
            engine.add_request(Request(rid, pool[p], adapter, SamplingParams(max_new_tokens=n)))
            w = current.get(adapter) if adapter is not None else None
            bound[rid] = (adapter, w, epoch.get(adapter, 0))
            requests[rid] = (p, n)
        if rng.random() < 0.5:
            engine.step()
    _drain(engine)
    served = refused_unloaded = refused_unknown = 0
    for rid, (adapter, w, at_epoch) in bound.items():
        out = engine.finished.pop(rid)
        p, n = requests[rid]
        if adapter is not None and w is None:
            assert out.error.startswith(f"unknown adapter {adapter!r}"), out.error
            refused_unknown += 1
        elif out.error is not None:
            assert out.error == f"adapter {adapter!r} was unloaded", out.error
            assert epoch[adapter] > at_epoch, f"{rid} refused but its version was never unloaded"
            refused_unloaded += 1
        else:
            assert out.token_ids == expected(p, w, n)[: len(out.token_ids)], rid
            assert out.finish_reason == "stop" or len(out.token_ids) == n, rid
            served += 1
    assert served > 150 and refused_unloaded > 5 and refused_unknown > 5
    assert not m.registry.held_keys()
    assert sorted(e.name for e in m.registry.entries()) == sorted(current) == sorted(m.loras)
