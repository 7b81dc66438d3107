"""Architectures beyond Llama 2/3, Mistral and Qwen2 (issue #14): Qwen3, Phi-3 and Gemma 2,
each a tiny random checkpoint made with ``transformers`` and adapters made with ``peft``
(``conftest.py``), against per-request ``transformers`` + ``peft``:

- a mixed, interleaved prefill batch (base rows and four adapters) matches every token's
  logits;
- greedy generation of 16 tokens matches, with prompts longer than the step's token budget
  (chunked prefill beside other requests' decodes) over pages of 4 tokens;
- the compiled step (inductor on the CPU, one token bucket) gives the eager engine's tokens
  without a recompile, with one layer graph per kind of layer (with LoRA and base-only).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_pipeline, prompts, run_prefill

from lora_graph.engine import LLMEngine, Request, SamplingParams

KINDS = ["qwen3", "phi3", "gemma2"]
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", [*KINDS, "tied", "qwen2_window", "llama3"])
def test_gpu_mixed_batch_matches_peft(kind, tiny_factory, reference_factory):
    """On CUDA (the Triton kernels, float32): the interleaved batch against peft's logits,
    for the new architectures and the Llama variants no other GPU test covers (tied
    embeddings, per-layer windows, Llama-3 RoPE). Passed on the H200 (2026-12-02)."""
    t = tiny_factory(kind)
    ref = reference_factory(t)
    pipe = make_pipeline(t, device="cuda")
    batch = prompts(len(MIX), seed=47)
    for ids, adapter, logits in zip(batch, MIX, run_prefill(pipe, batch, MIX), strict=True):
        expected = ref.logits(ids, adapter)
        err = float((logits.float().cpu() - expected).norm() / expected.norm())
        assert err < 2e-3, (kind, adapter, err)


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
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.enable_compile("inductor", token_buckets=(16,), progress=False)
    # a layer graph per kind of layer (its window), with LoRA and base-only: Gemma 2's
    # alternating sliding and full layers make four, the others two
    kinds = {layer.self_attn.window for layer in compiled.model.layers}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2 * len(kinds)
    assert len(kinds) == (2 if kind == "gemma2" else 1)
    batch = prompts(4, seed=43) + prompts(1, seed=44, min_len=20, max_len=24)
    reqs = _requests(batch, ["A", None, "B", "D", "C"], 6)
    got = LLMEngine(compiled).generate(reqs)
    want = LLMEngine(make_pipeline(t, **kw)).generate(reqs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert compiled.graphs.recompiles == 0


@pytest.mark.parametrize("modules", [["k_proj", "v_proj"], ["v_proj"], ["up_proj"]])
def test_partial_adapters_land_on_their_slices(modules, tiny, tmp_path):
    """An adapter on some slices of a fused target (only k and v; only v; only up) lands at
    those slices' offsets with the rest of the target zero: logits equal peft's."""
    from conftest import make_peft_adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = make_peft_adapter(
        tiny.base, tmp_path / "partial", seed=7, factor=20.0, r=8, lora_alpha=16,
        target_modules=modules,
    )  # fmt: skip
    pipe = make_pipeline(tiny, load=())
    pipe.manager.load_adapter(str(path), name="P")
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny.base), path).eval()
    batch = prompts(3, seed=45)
    got = run_prefill(pipe, batch, ["P", None, "P"])
    with torch.no_grad():
        want = [ref(torch.tensor([ids])).logits[0] for ids in (batch[0], batch[2])]
        with ref.disable_adapter():
            base = ref(torch.tensor([batch[1]])).logits[0]
            base0 = ref(torch.tensor([batch[0]])).logits[0]
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], base, rtol=1e-4, atol=1e-4)
    assert (want[0] - base0).abs().max() > 0.05  # the adapter changes the output


def test_packed_module_of_the_wrong_size_is_refused(tiny_factory, tmp_path):
    """A packed ``qkv_proj`` whose B does not hold exactly q, k and v's rows is refused,
    naming the module; the pipeline serves on."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lora_graph import AdapterError

    t = tiny_factory("phi3")
    bad = tmp_path / "bad"
    shutil.copytree(t.adapters["B"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.1.self_attn.qkv_proj.lora_B" in k)
    tensors[key] = tensors[key][:-4].contiguous()  # v's last rows missing
    save_file(tensors, bad / "adapter_model.safetensors")
    pipe = make_pipeline(t, load=("A",))
    with pytest.raises(AdapterError, match=r"layers\.1\.self_attn\.qkv_proj .*does not fit"):
        pipe.manager.load_adapter(str(bad), name="bad")
    batch = prompts(2, seed=46)
    assert all(x.isfinite().all() for x in run_prefill(pipe, batch, ["A", None]))


def test_unverified_architecture_refused_on_cuda(tiny_factory, monkeypatch):
    """An architecture whose CUDA parity test has not passed (``verified_on_cuda = False``)
    is refused on a CUDA device at start-up, naming the cause (checked without a GPU: the
    refusal comes before anything is read or allocated)."""
    from lora_graph.architectures import Gemma2Pipeline

    monkeypatch.setattr(Gemma2Pipeline, "verified_on_cuda", False)
    with pytest.raises(ValueError, match="Gemma2Pipeline is not verified on CUDA yet"):
        make_pipeline(tiny_factory("gemma2"), device="cuda")


def test_variants_not_implemented_are_refused_at_start_up():
    """Phi-3's long-context RoPE (longrope), another MLP activation, or a partial rotary
    factor giving an odd rotary width: refused with the cause, before any weight is read."""
    from transformers import LlamaConfig as HFLlama
    from transformers import Phi3Config

    from lora_graph.models.llama import LlamaConfig

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    longrope = Phi3Config(
        **small, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8),
    )  # fmt: skip
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        LlamaConfig.from_hf(longrope)
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        LlamaConfig.from_hf(HFLlama(**small, hidden_act="gelu"))
    with pytest.raises(ValueError, match="unsupported partial_rotary_factor"):
        LlamaConfig.from_hf(Phi3Config(**small, partial_rotary_factor=0.1))
    assert LlamaConfig.from_hf(Phi3Config(**small, partial_rotary_factor=0.5)).rotary_dim == 8


def test_a_model_without_tokenizer_files_is_said_so(tiny_factory, capsys):
    """transformers 5 builds an empty tokenizer for a directory without tokenizer files; the
    command says the model has none instead of generating from nothing."""
    from lora_graph.cli import main

    t = tiny_factory("qwen3")
    assert main(["generate", "--model", str(t.base), "--prompt", "hello", "--device", "cpu"]) == 2
    assert "the model has no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_residual_add_is_the_plain_add_bit_for_bit(dtype):
    """The decoder's residual add, written as a float32 add so torch.compile keeps it out of
    addmm, equals ``x + y`` exactly: magnitudes far apart (rounding), overflow to inf in
    fp16, signed zeros and NaN."""
    from lora_graph.models.blocks import residual_add

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 300).to(dtype)
    y = (torch.randn(4096, generator=g) * torch.logspace(-6, 2, 4096)).to(dtype)
    x[:4] = torch.tensor([65504.0, -0.0, float("nan"), 1.0]).to(dtype)
    y[:4] = torch.tensor([65504.0, -0.0, 1.0, -1.0]).to(dtype)
    got, want = residual_add(x, y), x + y
    assert got.dtype == dtype
    assert torch.equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32),
        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
