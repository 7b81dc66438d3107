"""Sampling, stopping, request validation and dtypes of the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pipeline, prompts

from lora_graph.engine import LLMEngine, Request, SamplingParams, sample


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny, reference_factory):
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny)
    ids = prompts(1, seed=41)[0]
    hot = SamplingParams(max_new_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    runs = [LLMEngine(pipe).generate([Request("x", ids, "A", hot)])[0].token_ids for _ in range(2)]
    other = (
        LLMEngine(pipe)
        .generate([Request("x", ids, "A", SamplingParams(**{**hot.__dict__, "seed": 8}))])[0]
        .token_ids
    )
    assert runs[0] == runs[1]
    assert other != runs[0]
    top1 = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=1, seed=3, ignore_eos=True)
    out = LLMEngine(pipe).generate([Request("x", ids, "A", top1)])[0].token_ids
    assert out == ref.greedy(ids, "A", 12)


def test_seeds_differing_in_their_high_bits_draw_differently(tiny):
    """The CPU generator keeps 32 bits of a seed: 5, 5 + 2**32 and 2**63 + 5 drew the same
    tokens; every seed in [0, 2**64) now seeds its own stream (below 2**32 as before)."""
    pipe = make_pipeline(tiny)
    ids = prompts(1, seed=44)[0]

    def draw(seed: int) -> list[int]:
        s = SamplingParams(max_new_tokens=12, temperature=1.5, seed=seed, ignore_eos=True)
        return LLMEngine(pipe).generate([Request("x", ids, "A", s)])[0].token_ids

    runs = [draw(s) for s in (5, 5 + 2**32, 2**63 + 5, 2**64 - 1)]
    assert len({tuple(r) for r in runs}) == 4
    assert draw(5 + 2**32) == runs[1]  # still reproducible


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.75), g) for _ in range(200)}
    assert draws == {0, 1}
    draws = {sample(logits, SamplingParams(temperature=1.0, top_k=3), g) for _ in range(300)}
    assert draws == {0, 1, 2}
    off = SamplingParams(temperature=1.0, top_k=-1)  # vLLM's "every token" (was refused)
    off.validate()
    assert {sample(logits, off, g) for _ in range(300)} == {0, 1, 2, 3}


def test_stop_tokens_and_eos_end_a_request(tiny, reference_factory):
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny)
    ids = prompts(1, seed=42)[0]
    expected = ref.greedy(ids, "B", 10)
    stop = expected[4]
    first = expected.index(stop)
    out = LLMEngine(pipe).generate(
        [Request("s", ids, "B", SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))]
    )[0]
    assert out.token_ids == expected[: first + 1] and out.finish_reason == "stop"
    out = LLMEngine(pipe, eos_token_ids=(stop,)).generate(
        [Request("e", ids, "B", SamplingParams(max_new_tokens=10))]
    )[0]
    assert out.token_ids == expected[: first + 1]
    out = LLMEngine(pipe, eos_token_ids=(stop,)).generate(
        [Request("i", ids, "B", SamplingParams(max_new_tokens=10, ignore_eos=True))]
    )[0]
    assert out.token_ids == expected and out.finish_reason == "length"


def test_bad_requests_get_errors_and_the_rest_are_served(tiny, reference_factory):
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_seq_len=32)
    good = prompts(2, seed=43)
    requests = [
        Request("ok0", good[0], "A", SamplingParams(max_new_tokens=5, ignore_eos=True)),
        Request("unknown", good[0], "Z"),
        Request("empty", [], None),
        Request("vocab", [1, 999], None),
        Request("long", list(range(3, 40)), None),
        Request("zero", good[0], None, SamplingParams(max_new_tokens=0)),
        Request("top_p", good[0], None, SamplingParams(temperature=1.0, top_p=0.0)),
        Request("ok1", good[1], None, SamplingParams(max_new_tokens=5, ignore_eos=True)),
    ]
    out = {o.id: o for o in LLMEngine(pipe).generate(requests)}
    assert "unknown adapter 'Z'" in out["unknown"].error
    assert "empty" in out["empty"].error
    assert "[0, 128)" in out["vocab"].error
    assert "max_seq_len" in out["long"].error
    assert "max_new_tokens" in out["zero"].error
    assert "top_p" in out["top_p"].error
    assert out["ok0"].token_ids == ref.greedy(good[0], "A", 5)
    assert out["ok1"].token_ids == ref.greedy(good[1], None, 5)


def test_generation_stops_at_max_seq_len(tiny):
    pipe = make_pipeline(tiny, max_seq_len=16)
    out = LLMEngine(pipe).generate(
        [Request("x", list(range(3, 13)), "A", SamplingParams(max_new_tokens=50, ignore_eos=True))]
    )[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_error_is_peft_own(tiny, reference_factory, dtype):
    """In half precision each row is as close to float32 peft as transformers + peft is in
    the same precision. PEFT keeps adapter weights in float32 under a half-precision base
    (``autocast_adapter_dtype=True``); the engine's slots hold the model dtype unless
    ``LoRAConfig.dtype`` says otherwise. Each is compared with peft configured alike."""
    from conftest import PeftReference
    from test_parity import MIX, run_prefill

    truth = reference_factory(tiny)
    batch = prompts(len(MIX), seed=44)
    for slot_dtype, autocast in ((None, False), (torch.float32, True)):
        peft = PeftReference(tiny, dtype=dtype, autocast_adapter_dtype=autocast)
        got = run_prefill(make_pipeline(tiny, dtype=dtype, slot_dtype=slot_dtype), batch, MIX)
        for ids, adapter, g in zip(batch, MIX, got, strict=True):
            want = truth.logits(ids, adapter)
            err = float((g.float() - want).norm() / want.norm())
            err_peft = float((peft.logits(ids, adapter) - want).norm() / want.norm())
            assert err <= 1.3 * err_peft + 1e-3, (dtype, slot_dtype, adapter, err, err_peft)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_that_raises_changes_nothing(tiny, reference_factory, async_scheduling):
    """A step whose execution raises (a transient device error, an interrupt) propagates
    the error and changes nothing: the step before it is still read back, and stepping on
    serves every request as if it had not happened; after ``generate`` the engine is idle
    (a request that ended on a stop token read a step late leaves no unfinished work)."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny)
    ids = prompts(2, seed=48)
    want = [ref.greedy(ids[0], "A", 8), ref.greedy(ids[1], None, 8)]
    execute, calls = pipe.execute, [0]

    def flaky(inputs):
        calls[0] += 1
        if calls[0] in (4, 5):
            raise RuntimeError("transient")
        return execute(inputs)

    pipe.execute = flaky
    engine = LLMEngine(pipe, async_scheduling=async_scheduling)
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.add_request(Request("a", ids[0], "A", sampling))
    engine.add_request(Request("b", ids[1], None, sampling))
    errors = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except RuntimeError:
            errors += 1
    assert errors == 2
    assert [engine.finished[i].token_ids for i in "ab"] == want
    assert pipe.pages.num_free == pipe.pages.capacity
    stop = want[0][3]
    stopping = SamplingParams(max_new_tokens=8, stop_token_ids=(stop,))
    out = engine.generate([Request("s", ids[0], "A", stopping)])
    assert out[0].token_ids == want[0][: want[0].index(stop) + 1]
    assert not engine.has_unfinished()


