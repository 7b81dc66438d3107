"""Unit tests of the adapter pool's parts on their own: routing, registry, host tier and
slot pool, wrapping; and the manager loading ``LoRAConfig.adapters`` at start-up."""

from __future__ import annotations

import pytest
import torch
from conftest import Row, make_pipeline, prompts
from test_parity import run_prefill
from torch import nn

from lora_graph import AdapterError, LoRAConfig
from lora_graph.layout import AdapterImage, SlotLayout
from lora_graph.loading.adapter_files import AdapterSource
from lora_graph.registry import AdapterRegistry, LoadedAdapter
from lora_graph.routing import RoutingBuffer, group_batch, row_slots, sort_lora_batch
from lora_graph.slots import HostTier, NoFreeSlotError, SlotPool
from lora_graph.targets import LoraTarget
from lora_graph.wrapping import lora_weight_adapter


# ---- routing ---------------------------------------------------------------------------
def test_group_batch_and_buffer():
    slots = {"A": 3, "B": 1}
    batch = sort_lora_batch([Row("B"), Row(None), Row("A"), Row("B")])
    assert [r.adapter for r in batch] == ["B", "B", "A", None]
    groups = group_batch(batch, [0, 4, 5, 9, 10], slots.get, max_groups=3)
    assert groups == ([1, 3], [0, 5, 9], [0, 2, 3])
    buf = RoutingBuffer(3, torch.device("cpu"))
    r = buf.fill(*groups)
    assert (
        r.lora_ids.tolist() == [1, 3, 0]
        and r.grouped_offsets.tolist() == [0, 5, 9, 9]
        and r.end.tolist() == [9]
    )
    assert r.segment_offsets.tolist() == [0, 2, 3, 3] and r.segment_end.tolist() == [3]
    # the documented row rule: rows 0..4 slot 1, 5..8 slot 3, the base row after end
    assert row_slots(10, *r.tokens).tolist() == [1] * 5 + [3] * 4 + [-1]
    assert buf.fill([], [0], [0]).end.tolist() == [0]  # all base
    with pytest.raises(ValueError, match="more than 1 adapter groups"):
        group_batch([Row("A"), Row("B")], [0, 1, 2], slots.get, max_groups=1)
    with pytest.raises(ValueError, match="'C' is not active"):
        group_batch([Row("C")], [0, 1], slots.get, max_groups=2)


# ---- registry --------------------------------------------------------------------------
def _entry(name: str, digest: str) -> LoadedAdapter:
    return LoadedAdapter(name, AdapterSource(name, {}, name), digest, 4, False)


def test_registry_holds_retire_and_purge():
    reg = AdapterRegistry()
    reg.add(_entry("x", "aaaa" * 4))
    ref = reg.acquire("x")
    alias, merged = reg.retire("x")  # a reload while a request holds x
    assert alias == "x@" + "aaaa" * 3 and not merged and ref.key == alias
    reg.add(_entry("x", "bbbb" * 4))
    assert reg.loras == ["x"] and alias in reg and reg.held(alias)
    assert reg.purge(frozenset()) == []  # still held
    reg.release(ref)
    reg.release(ref)  # twice is harmless
    assert reg.purge(frozenset()) == [alias] and alias not in reg
    reg.begin_unload("x")
    assert not reg.is_lora("x")
    assert reg.purge(frozenset({"x"})) == []  # the running batch names it
    assert reg.purge(frozenset()) == ["x"]
    with pytest.raises(KeyError, match="'x' is not loaded"):
        reg.acquire("x")


# ---- host tier and slots -----------------------------------------------------------------
def test_host_tier_spares_and_evicts_lru():
    spared = {"b"}
    tier = HostTier(2, pin=False, spare=spared.__contains__)
    for key in "abc":
        tier.put(key, torch.zeros(1))
    assert "a" not in tier and "b" in tier and "c" in tier
    tier.get("b")
    tier.put("d", torch.zeros(1))  # over capacity: c is the oldest unspared
    assert "c" not in tier and {"b", "d"} <= {k for k in "abcd" if k in tier}


def _images(layout, values):
    """A rank-1 image of the one block of ``layout`` per value, every element that value."""
    images = {}
    for key, value in values.items():
        images[key] = AdapterImage(layout, [("t", 0)], 1, torch.float32)
        images[key].data.fill_(value)
    return images


def _slot_of(layout, image):
    slot = torch.zeros(layout.numel)
    layout.write(slot, image)
    return slot


