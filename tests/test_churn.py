"""Slot churn: 600 decode steps through 3 slots and a 5-adapter host tier.

A dozen adapters of different ranks and target sets (the embedding and LM head included);
every step draws a random batch
(base rows mixed in) and every row is checked against the reference logits of its
(token, adapter) from transformers + peft. Rows decode at position 0 of their own KV cache
row, so a row's output depends on its token and adapter alone, whatever ran before.
"""

from __future__ import annotations

import random

import torch
from conftest import ALL_LINEARS, Row, make_peft_adapter

from lora_graph import LoRAConfig
from lora_graph.architectures import LlamaPipeline
from lora_graph.step import SeqChunk

TARGET_SETS = [
    ["q_proj", "v_proj"],
    ALL_LINEARS,
    ["o_proj", "down_proj"],
    ["embed_tokens", "lm_head", "gate_proj", "up_proj", "k_proj"],
]
STEPS = 600
TOKENS = [5, 17, 42, 99]


def test_churn_every_row_matches_peft(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    specs = {}
    for i in range(12):
        kw = dict(
            r=[2, 4, 8, 16][i % 4],
            lora_alpha=8,
            target_modules=TARGET_SETS[i % 4],
            use_rslora=i % 3 == 0,
        )
        if i == 5:
            kw["rank_pattern"] = {"down_proj": 2}
        specs[f"ad{i}"] = make_peft_adapter(
            tiny.base, tmp_path / f"ad{i}", seed=200 + i, factor=20.0, **kw
        )
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny.base), specs["ad0"], adapter_name="ad0"
    ).eval()
    for name, path in list(specs.items())[1:]:
        model.load_adapter(path, adapter_name=name)
    reference: dict[tuple[int, str | None], torch.Tensor] = {}
    with torch.no_grad():
        for token in TOKENS:
            with model.disable_adapter():
                reference[(token, None)] = model(torch.tensor([[token]])).logits[0, -1]
            for name in specs:
                model.set_adapter(name)
                reference[(token, name)] = model(torch.tensor([[token]])).logits[0, -1]

    pipe = LlamaPipeline(
        str(tiny.base),
        max_batch_size=6,
        max_seq_len=8,
        lora=LoRAConfig(max_slots=3, max_rank=16, cpu_capacity=5),
    )
    for name, path in specs.items():
        pipe.manager.load_adapter(str(path), name=name)
    rng = random.Random(0)
    names: list[str | None] = [*specs, None, None]
    for step in range(STEPS):
        width = rng.randint(1, 6)
        chosen = rng.sample([n for n in names if n is not None], rng.randint(0, 3))
        rows = [Row(rng.choice([*chosen, None]) if chosen else None) for _ in range(width)]
        tokens = [rng.choice(TOKENS) for _ in rows]
        chunks = [
            SeqChunk(r.adapter, [t], 0, pipe.pages.allocate(1), owner=(r, t))
            for r, t in zip(rows, tokens, strict=True)
        ]
        inputs = pipe.prepare(chunks)
        logits = pipe.execute(inputs)
        for c in chunks:
            pipe.pages.free(c.pages)
        rows, tokens = zip(*(c.owner for c in inputs.chunks), strict=True)
        for row, token, got in zip(rows, tokens, logits[: len(rows)], strict=True):
            torch.testing.assert_close(
                got,
                reference[(token, row.adapter)],
                rtol=1e-4,
                atol=1e-4,
                msg=lambda m, s=step, r=row: f"step {s}, adapter {r.adapter}: {m}",
            )
    assert pipe.manager.slot_loads > 150  # the slots really churned
    assert sum(name in pipe.manager.host for name in specs) == 5  # host tier capacity held