def test_abort_frees_the_row_and_the_rest_run_on(tiny, reference_factory):
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=2, max_slots=1)
    engine = LLMEngine(pipe)
    ids = prompts(3, seed=45)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for i, adapter in enumerate(["A", "A", "B"]):
        engine.add_request(Request(str(i), ids[i], adapter, sampling))
    streamed = [t for _ in range(3) for i, t in engine.step() if i == "0"]
    assert streamed  # (with asynchronous scheduling, a step's tokens come a call later)
    assert engine.abort_request("0") and not engine.abort_request("0")
    while engine.has_unfinished():
        engine.step()
    # the aborted output is what was streamed, a prefix of its greedy output
    assert engine.finished["0"].error == "aborted"
    assert engine.finished["0"].token_ids == streamed == ref.greedy(ids[0], "A", len(streamed))
    assert engine.finished["1"].token_ids == ref.greedy(ids[1], "A", 6)
    assert engine.finished["2"].token_ids == ref.greedy(
        ids[2], "B", 6
    )  # B took the one slot after A's requests


def test_requests_needing_no_slot_are_not_held_back_by_one_that_waits_for_a_slot(
    tiny, reference_factory
):
    """One slot: A runs, B waits for the slot; base requests and another A request queued
    behind B are admitted at once, a C request behind B waits for B (no overtaking for
    slots); every output matches peft."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_slots=1, max_batch_size=8)
    engine = LLMEngine(pipe)
    batch = prompts(6, seed=81)
    adapters = ["A", "B", None, "A", "C", None]
    lengths = [12, 4, 4, 4, 4, 4]
    reqs = [
        Request(str(i), ids, a, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (ids, a, n) in enumerate(zip(batch, adapters, lengths, strict=True))
    ]
    for r in reqs:
        engine.add_request(r)
    engine.step()  # admits and prefills
    running = {s.request.id for s in engine.running}
    assert running == {"0", "2", "3", "5"}  # B and C wait; the base and A requests do not
    assert [s.request.id for s in engine.waiting] == ["1", "4"]
    while engine.has_unfinished():
        engine.step()
    for r in reqs:
        out = engine.finished.pop(r.id)
        assert out.token_ids == ref.greedy(r.prompt_token_ids, r.adapter, len(out.token_ids)), r.id
        assert len(out.token_ids) == r.sampling.max_new_tokens


def test_steps_hand_out_their_new_tokens_with_times(tiny):
    """Each step returns the tokens it produced (what a server streams), in order, and a
    finished request carries its arrival and per-token times."""
    pipe = make_pipeline(tiny, max_batch_size=4)
    engine = LLMEngine(pipe)
    reqs = [
        Request(str(i), ids, a, SamplingParams(max_new_tokens=3 + i, ignore_eos=True))
        for i, (ids, a) in enumerate(zip(prompts(3, seed=82), ["A", None, "B"], strict=True))
    ]
    for r in reqs:
        engine.add_request(r)
    streamed: dict[str, list[int]] = {r.id: [] for r in reqs}
    while engine.has_unfinished():
        for rid, token in engine.step():
            streamed[rid].append(token)
    for r in reqs:
        out = engine.finished.pop(r.id)
        assert streamed[r.id] == out.token_ids and len(out.token_ids) == 3 + int(r.id)
        assert len(out.token_times) == len(out.token_ids) and out.ttft >= 0
        assert out.token_times == sorted(out.token_times)


def test_a_request_waiting_for_a_slot_is_not_starved_by_steady_traffic(tiny, reference_factory):
    """One slot: A runs, B waits for the slot, and a new A request arrives every step. A
    requests may go ahead of B at most max_batch_size times; then B gets the slot once
    the running A requests drain, and every output matches peft."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_slots=1, max_batch_size=4)
    engine = LLMEngine(pipe)
    batch = prompts(40, seed=83)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.add_request(Request("a0", batch[0], "A", sampling))
    engine.add_request(Request("b0", batch[1], "B", sampling))
    steps = 0
    while "b0" not in engine.finished:
        if steps < 38:
            engine.add_request(Request(f"a{steps + 1}", batch[steps + 2], "A", sampling))
        engine.step()
        steps += 1
        assert steps < 60, "the B request was starved"
    assert engine.finished["b0"].token_ids == ref.greedy(batch[1], "B", 6)
    while engine.has_unfinished():
        engine.step()
    a_done = [rid for rid in engine.finished if rid.startswith("a")]
    assert len(a_done) == min(steps, 38) + 1
    for rid in a_done[:5]:
        i = int(rid[1:])
        want = ref.greedy(batch[0 if i == 0 else i + 1], "A", 6)
        assert engine.finished[rid].token_ids == want, rid


