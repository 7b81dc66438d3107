"""PEFT config features, each against per-request transformers + peft."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_peft_adapter, make_pipeline, prompts
from safetensors.torch import load_file, save_file
from test_parity import run_prefill

CASES = {
    "regex_targets": dict(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|down_proj)"),
    "all_linear": dict(r=4, lora_alpha=4, target_modules="all-linear"),
    "rank_alpha_pattern": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"v_proj": 8, "layers.1.mlp.up_proj": 2},
        alpha_pattern={"q_proj": 32},
    ),
    "layers_to_transform": dict(
        r=8,
        lora_alpha=16,
        target_modules=["k_proj", "gate_proj"],
        layers_to_transform=[1],
        layers_pattern="layers",
    ),
    "rslora_rank_pattern": dict(
        r=8,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["o_proj", "up_proj"],
        rank_pattern={"o_proj": 2},
    ),
}


@pytest.fixture(scope="module")
def feature_adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    return {
        name: make_peft_adapter(tiny.base, root / name, seed=100 + i, factor=30.0, **kw)
        for i, (name, kw) in enumerate(CASES.items())
    }


def _peft_logits(base_dir, adapter_dir, batch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir
    ).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in batch]


def _matches_peft(tiny, pipe, name, path, *, seed):
    """Adapter ``name`` (loaded from ``path``) serves a prompt as peft does (logits)."""
    batch = prompts(1, seed=seed)
    got = run_prefill(pipe, batch, [name])[0]
    torch.testing.assert_close(got, _peft_logits(tiny.base, path, batch)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_peft_feature_matches_peft(tiny, feature_adapters, case):
    pipe = make_pipeline(tiny, load=())
    pipe.manager.load_adapter(str(feature_adapters[case]), name=case)
    batch = prompts(2, seed=51)
    got = run_prefill(pipe, batch, [case, None])
    want = _peft_logits(tiny.base, feature_adapters[case], batch[:1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(
        got[0], run_prefill(pipe, batch[:1], [None])[0], atol=1e-2
    )  # the adapter acts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_and_adapter_name_infix(tiny, tmp_path, dtype):
    """Weights saved in half precision, and keys with PEFT's adapter-name infix
    (``lora_A.default.weight``), which PEFT loads as the adapter's own."""
    src = tiny.adapters["A"]
    weights = load_file(str(src / "adapter_model.safetensors"))
    renamed = {k.replace(".weight", ".default.weight"): v.to(dtype) for k, v in weights.items()}
    out = tmp_path / "renamed"
    out.mkdir()
    save_file(renamed, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    cast = tmp_path / "cast"
    cast.mkdir()
    save_file(
        {k: v.to(dtype).float() for k, v in weights.items()},
        str(cast / "adapter_model.safetensors"),
    )
    (cast / "adapter_config.json").write_text(
        json.dumps(json.loads((src / "adapter_config.json").read_text()))
    )
    pipe = make_pipeline(tiny, load=())
    pipe.manager.load_adapter(str(out), name="renamed")
    pipe.manager.load_adapter(str(cast), name="cast")
    batch = prompts(1, seed=52)
    got, want = run_prefill(pipe, batch * 2, ["renamed", "cast"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, _peft_logits(tiny.base, out, batch)[0], rtol=1e-4, atol=1e-4)


def test_config_without_lora_alpha_uses_peft_default(tiny, tmp_path):
    """An adapter_config.json without ``lora_alpha``: PEFT's default alpha (8) applies."""
    src = tiny.adapters["A"]  # r=8, lora_alpha=16
    out = tmp_path / "no_alpha"
    out.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    pipe = make_pipeline(tiny, load=())
    pipe.manager.load_adapter(str(out), name="no_alpha")
    _matches_peft(tiny, pipe, "no_alpha", out, seed=52)


@pytest.mark.parametrize(
    "extra",
    [
        {"use_dora": None},
        {"runtime_config": {"ephemeral_gpu_offload": True}},
        {"bias": "all"},
        {"bias": "lora_only"},
        {"target_modules": "ALL-LINEAR"},
        {"corda_config": {"corda_method": "ipm", "prune_temporary_fields": True}},
        {"loftq_config": {"loftq_bits": 4, "loftq_iter": 1}},
        {"lora_ga_config": {"direction": "ArB2r", "scale": "stable", "stable_gamma": 16}},
    ],
    ids=lambda extra: "-".join(f"{k}={v}" for k, v in extra.items())[:40],
)
def test_config_values_peft_loads_as_plain_lora_are_served(tiny, tmp_path, extra):
    """Config values PEFT loads as plain LoRA are served as PEFT serves them (new users'
    trials found them refused): ``use_dora: null`` (PEFT tests it for truth); a
    ``runtime_config`` (where PEFT offloads work; no plain LoRA's output changes); ``bias``
    "all" / "lora_only" on a model without biases (the file holds no bias to load);
    ``"all-linear"`` in capitals (PEFT lower-cases it); an initialisation's settings beside
    ``init_lora_weights: true`` (PEFT ignores them: a CorDA, LoftQ or LoRA-GA adapter
    converted to plain LoRA, as PEFT's ``path_initial_model_for_weight_conversion`` saves
    it, keeps its ``corda_config``)."""
    src = tiny.adapters["A"]
    out = tmp_path / "extra"
    out.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **extra}))
    (out / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    pipe = make_pipeline(tiny, load=())
    pipe.manager.load_adapter(str(out), name="extra")
    _matches_peft(tiny, pipe, "extra", out, seed=53)


def test_embedding_layers_saved_beside_the_adapter(tiny, tmp_path):
    """PEFT's ``save_embedding_layers=True`` saves the base embedding and LM head beside
    the pairs (``...embed_tokens.weight``, ``...lm_head.weight``), and loads them into the
    model: served when they are the model's own (a new user's trial found them refused),
    refused when they are not (serving the pairs alone would be a silent wrong answer)."""
    from lora_graph import AdapterError

    save = {"save_embedding_layers": True}
    path = make_peft_adapter(tiny.base, tmp_path / "emb", seed=54, factor=30.0, r=4,
                             target_modules=["q_proj"], save=save)  # fmt: skip
    weights = load_file(str(path / "adapter_model.safetensors"))
    head, embed = "base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"
    assert head in weights and embed in weights
    pipe = make_pipeline(tiny, load=())
    pipe.manager.load_adapter(str(path), name="emb")
    _matches_peft(tiny, pipe, "emb", path, seed=54)
    save_file({**weights, head: weights[head] * 2}, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="saved base weight of lm_head differs"):
        pipe.manager.load_adapter(str(path), name="emb2")


def test_peft_trainable_tokens_adapter_is_refused(tiny, tmp_path):
    """PEFT's trainable tokens beside LoRA (``trainable_token_indices``) change embedding rows
    that plain LoRA does not: refused, never served without them."""
    from lora_graph import AdapterError

    path = make_peft_adapter(
        tiny.base,
        tmp_path / "tokens",
        seed=53,
        factor=1.0,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        trainable_token_indices=[5, 6, 7],
    )
    pipe = make_pipeline(tiny, load=())
    with pytest.raises(AdapterError, match="trainable_token_indices|token_adapter"):
        pipe.manager.check_adapter(str(path), name="tokens")
    with pytest.raises(AdapterError, match="trainable_token_indices|token_adapter"):
        pipe.manager.load_adapter(str(path), name="tokens")
