"""Tiny models and PEFT adapters, built in the test session (nothing is downloaded).

The reference for every engine output is Hugging Face ``transformers`` + ``peft`` on the
same checkpoint, run one request at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the cores shared among pytest-xdist's workers (-n auto: one each), and inherited by the
# processes the tests start (OMP_NUM_THREADS): on 2 cores, two workers of two threads each
# took the suite's wall time up by two fifths
_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
_THREADS = min(_THREADS, 2)
os.environ["OMP_NUM_THREADS"] = str(_THREADS)
torch.set_num_threads(_THREADS)

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (peft LoraConfig kwargs, factor B is multiplied by so the delta is large)
ADAPTERS = {
    "A": (dict(r=8, lora_alpha=16, target_modules=ALL_LINEARS), 20.0),
    "B": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True), 40.0),
    "C": (dict(r=16, lora_alpha=8, target_modules=["o_proj", "gate_proj", "down_proj"]), 20.0),
    # the embedding (lora_embedding_A/B) and the LM head (per segment), at another rank
    "D": (
        dict(
            r=8,
            lora_alpha=16,
            target_modules=["embed_tokens", "lm_head", "q_proj", "down_proj"],
            rank_pattern={"lm_head": 4},
        ),
        20.0,
    ),
}


@pytest.fixture(autouse=True)
def _async_scheduling_on_the_cpu_too(monkeypatch):
    """The engine's default on CUDA, asynchronous scheduling, is what every test runs on
    the CPU too (where its default is off: nothing would overlap); tests that compare the
    two modes pass ``async_scheduling`` explicitly."""
    import lora_graph.engine

    monkeypatch.setattr(lora_graph.engine, "default_async_scheduling", lambda device: True)


@dataclass
class Row:
    """A batch row as the manager sees it."""

    adapter: str | None


@dataclass
class Tiny:
    """A tiny model directory, its adapters' directories, and the kind of model."""

    kind: str
    base: Path
    adapters: dict[str, Path]
    vocab_size: int