def test_ids_in_flight_or_uncollected_are_refused(tiny):
    """An id that is waiting, running or finished but not collected cannot be added again
    (the outputs would overwrite each other); generate serves its own requests and leaves
    others in flight running, their outputs in ``finished``."""
    engine = LLMEngine(make_pipeline(tiny))
    ids = prompts(2, seed=84)
    engine.add_request(Request("x", ids[0], "A", SamplingParams(max_new_tokens=20)))
    with pytest.raises(ValueError, match="'x' is in flight"):
        engine.add_request(Request("x", ids[1], None))
    with pytest.raises(ValueError, match="'x' is in flight or not collected"):
        engine.generate([Request("x", ids[1], None, SamplingParams(max_new_tokens=2))])
    out = engine.generate([Request("y", ids[1], None, SamplingParams(max_new_tokens=2))])
    assert out[0].id == "y" and len(out[0].token_ids) == 2
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="'x' is finished but not collected"):
        engine.add_request(Request("x", ids[1], None))
    assert len(engine.finished.pop("x").token_ids) == 20
    engine.add_request(Request("x", ids[1], None, SamplingParams(max_new_tokens=1)))


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny):
    engine = LLMEngine(make_pipeline(tiny))
    engine.add_request(Request("s", [5, 6], None, SamplingParams(stop_token_ids=(-5,))))
    assert "stop_token_ids must be in [0, 128), got -5" in engine.finished["s"].error


def test_admission_scans_a_bounded_part_of_a_blocked_queue(tiny):
    """With the one slot taken, a queue of 300 requests for other adapters is not walked
    in full every step: the scan stops after 4 x max_batch_size waiting requests."""
    pipe = make_pipeline(tiny, max_slots=1, max_batch_size=4)
    engine = LLMEngine(pipe)
    ids = prompts(1, seed=85)[0]
    engine.add_request(Request("a", ids, "A", SamplingParams(max_new_tokens=8)))
    engine.step()
    for i in range(300):
        engine.add_request(Request(f"w{i}", ids, "BC"[i % 2], SamplingParams(max_new_tokens=1)))
    scanned = 0
    pages_for = engine.pages.pages_for

    def counting(tokens):
        nonlocal scanned
        scanned += 1
        return pages_for(tokens)

    engine.pages.pages_for = counting
    engine.step()
    assert scanned <= 4 * 4 + 2
    assert [s.request.id for s in engine.waiting][:3] == ["w0", "w1", "w2"]  # order kept
