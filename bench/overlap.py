"""Can a decode step's LoRA work hide behind the base GEMM it sits beside? A probe.

For each Llama-3-8B linear family (qkv, o, gate_up, down) and decode batch size, one
"layer" is the base ``F.linear`` plus the target's LoRA for 4 distinct rank-16 adapters,
and ``L`` layers (each its own weights and adapter blocks, so bytes come from HBM) are
captured in one CUDA graph; the replay time over ``L`` is the time per layer. Variants:

    base      the base linear alone
    inplace   base, then shrink + expand into its output (what the engine runs today)
    side      shrink + expand into a float32 delta on a side stream, forked before the base
              linear and joined after it, then ``y + delta`` (one add kernel)
    side-noadd  as side without the add (inductor would fuse it into the next pointwise op)

    python bench/overlap.py [--batch 1 8 32 64] [--layers 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[0:1] = [str(Path(__file__).resolve().parents[1])]

from lora_graph import triton_ops as T  # noqa: E402
from lora_graph.layout import SlotLayout  # noqa: E402
from lora_graph.targets import LoraTarget  # noqa: E402

TARGETS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
           "down": (14336, (4096,))}


def time_graph(fn, reps: int = 30) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def measure(name: str, target: LoraTarget, weights: list[torch.Tensor], slots: list[torch.Tensor],
            blocks: list[tuple[int, int]], n: int, side: torch.cuda.Stream) -> dict:
    """Per-layer µs of each variant for ``n`` rows over 4 adapters, and the side variant's
    relative error against in-place on the last layer."""
    dev, dt = weights[0].device, weights[0].dtype
    slices = list(target.out_slices)
    groups = min(4, n)
    cuts = [round(i * n / groups) for i in range(groups + 1)]
    i32 = dict(dtype=torch.int32, device=dev)
    routing = (torch.tensor(list(range(1, groups + 1)) + [0] * (4 - groups), **i32),
               torch.tensor(cuts + [n] * (4 - groups), **i32), torch.tensor([n], **i32))
    x = torch.randn(n, target.in_features, dtype=dt, device=dev)
    out: dict = {}

    def base():
        for w in weights:
            out["y"] = F.linear(x, w)

    def inplace():
        for w, (a_off, b_off) in zip(weights, blocks, strict=True):
            y = F.linear(x, w)
            h = T.lora_shrink_triton(x, slots, a_off, target.num_slices, 16, *routing)
            T.lora_expand_triton_(y, h, slots, b_off, slices, *routing)
            out["y"] = y

    def side_variant(add: bool):
        def fn():
            main = torch.cuda.current_stream()
            keep = []  # side-stream buffers stay alive (unreused) until the replay ends
            for w, (a_off, b_off) in zip(weights, blocks, strict=True):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    h = T.lora_shrink_triton(x, slots, a_off, target.num_slices, 16, *routing)
                    d = torch.zeros(n, target.out_features, dtype=torch.float32, device=dev)
                    T.lora_expand_triton_(d, h, slots, b_off, slices, *routing)
                y = F.linear(x, w)
                main.wait_stream(side)
                out["y"] = (y.float() + d).to(dt) if add else y
                keep += [h, d]
            out["keep"] = keep
        return fn

    inplace()
    ref = out["y"].float()
    side_variant(True)()
    torch.cuda.synchronize()
    row = dict(target=name, batch=n, err=float((out["y"].float() - ref).norm() / ref.norm()))
    for label, fn in (("base", base), ("inplace", inplace), ("side", side_variant(True)),
                      ("side-noadd", side_variant(False))):
        row[label] = time_graph(fn) / len(weights) * 1e6
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--targets", nargs="+", default=list(TARGETS))
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    side = torch.cuda.Stream()
    rows = []
    for name in args.targets:
        k, slices = TARGETS[name]
        target = LoraTarget(k, slices)
        layout = SlotLayout({name: target}, args.layers, 16)
        pool = torch.zeros(5, layout.numel, dtype=dt, device=dev)
        slots = [pool[s] for s in range(5)]
        for s in range(1, 5):
            for layer in range(args.layers):
                layout.a_view(slots[s], name, layer).normal_(0, k ** -0.5)
                layout.b_view(slots[s], name, layer).normal_(0, 0.25)
        weights = [torch.randn(target.out_features, k, dtype=dt, device=dev) * k ** -0.5 for _ in range(args.layers)]
        blocks = [layout.blocks[(name, layer)] for layer in range(args.layers)]
        for n in args.batch:
            rows.append(measure(name, target, weights, slots, blocks, n, side))
            print(rows[-1], flush=True)
        del weights, pool, slots
        torch.cuda.empty_cache()
    print()
    print("| target | batch | base µs | inplace µs | side µs | side-noadd µs | inplace - base | side - base | side-noadd - base | rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['target']} | {r['batch']} | {r['base']:.2f} | {r['inplace']:.2f} | {r['side']:.2f} | {r['side-noadd']:.2f} "
              f"| {r['inplace'] - r['base']:.2f} | {r['side'] - r['base']:.2f} | {r['side-noadd'] - r['base']:.2f} | {r['err']:.1e} |")


if __name__ == "__main__":
    main()