def make_hf_model(kind: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind in ("qwen2", "qwen2_window"):
        # qwen2_window: a sliding window of 4 on layer 1 only (max_window_layers=1), as
        # transformers applies it; prompts of 3-12 tokens reach past it
        window = (
            dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
            if kind == "qwen2_window"
            else {}
        )
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2, **window))
        with torch.no_grad():  # make the q/k/v biases visible
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
        return model
    if kind == "phi3":
        # fused qkv_proj / gate_up_proj in the checkpoint, RoPE on half of each head's dims,
        # and a sliding window of 6 on every layer (prompts reach past it)
        from transformers import Phi3Config, Phi3ForCausalLM

        cfg = Phi3Config(
            **common, num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=6,
            pad_token_id=0,
        )  # fmt: skip
        return Phi3ForCausalLM(cfg)
    if kind == "gemma2":
        # four offset norms a layer (random weights), GeGLU, a scaled tied embedding,
        # query_pre_attn_scalar != head_dim, sliding (window 4) and full layers
        # alternating, and soft caps the logits reach (q/k scaled up, small caps)
        from transformers import Gemma2Config, Gemma2ForCausalLM

        cfg = Gemma2Config(
            **common, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
            pad_token_id=0,
        )  # fmt: skip
        model = Gemma2ForCausalLM(cfg)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0, 0.5)
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8)
                layer.self_attn.k_proj.weight.mul_(8)
            model.model.embed_tokens.weight.mul_(20)
        return model
    if kind == "qwen3":
        # per-head q/k norms (random weights, so a norm not loaded shows), attention biases,
        # and a head_dim that is not hidden / heads
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**common, num_key_value_heads=2, head_dim=32, attention_bias=True)
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                attn.q_norm.weight.normal_(1, 0.5)
                attn.k_norm.weight.normal_(1, 0.5)
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                    proj.bias.normal_(0, 0.5)
        return model
    extra = {
        "gqa": dict(num_key_value_heads=2),
        "tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
        # a vocabulary 2 ranks do not split (tensor parallelism pads it)
        "vocab127": dict(num_key_value_heads=2, tie_word_embeddings=True, vocab_size=127),
        "llama3": dict(
            num_key_value_heads=1,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    }[kind]
    return LlamaForCausalLM(LlamaConfig(**{**common, **extra}))


def make_peft_adapter(
    base_dir: Path, out_dir: Path, *, seed: int, factor: float, save: dict | None = None,
    **lora_kwargs,
) -> Path:  # fmt: skip
    """An adapter made by peft on ``base_dir`` (B scaled by ``factor``), saved to ``out_dir``
    (``save``: ``save_pretrained``'s keyword arguments)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(factor)
    peft_model.save_pretrained(out_dir, **(save or {}))
    return out_dir


# a checkpoint that stores q/k/v and gate/up fused names them as one module each (Phi-3)
PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip


def for_model(kind: str, lora_kwargs: dict) -> dict:
    """``ADAPTERS``' LoraConfig kwargs for a model kind: Phi-3's adapters target its packed
    modules where the others name the separate ones."""
    if kind != "phi3":
        return lora_kwargs
    names = [PACKED.get(m, m) for m in lora_kwargs["target_modules"]]
    return {**lora_kwargs, "target_modules": list(dict.fromkeys(names))}


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict[str, Tiny] = {}

    def build(kind: str) -> Tiny:
        if kind not in cache:
            root = tmp_path_factory.mktemp(kind)
            make_hf_model(kind).save_pretrained(root / "base")
            adapters = {
                name: make_peft_adapter(
                    root / "base", root / name, seed=i + 10, factor=f, **for_model(kind, kw)
                )
                for i, (name, (kw, f)) in enumerate(ADAPTERS.items())
            }
            cache[kind] = Tiny(kind, root / "base", adapters, 128)
        return cache[kind]

    return build


@pytest.fixture(scope="session")
def tiny(tiny_factory) -> Tiny:
    return tiny_factory("gqa")


class PeftReference:
    """Per-request reference: ``transformers`` + ``peft`` with every adapter loaded."""

    def __init__(
        self,
        t: Tiny,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        autocast_adapter_dtype: bool = True,
    ) -> None:
        """``autocast_adapter_dtype`` is PEFT's: True (its default) keeps the adapter weights
        in float32 under a half-precision base; False casts them to ``dtype``."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.device = device
        # the float32 truth runs eager attention, the models' own semantics (transformers
        # 5.17's Gemma 2 under SDPA, its default there, drops the attention soft cap); a
        # half-precision peer runs as users run it (the default attention)
        attention = {"attn_implementation": "eager"} if dtype == torch.float32 else {}
        base = AutoModelForCausalLM.from_pretrained(t.base, dtype=dtype, **attention)
        base = base.to(device).eval()
        names = list(t.adapters)
        self.model = PeftModel.from_pretrained(
            base,
            t.adapters[names[0]],
            adapter_name=names[0],
            autocast_adapter_dtype=autocast_adapter_dtype,
        ).eval()
        for name in names[1:]:
            self.model.load_adapter(
                t.adapters[name], adapter_name=name, autocast_adapter_dtype=autocast_adapter_dtype
            )

    @torch.no_grad()
    def logits(self, ids: list[int], adapter: str | None) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        if adapter is None:
            with self.model.disable_adapter():
                return self.model(x).logits[0].float().cpu()
        self.model.set_adapter(adapter)
        return self.model(x).logits[0].float().cpu()

    def greedy(self, ids: list[int], adapter: str | None, n: int) -> list[int]:
        ids = list(ids)
        out = []
        for _ in range(n):
            token = int(self.logits(ids, adapter)[-1].argmax())
            ids.append(token)
            out.append(token)
        return out


@pytest.fixture(scope="session")
def reference_factory():
    cache: dict[str, PeftReference] = {}

    def build(t: Tiny) -> PeftReference:
        if t.kind not in cache:
            cache[t.kind] = PeftReference(t)
        return cache[t.kind]

    return build


def make_pipeline(
    t: Tiny,
    *,
    max_slots: int = 4,
    max_rank: int = 16,
    max_batch_size: int = 8,
    max_seq_len: int = 64,
    load: tuple[str, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    slot_dtype: torch.dtype | None = None,
    **pipeline_kwargs,
):
    from transformers import AutoConfig

    from lora_graph import LoRAConfig
    from lora_graph.architectures import pipeline_class

    pipe = pipeline_class(AutoConfig.from_pretrained(t.base).model_type)(
        str(t.base),
        dtype=dtype,
        device=device,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        lora=LoRAConfig(max_slots=max_slots, max_rank=max_rank, dtype=slot_dtype),
        **pipeline_kwargs,
    )
    for name in load if load is not None else tuple(t.adapters):
        pipe.manager.load_adapter(str(t.adapters[name]), name=name)
    return pipe


def prompts(
    n: int, *, seed: int = 0, vocab: int = 128, min_len: int = 3, max_len: int = 12
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(3, vocab, (int(n_),), generator=g).tolist() for n_ in lengths]


def run_prefill(pipe, batch: list[list[int]], adapters: list[str | None]) -> list[torch.Tensor]:
    """All-position logits of one packed prefill step; item i of the result is request i.
    Each request's pages are taken from the pipeline's pool and given back after."""
    from lora_graph.step import SeqChunk

    chunks = []
    for i, (ids, adapter) in enumerate(zip(batch, adapters, strict=True)):
        pages = pipe.pages.allocate(pipe.pages.pages_for(len(ids)))
        chunks.append(SeqChunk(adapter, ids, 0, pages, owner=i))
    try:
        inputs = pipe.prepare(chunks, all_logits=True)
        logits = pipe.execute(inputs)
    finally:
        for c in chunks:
            pipe.pages.free(c.pages)
    out: list[torch.Tensor] = [torch.empty(0)] * len(batch)
    at = 0
    for c in inputs.chunks:
        out[c.owner] = logits[at : at + len(c.token_ids)]
        at += len(c.token_ids)
    return out
