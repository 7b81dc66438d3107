"""LoRA on the token embedding (``lora_embedding_A/B``) and the LM head (a per-segment
target), tied embeddings included, each against its formula from the adapter file and
against transformers + peft (the mixed-batch tests run adapter ``D``, which has both)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_peft_adapter, make_pipeline, prompts
from safetensors.torch import load_file

from lora_graph import AdapterError, LoRAConfig
from lora_graph.engine import LLMEngine, Request, SamplingParams
from lora_graph.step import SeqChunk

LINEAR_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _prefill_trace(pipe, ids, adapters):
    """Rows of one packed prefill of the same prompt under each adapter, ``[adapter,
    position, ...]``: (embedding output, final-norm output, all-position logits)."""
    n = len(adapters)
    seen: dict[str, torch.Tensor] = {}
    inner = pipe.model
    hooks = [
        inner.embed_tokens.register_forward_hook(
            lambda m, i, o: seen.__setitem__("embed", o.clone())
        ),
        inner.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("norm", o.clone())),
    ]
    chunks = [
        SeqChunk(a, ids, 0, pipe.pages.allocate(pipe.pages.pages_for(len(ids))), owner=k)
        for k, a in enumerate(adapters)
    ]
    try:
        inputs = pipe.prepare(chunks, all_logits=True)
        logits = pipe.execute(inputs)
    finally:
        for h in hooks:
            h.remove()
        for c in chunks:
            pipe.pages.free(c.pages)
    # the step's tokens are the chunks' in step order: back to [request, position, ...]
    order = [c.owner for c in inputs.chunks]
    back = [order.index(k) for k in range(n)]

    def per_request(x):
        return x.view(n, len(ids), *x.shape[1:])[back]

    return per_request(seen["embed"]), per_request(seen["norm"]), per_request(logits)


@pytest.fixture(scope="module")
def tied_adapters(tiny_factory, tmp_path_factory):
    t = tiny_factory("tied")
    root = tmp_path_factory.mktemp("tied_adapters")
    return t, {
        "head": make_peft_adapter(
            t.base,
            root / "head",
            seed=71,
            factor=20.0,
            r=4,
            lora_alpha=8,
            target_modules=["lm_head"],
        ),
        "embed": make_peft_adapter(
            t.base,
            root / "embed",
            seed=72,
            factor=1.0,
            r=8,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["embed_tokens"],
        ),
    }


def test_lm_head_delta_changes_logits_only_tied(tied_adapters):
    """Tied embeddings: an LM-head adapter leaves the input embedding and every hidden state
    as the base model's; the logits move by exactly ``norm(h) @ (scale * B @ A).T``."""
    t, paths = tied_adapters
    pipe = make_pipeline(t, load=())
    pipe.manager.load_adapter(str(paths["head"]), name="head")
    weight_before = pipe.model.embed_tokens.base.weight.clone()
    ids = prompts(1, seed=73)[0]
    embed, norm, logits = _prefill_trace(pipe, ids, ["head", None])
    assert torch.equal(embed[0], embed[1])
    torch.testing.assert_close(
        norm[0], norm[1], rtol=1e-6, atol=1e-6
    )  # rows of one matmul may round apart
    w = load_file(str(paths["head"] / "adapter_model.safetensors"))
    a, b = w["base_model.model.lm_head.lora_A.weight"], w["base_model.model.lm_head.lora_B.weight"]
    expected = logits[1] + norm[1] @ (2.0 * b @ a).T  # alpha 8 / r 4
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)
    assert (logits[0] - logits[1]).abs().max() > 0.1
    assert torch.equal(pipe.model.embed_tokens.base.weight, weight_before)
    assert pipe.model.lm_head.base.weight is pipe.model.embed_tokens.base.weight  # still tied


