"""Penalties and logit controls (``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``, ``min_tokens``, ``min_p``) against transformers'
``generate`` with the matching logits processors and peft, token for token, in one mixed
batch where the rows that ask nothing stay bit for bit what they are without them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pipeline, prompts

from lora_graph.engine import LLMEngine, Request, SamplingParams
from lora_graph.sampling import sample

N = 10


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties over the generated tokens, as a
    transformers logits processor (transformers has none of its own)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(ref, ids: list[int], adapter: str | None, eos: int, n: int = N, **kw) -> list[int]:
    """transformers' greedy ``generate`` through peft with the processors ``kw`` names."""
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList()
    if "presence" in kw or "frequency" in kw:
        processors.append(
            OpenAIPenalties(len(ids), kw.pop("presence", 0.0), kw.pop("frequency", 0.0))
        )
    x = torch.tensor([ids])
    args = dict(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
                logits_processor=processors, attention_mask=torch.ones_like(x), **kw)  # fmt: skip
    with torch.no_grad():
        if adapter is None:
            with ref.model.disable_adapter():
                out = ref.model.generate(input_ids=x, **args)
        else:
            ref.model.set_adapter(adapter)
            out = ref.model.generate(input_ids=x, **args)
    return out[0, len(ids) :].tolist()


CASES = [
    # (our SamplingParams fields, transformers' generate arguments)
    (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    (dict(repetition_penalty=0.6), dict(repetition_penalty=0.6)),
    (dict(frequency_penalty=1.5), dict(frequency=1.5)),
    (dict(presence_penalty=2.0), dict(presence=2.0)),
    (dict(presence_penalty=-1.0, frequency_penalty=0.5), dict(presence=-1.0, frequency=0.5)),
    (dict(logit_bias=((7, 30.0), (9, -100.0))), dict(sequence_bias={(7,): 30.0, (9,): -100.0})),
    (dict(min_tokens=6), dict(min_new_tokens=6)),
]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_each_control_equals_transformers_generate(tiny, reference_factory, async_scheduling):
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=16, max_num_batched_tokens=32)
    batch = prompts(len(CASES) + 3, seed=611, min_len=4, max_len=10)
    adapters = ["A", None, "B", "D", "C", "A", None, "B", None, "D"]
    # an EOS the model reaches early (its first greedy token for the first prompt), so
    # min_tokens has something to hold back
    eos = ref.greedy(batch[6], adapters[6], 1)[0]
    reqs, want = [], []
    for i, (ids, adapter) in enumerate(zip(batch, adapters, strict=True)):
        ours, theirs = CASES[i] if i < len(CASES) else ({}, {})
        s = SamplingParams(N, logprobs=2, **ours)
        reqs.append(Request(f"r{i}", ids, adapter, s))
        want.append(hf_generate(ref, ids, adapter, eos, **theirs))
    engine = LLMEngine(pipe, eos_token_ids=(eos,), async_scheduling=async_scheduling)
    outs = engine.generate(reqs)
    for req, out, w in zip(reqs, outs, want, strict=True):
        assert out.error is None, out.error
        assert out.token_ids == w, (req.id, req.sampling)
    # min_tokens held back the EOS its row would have ended on at once: the case bites
    assert len(outs[6].token_ids) >= 6 and eos not in outs[6].token_ids[:6]
    # the same batch without any control: the free rows are bit for bit what they were
    plain = [Request(r.id + "p", r.prompt_token_ids, r.adapter, SamplingParams(N, logprobs=2))
             for r in reqs]  # fmt: skip
    alone = LLMEngine(pipe, eos_token_ids=(eos,), async_scheduling=async_scheduling).generate(plain)
    for i in range(len(CASES), len(reqs)):
        assert outs[i].token_ids == alone[i].token_ids
        assert [e.logprob for e in outs[i].logprobs] == [e.logprob for e in alone[i].logprobs]


def test_controls_survive_preemption(tiny, reference_factory):
    """A pool too small for the batch: requests are preempted and recomputed; their
    penalties still see their whole history (transformers' generate, token for token)."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=4, max_seq_len=40, kv_cache_tokens=48, page_size=4)
    batch = prompts(4, seed=612, min_len=8, max_len=14)
    adapters = ["A", "B", None, "D"]
    eos = 0  # (never chosen here: the prompts' tokens are >= 3)
    reqs, want = [], []
    for i, (ids, adapter) in enumerate(zip(batch, adapters, strict=True)):
        ours, theirs = CASES[i]
        reqs.append(Request(f"p{i}", ids, adapter, SamplingParams(16, **ours)))
        want.append(hf_generate(ref, ids, adapter, eos, 16, **theirs))
    engine = LLMEngine(pipe, eos_token_ids=(eos,))
    outs = engine.generate(reqs)
    assert engine.preemptions > 0
    assert [o.token_ids for o in outs] == want
    assert pipe.pages.num_free == pipe.pages.capacity


def test_min_p_keeps_what_transformers_min_p_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=g) * 3
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7), (0.9, 1.3)):
        scaled = logits[None] / temperature
        keep = MinPLogitsWarper(min_p)(None, scaled)[0] > float("-inf")
        s = SamplingParams(temperature=temperature, min_p=min_p)
        draws = {sample(logits, s, g) for _ in range(600)}
        assert draws <= set(keep.nonzero()[:, 0].tolist())
        assert len(draws) >= min(int(keep.sum()), 2)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be a number in [-2, 2]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
        ("min_p", 1.5, "min_p must be a number in [0, 1]"),
        ("min_tokens", 99, "min_tokens must be an integer in [0, max_new_tokens]"),
        ("logit_bias", ((5, 101.0),), "logit_bias values must be in [-100, 100]"),
        ("logit_bias", ((1000, 1.0),), "logit_bias token ids must be in [0, 128)"),
    ],
)
def test_out_of_range_controls_are_refused_by_name(tiny, field, value, message):
    pipe = make_pipeline(tiny)
    s = SamplingParams(8, **{field: value})
    out = LLMEngine(pipe).generate([Request("x", [5, 6], None, s)])[0]
    assert out.error is not None and message in out.error, out.error
