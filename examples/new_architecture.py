"""Adding an architecture, step by step: IBM's Granite (``GraniteForCausalLM``).

Granite is Llama with four scalars (transformers' ``modeling_granite.py``): the embedding
is multiplied by ``embedding_multiplier``, attention scales by ``attention_multiplier``
instead of ``head_dim ** -0.5``, each block's output joins the residual times
``residual_multiplier``, and the logits are divided by ``logits_scaling``. Everything else
(the checkpoint's names, the LoRA targets, the paged KV cache, the step inputs) is
Llama's, so the subclass below is all it takes; ``docs/adding_an_architecture.md`` walks
through it.

Run it (CPU, seconds; nothing is downloaded): it builds a tiny random Granite with
``transformers`` and two adapters with ``peft``, then checks a mixed batch (base rows and
both adapters) against ``transformers`` + ``peft`` run per request, logits and greedy
tokens::

    python examples/new_architecture.py
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lora_graph.architectures import PIPELINES, LlamaPipeline, pipeline_class
from lora_graph.models.blocks import AttentionMetadata, GatedMLP, PagedAttention, RMSNorm
from lora_graph.models.llama import LlamaConfig, LlamaModel, hf_fields
from lora_graph.routing import Routing


# 1. The config: Llama's fields (read by hf_fields) plus Granite's four scalars.
@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, hf: Any) -> GraniteConfig:
        """Read a ``transformers`` ``GraniteConfig``; refuse what this model does not do."""
        if hf.model_type != "granite":
            raise ValueError(f"unsupported model type {hf.model_type!r} (granite)")
        if hf.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r} (silu)")
        return cls(
            **hf_fields(hf, "granite"),
            embedding_multiplier=float(hf.embedding_multiplier),
            residual_multiplier=float(hf.residual_multiplier),
            attention_multiplier=float(hf.attention_multiplier),
            logits_scaling=float(hf.logits_scaling),
        )


# 2. The block, from the shared blocks, with Hugging Face's attribute names (the LoRA
#    target paths and the checkpoint names follow them).
class GraniteDecoderLayer(nn.Module):
    def __init__(self, config: GraniteConfig, kv_cache, window: int | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = PagedAttention(config, kv_cache, window, scale=config.attention_multiplier)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, config.intermediate_size, bias=config.mlp_bias)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata,
        routing: Routing | None,
    ) -> Tensor:  # fmt: skip
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn, routing)
        x = x + a * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x), routing) * self.residual_multiplier


# 3. The model: Llama's stack with this block, the embedding scaled (its LoRA delta too, as
#    in transformers, where the multiplier applies to the embedding module's output) and
#    the logits divided.
class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def embed(self, tokens: Tensor, routing: Routing | None) -> Tensor:
        return self.embed_tokens(tokens, routing) * self.config.embedding_multiplier

    def final_logits(self, logits: Tensor) -> Tensor:
        return logits.float() / self.config.logits_scaling


# 4. The pipeline: what the engine asks of an architecture. Granite inherits Llama's weights
#    adapter (q/k/v and gate/up fused on load), LoRA target table and module map, compile
#    regions (the decoder layers) and declared step inputs (_get_compile_input_types: the
#    paged decoder's); a model that differs there overrides those methods.
class GranitePipeline(LlamaPipeline):
    config_class = GraniteConfig
    model_class = GraniteModel


# 5. The registration line: `lora-graph generate/serve --model` and pipeline_class find it.
PIPELINES["granite"] = GranitePipeline


def main() -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers import GraniteConfig as HFGraniteConfig

    from lora_graph import LoRAConfig
    from lora_graph.engine import LLMEngine, Request, SamplingParams
    from lora_graph.step import SeqChunk

    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="granite_"))
    hf_config = HFGraniteConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.05,
        logits_scaling=4.0,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(root / "base")
    adapters = {"qv": ["q_proj", "v_proj"], "all": ["q_proj", "k_proj", "v_proj", "o_proj",
                "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]}  # fmt: skip
    for i, (name, modules) in enumerate(adapters.items()):
        torch.manual_seed(10 + i)
        model = AutoModelForCausalLM.from_pretrained(root / "base")
        peft_model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=modules, init_lora_weights=False)
        )
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname or "lora_embedding_B" in pname:
                    p.mul_(20)
        peft_model.save_pretrained(root / name)

    pipe = pipeline_class("granite")(
        str(root / "base"), max_batch_size=4, max_seq_len=64,
        lora=LoRAConfig(max_slots=2, max_rank=8),
    )  # fmt: skip
    for name in adapters:
        pipe.manager.load_adapter(str(root / name), name=name)

    base = AutoModelForCausalLM.from_pretrained(root / "base")
    ref = PeftModel.from_pretrained(base, root / "qv", adapter_name="qv").eval()
    ref.load_adapter(root / "all", adapter_name="all")

    @torch.no_grad()
    def ref_logits(ids: list[int], adapter: str | None) -> Tensor:
        if adapter is None:
            with ref.disable_adapter():
                return ref(torch.tensor([ids])).logits[0]
        ref.set_adapter(adapter)
        return ref(torch.tensor([ids])).logits[0]

    # a mixed batch in one packed step: every token's logits, each row under its adapter
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 7, 4)]
    mix = ["all", None, "qv", "all"]
    chunks = [
        SeqChunk(a, ids, 0, pipe.pages.allocate(pipe.pages.pages_for(len(ids))), owner=i)
        for i, (ids, a) in enumerate(zip(batch, mix, strict=True))
    ]
    inputs = pipe.prepare(chunks, all_logits=True)
    logits = pipe.execute(inputs)
    at, worst = 0, 0.0
    for c in inputs.chunks:
        got = logits[at : at + len(c.token_ids)]
        at += len(c.token_ids)
        worst = max(worst, float((got - ref_logits(list(c.token_ids), c.adapter)).abs().max()))
        pipe.pages.free(c.pages)
    print(f"mixed batch, every token's logits: max |engine - peft| = {worst:.2e}")
    assert worst < 1e-4, worst

    # greedy generation through the engine (packed steps, paged KV) against peft's
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [
        Request(str(i), ids, a, sampling) for i, (ids, a) in enumerate(zip(batch, mix, strict=True))
    ]
    for req, out in zip(reqs, LLMEngine(pipe).generate(reqs), strict=True):
        ids, want = list(req.prompt_token_ids), []
        for _ in range(8):
            want.append(int(ref_logits(ids + want, req.adapter)[-1].argmax()))
        same = "==" if out.token_ids == want else "!="
        print(f"[{req.adapter or 'base':>4}] {out.token_ids} {same} peft")
        assert out.token_ids == want
    print("Granite: the engine equals transformers + peft")


if __name__ == "__main__":
    main()