def test_slot_pool_lru_protection_and_rename():
    layout = SlotLayout({"t": LoraTarget(4, (2,), "none", ("t",), layers=(0,))}, 1, 2)
    pool = SlotPool(3, layout.numel, dtype=torch.float32, device=torch.device("cpu"))
    img = _images(layout, {"a": 1.0, "b": 2.0, "c": 3.0})
    never = lambda k: False  # noqa: E731
    sa = pool.activate("a", lambda: img["a"], protected=never, prefer=never)
    sb = pool.activate("b", lambda: img["b"], protected=never, prefer=never)
    assert {sa, sb} == {1, 2} and pool.loads == 2 and torch.equal(pool.pool[0], torch.zeros(128))
    assert (
        pool.activate("a", lambda: img["a"], protected=never, prefer=never) == sa
        and pool.loads == 2
    )
    # full: b is least recently used, but protected; a goes
    sc = pool.activate("c", lambda: img["c"], protected=lambda k: k == "b", prefer=never)
    assert sc == sa and pool.owners == [None, *(("c", "b") if sa == 1 else ("b", "c"))]
    assert torch.equal(pool.pool[sc], _slot_of(layout, img["c"]))
    with pytest.raises(NoFreeSlotError):
        pool.activate("a", lambda: img["a"], protected=lambda k: True, prefer=never)
    pool.rename("c", "c@1")
    assert pool.slot_of("c@1") == sc and pool.slot_of("c") is None
    assert torch.equal(pool.read("c@1"), _slot_of(layout, img["c"]))


def test_an_image_holds_its_own_blocks_at_its_rank_and_fills_a_slot_whole():
    """An adapter image is its blocks at its rank only; written into a slot (with garbage
    from a previous owner) it gives the padded layout: its A rows and B columns up to its
    rank, zeros everywhere else; reading the slot back gives the image again."""
    targets = {
        "qkv": LoraTarget(8, (8, 4, 4), "column", ("q", "k", "v"), layers=(0, 1)),
        "emb": LoraTarget(16, (8,), "none", ("emb",), layers=(0,), kind="embedding"),
    }
    layout = SlotLayout(targets, 2, max_rank=4)
    image = AdapterImage(layout, [("qkv", 1), ("emb", 0)], 2, torch.float32)
    torch.manual_seed(0)
    image.data.copy_(torch.randn(image.numel))
    assert image.numel == 3 * 2 * 8 + 16 * 2 + 16 * 2 + 8 * 2  # qkv A, B; emb A, B
    assert image.nbytes == 4 * image.numel < 4 * layout.numel
    slot = torch.full((layout.numel,), 7.0)
    layout.write(slot, image)
    expected = torch.zeros(layout.numel)
    layout.a_view(expected, "qkv", 1)[:, :2] = image.a("qkv", 1)
    layout.b_view(expected, "qkv", 1)[:, :2] = image.b("qkv", 1)
    layout.a_view(expected, "emb", 0)[:, :2] = image.a("emb", 0)
    layout.b_view(expected, "emb", 0)[:, :2] = image.b("emb", 0)
    assert torch.equal(slot, expected)
    back = layout.read(slot, 2)
    assert sorted(back.offsets) == sorted(image.offsets) and torch.equal(back.data, image.data)


# ---- wrapping ----------------------------------------------------------------------------
def test_weight_adapter_moves_wrapped_weights_under_base():
    adapter = lora_weight_adapter(lambda sd: sd, {"layers.0.qkv_proj"})
    out = adapter({"layers.0.qkv_proj.weight": torch.zeros(1), "norm.weight": torch.zeros(1)})
    assert set(out) == {"layers.0.qkv_proj.base.weight", "norm.weight"}
    prefixed = lora_weight_adapter(lambda sd: sd, set(), wrapper_prefix="model")(
        {"norm.weight": torch.zeros(1)}
    )
    assert set(prefixed) == {"model.norm.weight"}


def test_wrapped_model_holds_views_of_the_pool(tiny):
    pipe = make_pipeline(tiny, load=("A",))
    m = pipe.manager
    layer = m.layers[("qkv_proj", 1)]
    assert (
        isinstance(pipe.model.layers[1].self_attn.qkv_proj, nn.Module)
        and pipe.model.layers[1].self_attn.qkv_proj is layer
    )
    assert layer.a.shape == (5, 3 * 16, 64) and layer.b.shape == (5, 64 + 32 + 32, 16)
    assert layer.a.untyped_storage().data_ptr() == m.pool.untyped_storage().data_ptr()
    slot = m.activate_adapter("A")
    assert layer.a[slot].abs().sum() > 0 and layer.a[0].abs().sum() == 0  # slot 0: the zero adapter


