"""Load a model and adapters, capture every token bucket, print the capture keys, run a mixed
batch (packed steps: prefill chunks and decodes together).

With no arguments: the bundled demo model and adapters, on the GPU with CUDA graphs if
there is one, else on the CPU with torch.compile (inductor).

    python examples/compile_and_run.py [--model DIR] [--lora NAME=PATH ...] [--compile MODE]

Adapters are loaded *after* the capture: they ride into the captured graphs as inputs,
so loading them compiles nothing. A LoRA layer graph's inputs do not grow with the slots:
each LoRA layer passes its two stacked views of the slot pool and the step's routing
(26 inputs for the demo model's decoder layer at any ``--max-loras``; before the stacked
views, 56 at 4 slots and 152 at 16).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from lora_graph import LoRAConfig
from lora_graph.architectures import LlamaPipeline
from lora_graph.engine import LLMEngine, Request, SamplingParams

ASSETS = Path(__file__).resolve().parent / "assets"


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=str(ASSETS / "base"), help="model directory (default: the demo model)"
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="adapters (default: every bundled demo adapter)",
    )
    parser.add_argument(
        "--compile", default="cudagraph" if cuda else "inductor", choices=["inductor", "cudagraph"]
    )
    parser.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument(
        "--max-loras", type=int, default=None, help="device slots (default: one per adapter)"
    )
    args = parser.parse_args()
    loras = args.lora or [
        f"{p.name}={p}" for p in sorted((ASSETS / "adapters").iterdir()) if p.is_dir()
    ]

    pipe = LlamaPipeline(
        args.model,
        device=args.device,
        max_batch_size=8,
        max_seq_len=128,
        max_num_batched_tokens=32,
        lora=LoRAConfig(max_slots=args.max_loras or max(1, len(loras)), max_rank=64),
    )
    start = time.perf_counter()
    graphs = pipe.enable_compile(args.compile, token_buckets=(8, 32))
    print(
        f"captured {len(graphs.graphs)} graphs in {time.perf_counter() - start:.1f} s "
        f"({args.compile}, {args.device})"
    )
    for key, graph in graphs.graphs.items():
        kind = "none" if not key.lora else ", ".join(sorted(graph.lora_ops))
        print(
            f"  {str(key):36s} layer graphs compiled: {graph.compiles}  layer graph inputs: "
            f"{graph.inputs}  LoRA ops: {kind}"
        )

    names = []
    for spec in loras:
        name, _, path = spec.partition("=")
        pipe.manager.load_adapter(path, name=name)
        names.append(name)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(args.prompt)["input_ids"]
    adapters: list[str | None] = [None, *names, None, *names][:8]
    requests = [
        Request(str(i), ids, a, SamplingParams(max_new_tokens=20)) for i, a in enumerate(adapters)
    ]
    engine = LLMEngine(pipe, eos_token_ids=(tokenizer.eos_token_id,))
    for req, out in zip(requests, engine.generate(requests), strict=True):
        print(
            f"[{req.adapter or 'base':>8}] "
            f"{tokenizer.decode(out.token_ids, skip_special_tokens=True)!r}"
        )
    replayed = {str(k): g.replays for k, g in graphs.graphs.items() if g.replays}
    print(f"replays by key: {replayed}; recompiles while serving: {graphs.recompiles}")


if __name__ == "__main__":
    main()
