"""Where one packed step's device time goes: kernel time by kind, base-only against LoRA.

Llama-3-8B shapes, bf16, random weights and random adapters on all seven linears (rank 16,
or ``--ranks`` cycled over them in a pool of their largest rank; as ``bench/decode.py``).
One step as ``bench/serve.py`` runs them at ``--max-num-batched-tokens``: ``--decodes``
requests decoding (contexts spread around ``--context``) beside prefill chunks filling the
rest of the token budget, requests spread round-robin over ``--adapters`` adapters plus
base rows. The step is captured (CUDA graphs) at its token bucket, replayed, and the
replays profiled with ``torch.profiler`` (CUPTI traces the kernels inside a graph); kernel
time is summed by kind:

    gemm        cuBLAS / cutlass matrix multiplies (the base linears, the LM head)
    lora        lora_graph's shrink / expand kernels, and their memsets
    collective  NCCL's kernels (``--tensor-parallel-size``)
    attention   lora_graph's paged attention
    other       everything else (norms, RoPE, residual adds, KV writes, sampling inputs)

for the LoRA pipeline with the mixed batch and with every row on the base model (the
base-only graph), and the step's wall time (CUDA events) for each.

    python bench/profile_step.py             # the H200 run
    python bench/profile_step.py --tokens 1 --decodes 1 --context 64 --adapters 16 \
        --ranks 8/16/32/64                   # a decode step of one row in a rank-64 pool
    python bench/profile_step.py --smoke     # tiny shapes on the CPU (no kernels traced)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import decode as bench_decode  # bench/decode.py
import torch


def kind(name: str) -> str:
    n = name.lower()
    if "paged_attention" in n or "reduce_splits" in n:
        return "attention"
    if "nccl" in n:
        return "collective"
    if "shrink" in n or "expand" in n or "lora" in n:
        return "lora"
    if "gemm" in n or "cutlass" in n or "sm90" in n or "cublas" in n or "nvjet" in n:
        return "gemm"
    return "other"


def step_chunks(pipe, args, names, vocab):
    """The step's chunks: decodes at spread contexts, then prefill chunks to the budget."""
    from lora_graph.step import SeqChunk

    g = torch.Generator().manual_seed(0)
    chunks = []
    pool = [*names, None]
    for i in range(args.decodes):
        ctx = args.context // 2 + (args.context * i) // max(1, args.decodes - 1)
        pages = pipe.pages.allocate(pipe.pages.pages_for(ctx + 1))
        chunks.append(SeqChunk(pool[i % len(pool)], [5], ctx, pages))
    left, i = args.tokens - args.decodes, 0
    while left > 0:
        n = min(left, args.chunk)
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        pages = pipe.pages.allocate(pipe.pages.pages_for(n))
        chunks.append(SeqChunk(pool[i % len(pool)], ids, 0, pages))
        left -= n
        i += 1
    return chunks