# ---- LoRAConfig.adapters -----------------------------------------------------------------
def test_configured_adapters_load_at_start_up(tiny):
    from lora_graph.architectures import LlamaPipeline

    digest = make_pipeline(tiny, load=("A",)).manager.adapter("A").digest
    pipe = LlamaPipeline(
        str(tiny.base),
        max_batch_size=4,
        max_seq_len=64,
        lora=LoRAConfig(
            adapters={"A": str(tiny.adapters["A"]), "B": str(tiny.adapters["B"])},
            adapter_digests={"A": digest},
        ),
    )
    assert pipe.manager.loras == ["A", "B"]
    want = run_prefill(make_pipeline(tiny), prompts(2, seed=71), ["A", "B"])
    got = run_prefill(pipe, prompts(2, seed=71), ["A", "B"])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    with pytest.raises(
        AdapterError, match="'A': weights digest .* does not match the expected 000000"
    ):
        LlamaPipeline(
            str(tiny.base),
            max_batch_size=4,
            max_seq_len=64,
            lora=LoRAConfig(
                adapters={"A": str(tiny.adapters["A"])}, adapter_digests={"A": "0" * 64}
            ),
        )


def test_active_adapters_by_slot_and_adapter_info(tiny):
    m = make_pipeline(tiny, load=("A", "B")).manager
    m.activate_batch([Row("A"), Row("B"), Row(None)])
    by_slot = m.active_adapters_by_slot([Row("A"), Row(None), Row("B"), Row("A")])
    assert {slot: a.name for slot, a in by_slot.items()} == {
        m.activate_adapter("A"): "A",
        m.activate_adapter("B"): "B",
    }
    info = m.adapter_info(str(tiny.adapters["C"]))  # from the header alone
    assert info.rank == 16 and info.unmapped == () and info.misfits == ()


def test_attention_types_read_per_layer_and_unknown_ones_refused():
    """transformers' ``layer_types`` decide which layers slide (Qwen2 and Qwen3: from
    ``max_window_layers`` on; Mistral: every layer); a type this model does not implement is
    refused at start-up."""
    from transformers import LlamaConfig as HFLlama
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    from lora_graph.models.llama import LlamaConfig

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
    qwen = LlamaConfig.from_hf(
        Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    )
    assert [qwen.window(i) for i in range(3)] == [None, None, 8]
    assert (
        LlamaConfig.from_hf(Qwen2Config(**small, sliding_window=8)).window(2) is None
    )  # use_sliding_window off
    mistral = LlamaConfig.from_hf(MistralConfig(**small, sliding_window=8))
    assert [mistral.window(i) for i in range(3)] == [8, 8, 8]
    qwen3 = LlamaConfig.from_hf(
        Qwen3Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    )
    assert [qwen3.window(i) for i in range(3)] == [None, 8, 8] and qwen3.qk_norm
    assert not qwen3.qkv_bias and not qwen.qk_norm and qwen.qkv_bias
    odd = HFLlama(**small)
    odd.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="unsupported attention: layer_types"):
        LlamaConfig.from_hf(odd)


def test_module_map_and_paths_derive_from_the_target_table():
    """One table per model: checkpoint names (any layer number, each pack name and each
    slice name no pack holds: Llama's q_proj, Phi-3's qkv_proj, never both) and module
    paths come from each target's templates; two targets naming one module is
    an error in the table."""
    from transformers import LlamaConfig as HFLlama

    from lora_graph.models.llama import LlamaConfig, lora_targets
    from lora_graph.targets import (
        LoraModuleRef,
        LoraTarget,
        checkpoint_modules,
        module_map,
        module_path,
    )

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    targets = lora_targets(LlamaConfig.from_hf(HFLlama(**small)))
    find = module_map(targets, 2)
    assert find("model.layers.1.self_attn.k_proj") == LoraModuleRef("qkv_proj", 1, "k_proj")
    assert find("model.layers.0.self_attn.qkv_proj") is None  # (Llama has no packed module)
    assert find("model.layers.7.mlp.up_proj") == LoraModuleRef("gate_up_proj", 7, "up_proj")
    assert find("model.embed_tokens") == LoraModuleRef("embed_tokens", 0, None)
    assert find("model.layers.0.self_attn.rotary_emb") is None
    assert find("model.layers.x.mlp.up_proj") is None
    phi3 = lora_targets(LlamaConfig.from_hf(HFLlama(**small, model_type="phi3")))
    find = module_map(phi3, 2)  # Phi-3's checkpoint packs them: no q_proj of its own
    assert find("model.layers.0.self_attn.qkv_proj") == LoraModuleRef("qkv_proj", 0, "qkv_proj")
    assert find("model.layers.0.self_attn.q_proj") is None
    assert checkpoint_modules(targets)[:3] == ["q_proj", "k_proj", "v_proj"]
    assert checkpoint_modules(phi3) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                        "embed_tokens", "lm_head"]  # fmt: skip
    path = module_path(targets)
    assert path("down_proj", 1) == "layers.1.mlp.down_proj" and path("lm_head", 0) == "lm_head"
    clash = dict(
        targets, other=LoraTarget(64, (64,), module_path="x", checkpoint_names=("lm_head",))
    )
    with pytest.raises(ValueError, match="module lm_head is named by both lm_head and other"):
        module_map(clash, 2)


