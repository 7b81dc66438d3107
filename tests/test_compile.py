"""Captured graphs against eager (invariants 6 and 7), and no recompiles.

One small capture per mode (two decode buckets, one prefill length), shared by the
module: inductor on the CPU in CI; CUDA graphs on a GPU (skipped without one).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Row, make_pipeline, prompts

from lora_graph.compile.keys import CaptureKey, LoraBaseOnly, node_capture_key

pytestmark = pytest.mark.compile

MODES = [
    pytest.param(("cpu", "inductor"), id="cpu-inductor"),
    pytest.param(
        ("cuda", "cudagraph"),
        id="cuda-cudagraph",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


@pytest.fixture(scope="module", params=MODES)
def pair(request, tiny):
    device, mode = request.param
    compiled = make_pipeline(tiny, max_batch_size=4, device=device)
    compiled.enable_compile(mode, decode_buckets=(2, 4), prefill_lengths=(16,), progress=False)
    eager = make_pipeline(tiny, max_batch_size=4, device=device)
    return compiled, eager


def test_keys_captured_for_both_buckets_with_and_without_lora(pair):
    compiled, _ = pair
    keys = set(compiled.graphs.graphs)
    own = [CaptureKey("decode", 2), CaptureKey("decode", 4), CaptureKey("prefill", 1, 16)]
    assert keys == {*own, *(LoraBaseOnly(k) for k in own)}
    assert node_capture_key(LoraBaseOnly(own[0])) == own[0] == node_capture_key(own[0])
    assert str(LoraBaseOnly(own[0])) == "base-only decode(batch=2, seq_len=1)"
    for key, graph in compiled.graphs.graphs.items():
        assert graph.compiles == 1, (key, graph.compiles)  # one layer graph serves every layer
        if isinstance(key, LoraBaseOnly):
            assert graph.lora_ops == frozenset(), key
        else:
            kinds = {op.removeprefix("lora_graph.lora_").split("_")[0] for op in graph.lora_ops}
            # the torch or triton pair, or at decode sizes the triton base linear + side-stream
            # delta
            assert kinds in ({"shrink", "expand"}, {"linear"}), (key, graph.lora_ops)


def _prefill_rows(pipe, batch, adapters):
    """Eager batched prefill of rows 0..n-1 (the same on both pipelines)."""
    order = sorted(
        range(len(batch)), key=lambda i: (adapters[i] is None, adapters.index(adapters[i]))
    )
    length = max(len(p) for p in batch)
    dev = pipe.device
    tokens = torch.zeros(len(batch), length, dtype=torch.long)
    for j, i in enumerate(order):
        tokens[j, : len(batch[i])] = torch.tensor(batch[i])
    pipe.execute(
        pipe.prepare(
            [Row(adapters[i]) for i in order],
            tokens=tokens.to(dev),
            positions=torch.arange(length, device=dev).expand(len(batch), length),
            cache_rows=torch.tensor(order, device=dev),
            logits_index=torch.tensor([len(batch[i]) - 1 for i in order], device=dev),
            prefill=True,
        )
    )


def _decode(pipe, adapters, tokens, positions):
    """One decode step over rows 0..n-1 under ``adapters`` (sorted here); logits by row."""
    n = len(adapters)
    order = sorted(range(n), key=lambda i: (adapters[i] is None, adapters.index(adapters[i])))
    width = pipe.decode_width(n)
    order += list(range(n, width))  # padding rows: free cache rows, base
    rows = [Row(adapters[i] if i < n else None) for i in order]
    dev = pipe.device
    tok = torch.tensor([[tokens[i] if i < n else 0] for i in order], device=dev)
    pos = torch.tensor([[positions[i] if i < n else 0] for i in order], device=dev)
    inputs = pipe.prepare(
        rows,
        tokens=tok,
        positions=pos,
        cache_rows=torch.tensor(order, device=dev),
        logits_index=torch.zeros(width, dtype=torch.long, device=dev),
        prefill=False,
    )
    logits = pipe.execute(inputs).clone()
    out = torch.empty(n, logits.shape[-1], device=dev)
    for j, i in enumerate(order):
        if i < n:
            out[i] = logits[j]
    return out


def test_compiled_steps_equal_eager_across_mixes(pair):
    compiled, eager = pair
    graphs = compiled.graphs
    unique_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    batch = prompts(4, seed=31, max_len=8)
    for pipe in pair:
        _prefill_rows(pipe, batch, ["A", "B", None, "C"])
    positions = [len(p) for p in batch]
    mixes = [
        [None, None, None, None],  # all base: the base-only graph
        ["A", None, "B", "D"],  # mixed (D: embedding and LM head)
        ["C", "C", "C", "C"],  # one adapter for every row
        ["A", "B", "C", "D"],  # all distinct: more groups than at capture (none)
        [None, None, None, None],
        ["B", None, "A"],  # 3 rows padded into the bucket of 4
        ["C", "A"],  # bucket 2
    ]
    for step, mix in enumerate(mixes):
        n = len(mix)
        tokens = [(7 * step + i) % 100 + 3 for i in range(n)]
        before = {k: g.replays for k, g in graphs.graphs.items()}
        got = _decode(compiled, mix, tokens, positions[:n])
        want = _decode(eager, mix, tokens, positions[:n])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {step} mix {mix}")
        replayed = [k for k, g in graphs.graphs.items() if g.replays > before[k]]
        expected = CaptureKey("decode", 2 if n <= 2 else 4)
        assert replayed == [expected if any(mix) else LoraBaseOnly(expected)], (step, replayed)
        for i in range(n):
            positions[i] += 1
    assert graphs.recompiles == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == unique_graphs


def test_replacing_an_adapter_changes_output_without_recompile(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    compiled, eager = pair
    graphs = compiled.graphs
    prompt = prompts(1, seed=32, max_len=8)
    src = load_file(str(compiled.manager.adapter("A").source.weights_path))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "adapter_config.json").write_text(
        json.dumps(compiled.manager.adapter("A").source.config)
    )
    results = []
    for factor in (1.0, -1.0):
        save_file(
            {k: (v * factor if "lora_B" in k else v).contiguous() for k, v in src.items()},
            str(tmp_path / "x" / "adapter_model.safetensors"),
        )
        for pipe in pair:
            pipe.manager.load_adapter(str(tmp_path / "x"), name="x")
            _prefill_rows(pipe, prompt, ["x"])
        got = _decode(compiled, ["x", None], [5, 6], [len(prompt[0]), 0])
        torch.testing.assert_close(
            got, _decode(eager, ["x", None], [5, 6], [len(prompt[0]), 0]), rtol=1e-4, atol=1e-4
        )
        results.append(got[0])
    assert not torch.allclose(results[0], results[1], atol=1e-3)
    assert graphs.recompiles == 0


def test_engine_through_graphs_matches_eager_engine(pair):
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    compiled, eager = pair
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    # five prompts within the 16-token prefill bucket (one graph replay each), two beyond it
    # (prefilled together in one eager call)
    batch = prompts(5, seed=33) + prompts(2, seed=34, min_len=20, max_len=30)
    adapters = ["A", None, "B", "C", "D", "A", None]
    reqs = [
        Request(str(i), p, a, sampling)
        for i, (p, a) in enumerate(zip(batch, adapters, strict=True))
    ]
    got = LLMEngine(compiled).generate(reqs)
    want = LLMEngine(eager).generate(reqs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert compiled.graphs.recompiles == 0


def test_a_dropped_pipeline_frees_its_memory(tiny):
    """Deleting a compiled pipeline frees its weights, KV cache and slot pool (torch.compile
    keeps its backend in process-wide caches; the graph cache is only weakly referenced)."""
    import gc
    import weakref

    from conftest import make_pipeline

    pipe = make_pipeline(tiny, load=("A",), max_batch_size=2)
    pipe.enable_compile("inductor", decode_buckets=(1,), prefill_lengths=(), progress=False)
    _decode(pipe, ["A"], [5], [3])
    refs = [weakref.ref(x) for x in (pipe, pipe.model, pipe.manager.pool, pipe.graphs)]
    del pipe
    gc.collect()
    assert all(r() is None for r in refs)
