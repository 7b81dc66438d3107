"""The distributed path at size 1 against the plain step, in one process, interleaved.

Tensor parallelism's target on one GPU (#30): the step of a pipeline built at
``tensor_parallel_size=1`` (an NCCL group of one rank: the sharded model, a row-parallel
layer's all-reduce inside the captured graph) no slower than the plain pipeline's step
(no group) by more than 1%. Two processes differ by more than that at one row: the device
copy bandwidth ``bench/decode.py`` measures varied by 2% between its runs (4.09-4.17 TB/s,
session 21), so comparing one process's medians with another's cannot resolve 1%.

Here both pipelines live in one process (the plain one built and captured first, then the
group joined and the size-1 one built), Llama-3-8B shapes, random bf16 weights, 4
rank-16 adapters on all seven linears loaded into both, CUDA graphs. Each round times, for
each batch, a decode step of (b) base-only rows and (d) the 4 adapters mixed on both
pipelines (:func:`time_step_modes`: the step waited for, as ``bench/decode.py`` times it;
10 steps queued back to back; the launch's host time), the order of the two flipped every
round. Reported: the medians over the rounds, their ratio (size 1 over plain), and the
lowest and highest per-round ratio of the first.

    python bench/tp_overhead.py                    # the H200 run
    python bench/tp_overhead.py --smoke            # tiny shapes on the CPU (gloo), eager
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import decode as bench_decode  # bench/decode.py
import torch


def time_step_modes(
    pipe, batch: int, adapters: list, *, context: int, reps: int
) -> tuple[float, float, float]:
    """Three medians of one packed decode step (``bench/decode.py``'s step; ms): ``sync``,
    each step between CUDA events and waited for (``bench/decode.py``'s number: the launch's
    host time before the device starts is in it); ``pipelined``, 10 steps queued back to back
    between two events, a tenth of it (the device's time a step, the host's hidden behind
    the steps before, as under asynchronous scheduling); ``host``, the ``execute`` call's own
    wall time (its launch), the device not waited for."""
    from lora_graph.step import SeqChunk

    g = torch.Generator().manual_seed(batch)
    chunks = []
    for adapter, ctx in zip(adapters, bench_decode.contexts(batch, context), strict=True):
        token = int(torch.randint(0, pipe.config.vocab_size, (), generator=g))
        pages = pipe.pages.allocate(pipe.pages.pages_for(ctx + 1))
        chunks.append(SeqChunk(adapter, [token], ctx, pages))
    cuda = pipe.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def events() -> tuple:
        return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    try:
        inputs = pipe.prepare(chunks)
        for _ in range(3):
            pipe.execute(inputs)
        sync()
        step_ms, piped_ms, host_ms = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            if cuda:
                start, end = events()
                start.record()
            pipe.execute(inputs)
            host_ms.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                end.record()
                end.synchronize()
                step_ms.append(start.elapsed_time(end))
            else:
                step_ms.append(host_ms[-1])
        for _ in range(max(1, reps // 10)):
            t0 = time.perf_counter()
            if cuda:
                start, end = events()
                start.record()
            for _ in range(10):
                pipe.execute(inputs)
            if cuda:
                end.record()
                end.synchronize()
                piped_ms.append(start.elapsed_time(end) / 10)
            else:
                piped_ms.append((time.perf_counter() - t0) * 1e3 / 10)
    finally:
        for c in chunks:
            pipe.pages.free(c.pages)
    med = statistics.median
    return med(step_ms), med(piped_ms), med(host_ms)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=64, help="mean decode context (default 64)")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds (default 8)")
    parser.add_argument("--reps", type=int, default=50, help="steps timed a round (default 50)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--json", default="bench/out/tp_overhead.json")
    args = parser.parse_args()

    from transformers import LlamaConfig

    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shapes = bench_decode.SMOKE if args.smoke else bench_decode.LLAMA3_8B
    if args.smoke:
        args.rounds, args.reps, args.batch_sizes = 2, 2, [1, 4]
    mode = "eager" if device.type == "cpu" else "cudagraph"
    work = Path(tempfile.mkdtemp(prefix="lora_graph_tp_overhead_"))
    LlamaConfig(**shapes).save_pretrained(work / "base")
    names = [f"a{i}" for i in range(4)]
    for i, name in enumerate(names):
        bench_decode.write_adapter(work / name, shapes, 16, seed=i)
    weights = bench_decode.RandomWeights(shapes)
    max_batch = max(args.batch_sizes)
    common = dict(
        dtype=torch.bfloat16,
        device=device,
        max_batch_size=max_batch,
        max_seq_len=3 * args.context // 2 + 64,
        max_num_batched_tokens=max(max_batch, 16),
        weights=weights,
        lora=LoRAConfig(max_slots=4, max_rank=16),
    )
    pipes = {}
    for label, size in (("plain", None), ("size 1", 1)):
        t0 = time.time()
        bench_decode.release_memory(device)  # (dynamo's caches: each compiles the layers afresh)
        pipe = LlamaPipeline(str(work / "base"), **common, tensor_parallel_size=size)
        bench_decode.compile_step(pipe, mode, args.batch_sizes)
        for name in names:
            pipe.manager.load_adapter(str(work / name), name=name)
        pipes[label] = pipe
        print(f"{label}: built, captured and loaded in {time.time() - t0:.1f} s", flush=True)

    kinds = {
        "(b) base rows": lambda b: [None] * b,
        "(d) 4 adapters": lambda b: bench_decode.mix(b, names),
    }
    times: dict = {(k, b, p): [] for k in kinds for b in args.batch_sizes for p in pipes}
    for r in range(args.rounds):
        order = list(pipes) if r % 2 == 0 else list(pipes)[::-1]
        for b in args.batch_sizes:
            for kind, adapters in kinds.items():
                for label in order:
                    ms = time_step_modes(
                        pipes[label], b, adapters(b), context=args.context, reps=args.reps
                    )
                    times[(kind, b, label)].append(ms)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for pipe in pipes.values():
        assert pipe.graphs is None or pipe.graphs.recompiles == 0
    pipes["size 1"].close()  # (leaves the group)

    modes = ("sync", "pipelined", "host")
    lines = [
        "| step | batch | "
        + " | ".join(f"{m} plain ms | {m} size 1 ms | {m} ratio" for m in modes)
        + " | sync per-round ratio min / max |",
        "|---|---:|" + "---:|---:|---:|" * len(modes) + "---:|",
    ]
    rows = []
    for kind in kinds:
        for b in args.batch_sizes:
            plain, one = times[(kind, b, "plain")], times[(kind, b, "size 1")]
            row: dict = {"step": kind, "batch": b}
            cells = []
            for m, mode in enumerate(modes):
                p = statistics.median(t[m] for t in plain)
                o = statistics.median(t[m] for t in one)
                row[mode] = {"plain_ms": [t[m] for t in plain], "size1_ms": [t[m] for t in one],
                             "ratio": o / p}  # fmt: skip
                cells.append(f"{p:.3f} | {o:.3f} | {o / p:.4f}")
            ratios = [o[0] / p[0] for o, p in zip(one, plain, strict=True)]
            rows.append(row)
            lines.append(
                f"| {kind} | {b} | " + " | ".join(cells)
                + f" | {min(ratios):.4f} / {max(ratios):.4f} |"
            )  # fmt: skip
    table = "\n".join(lines)
    print(table, flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "context": args.context, "rounds": args.rounds,
        "reps": args.reps, "rows": rows, "table": table,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