def test_an_image_of_every_layer_is_placed_by_strided_copies_as_block_by_block():
    """Runs of consecutive layers are written two strided copies a target; the slot is the
    same as one written block by block (layers 0-2 a run, layer 4 alone, layer 3 absent)."""
    targets = {
        "qkv": LoraTarget(8, (8, 4, 4), "column", ("q", "k", "v")),
        "down": LoraTarget(12, (8,), "row", ("down",)),
    }
    layout = SlotLayout(targets, 5, max_rank=4)
    blocks = [("qkv", 0), ("qkv", 1), ("qkv", 2), ("qkv", 4), ("down", 1), ("down", 2)]
    image = AdapterImage(layout, blocks, 3, torch.float32)
    torch.manual_seed(1)
    image.data.copy_(torch.randn(image.numel))
    assert image.runs() == [("qkv", [0, 1, 2]), ("qkv", [4]), ("down", [1, 2])]
    pool = torch.full((3, layout.numel), 5.0)  # slot 1 of a pool: a view at an offset
    layout.write(pool[1], image)
    expected = torch.zeros(layout.numel)
    for target, layer in blocks:
        layout.a_view(expected, target, layer)[:, :3] = image.a(target, layer)
        layout.b_view(expected, target, layer)[:, :3] = image.b(target, layer)
    assert torch.equal(pool[1], expected)
    assert (pool[0] == 5).all() and (pool[2] == 5).all()


