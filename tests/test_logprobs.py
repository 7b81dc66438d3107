"""Log-probabilities of generated and prompt tokens (``SamplingParams.logprobs`` /
``prompt_logprobs``) against ``log_softmax`` of transformers + peft's logits for the same
adapter, at every position, in mixed batches with chunked prefill, asynchronous scheduling
and preemption; the rows that ask nothing are served as without them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pipeline, prompts

from lora_graph.engine import LLMEngine, Request, SamplingParams

ATOL = 1e-4


def check_token(got, logits_row: torch.Tensor, token: int, k: int) -> None:
    """``got`` (a TokenLogprob) against the reference's float32 logits at its position."""
    lp = torch.log_softmax(logits_row.float(), -1)
    assert got.token == token
    assert abs(got.logprob - float(lp[token])) <= ATOL, (got.logprob, float(lp[token]))
    # (tokens within the tolerance of it may rank either side)
    assert (
        1 + int((lp > lp[token] + ATOL).sum()) <= got.rank <= 1 + int((lp > lp[token] - ATOL).sum())
    )
    top = lp.topk(k)
    assert [t for t, _ in got.top] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in got.top]), top.values,
                               rtol=0, atol=ATOL)  # fmt: skip


def check_output(ref, req: Request, out) -> None:
    s = req.sampling
    ids = list(req.prompt_token_ids)
    logits = ref.logits(ids + out.token_ids, req.adapter)  # [prompt + generated, vocab]
    if s.logprobs is not None:
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            check_token(got, logits[len(ids) - 1 + i], token, s.logprobs)
    else:
        assert out.logprobs is None
    if s.prompt_logprobs is not None:
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for p in range(1, len(ids)):
            check_token(out.prompt_logprobs[p], logits[p - 1], ids[p], s.prompt_logprobs)
    else:
        assert out.prompt_logprobs is None


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_logprobs_equal_peft_in_a_mixed_chunked_batch(tiny, reference_factory, async_scheduling):
    """Base rows and four adapters (one adapting the embedding and the LM head), greedy and
    sampled rows, with and without logprobs, prompts prefilled in chunks of up to 8 tokens
    of a step; the rows that ask nothing get the tokens they get alone."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=8, max_num_batched_tokens=8)
    batch = prompts(8, seed=501, min_len=5, max_len=14)
    adapters = ["A", None, "B", "D", "C", None, "D", "A"]
    asks = [(5, 3), (0, None), (None, 2), (20, 0), (None, None), (2, 2), (None, None), (3, None)]
    reqs = []
    for i, (ids, adapter, (k, pk)) in enumerate(zip(batch, adapters, asks, strict=True)):
        hot = i == 7  # sampled at a temperature: its logprobs come from the host
        s = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=k, prompt_logprobs=pk,
                           temperature=0.8 if hot else 0.0, seed=5)  # fmt: skip
        reqs.append(Request(f"r{i}", ids, adapter, s))
    engine = LLMEngine(pipe, async_scheduling=async_scheduling)
    outs = engine.generate(reqs)
    for req, out in zip(reqs, outs, strict=True):
        assert out.error is None, out.error
        if req.sampling.temperature == 0:
            assert out.token_ids == ref.greedy(req.prompt_token_ids, req.adapter, 6), req.id
        check_output(ref, req, out)
    none = {"logprobs": None, "prompt_logprobs": None}
    plain = [
        Request(
            r.id + "p",
            r.prompt_token_ids,
            r.adapter,
            SamplingParams(**{**r.sampling.__dict__, **none}),
        )
        for r in reqs
    ]
    alone = LLMEngine(pipe, async_scheduling=async_scheduling).generate(plain)
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs]
    assert pipe.pages.num_free == pipe.pages.capacity


def test_prompt_logprobs_survive_preemption(tiny, reference_factory):
    """A pool too small for the batch: requests are preempted and their prompts computed
    again; their prompt and token logprobs still equal peft's."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=4, max_seq_len=40, kv_cache_tokens=48, page_size=4)
    batch = prompts(4, seed=502, min_len=8, max_len=14)
    reqs = [
        Request(
            f"p{i}",
            ids,
            adapter,
            SamplingParams(16, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        )  # fmt: skip
        for i, (ids, adapter) in enumerate(zip(batch, ["A", "B", None, "D"], strict=True))
    ]
    engine = LLMEngine(pipe)
    outs = engine.generate(reqs)
    assert engine.preemptions > 0
    for req, out in zip(reqs, outs, strict=True):
        assert out.token_ids == ref.greedy(req.prompt_token_ids, req.adapter, 16)
        check_output(ref, req, out)


def test_logprobs_out_of_range_are_refused(tiny):
    pipe = make_pipeline(tiny)
    for field, value in (("logprobs", 21), ("prompt_logprobs", -1), ("logprobs", 1.5)):
        out = LLMEngine(pipe).generate(
            [Request("x", [5, 6], None, SamplingParams(4, **{field: value}))]
        )[0]
        assert f"{field} must be an integer in [0, 20] or null" in out.error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graphs_logprobs_and_penalties(tiny, reference_factory):
    """On CUDA with captured graphs and asynchronous scheduling: logprobs and prompt
    logprobs equal peft's (float32), and rows with penalties get the CPU engine's tokens
    (which equal transformers' generate: test_penalties.py)."""
    ref = reference_factory(tiny)
    kw = dict(max_batch_size=8, max_num_batched_tokens=16)
    gpu = make_pipeline(tiny, device="cuda", **kw)
    gpu.enable_compile("cudagraph", token_buckets=(8, 16), progress=False)
    cpu = make_pipeline(tiny, **kw)
    batch = prompts(8, seed=503, min_len=5, max_len=14)
    adapters = ["A", None, "B", "D", "C", None, "D", "A"]
    controls = [{}, dict(repetition_penalty=1.5), {}, dict(frequency_penalty=1.0),
                dict(logit_bias=((5, 20.0),)), {}, dict(presence_penalty=1.5), {}]  # fmt: skip
    reqs = [
        Request(
            f"g{i}",
            ids,
            a,
            SamplingParams(
                8, ignore_eos=True, logprobs=3, prompt_logprobs=2 if i % 2 else None, **c
            ),
        )  # fmt: skip
        for i, (ids, a, c) in enumerate(zip(batch, adapters, controls, strict=True))
    ]
    outs = LLMEngine(gpu).generate(reqs)
    want = LLMEngine(cpu).generate([Request(r.id, r.prompt_token_ids, r.adapter, r.sampling)
                                    for r in reqs])  # fmt: skip
    assert gpu.graphs is not None and sum(g.replays for g in gpu.graphs.graphs.values()) > 0
    for req, out, w in zip(reqs, outs, want, strict=True):
        assert out.error is None, out.error
        assert out.token_ids == w.token_ids, req.id
        if not req.sampling.processes_logits:
            check_output(ref, req, out)
