"""Mixed batches against per-request transformers + peft (invariants 1, 2 and 7)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pipeline, prompts, run_prefill
from torch.utils._python_dispatch import TorchDispatchMode

from lora_graph.engine import LLMEngine, Request, SamplingParams

MIX = ["A", None, "B", "A", None, "C", "D"]


@pytest.mark.parametrize("kind", ["gqa", "tied", "qwen2", "qwen2_window", "llama3"])
def test_mixed_batch_logits_match_peft(kind, tiny_factory, reference_factory):
    t = tiny_factory(kind)
    ref = reference_factory(t)
    pipe = make_pipeline(t)
    batch = prompts(len(MIX), seed=1)
    got = run_prefill(pipe, batch, MIX)
    for ids, adapter, logits in zip(batch, MIX, got, strict=True):
        expected = ref.logits(ids, adapter)
        torch.testing.assert_close(
            logits, expected, rtol=1e-4, atol=1e-4, msg=f"{kind} adapter={adapter}"
        )
    # the adapters really change the output: a missing delta would not pass the above
    base0 = ref.logits(batch[0], None)
    assert (got[0] - base0).abs().max() > 0.1


def test_base_rows_equal_base_model_exactly(tiny):
    pipe = make_pipeline(tiny)
    batch = prompts(len(MIX), seed=2)
    mixed = run_prefill(pipe, batch, MIX)
    alone = run_prefill(pipe, batch, [None] * len(MIX))
    for i, adapter in enumerate(MIX):
        if adapter is None:
            assert torch.equal(mixed[i], alone[i])
        else:
            assert not torch.allclose(mixed[i], alone[i])


def test_batch_order_changes_no_row(tiny):
    pipe = make_pipeline(tiny)
    batch = prompts(len(MIX), seed=3)
    first = run_prefill(pipe, batch, MIX)
    perm = [4, 6, 2, 0, 5, 1, 3]
    second = run_prefill(pipe, [batch[i] for i in perm], [MIX[i] for i in perm])
    for j, i in enumerate(perm):
        torch.testing.assert_close(second[j], first[i], rtol=1e-5, atol=1e-5)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_base_only_batch_calls_no_lora_op(tiny):
    pipe = make_pipeline(tiny)
    batch = prompts(3, seed=4)
    with OpCounter() as base_only:
        run_prefill(pipe, batch, [None, None, None])
    with OpCounter() as mixed:
        run_prefill(pipe, batch, ["A", None, None])
    assert not any("lora_graph.lora_" in n for n in base_only.names)
    assert any("lora_graph.paged_attention" in n for n in base_only.names)
    assert (
        sum("lora_graph.lora_shrink" in n for n in mixed.names) == 4 * 2 + 1
    )  # 4 targets x 2 layers, LM head
    assert sum("lora_graph.lora_embedding_shrink" in n for n in mixed.names) == 1


@pytest.mark.parametrize("kind", ["gqa", "qwen2", "qwen2_window"])
def test_greedy_generation_matches_peft(kind, tiny_factory, reference_factory):
    t = tiny_factory(kind)
    ref = reference_factory(t)
    pipe = make_pipeline(t)
    engine = LLMEngine(pipe)
    batch = prompts(len(MIX), seed=5)
    sampling = SamplingParams(max_new_tokens=16, ignore_eos=True)
    requests = [
        Request(str(i), ids, a, sampling) for i, (ids, a) in enumerate(zip(batch, MIX, strict=True))
    ]
    outputs = engine.generate(requests)
    for req, out in zip(requests, outputs, strict=True):
        assert out.error is None
        assert out.token_ids == ref.greedy(req.prompt_token_ids, req.adapter, 16), (
            f"{kind} adapter={req.adapter}"
        )
    # the same engine again, each prompt extended to 18 tokens by its own output: its first
    # 16-token page is now served from the prefix cache, computed under its own adapter
    again = [
        Request(f"again{r.id}", [*r.prompt_token_ids, *o.token_ids][:18], r.adapter,
                SamplingParams(max_new_tokens=8, ignore_eos=True))
        for r, o in zip(requests, outputs, strict=True)
    ]  # fmt: skip
    for req, out in zip(again, engine.generate(again), strict=True):
        assert out.cached_tokens == 16, req.id
        assert out.token_ids == ref.greedy(req.prompt_token_ids, req.adapter, 8), (
            f"{kind} adapter={req.adapter}, from the prefix cache"
        )


def test_requests_joining_mid_decode_match_peft(tiny, reference_factory):
    """Continuous batching: requests join while others decode, in KV rows freed by others."""
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_batch_size=3)
    engine = LLMEngine(pipe)
    batch = prompts(6, seed=6)
    lengths = [4, 12, 6, 9, 3, 10]
    adapters = ["B", None, "A", "C", "A", None]
    requests = [
        Request(str(i), ids, a, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (ids, a, n) in enumerate(zip(batch, adapters, lengths, strict=True))
    ]
    outputs = engine.generate(requests)
    assert engine.steps["prefill"] > 1
    for req, out in zip(requests, outputs, strict=True):
        assert out.token_ids == ref.greedy(
            req.prompt_token_ids, req.adapter, req.sampling.max_new_tokens
        )


def test_fewer_slots_than_adapters_serves_everyone(tiny, reference_factory):
    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, max_slots=1)
    engine = LLMEngine(pipe)
    batch = prompts(6, seed=7)
    adapters = ["A", "B", "C", None, "B", "A"]
    requests = [
        Request(str(i), ids, a, SamplingParams(max_new_tokens=8, ignore_eos=True))
        for i, (ids, a) in enumerate(zip(batch, adapters, strict=True))
    ]
    outputs = engine.generate(requests)
    for req, out in zip(requests, outputs, strict=True):
        assert out.token_ids == ref.greedy(req.prompt_token_ids, req.adapter, 8)
    # A, B and C took turns in the one slot; the second A and B requests joined their
    # adapter's batch (requests needing no new slot are not held back)
    assert pipe.manager.slot_loads == 3


def test_steady_state_decode_copies_no_adapter_weights(tiny):
    pipe = make_pipeline(tiny)
    engine = LLMEngine(pipe)
    for i, (ids, a) in enumerate(zip(prompts(4, seed=8), ["A", "B", None, "C"], strict=True)):
        engine.add_request(
            Request(str(i), ids, a, SamplingParams(max_new_tokens=10, ignore_eos=True))
        )
    engine.step()  # prefill: the adapters are copied into slots once
    loads = pipe.manager.slot_loads
    pool_ptr = pipe.manager.pool.data_ptr()
    while engine.has_unfinished():
        engine.step()
    assert pipe.manager.slot_loads == loads == 3
    assert pipe.manager.pool.data_ptr() == pool_ptr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_mixed_batch_matches_peft(tiny, reference_factory, backend, dtype):
    """On CUDA, each backend and dtype: the interleaved batch against float32 peft. In half
    precision the error is transformers + peft's own in the same precision on the same GPU,
    peft configured as the engine: adapter weights in the model dtype
    (``autocast_adapter_dtype=False``), or in float32 (PEFT's default) against float32 slots."""
    from conftest import PeftReference

    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline

    ref = reference_factory(tiny)
    configs = [(None, True)] if dtype == torch.float32 else [(None, False), (torch.float32, True)]
    batch = prompts(len(MIX), seed=9)
    for slot_dtype, autocast in configs:
        same_dtype = PeftReference(
            tiny, dtype=dtype, device="cuda", autocast_adapter_dtype=autocast
        )
        pipe = LlamaPipeline(
            str(tiny.base),
            dtype=dtype,
            device="cuda",
            max_batch_size=8,
            max_seq_len=64,
            lora=LoRAConfig(max_slots=4, max_rank=16, backend=backend, dtype=slot_dtype),
        )
        for name, path in tiny.adapters.items():
            pipe.manager.load_adapter(str(path), name=name)
        for ids, adapter, logits in zip(batch, MIX, run_prefill(pipe, batch, MIX), strict=True):
            expected = ref.logits(ids, adapter)
            err = float((logits.float().cpu() - expected).norm() / expected.norm())
            assert torch.isfinite(logits).all()
            if dtype == torch.float32:
                assert err < 2e-3, (backend, adapter, err)
                continue
            err_peft = float((same_dtype.logits(ids, adapter) - expected).norm() / expected.norm())
            assert err <= 1.5 * err_peft + 2e-3, (backend, slot_dtype, adapter, err, err_peft)