@pytest.mark.parametrize(
    "policy_kw, rows, want",
    [
        ({}, 8, "fused"),  # decode in a graph at 8 rows: side shrink + fused expand/SwiGLU
        ({}, 4, "side"),  # below fused_silu_min_rows: the side-stream delta
        ({"fused_silu_decode": False}, 8, "side"),
        ({"fused_silu_min_rows": 2}, 4, "fused"),
        ({"side_stream_max_rows": 4}, 8, "plain"),  # above it: shrink + fused expand in place
        ({"side_stream_max_rows": 0}, 1, "plain"),
    ],
)
def test_the_kernel_policy_picks_each_layer_path(monkeypatch, policy_kw, rows, want):
    """The backend (``ops.Kernels``) picks a LoRA linear's path from the frozen policy it
    was built with, never from module state; every path gives the same values (the torch
    reference implementations behind each kernel, the call as if in a CUDA graph)."""
    from types import SimpleNamespace

    from lora_graph import ops
    from lora_graph.kernels import reference
    from lora_graph.kernels.policy import KernelPolicy

    calls: list[str] = []

    def spy(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    kernels = ops.Kernels(
        spy("shrink", reference.shrink),
        reference.embedding_shrink,
        spy("expand", reference.expand_),
        linear_delta=spy("linear_delta", reference.linear_delta),
        expand_silu_mul=spy("expand_silu_mul", reference.expand_silu_mul),
        linear_shrink=spy("linear_shrink", reference.linear_shrink),
        policy=KernelPolicy(**policy_kw),
    )
    monkeypatch.setattr(ops, "in_graph", lambda x: True)
    g = torch.Generator().manual_seed(rows)
    base = nn.Linear(16, 24)
    layer = SimpleNamespace(
        base=base, a=torch.randn(3, 2 * 4, 16, generator=g), b=torch.randn(3, 24, 4, generator=g),
        ranks=None, num_slices=2, out_slices=[12, 12], per_segment=False, plans_tokens={},
        plans_segments={},
    )  # fmt: skip
    routing = RoutingBuffer(2, torch.device("cpu")).fill([1], [0, rows], [0, 1])  # slot 1
    x = torch.randn(rows, 16, generator=g)
    got = kernels.silu_and_mul(layer, x, routing)
    paths = {
        "fused": ["linear_shrink", "expand_silu_mul"],
        "side": ["linear_delta"],
        "plain": ["shrink", "expand_silu_mul"],
    }
    assert calls == paths[want]
    h = [x @ layer.a[1][4 * s : 4 * s + 4].T for s in range(2)]
    d = torch.cat([h[s] @ layer.b[1][12 * s : 12 * s + 12].T for s in range(2)], dim=1)
    torch.testing.assert_close(got, ops.silu_and_mul(base(x) + d), rtol=1e-5, atol=1e-5)


APART = {"reduce_delta_apart": True}


@pytest.mark.parametrize(
    "policy_kw, rows, graph, per_segment, stacked",
    [
        (APART, 8, True, False, True),  # decode in a graph: base output and delta stacked
        ({}, 8, True, False, True),  # (on by default: measured on the H200, session 20)
        ({"reduce_delta_apart": False}, 8, True, False, False),  # off: added before
        ({**APART, "side_stream_max_rows": 4}, 8, True, False, False),
        (APART, 8, False, False, False),  # eager: the delta joins the output in place
        (APART, 8, True, True, False),  # an LM head (routed by request) is never row-parallel
    ],
)
def test_a_row_parallel_layer_stacks_its_delta_where_the_policy_says(
    monkeypatch, policy_kw, rows, graph, per_segment, stacked
):
    """``Kernels.linear_stacked`` (a row-parallel layer's delta all-reduced beside its
    output) applies exactly where :meth:`Kernels.linear` takes the side-stream delta and
    the policy's ``reduce_delta_apart`` is on; its two halves sum to ``linear``'s result."""
    from types import SimpleNamespace

    from lora_graph import ops
    from lora_graph.kernels import reference
    from lora_graph.kernels.policy import KernelPolicy

    kernels = ops.Kernels(
        reference.shrink, reference.embedding_shrink, reference.expand_,
        linear_delta=reference.linear_delta,
        linear_delta_stacked=reference.linear_delta_stacked,
        policy=KernelPolicy(**policy_kw),
    )  # fmt: skip
    monkeypatch.setattr(ops, "in_graph", lambda x: graph)
    g = torch.Generator().manual_seed(rows)
    layer = SimpleNamespace(
        base=nn.Linear(16, 24), a=torch.randn(3, 4, 16, generator=g),
        b=torch.randn(3, 24, 4, generator=g), ranks=None, num_slices=1, out_slices=[24],
        per_segment=per_segment, plans_tokens={}, plans_segments={},
    )  # fmt: skip
    routing = RoutingBuffer(2, torch.device("cpu")).fill([2], [0, rows], [0, 1])  # slot 2
    x = torch.randn(rows, 16, generator=g)
    got = kernels.linear_stacked(layer, x, routing)
    assert (got is not None) == stacked
    if got is not None:
        want = layer.base(x) + x @ layer.a[2].T @ layer.b[2].T
        assert got.shape == (2, rows, 24)
        torch.testing.assert_close(got[0] + got[1], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0] + got[1], kernels.linear(layer, x, routing))


def test_a_kernel_policy_is_frozen_and_checked():
    from dataclasses import FrozenInstanceError

    from lora_graph.kernels.policy import KernelPolicy

    with pytest.raises(ValueError, match="side_stream_max_rows must be at least 0, got -1"):
        KernelPolicy(side_stream_max_rows=-1)
    with pytest.raises(ValueError, match="fused_silu_min_rows must be at least 1, got 0"):
        KernelPolicy(fused_silu_min_rows=0)
    for bad in (dict(side_stream_max_rows=1.5), dict(side_stream_max_rows=True),
                dict(side_stream_max_rows="8"), dict(fused_silu_min_rows=None)):  # fmt: skip
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer, got"):
            KernelPolicy(**bad)
    with pytest.raises(ValueError, match="fused_silu_decode must be True or False, got -1"):
        KernelPolicy(fused_silu_decode=-1)
    with pytest.raises(ValueError, match="reduce_delta_apart must be True or False, got 1"):
        KernelPolicy(reduce_delta_apart=1)
    with pytest.raises(ValueError, match="kernel_policy must be a KernelPolicy, got 'x'"):
        LoRAConfig(kernel_policy="x")
    with pytest.raises(FrozenInstanceError):
        KernelPolicy().side_stream_max_rows = 0  # type: ignore[misc]
    assert LoRAConfig(kernel_policy=KernelPolicy(side_stream_max_rows=0)).kernel_policy == (
        KernelPolicy(side_stream_max_rows=0)
    )


