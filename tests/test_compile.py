"""Captured graphs against eager (invariants 6 and 7), and no recompiles.

One small capture per mode (token buckets 4 and 16), shared by the module: inductor on
the CPU in CI; CUDA graphs on a GPU (skipped without one).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_pipeline, prompts

from lora_graph.compile.keys import CaptureKey
from lora_graph.kernels.policy import KernelPolicy
from lora_graph.step import SeqChunk

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
    kw = dict(max_batch_size=4, max_num_batched_tokens=16, device=device)
    compiled = make_pipeline(tiny, **kw)
    compiled.enable_compile(mode, token_buckets=(4, 16), progress=False)
    eager = make_pipeline(tiny, **kw)
    return compiled, eager


def test_keys_captured_for_both_buckets_with_and_without_lora(pair):
    compiled, _ = pair
    keys = set(compiled.graphs.graphs)
    own = [CaptureKey(4, 4), CaptureKey(16, 4)]
    assert keys == {*own, *(k.base_only() for k in own)}
    assert own[0].base_only() == CaptureKey(4, 4, lora=False) != own[0]
    assert str(own[0].base_only()) == "base-only step(tokens=4, seqs=4)"
    assert str(own[0]) == "step(tokens=4, seqs=4)"
    for key, graph in compiled.graphs.graphs.items():
        assert graph.compiles == 1, (key, graph.compiles)  # one layer graph serves every layer
        assert "lora_graph.paged_attention" in graph.ops, key
        if not key.lora:
            assert graph.lora_ops == frozenset(), key
        else:
            ops = {op.removeprefix("lora_graph.lora_") for op in graph.lora_ops}
            # the torch or triton pair; or at decode sizes on CUDA the base linear with the
            # side-stream delta, and from fused_silu_min_rows rows on the MLP's gate/up
            # with the side-stream shrink and the fused expand + activation
            if key.tokens >= KernelPolicy().fused_silu_min_rows:
                decode = {"linear_delta", "linear_shrink", "expand_silu_mul"}
            else:
                decode = {"linear_delta"}
            assert ops in ({"shrink", "expand_"}, decode), (key, graph.lora_ops)


class Requests:
    """Requests driven step by step on one pipeline: their tokens so far and pages."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.pages: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, str | None, list[int]]]) -> dict[str, torch.Tensor]:
        """Run ``(request, adapter, new tokens)`` chunks as one packed step; each request's
        last-token logits."""
        pipe = self.pipe
        specs = []
        for rid, adapter, ids in chunks:
            if rid not in self.pages:
                self.pages[rid] = pipe.pages.allocate(pipe.pages.pages_for(pipe.max_seq_len))
                self.done[rid] = 0
            specs.append(SeqChunk(adapter, ids, self.done[rid], self.pages[rid], owner=rid))
            self.done[rid] += len(ids)
        inputs = pipe.prepare(specs)
        logits = pipe.execute(inputs)
        return {c.owner: logits[i].clone() for i, c in enumerate(inputs.chunks)}

    def free(self):
        for pages in self.pages.values():
            self.pipe.pages.free(pages)
        self.pages.clear()


def test_compiled_steps_equal_eager_across_mixes(pair):
    """Packed steps mixing prefill chunks and decodes under several adapters, padded into
    both buckets: the compiled step equals the eager one, replays the expected graph, and
    never recompiles."""
    compiled, eager = pair
    graphs = compiled.graphs
    unique_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    p = prompts(4, seed=31, min_len=9, max_len=12)
    steps = [
        [("r0", "A", p[0][:6]), ("r1", None, p[1][:5])],  # two prefill chunks
        [("r0", "A", p[0][6:]), ("r1", None, p[1][5:9])],  # their next chunks
        [("r0", "A", [5]), ("r2", "B", p[2][:8]), ("r3", "D", p[3][:4])],  # decode + prefills
        [("r0", "A", [6]), ("r1", None, [7]), ("r2", "B", [8]), ("r3", "D", [9])],  # decodes
        [("r1", None, [10])],  # base only, padded to 4 tokens
        [("r2", "B", p[2][8:]), ("r3", "D", p[3][4:])],  # last chunks
        [("r0", "A", [11]), ("r1", None, [12]), ("r2", "C", [13])],  # r2 under another adapter
    ]
    runs = [Requests(compiled), Requests(eager)]
    try:
        for step, chunks in enumerate(steps):
            before = {k: g.replays for k, g in graphs.graphs.items()}
            got, want = (r.step(chunks) for r in runs)
            for rid in want:
                torch.testing.assert_close(
                    got[rid], want[rid], rtol=1e-4, atol=1e-4, msg=f"step {step} {rid}"
                )
            replayed = [k for k, g in graphs.graphs.items() if g.replays > before[k]]
            n = sum(len(ids) for _, _, ids in chunks)
            expected = CaptureKey(4 if n <= 4 else 16, 4)
            lora = any(a is not None for _, a, _ in chunks)
            assert replayed == [expected if lora else expected.base_only()], (step, replayed)
    finally:
        for r in runs:
            r.free()
    assert graphs.recompiles == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == unique_graphs


def test_a_replay_refuses_inputs_that_are_not_its_captured_buffers(pair):
    """A step whose inputs are copies of the buffers (a stale or hand-built step) would
    replay over old values: refused by name; the prepared step itself replays."""
    import dataclasses

    compiled, _ = pair
    pages = compiled.pages.allocate(1)
    try:
        inputs = compiled.prepare([SeqChunk("A", [1, 2, 3], 0, pages, owner="r")])
        graph = compiled.graphs.lookup(inputs)
        assert graph is not None and graph.key == CaptureKey(4, 4)
        compiled.graphs.run(inputs, graph)
        copied = dict(inputs.inputs, positions=inputs.inputs["positions"].clone())
        with pytest.raises(RuntimeError, match="'positions' is not the buffer"):
            compiled.graphs.run(dataclasses.replace(inputs, inputs=copied), graph)
        routing = inputs.routing._replace()
        with pytest.raises(RuntimeError, match="routing is not the persistent buffer"):
            compiled.graphs.run(dataclasses.replace(inputs, routing=routing), graph)
    finally:
        compiled.pages.free(pages)


def test_replacing_an_adapter_changes_output_without_recompile(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    compiled, eager = pair
    graphs = compiled.graphs
    prompt = prompts(1, seed=32, max_len=8)[0]
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
        outs = []
        for pipe in pair:
            pipe.manager.load_adapter(str(tmp_path / "x"), name="x")
            run = Requests(pipe)
            try:
                run.step([("a", "x", prompt), ("b", None, [3, 4])])
                outs.append(run.step([("a", "x", [5]), ("b", None, [6])]))
            finally:
                run.free()
        torch.testing.assert_close(outs[0]["a"], outs[1]["a"], rtol=1e-4, atol=1e-4)
        results.append(outs[0]["a"])
    assert not torch.allclose(results[0], results[1], atol=1e-3)
    assert graphs.recompiles == 0


def test_engine_through_graphs_matches_eager_engine(pair):
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    compiled, eager = pair
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    # five short prompts, two longer than the 16-token step (prefilled in chunks while the
    # others decode)
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
    pipe.enable_compile("inductor", token_buckets=(2,), progress=False)
    run = Requests(pipe)
    run.step([("a", "A", [5, 6])])
    run.free()
    del run
    refs = [weakref.ref(x) for x in (pipe, pipe.model, pipe.manager.pool, pipe.graphs)]
    del pipe
    gc.collect()
    assert all(r() is None for r in refs)
