"""The adapter pool: inputs, routing, loading, slots (invariants 3, 4, 5, 9)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import ALL_LINEARS, Row, make_peft_adapter, make_pipeline, prompts
from safetensors.torch import load_file, save_file
from test_parity import run_prefill

from lora_graph import AdapterError, LoraReqConfig, LoRAStatus, NoFreeSlotError, Routing


def test_routing_of_a_sorted_batch(tiny):
    """The five routing tensors of a batch (lora_graph.routing's statement of their meaning):
    groups over rows and over requests, padded with empty slot-0 groups."""
    m = make_pipeline(tiny, max_slots=3).manager
    m.activate_batch([Row("A"), Row("B")])
    routing = m.route([Row("A"), Row("A"), Row("B"), Row(None)], [0, 2, 5, 6, 7])
    assert isinstance(routing, Routing)
    assert [tuple(t.shape) for t in routing] == [(3,), (4,), (1,), (4,), (1,)]
    assert all(t.dtype == torch.int32 for t in routing)
    slot_a, slot_b = m.activate_adapter("A"), m.activate_adapter("B")
    assert routing.lora_ids.tolist() == [slot_a, slot_b, 0]
    assert routing.grouped_offsets.tolist() == [0, 5, 6, 6]
    assert routing.end.tolist() == [6]
    assert routing.segment_offsets.tolist() == [0, 2, 3, 3]  # the same groups, counted in requests
    assert routing.segment_end.tolist() == [3]
    again = m.route([Row("B")], [0, 4])
    assert all(
        a is b for a, b in zip(again, routing, strict=True)
    )  # the same persistent buffers, refilled
    assert again.lora_ids.tolist() == [slot_b, 0, 0] and again.grouped_offsets.tolist() == [
        0,
        4,
        4,
        4,
    ]
    with pytest.raises(ValueError, match="not sorted"):
        m.get_lora_graph_inputs([Row("A"), Row(None), Row("B")], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="needs 3 entries|need 3 entries"):
        m.route([Row("A"), Row("A")], [0, 1])


def test_sort_lora_batch_groups_adapters_base_last():
    from lora_graph.manager import LoRAManager

    rows = [Row("B"), Row(None), Row("A"), Row("B"), Row(None), Row("A")]
    out = LoRAManager.sort_lora_batch(rows)
    assert [r.adapter for r in out] == ["B", "B", "A", "A", None, None]
    assert out[0] is rows[0] and out[1] is rows[3]


def test_scale_applied_once_and_source_unchanged(tiny):
    path = tiny.adapters["B"]
    before = load_file(str(path / "adapter_model.safetensors"))
    pipe = make_pipeline(tiny, load=())
    m = pipe.manager
    assert m.load_adapter(str(path), name="B") == LoRAStatus.LOADED
    assert m.load_adapter(str(path), name="B") == LoRAStatus.UNCHANGED
    slot = m.activate_adapter("B")
    after = load_file(str(path / "adapter_model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    key = next(k for k in before if "layers.1.self_attn.v_proj.lora_B" in k)
    scale = 8 / math.sqrt(4)  # rsLoRA: alpha / sqrt(r)
    b = m.layout.b_view(m.pool[slot], "qkv_proj", 1)
    q, kv = pipe.config.q_size, pipe.config.kv_size
    torch.testing.assert_close(b[q + kv : q + 2 * kv, :4], before[key] * scale)
    assert b[q + kv :, 4:].abs().sum() == 0


@pytest.mark.parametrize("previous", ["A", "D"])
def test_slot_reuse_keeps_nothing_of_previous_owner(tiny, previous):
    """An all-linear rank-8 adapter (A), or one on the embedding, LM head, q and down (D),
    leaves the slot; a q/v-only rank-4 one takes it."""
    pipe = make_pipeline(tiny, max_slots=1)
    m = pipe.manager
    batch = prompts(2, seed=21)
    slot = m.activate_adapter(previous)
    assert m.pool[slot].abs().sum() > 0
    assert m.activate_adapter("B") == slot
    only_b = make_pipeline(tiny, max_slots=1, load=("B",))
    assert torch.equal(m.pool[slot], only_b.manager.pool[only_b.manager.activate_adapter("B")])
    torch.testing.assert_close(
        run_prefill(pipe, batch, ["B", None])[0], run_prefill(only_b, batch, ["B", None])[0]
    )


def test_slot_ranks_follow_their_adapters(tiny):
    """``SlotPool.ranks`` holds each slot's adapter rank (the largest of its modules: D has
    rank 8 with its LM head at 4) as slots change owner, and every block of a slot is zero
    from that rank on: the kernels skip those columns, so the invariant is what makes that
    exact."""
    pipe = make_pipeline(tiny, max_slots=2)
    m = pipe.manager
    assert m.slots.ranks.tolist() == [0, 0, 0]
    expected = {"A": 8, "B": 4, "C": 16, "D": 8}
    for name in ("A", "B", "C", "D", "B"):
        slot = m.activate_adapter(name)
        assert int(m.slots.ranks[slot]) == expected[name], name
        rank = expected[name]
        for target, layer in m.layout.blocks:
            a = m.layout.a_view(m.pool[slot], target, layer)
            b = m.layout.b_view(m.pool[slot], target, layer)
            # A [S, R, in] (an embedding's [vocab, R]) and B [out, R]: dim 1 is the rank
            assert not a[:, rank:].any() and not b[:, rank:].any(), (name, target, layer)
    assert int(m.slots.ranks[0]) == 0
    for layer in m.layers.values():
        assert layer.ranks is m.slots.ranks


def test_reload_with_new_weights_serves_new_weights(tiny, tmp_path):
    pipe = make_pipeline(tiny, load=())
    m = pipe.manager
    path = tmp_path / "x"
    shutil.copytree(tiny.adapters["A"], path)
    m.load_adapter(str(path), name="x")
    batch = prompts(1, seed=22)
    first = run_prefill(pipe, batch, ["x"])[0]
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file(
        {k: v * 2 if "lora_B" in k else v for k, v in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )
    assert m.load_adapter(str(path), name="x") == LoRAStatus.RELOADED
    second = run_prefill(pipe, batch, ["x"])[0]
    fresh = make_pipeline(tiny, load=())
    fresh.manager.load_adapter(str(path), name="x")
    torch.testing.assert_close(second, run_prefill(fresh, batch, ["x"])[0])
    assert not torch.allclose(second, first, atol=1e-3)


def test_eviction_spares_running_batch_and_pinned(tiny):
    m = make_pipeline(tiny, max_slots=2, load=()).manager
    m.load_adapter(str(tiny.adapters["A"]), name="A", pin=True)
    m.load_adapter(str(tiny.adapters["B"]), name="B")
    m.load_adapter(str(tiny.adapters["C"]), name="C")
    m.activate_batch([Row("B")])
    with pytest.raises(NoFreeSlotError):
        m.activate_adapter("C")
    m.activate_batch([Row("C")])
    assert m.is_active_lora("A") and m.is_active_lora("C") and not m.is_active_lora("B")
    with pytest.raises(NoFreeSlotError, match="pinned"):
        m.load_adapter(str(tiny.adapters["B"]), name="B2", pin=True)


def _copy_adapter(src, dst, *, config=None, tensors=None):
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(dst / "adapter_model.safetensors"))
    return dst


Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"
WIDE = {
    "target_modules": [*ALL_LINEARS, "embed_tokens", "lm_head"]
}  # a config that selects the added modules


@pytest.mark.parametrize(
    "case, match",
    [
        (dict(config={"use_dora": True}), "use_dora"),
        (dict(config={"bias": "some"}), "bias='some' is not one of PEFT's"),
        (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        # r that disagrees with the tensors' rank: PEFT refuses it (size mismatch); so do we
        (
            dict(config={"r": 64}),
            r"down_proj has rank-8 tensors \(lora_A \[8, 96\]\) but adapter_config.json's r is 64",
        ),
        (
            dict(config={"rank_pattern": {"q_proj": 4}}),
            r"q_proj has rank-8 tensors .* rank_pattern gives 4",
        ),
        (dict(tensors=lambda w: {"something.weight": torch.zeros(2, 2)}), "no LoRA tensors"),
        (
            dict(
                tensors=lambda w: {
                    k: v[:, :-1].contiguous() if "layers.0.mlp.down_proj.lora_A" in k else v
                    for k, v in w.items()
                }
            ),
            r"layers\.0\.mlp\.down_proj .*does not fit",
        ),
        (
            dict(
                tensors=lambda w: {
                    **w,
                    "base_model.model.score.lora_A.weight": torch.zeros(8, 64),
                    "base_model.model.score.lora_B.weight": torch.zeros(2, 8),
                }
            ),
            "score is outside the served targets",
        ),
        (
            dict(
                config=WIDE,
                tensors=lambda w: {
                    **w,
                    "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 100),
                    "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(64, 8),
                },
            ),
            r"embed_tokens \(A \[8, 100\].*expected A \[8, 128\].*a resized vocabulary\?\) does "
            r"not fit",
        ),
        (
            dict(
                tensors=lambda w: {
                    **w,
                    "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight": torch.zeros(
                        8, 64
                    ),
                    "base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight": torch.zeros(
                        64, 8
                    ),
                }
            ),
            r"layers\.2\.self_attn\.q_proj \(layer 2: the model's qkv_proj has layers 0\.\.1",
        ),
        (
            dict(
                config=WIDE,
                tensors=lambda w: {
                    **w,
                    "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 128),
                    "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(64, 8),
                },
            ),
            r"embed_tokens \(lora_A/lora_B on an embedding target\)",
        ),
        (
            dict(
                config=WIDE,
                tensors=lambda w: {
                    **w,
                    "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                    "base_model.model.lm_head.lora_B.weight": torch.zeros(130, 8),
                },
            ),
            r"lm_head \(A .*does not fit",
        ),
        (
            dict(
                tensors=lambda w: {
                    **w,
                    "base_model.model.lm_head.base_layer.weight": torch.zeros(130, 64),
                }
            ),
            r"lm_head \(saved base weight \[130, 64\].*resized vocabulary",
        ),
        (
            dict(
                tensors=lambda w: {
                    **w,
                    "base_model.model.model.embed_tokens.base_layer.weight": torch.randn(128, 64),
                }
            ),
            "saved base weight of embed_tokens differs from the served model's",
        ),
        # a packed name the model does not have (Llama's q/k/v are separate modules): it
        # would land on q/k/v's rows, over the q_proj pair's (PEFT finds no such module)
        (
            dict(
                config={"target_modules": [*ALL_LINEARS, "qkv_proj"]},
                tensors=lambda w: {
                    **w,
                    "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": torch.ones(
                        8, 64
                    ),
                    "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight": torch.ones(
                        128, 8
                    ),
                },
            ),
            r"module model\.layers\.0\.self_attn\.qkv_proj is outside the served targets "
            r"\(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, embed_tokens, "
            r"lm_head\)",
        ),
        # a transposed A is a shape that does not fit, not a rank above max_rank
        (
            dict(
                tensors=lambda w: {
                    k: v.T.contiguous() if k == f"{Q_PROJ}.lora_A.weight" else v
                    for k, v in w.items()
                }
            ),
            r"q_proj \(A \[64, 8\], B \[64, 8\]; .*does not fit",
        ),
        (
            dict(tensors=lambda w: {**w, f"{Q_PROJ}.base_layer.weight": torch.zeros(64, 64)}),
            r"is a saved weight of the linear model\.layers\.0\.self_attn\.q_proj \(PEFT saves",
        ),
        (
            dict(tensors=lambda w: {k.removeprefix("base_model.model."): v for k, v in w.items()}),
            r"adapter 'bad': tensor model\..* lacks PEFT's 'base_model\.model\.' prefix",
        ),
        # configs PEFT's LoraConfig refuses
        (
            dict(config={"target_modules": r".*_proj", "layers_to_transform": [0]}),
            "'layers_to_transform' cannot be used when 'target_modules' is a string",
        ),
        (
            dict(config={"layers_pattern": "layers", "layers_to_transform": None}),
            "'layers_pattern' is set but 'layers_to_transform' is not",
        ),
        # LoRA variants that plain LoRA would serve wrong: by config field, or by a tensor it
        # carries
        (dict(config={"lora_bias": True}), "lora_bias=True, a LoRA variant"),
        (
            dict(config={"trainable_token_indices": [5, 6]}),
            "trainable_token_indices=.*LoRA variant",
        ),
        (
            dict(config={"alora_invocation_tokens": [9, 10]}),
            "alora_invocation_tokens=.*LoRA variant",
        ),
        (dict(config={"layer_replication": [[0, 2], [1, 2]]}), "layer_replication=.*LoRA variant"),
        (dict(config={"init_lora_weights": "pissa_niter_4"}), "rewrites the base weights"),
        (
            dict(
                tensors=lambda w: {
                    **w,
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64),
                }
            ),
            r"tensor .*q_proj\.lora_B\.bias is not a LoRA A/B weight",
        ),
        (
            dict(
                tensors=lambda w: {
                    **w,
                    f"{Q_PROJ}.lora_magnitude_vector": torch.ones(64),
                }
            ),
            "lora_magnitude_vector is not a LoRA A/B weight",
        ),
        (
            dict(
                tensors=lambda w: {
                    **w,
                    "base_model.model.model.embed_tokens.weight": torch.zeros(136, 64),
                }
            ),
            # (as PEFT's save_embedding_layers=True saves it, from a model of another vocabulary)
            r"model\.embed_tokens \(saved base weight \[136, 64\]; the model's is \[128, 64\]",
        ),
        (
            dict(
                tensors=lambda w: {
                    k: v for k, v in w.items() if "layers.0.self_attn.q_proj.lora_B" not in k
                }
            ),
            "lora_B missing",
        ),
    ],
)
def test_bad_adapter_is_refused_with_its_cause(tiny, tmp_path, case, match):
    pipe = make_pipeline(tiny, load=("B",))
    path = _copy_adapter(tiny.adapters["A"], tmp_path / "bad", **case)
    if "differs" not in match:  # everything but a base-weight comparison shows in the header
        import lora_graph.loading.adapter_files as checkpoint

        def no_data(*args):
            raise AssertionError("check_adapter read tensor data")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(checkpoint, "_load_tensors", no_data)
            with pytest.raises(AdapterError, match=match):
                pipe.manager.check_adapter(str(path), name="bad")
    with pytest.raises(AdapterError, match=match) as e:
        pipe.manager.load_adapter(str(path), name="bad")
    assert "'bad'" in str(e.value)
    assert not pipe.manager.is_lora("bad")
    out = run_prefill(pipe, prompts(2, seed=23), ["B", None])  # the engine serves on
    assert torch.isfinite(out[0]).all()


def _poisoned(value: float, key: str = f"{Q_PROJ}.lora_B.weight"):
    """Tensors with ``value`` written at [3, 1] of ``key``."""

    def edit(w):
        t = w[key].clone()
        t[3, 1] = value
        return {**w, key: t}

    return edit


@pytest.mark.parametrize(
    "value, key",
    [
        (float("nan"), f"{Q_PROJ}.lora_B.weight"),
        (float("inf"), f"{Q_PROJ}.lora_B.weight"),
        (float("-inf"), "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"),
    ],
)
def test_a_non_finite_adapter_weight_is_refused_at_load_naming_the_tensor(
    tiny, tmp_path, value, key
):
    """One NaN or infinity in a LoRA tensor would make every request on the adapter
    produce NaN logits: the load is refused, naming the tensor, and the rest serves on."""
    pipe = make_pipeline(tiny, load=("B",))
    path = _copy_adapter(tiny.adapters["A"], tmp_path / "bad", tensors=_poisoned(value, key))
    with pytest.raises(AdapterError, match=rf"adapter 'bad': tensor {key} holds 1 non-finite"):
        pipe.manager.load_adapter(str(path), name="bad")
    assert not pipe.manager.is_lora("bad") and "bad" not in pipe.manager.registry
    out = run_prefill(pipe, prompts(2, seed=23), ["B", None])
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize(
    "key, value, match",
    [
        # a finite float32 B times its scale (alpha/r = 2) past float16's largest value
        (f"{Q_PROJ}.lora_B.weight", 60000.0, r"q_proj\.lora_B\.weight times its scale 2 overflows"),
        # an A past it (found by a new user's trial: loaded, then every request NaN)
        (f"{Q_PROJ}.lora_A.weight", 80000.0, r"q_proj\.lora_A\.weight overflows"),
    ],
)
def test_a_weight_that_overflows_the_slot_dtype_is_refused(tiny, tmp_path, key, value, match):
    """A finite float32 value that would be an infinity in a float16 slot: refused,
    naming the tensor and the dtype."""
    pipe = make_pipeline(tiny, load=(), slot_dtype=torch.float16)
    path = _copy_adapter(tiny.adapters["A"], tmp_path / "big", tensors=_poisoned(value, key))
    with pytest.raises(AdapterError, match=match + " float16"):
        pipe.manager.load_adapter(str(path), name="big")


def test_rank_above_max_rank_is_refused(tiny):
    pipe = make_pipeline(tiny, max_rank=8, load=())
    with pytest.raises(AdapterError, match="rank 16 is above max_rank 8"):
        pipe.manager.load_adapter(str(tiny.adapters["C"]), name="C")


def test_other_model_size_is_refused(tiny, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    other.save_pretrained(tmp_path / "other")
    path = make_peft_adapter(
        tmp_path / "other", tmp_path / "ad", seed=1, factor=1.0, r=4, target_modules=ALL_LINEARS
    )
    pipe = make_pipeline(tiny, load=())
    with pytest.raises(AdapterError, match="does not fit the model"):
        pipe.manager.load_adapter(str(path), name="small")


def test_request_config_validates_adapter_name():
    LoraReqConfig(None).validate(["A"])
    LoraReqConfig("A").validate(["A"])
    with pytest.raises(ValueError, match="unknown adapter 'Z'"):
        LoraReqConfig("Z").validate(["A"])
    with pytest.raises(ValueError, match="non-empty"):
        LoraReqConfig("").validate(["A"])


def test_bin_and_bare_safetensors_formats(tiny, tmp_path):
    pipe = make_pipeline(tiny, load=("A",))
    batch = prompts(1, seed=24)
    expected = run_prefill(pipe, batch, ["A"])[0]
    weights = load_file(str(tiny.adapters["A"] / "adapter_model.safetensors"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(tiny.adapters["A"] / "adapter_config.json", bin_dir)
    torch.save(weights, bin_dir / "adapter_model.bin")
    bare = tmp_path / "bare" / "weights.safetensors"
    bare.parent.mkdir()
    shutil.copy(tiny.adapters["A"] / "adapter_config.json", bare.parent)
    save_file(weights, str(bare))
    for name, path in (("bin", bin_dir), ("bare", bare)):
        pipe.manager.load_adapter(str(path), name=name)
        torch.testing.assert_close(run_prefill(pipe, batch, [name])[0], expected)


def test_unload_with_requests_in_flight(tiny, reference_factory):
    """In-flight requests finish on the adapter; new ones get an error; then the slot is free."""
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny)
    engine = LLMEngine(pipe)
    ids = prompts(2, seed=25)
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.add_request(Request("b", ids[0], "B", sampling))
    engine.step()
    assert pipe.manager.unload_adapter("B") == LoRAStatus.UNLOADED
    assert not pipe.manager.is_lora("B") and "B" not in pipe.manager.loras
    engine.add_request(Request("late", ids[1], "B", sampling))
    while engine.has_unfinished():
        engine.step()
    assert engine.finished["b"].token_ids == ref.greedy(ids[0], "B", 8)
    assert "unknown adapter 'B'" in engine.finished["late"].error
    LLMEngine(pipe).generate([Request("base", ids[1], None, SamplingParams(max_new_tokens=2))])
    assert not pipe.manager.is_active_lora("B")
    with pytest.raises(KeyError):
        pipe.manager.unload_adapter("B")


def test_unload_in_flight_survives_batches_without_it(tiny, reference_factory):
    """An unloaded adapter's running request finishes on it even when other requests are
    admitted (and prefilled in batches that do not name it) before it is done."""
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    ref = reference_factory(tiny)
    engine = LLMEngine(make_pipeline(tiny))
    ids = prompts(3, seed=26)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.add_request(Request("b", ids[0], "B", sampling))
    engine.step()
    engine.pipeline.manager.unload_adapter("B")
    engine.add_request(Request("a", ids[1], "A", sampling))
    engine.add_request(Request("base", ids[2], None, sampling))
    while engine.has_unfinished():
        engine.step()
    assert engine.finished["b"].token_ids == ref.greedy(ids[0], "B", 6)
    assert engine.finished["a"].token_ids == ref.greedy(ids[1], "A", 6)
    assert engine.finished["base"].token_ids == ref.greedy(ids[2], None, 6)
    assert "B" not in engine.pipeline.manager.loras and not engine.pipeline.manager.is_active_lora(
        "B"
    )


def test_reload_in_flight_finishes_on_the_old_weights(tiny, reference_factory):
    """Reloading ``x`` with other weights while a request runs on it: that request finishes
    on the old weights, requests admitted afterwards get the new ones, and the old version
    is freed with its last request."""
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    ref = reference_factory(tiny)
    engine = LLMEngine(make_pipeline(tiny, load=()))
    m = engine.pipeline.manager
    m.load_adapter(str(tiny.adapters["A"]), name="x")
    ids = prompts(3, seed=27)
    engine.add_request(
        Request("old", ids[0], "x", SamplingParams(max_new_tokens=8, ignore_eos=True))
    )
    engine.step()
    engine.step()
    assert m.load_adapter(str(tiny.adapters["C"]), name="x") == LoRAStatus.RELOADED
    assert m.loras == ["x"]  # the old version is not requestable
    engine.add_request(
        Request("new", ids[1], "x", SamplingParams(max_new_tokens=4, ignore_eos=True))
    )
    engine.step()  # prefill "new" beside the running "old"
    engine.step()  # one decode step with both versions in the batch
    while engine.has_unfinished():
        engine.step()
    assert engine.finished["old"].token_ids == ref.greedy(ids[0], "A", 8)
    assert engine.finished["new"].token_ids == ref.greedy(ids[1], "C", 4)
    assert engine.finished["old"].adapter == engine.finished["new"].adapter == "x"
    assert [e.name for e in m.registry.entries()] == [
        "x"
    ] and not m.registry.held_keys()  # the old version is gone
    after = engine.generate(
        [Request("after", ids[2], "x", SamplingParams(max_new_tokens=3, ignore_eos=True))]
    )
    assert after[0].token_ids == ref.greedy(ids[2], "C", 3)


def test_abort_releases_the_adapter_hold(tiny):
    """An aborted request gives back its hold: an adapter unloaded meanwhile is freed."""
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    engine = LLMEngine(make_pipeline(tiny))
    m = engine.pipeline.manager
    engine.add_request(Request("c", prompts(1, seed=28)[0], "C", SamplingParams(max_new_tokens=8)))
    engine.step()
    m.unload_adapter("C")
    assert "C" in m.registry  # held by the running request
    assert engine.abort_request("c")
    assert "C" not in m.registry and not m.is_active_lora("C") and not m.registry.held_keys()


def test_adapter_whose_file_vanished_fails_its_requests_only(tiny, tmp_path, reference_factory):
    """An adapter that left the host tier and whose directory was then deleted cannot be
    read back into a slot: its requests finish with an error naming it, the rest run on."""
    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    ref = reference_factory(tiny)
    pipe = LlamaPipeline(
        str(tiny.base),
        max_batch_size=4,
        max_seq_len=32,
        lora=LoRAConfig(max_slots=1, max_rank=16, cpu_capacity=1),
    )
    shutil.copytree(tiny.adapters["A"], tmp_path / "x")
    pipe.manager.load_adapter(str(tmp_path / "x"), name="x")
    pipe.manager.load_adapter(str(tiny.adapters["B"]), name="B")  # x's image leaves the host tier
    shutil.rmtree(tmp_path / "x")
    ids = prompts(3, seed=29)
    sampling = SamplingParams(max_new_tokens=5, ignore_eos=True)
    reqs = [
        Request("b", ids[0], "B", sampling),
        Request("x", ids[1], "x", sampling),
        Request("base", ids[2], None, sampling),
    ]
    out = {o.id: o for o in LLMEngine(pipe).generate(reqs)}
    assert "'x'" in out["x"].error and "cannot read it back" in out["x"].error
    assert out["b"].token_ids == ref.greedy(ids[0], "B", 5)
    assert out["base"].token_ids == ref.greedy(ids[2], None, 5)


def test_replaced_version_keeps_its_host_image_while_held(tiny, tmp_path, reference_factory):
    """Reloading ``x`` from its own, rewritten directory while a request runs on it: the old
    version's image stays in the host tier beyond ``cpu_capacity`` (its file is rewritten),
    and the request finishes on the old weights while other adapters come and go."""
    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    ref = reference_factory(tiny)
    pipe = LlamaPipeline(
        str(tiny.base),
        max_batch_size=4,
        max_seq_len=32,
        lora=LoRAConfig(max_slots=2, max_rank=16, cpu_capacity=1),
    )
    m = pipe.manager
    shutil.copytree(tiny.adapters["A"], tmp_path / "x")
    m.load_adapter(str(tmp_path / "x"), name="x")
    m.load_adapter(str(tiny.adapters["B"]), name="B")
    engine = LLMEngine(pipe)
    ids = prompts(3, seed=30)
    engine.add_request(
        Request("old", ids[0], "x", SamplingParams(max_new_tokens=8, ignore_eos=True))
    )
    engine.step()
    engine.step()
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(tiny.adapters["C"] / f, tmp_path / "x" / f)
    m.load_adapter(str(tmp_path / "x"), name="x")
    old_key = engine.running[0].adapter
    assert old_key.startswith("x@") and old_key in m.host
    engine.add_request(Request("b", ids[1], "B", SamplingParams(max_new_tokens=3, ignore_eos=True)))
    engine.add_request(
        Request("new", ids[2], "x", SamplingParams(max_new_tokens=3, ignore_eos=True))
    )
    while engine.has_unfinished():
        engine.step()
    assert engine.finished["old"].token_ids == ref.greedy(ids[0], "A", 8)
    assert engine.finished["b"].token_ids == ref.greedy(ids[1], "B", 3)
    assert engine.finished["new"].token_ids == ref.greedy(ids[2], "C", 3)


def test_reloading_back_and_forth_in_flight(tiny, reference_factory):
    """x = A, B, A, B while requests admitted under the two A versions still run: both finish
    on A (the retired A versions share one entry), and no slot or hold is left behind."""
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    ref = reference_factory(tiny)
    engine = LLMEngine(make_pipeline(tiny, load=()))
    m = engine.pipeline.manager
    a, b = str(tiny.adapters["A"]), str(tiny.adapters["B"])
    ids = prompts(2, seed=31)
    m.load_adapter(a, name="x")
    engine.add_request(
        Request("r0", ids[0], "x", SamplingParams(max_new_tokens=12, ignore_eos=True))
    )
    engine.step()
    engine.step()
    m.load_adapter(b, name="x")
    m.load_adapter(a, name="x")
    engine.add_request(
        Request("r2", ids[1], "x", SamplingParams(max_new_tokens=3, ignore_eos=True))
    )
    engine.step()
    engine.step()
    m.load_adapter(b, name="x")
    while engine.has_unfinished():
        engine.step()
    assert engine.finished["r0"].token_ids == ref.greedy(ids[0], "A", 12)
    assert engine.finished["r2"].token_ids == ref.greedy(ids[1], "A", 3)
    assert (
        [e.name for e in m.registry.entries()] == ["x"]
        and not m.registry.held_keys()
        and m.loras == ["x"]
    )
    assert all(owner is None or owner == "x" for owner in m.slot_owners)


def test_pin_that_would_strand_requests_in_flight_is_refused(tiny, reference_factory):
    """A pin between steps may not take a slot that the requests in flight need (their
    next decode step names all their adapters): refused, and serving goes on."""
    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline
    from lora_graph.engine import LLMEngine, Request, SamplingParams

    ref = reference_factory(tiny)
    pipe = LlamaPipeline(
        str(tiny.base), max_batch_size=4, max_seq_len=32, lora=LoRAConfig(max_slots=2, max_rank=16)
    )
    m = pipe.manager
    for name in ("A", "B"):
        m.load_adapter(str(tiny.adapters[name]), name=name)
    engine = LLMEngine(pipe)
    ids = prompts(2, seed=32)
    engine.add_request(Request("a", ids[0], "A", SamplingParams(max_new_tokens=6, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.add_request(Request("b", ids[1], "B", SamplingParams(max_new_tokens=6, ignore_eos=True)))
    engine.step()  # a prefill of "b" alone: "a" is in flight but not in this batch
    with pytest.raises(NoFreeSlotError, match="too few of the 2 slots"):
        m.load_adapter(str(tiny.adapters["C"]), name="C", pin=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.finished["a"].token_ids == ref.greedy(ids[0], "A", 6)
    assert engine.finished["b"].token_ids == ref.greedy(ids[1], "B", 6)
    # with nothing in flight the pin is taken; pinning a loaded adapter again is honoured too
    assert m.load_adapter(str(tiny.adapters["A"]), name="A", pin=True) == LoRAStatus.UNCHANGED
    assert m.adapter("A").pinned and m.is_active_lora("A")


def test_replaced_version_is_copied_back_from_its_slot(tiny, tmp_path):
    """A version replaced while held, whose host image was already dropped and whose file is
    rewritten, is copied back from its slot: it can leave the slot and return intact."""
    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline

    pipe = LlamaPipeline(
        str(tiny.base),
        max_batch_size=4,
        max_seq_len=32,
        lora=LoRAConfig(max_slots=1, max_rank=16, cpu_capacity=1),
    )
    m = pipe.manager
    shutil.copytree(tiny.adapters["A"], tmp_path / "x")
    m.load_adapter(str(tmp_path / "x"), name="x")
    slot = m.activate_adapter("x")
    original = m.pool[slot].clone()
    m.load_adapter(str(tiny.adapters["B"]), name="B")  # x's host image leaves (cpu_capacity 1)
    assert "x" not in m.host
    hold = m.acquire("x")
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(tiny.adapters["C"] / f, tmp_path / "x" / f)
    m.load_adapter(str(tmp_path / "x"), name="x")
    assert hold.key.startswith("x@")
    m.activate_adapter("B")  # the only slot changes hands
    assert not m.is_active_lora(hold.key)
    assert torch.equal(m.pool[m.activate_adapter(hold.key)], original)
    m.release(hold)
    assert hold.key not in m.registry


def test_adapter_path_containing_equals_sign(tiny, tmp_path):
    """``load_adapter(path)`` with an existing path that contains '=' takes it whole."""
    path = tmp_path / "lr=1e-4" / "checkpoint-100"
    shutil.copytree(tiny.adapters["B"], path)
    m = make_pipeline(tiny, load=()).manager
    assert m.load_adapter(str(path)) == LoRAStatus.LOADED
    assert m.is_lora(str(path))


def test_hub_repo_ids_resolve_through_the_local_cache(tiny, tmp_path, monkeypatch):
    """A model and an adapter named by hub repo id load offline from the hub cache."""
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    for repo, src in (("org/tiny-base", tiny.base), ("org/tiny-lora", tiny.adapters["B"])):
        root = cache / f"models--{repo.replace('/', '--')}"
        shutil.copytree(src, root / "snapshots" / ("0" * 40))
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline

    pipe = LlamaPipeline(
        "org/tiny-base", max_batch_size=4, max_seq_len=32, lora=LoRAConfig(max_slots=2, max_rank=16)
    )
    pipe.manager.load_adapter("org/tiny-lora", name="B")
    local = make_pipeline(tiny, load=("B",))
    batch = prompts(1, seed=26)
    torch.testing.assert_close(
        run_prefill(pipe, batch, ["B"])[0], run_prefill(local, batch, ["B"])[0]
    )
    with pytest.raises(AdapterError, match="org/missing"):
        pipe.manager.load_adapter("org/missing", name="m")


@pytest.mark.parametrize(
    "content", [b"", b"not a safetensors file at all", b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}"]
)
def test_corrupt_weights_file_is_refused(tiny, tmp_path, content):
    bad = tmp_path / "corrupt"
    bad.mkdir()
    shutil.copy(tiny.adapters["A"] / "adapter_config.json", bad)
    (bad / "adapter_model.safetensors").write_bytes(content)
    pipe = make_pipeline(tiny, load=())
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        pipe.manager.load_adapter(str(bad), name="bad")
    bin_dir = tmp_path / "corrupt_bin"
    bin_dir.mkdir()
    (bin_dir / "adapter_model.bin").write_bytes(content)
    shutil.copy(tiny.adapters["A"] / "adapter_config.json", bin_dir)
    with pytest.raises(AdapterError, match="not a readable torch checkpoint"):
        pipe.manager.load_adapter(str(bin_dir), name="bad_bin")


def test_host_tier_holds_an_adapter_at_its_own_targets_and_rank(tiny, reference_factory):
    """The host image of a rank-4 adapter on q_proj/v_proj (B) is its own blocks at rank 4
    (q, k, v of the fused projection, of every layer), not every target at max_rank: at
    most 3x its own tensor bytes, a fraction of a slot; and it serves exactly."""
    from safetensors.torch import load_file

    ref = reference_factory(tiny)
    pipe = make_pipeline(tiny, load=("B",), max_rank=16)
    m = pipe.manager
    own = sum(
        t.numel() * 4
        for t in load_file(str(tiny.adapters["B"] / "adapter_model.safetensors")).values()
    )
    image = m.host.get("B")
    assert sorted(image.offsets) == [("qkv_proj", 0), ("qkv_proj", 1)] and image.rank == 4
    assert m.host.nbytes == image.nbytes <= 3 * own
    assert image.nbytes < m.layout.numel * 4 / 10
    ids = prompts(2, seed=29)
    out = run_prefill(pipe, ids, ["B", None])
    torch.testing.assert_close(out[0], ref.logits(ids[0], "B"), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], ref.logits(ids[1], None), rtol=1e-4, atol=1e-4)