def _sentencepiece_tokenizer():
    """A Llama-2-style fast tokenizer (SentencePiece's Metaspace, byte fallback, a decoder
    that strips the text's first space), as transformers' LlamaConverter builds one: letters,
    "▁the" and the 256 byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), "▁",
              *"abcdefghijklmnopqrstuvwxyz", "▁t", "▁th", "▁the"]  # fmt: skip
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e")]
    vocab = {p: i for i, p in enumerate(pieces)}
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")


def test_detokenizer_keeps_the_leading_space_and_waits_for_whole_characters():
    """A SentencePiece completion's first word keeps its space (decoding the generated
    tokens alone drops it: a helper found " the quick" served as "the quick"); its text is
    what the whole sequence's text adds to the prompt's, streamed or not; a character split
    over byte tokens comes whole; the EOS or stop token that ended it adds no text; and
    each token decodes a short window, not the whole output (once quadratic)."""
    from lora_graph.detokenize import Detokenizer, completion_text

    tok = _sentencepiece_tokenizer()
    prompt = tok("hello world", add_special_tokens=False)["input_ids"]
    out = tok("hello world the quick 日 fox", add_special_tokens=False)["input_ids"][len(prompt) :]
    whole = tok.decode(prompt + out, skip_special_tokens=True)
    want = whole[len(tok.decode(prompt, skip_special_tokens=True)) :]
    assert want == " the quick 日 fox" and tok.decode(out) == "the quick 日 fox"
    assert completion_text(tok, prompt, out) == want
    windows = []
    decode = tok.decode
    tok.decode = lambda ids, **kw: windows.append(len(ids)) or decode(ids, **kw)  # type: ignore[method-assign]
    detok = Detokenizer(tok, prompt)
    deltas = [detok.add(t) for t in out * 20]
    tok.decode = decode  # type: ignore[method-assign]
    assert "".join(deltas) == detok.text and detok.text.startswith(want + " the quick 日")
    assert max(windows) <= 8  # (the prompt's last tokens and a pending character's bytes)
    assert "日" in deltas and "" in deltas  # its 3 byte tokens: "" twice, then the character
    eos, bos = tok.convert_tokens_to_ids(["</s>", "<s>"])
    assert completion_text(tok, prompt, [*out, eos], {eos}) == want
    # a prompt shorter than the context, ending in a token without text (a chat template's
    # [/INST]): the first word keeps its space (only its last token was read: "the")
    short = [*prompt[:3], bos]
    the_quick = out[:4]
    whole = tok.decode(short + the_quick, skip_special_tokens=True)
    assert completion_text(tok, short, the_quick) == whole[len(tok.decode(short[:3])) :]
    assert completion_text(tok, short, the_quick).startswith(" ")
    # a context cut inside a character (the prompt's last 5 tokens start in 日's bytes): a
    # byte-fallback decoder blanked the output's run of bytes with it ("語" read "���...")
    cjk = tok("hello 日本語", add_special_tokens=False)["input_ids"]
    assert completion_text(tok, cjk[:-3], cjk[-3:]) == "語"
    # tokens without text (EOS under ignore_eos) and bytes that make no character: windows
    # stay short (each decoded all again a token, once), the text as decoded whole
    windows.clear()
    tok.decode = lambda ids, **kw: windows.append(len(ids)) or decode(ids, **kw)  # type: ignore[method-assign]
    byte80 = tok.convert_tokens_to_ids("<0x80>")
    text = completion_text(tok, prompt, [eos] * 300 + out[:4] + [byte80] * 30 + out[:4])
    tok.decode = decode  # type: ignore[method-assign]
    word = completion_text(tok, prompt, out[:4])
    assert max(windows) <= 16 and text == word + "\ufffd" * 30 + word, (windows, text)
    assert completion_text(tok, prompt, out, {out[-1]}) == completion_text(tok, prompt, out[:-1])
    # a logprob's token text keeps the space its piece holds, as the completion's text does
    from lora_graph.server.logprobs import token_text

    the, t = tok.convert_tokens_to_ids(["▁the", "t"])
    assert tok.decode([the]) == "the" and token_text(tok, the) == " the"
    assert token_text(tok, t) == "t" and token_text(tok, eos) == "</s>"