def test_embedding_delta_is_the_gathered_column_tied(tied_adapters):
    """``embed(t) += scale * lora_embedding_B @ lora_embedding_A[:, t]`` (rsLoRA scale), on
    the adapter's rows only; the LM head, tied to the embedding, is not changed by it."""
    t, paths = tied_adapters
    pipe = make_pipeline(t, load=())
    pipe.manager.load_adapter(str(paths["embed"]), name="embed")
    ids = prompts(1, seed=74)[0]
    embed, _, _ = _prefill_trace(pipe, ids, ["embed", None])
    w = load_file(str(paths["embed"] / "adapter_model.safetensors"))
    a = w["base_model.model.model.embed_tokens.lora_embedding_A"]
    b = w["base_model.model.model.embed_tokens.lora_embedding_B"]
    scale = 8 / 8**0.5
    torch.testing.assert_close(embed[0], embed[1] + scale * a[:, ids].T @ b.T, rtol=1e-5, atol=1e-5)
    head = pipe.model.lm_head
    x = torch.randn(3, head.base.in_features)
    torch.testing.assert_close(head(x), x @ pipe.model.embed_tokens.base.weight.T)


def test_generation_with_embedding_and_lm_head_matches_peft(tiny_factory, reference_factory):
    """Greedy decoding (the LM head routed per request at decode and at a batched,
    packed prefill) on a tied model, for D (embedding + LM head + linears) among others."""
    t = tiny_factory("tied")
    ref = reference_factory(t)
    engine = LLMEngine(make_pipeline(t))
    adapters = ["D", None, "A", "D", "B"]
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [
        Request(str(i), ids, a, sampling)
        for i, (ids, a) in enumerate(zip(prompts(5, seed=75), adapters, strict=True))
    ]
    for req, out in zip(reqs, engine.generate(reqs), strict=True):
        assert out.token_ids == ref.greedy(req.prompt_token_ids, req.adapter, 8), req.adapter


def test_unserved_embedding_and_lm_head_targets_refuse_such_adapters(tiny):
    """``LoRAConfig.targets`` without the embedding and LM head saves their vocabulary-sized
    blocks; an adapter that touches them is refused, naming the module."""
    from lora_graph.architectures import LlamaPipeline

    full = make_pipeline(tiny, load=())
    pipe = LlamaPipeline(
        str(tiny.base),
        max_batch_size=2,
        max_seq_len=16,
        lora=LoRAConfig(max_slots=2, max_rank=16, targets=LINEAR_TARGETS),
    )
    assert pipe.manager.layout.numel < full.manager.layout.numel
    with pytest.raises(
        AdapterError,
        match=r"module lm_head is outside the served targets \(q_proj, k_proj, .*, down_proj\), "
        "as is 1 more module",
    ):
        pipe.manager.load_adapter(str(tiny.adapters["D"]), name="D")
    pipe.manager.load_adapter(str(tiny.adapters["A"]), name="A")  # the rest is served


def _peft_logits(base_dir, adapter_dir, ids):
    """transformers + peft loading ``adapter_dir`` on ``base_dir``: all-position logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    model = PeftModel.from_pretrained(base.eval(), adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _rewrite(src, dst, edit):
    """A copy of the adapter at ``src`` with its tensors passed through ``edit``."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "adapter_model.safetensors"))
    save_file(edit(weights), str(dst / "adapter_model.safetensors"))
    return dst


HEAD_A, HEAD_B = "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"
EMB_A = "base_model.model.model.embed_tokens.lora_embedding_A"