def profile(
    pipe, chunks, reps: int, top_n: int = 10
) -> tuple[float, dict[str, float], list[tuple[str, float, float]]]:
    """Median ms of the step (replay), kernel ms per replay by kind, and the ``top_n``
    kernels that took longest (name, ms per replay, launches per replay)."""
    inputs = pipe.prepare(chunks)
    for _ in range(3):
        pipe.execute(inputs)
    times = []
    for _ in range(reps):
        if pipe.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            pipe.execute(inputs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            pipe.execute(inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    by_kind: dict[str, float] = defaultdict(float)
    top: list[tuple[str, float, float]] = []
    if pipe.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                pipe.execute(inputs)
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            device_us = getattr(evt, "device_time_total", None)
            if device_us is None:
                device_us = getattr(evt, "cuda_time_total", 0.0)
            if device_us:
                by_kind[kind(evt.key)] += device_us / 1e3 / reps
                top.append((evt.key[:90], device_us / 1e3 / reps, evt.count / reps))
    top = sorted(top, key=lambda kv: -kv[1])[:top_n]
    return statistics.median(times), dict(by_kind), top


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=512, help="tokens in the step (default 512)")
    p.add_argument("--decodes", type=int, default=64, help="decoding requests (default 64)")
    p.add_argument("--chunk", type=int, default=224, help="tokens a prefill chunk (default 224)")
    p.add_argument("--context", type=int, default=600, help="mean decode context (default 600)")
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters (default 8)")
    p.add_argument(
        "--ranks",
        default="16",
        help="the adapters' ranks, cycled over them, e.g. 8/16/32/64 (the pool's max_rank is "
        "the largest; default 16)",
    )
    p.add_argument(
        "--side-stream-rows", type=int, default=None, help="KernelPolicy.side_stream_max_rows"
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="no capture (kernel times stay valid where the profiler cannot trace graphs)",
    )
    p.add_argument(
        "--kernels",
        type=int,
        default=10,
        help="list this many of the longest kernels a run (name, ms and launches a step; "
        "default 10)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="profile rank 0 of a tensor-parallel pipeline of this many ranks (1: the "
        "distributed path on one GPU; default: no group)",
    )
    p.add_argument(
        "--reduce-delta-apart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KernelPolicy.reduce_delta_apart (default on): a row-parallel layer's delta "
        "all-reduced beside its output; --no-reduce-delta-apart adds it before",
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args()
    parts = args.ranks.split("/")
    if not all(r.isascii() and r.isdigit() and int(r) > 0 for r in parts):
        p.error(f"--ranks must be positive integers separated by '/', got {args.ranks!r}")
    ranks = [int(r) for r in parts]

    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline
    from lora_graph.kernels.policy import KernelPolicy

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shapes = dict(bench_decode.SMOKE if args.smoke else bench_decode.LLAMA3_8B)
    if args.smoke:
        args.tokens, args.decodes, args.chunk, args.context = 16, 4, 6, 20
        args.adapters, args.reps = 2, 2
    policy = KernelPolicy(
        side_stream_max_rows=KernelPolicy().side_stream_max_rows
        if args.side_stream_rows is None
        else args.side_stream_rows,
        reduce_delta_apart=args.reduce_delta_apart,
    )
    work = Path(tempfile.mkdtemp(prefix="lora_graph_profile_"))
    hf_config = LlamaConfig(**shapes)
    hf_config.save_pretrained(work / "base")
    torch.manual_seed(0)
    with torch.device(device):
        weights = dict(LlamaForCausalLM(hf_config).to(torch.bfloat16).state_dict())
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        bench_decode.write_adapter(work / name, shapes, ranks[i % len(ranks)], seed=i)
    pipe = LlamaPipeline(
        str(work / "base"),
        dtype=torch.bfloat16,
        device=device,
        max_batch_size=args.decodes + -(-(args.tokens - args.decodes) // args.chunk),
        max_seq_len=2 * args.context + args.tokens,
        max_num_batched_tokens=args.tokens,
        weights=weights,
        lora=LoRAConfig(max_slots=max(1, args.adapters), max_rank=max(ranks), kernel_policy=policy),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    del weights
    for name in names:
        pipe.manager.load_adapter(str(work / name), name=name)
    if not args.eager:
        mode = "inductor" if device.type == "cpu" else "cudagraph"
        pipe.enable_compile(mode, token_buckets=[args.tokens], progress=False)
    rows = {}
    for label, adapters in (("lora mixed", names), ("base only", [])):
        chunks = step_chunks(pipe, args, adapters, shapes["vocab_size"])
        rows[label] = profile(pipe, chunks, args.reps, args.kernels)
        for c in chunks:
            pipe.pages.free(c.pages)
    kinds = ["gemm", "lora", "attention", "collective", "other"]
    print(
        f"\nstep of {args.tokens} tokens: {args.decodes} decodes (mean context {args.context}) "
        f"+ prefill chunks of {args.chunk}; {args.adapters} adapters of ranks {args.ranks}; "
        f"{device}\n"
    )
    print("| run | step ms | " + " | ".join(f"{k} ms" for k in kinds) + " |")
    print("|---|---:|" + "---:|" * len(kinds))
    for label, (ms, by_kind, _) in rows.items():
        cells = [f"{ms:.3f}", *(f"{by_kind.get(k, 0.0):.3f}" for k in kinds)]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for label, (_, _, top) in rows.items():
        if top:
            print(f"\nlongest kernels, {label} (ms a step, launches a step):")
            for name, ms, count in top:
                print(f"  {ms:8.3f} {count:6.1f}  [{kind(name)}] {name}")
    assert pipe.graphs is None or pipe.graphs.recompiles == 0
    pipe.close()


if __name__ == "__main__":
    main()
