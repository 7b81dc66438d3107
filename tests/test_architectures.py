"""Architectures beyond Llama 2/3, Mistral and Qwen2 (issue #14), each a tiny random
checkpoint made with ``transformers`` and adapters made with ``peft`` (``conftest.py``),
against per-request ``transformers`` + ``peft``:

- a mixed, interleaved prefill batch (base rows and four adapters) matches every token's
  logits;
- greedy generation of 16 tokens matches, with prompts longer than the step's token budget
  (chunked prefill beside other requests' decodes) over pages of 4 tokens;
- the compiled step (inductor on the CPU, one token bucket) gives the eager engine's tokens
  without a recompile.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_pipeline, prompts, run_prefill

from lora_graph.engine import LLMEngine, Request, SamplingParams

KINDS = ["qwen3"]
MIX = ["A", None, "B", "D", "A", None, "C"]


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_logits_match_peft(kind, tiny_factory, reference_factory):
    t = tiny_factory(kind)
    ref = reference_factory(t)
    pipe = make_pipeline(t)
    batch = prompts(len(MIX), seed=41)
    got = run_prefill(pipe, batch, MIX)
    for ids, adapter, logits in zip(batch, MIX, got, strict=True):
        torch.testing.assert_close(
            logits, ref.logits(ids, adapter), rtol=1e-4, atol=1e-4, msg=f"{kind} {adapter}"
        )
    # the adapters and the architecture's own parts really change the output
    assert (got[0] - ref.logits(batch[0], None)).abs().max() > 0.1


def _requests(batch, adapters, n):
    sampling = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return [
        Request(str(i), ids, a, sampling)
        for i, (ids, a) in enumerate(zip(batch, adapters, strict=True))
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_chunked_and_paged_matches_peft(kind, tiny_factory, reference_factory):
    t = tiny_factory(kind)
    ref = reference_factory(t)
    pipe = make_pipeline(t, max_batch_size=4, max_num_batched_tokens=12, page_size=4)
    batch = prompts(6, seed=42, min_len=3, max_len=30)
    assert max(len(p) for p in batch) > 12  # some prompts take several steps
    reqs = _requests(batch, ["A", None, "B", "D", "C", "A"], 16)
    engine = LLMEngine(pipe)
    for r, out in zip(reqs, engine.generate(reqs), strict=True):
        assert out.error is None, (r.id, out.error)
        assert out.token_ids == ref.greedy(r.prompt_token_ids, r.adapter, 16), (kind, r.id)
    assert engine.steps["prefill"] > 1
    assert pipe.pages.num_free == pipe.pages.capacity


@pytest.mark.compile
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_engine_equals_eager(kind, tiny_factory):
    t = tiny_factory(kind)
    kw = dict(max_batch_size=4, max_num_batched_tokens=16)
    compiled = make_pipeline(t, **kw)
    compiled.enable_compile("inductor", token_buckets=(16,), progress=False)
    batch = prompts(4, seed=43) + prompts(1, seed=44, min_len=20, max_len=24)
    reqs = _requests(batch, ["A", None, "B", "D", "C"], 6)
    got = LLMEngine(compiled).generate(reqs)
    want = LLMEngine(make_pipeline(t, **kw)).generate(reqs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert compiled.graphs.recompiles == 0