@pytest.fixture(scope="module")
def weight_tied(tiny_factory, tmp_path_factory):
    """Adapters PEFT saves with ``ensure_weight_tying`` on the tied model: it rewrites
    ``target_modules`` to name the input embedding only, and saves the LM head's A and B
    (the embedding's B and A transposed) beside the embedding's."""
    t = tiny_factory("tied")
    root = tmp_path_factory.mktemp("weight_tied")
    kwargs = dict(seed=81, factor=5.0, r=4, lora_alpha=8, ensure_weight_tying=True)
    made = {
        "list lm_head": make_peft_adapter(t.base, root / "l", target_modules=["lm_head"], **kwargs),
        "list embed_tokens": make_peft_adapter(
            t.base, root / "e", target_modules=["embed_tokens", "q_proj"], **kwargs
        ),
        "regex lm_head": make_peft_adapter(t.base, root / "r", target_modules="lm_head", **kwargs),
    }
    src = made["list lm_head"]
    made["file without the LM head"] = _rewrite(
        src, root / "no_head", lambda w: {k: v for k, v in w.items() if "lm_head.lora" not in k}
    )
    made["file without the embedding"] = _rewrite(
        src, root / "no_emb", lambda w: {k: v for k, v in w.items() if "embed_tokens.lora" not in k}
    )
    return t, made


@pytest.mark.parametrize(
    "case",
    [
        "list lm_head",
        "list embed_tokens",
        "regex lm_head",
        "file without the LM head",
        "file without the embedding",
    ],
)
def test_ensure_weight_tying_adapters_are_served_as_peft_loads_them(weight_tied, case):
    """PEFT targets the LM head through its tie to the embedding although the saved
    ``target_modules`` no longer names it, and gives the half of the tied pair a file
    lacks the other half transposed: served equal to PEFT loading the same directory, in
    a batch beside the base model."""
    import json

    t, made = weight_tied
    path = made[case]
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["ensure_weight_tying"] is True
    if case.startswith("list"):
        assert "lm_head" not in config["target_modules"]  # as PEFT saved it
    pipe = make_pipeline(t, load=())
    pipe.manager.load_adapter(str(path), name="tied")
    ids = prompts(1, seed=82)[0]
    embed, _, logits = _prefill_trace(pipe, ids, ["tied", None])
    expected = _peft_logits(t.base, path, ids)
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)
    assert (logits[0] - logits[1]).abs().max() > 0.1
    assert not torch.equal(embed[0], embed[1])  # the embedding is adapted too


def test_tied_halves_that_differ_are_refused(weight_tied, tmp_path):
    """Both halves of a tied pair in the file, not each other's transpose: PEFT would
    serve whichever it loaded last; refused, naming the two tensors."""
    t, made = weight_tied
    bad = _rewrite(made["list lm_head"], tmp_path / "bad", lambda w: {**w, HEAD_B: w[HEAD_B] * 2})
    pipe = make_pipeline(t, load=())
    with pytest.raises(AdapterError, match=rf"tensors {HEAD_B} and {EMB_A} are tied"):
        pipe.manager.load_adapter(str(bad), name="bad")


def test_ensure_weight_tying_on_an_untied_model_ties_nothing(tiny, weight_tied):
    """The same file on a model that does not tie its embeddings (same shapes): PEFT ties
    nothing and drops the LM head's weights (its target_modules names only the
    embedding), so serving them would differ from PEFT: refused, naming the field."""
    _, made = weight_tied
    path = made["list lm_head"]
    ids = prompts(1, seed=83)[0]
    with_head = _peft_logits(tiny.base, path, ids)
    # PEFT indeed ignores the LM head's pair: dropping it from the file changes nothing
    without = _rewrite(
        path,
        path.parent / "untied_no_head",
        lambda w: {k: v for k, v in w.items() if "lm_head.lora" not in k},
    )
    torch.testing.assert_close(with_head, _peft_logits(tiny.base, without, ids))
    pipe = make_pipeline(tiny, load=())
    with pytest.raises(AdapterError, match="module lm_head has LoRA weights, but adapter_config"):
        pipe.manager.load_adapter(str(path), name="x")
    pipe.manager.load_adapter(str(without), name="y")
    _, _, logits = _prefill_trace(pipe, ids, ["y"])
    torch.testing.assert_close(logits[0], with_head, rtol=1e-4, atol=1e-4)
