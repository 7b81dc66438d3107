"""Eager host time of one LoRA linear call at decode, and of its parts.

Outside a captured graph (tests, a step that is not captured, a first call) every LoRA
linear pays its host time: Python, the op dispatch, the kernel launches. This times one
``LoRALinear`` at Llama-3-8B's q/k/v shape (4096 -> 4096 + 1024 + 1024, three slices),
``--rows`` decode rows spread over 4 distinct rank-16 adapters, called eagerly in a loop:
with the device's queue kept short by small kernels, the wall time a call is its host time.

    base        the base ``nn.Linear`` alone (the floor: one cuBLAS launch)
    lora        the LoRA linear's forward (what a model calls: at decode on CUDA the base
                linear, then shrink and expand in one launch, ``delta_``)
    delta       the captured step's ``linear_delta`` implementation, called eagerly here
                (no op dispatch; not what an eager call runs)
    shrink      ``launch_shrink`` alone, and ``expand`` ``launch_expand`` alone
    ..., kernel[grid]   the same with every Triton launch through ``kernel[grid]`` instead
                of :mod:`lora_graph.kernels.fast_launch`

Microseconds a call: the median over ``--rounds`` rounds of the mean of ``--calls`` calls.

    python bench/host_time.py            # on CUDA (the Triton kernels)
    python bench/host_time.py --profile  # and where the LoRA call's host time goes (cProfile)
    python bench/host_time.py --smoke    # on the CPU (the torch reference), to check it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def per_call_us(fn, calls: int, rounds: int, sync) -> float:
    """Median over ``rounds`` of the mean wall time of ``calls`` calls of ``fn``, in µs."""
    for _ in range(20):
        fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


@torch.inference_mode()  # as the engine runs a step
def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=8, help="decode rows (default 8)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="small shapes on the CPU")
    p.add_argument("--json", default="bench/out/host_time.json")
    p.add_argument(
        "--profile", action="store_true", help="also print where the LoRA call's host time goes"
    )
    args = p.parse_args()

    from lora_graph import ops
    from lora_graph.layers import LoRALinear, slot_stack
    from lora_graph.routing import RoutingBuffer
    from lora_graph.targets import LoraTarget

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    hidden, kv = (4096, 1024) if not args.smoke else (64, 16)
    rank, slots, n = 16, 4, args.rows
    target = LoraTarget(hidden, (hidden, kv, kv), slice_names=("q_proj", "k_proj", "v_proj"))
    dtype = torch.bfloat16 if cuda else torch.float32
    a_numel = target.num_slices * rank * hidden
    pool = torch.randn(slots + 1, a_numel + target.out_features * rank, device=device)
    pool = (pool * 0.02).to(dtype)
    pool[0].zero_()
    a = slot_stack(pool, 0, (target.num_slices * rank, hidden))
    b = slot_stack(pool, a_numel, (target.out_features, rank))
    base = torch.nn.Linear(hidden, target.out_features, bias=False, device=device, dtype=dtype)
    kernels = ops.kernels("auto", device)
    layer = LoRALinear(base, target=target, target_name="qkv_proj", layer=0, a=a, b=b,
                       kernels=kernels)  # fmt: skip
    per = -(-n // slots)
    offsets = [min(i * per, n) for i in range(slots + 1)]
    routing = RoutingBuffer(slots, device).fill(
        list(range(1, slots + 1)), offsets, list(range(slots + 1))
    )
    x = torch.randn(n, hidden, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    route = routing.tokens
    results = {
        "base": per_call_us(lambda: base(x), args.calls, args.rounds, sync),
        "lora": per_call_us(lambda: layer(x, routing), args.calls, args.rounds, sync),
    }
    if cuda and ops.have_triton():
        from lora_graph.kernels import triton_launch as T

        h = torch.zeros(target.num_slices, n, rank, dtype=torch.float32, device=device)
        y = torch.zeros(n, target.out_features, dtype=torch.float32, device=device)
        slices = tuple(target.out_slices)
        results["delta"] = per_call_us(
            lambda: T.linear_delta(x, base.weight, None, a, b, 3, list(slices), *route),
            args.calls,
            args.rounds,
            sync,
        )
        results["shrink"] = per_call_us(
            lambda: T.launch_shrink(x, a, h, *route, rank), args.calls, args.rounds, sync
        )
        results["expand"] = per_call_us(
            lambda: T.launch_expand(y, h, b, slices, *route, overwrite=True),
            args.calls,
            args.rounds,
            sync,
        )
        from lora_graph.kernels import fast_launch

        enabled = fast_launch.enabled
        fast_launch.enabled = lambda: False  # every launch through kernel[grid]
        try:
            results["shrink, kernel[grid]"] = per_call_us(
                lambda: T.launch_shrink(x, a, h, *route, rank), args.calls, args.rounds, sync
            )
            results["lora, kernel[grid]"] = per_call_us(
                lambda: layer(x, routing), args.calls, args.rounds, sync
            )
        finally:
            fast_launch.enabled = enabled
    if args.profile:  # the functions a LoRA call spends its host time in (cProfile)
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls * 5):
            layer(x, routing)
        sync()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    lines = ["| what | µs a call |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in results.items()]
    print(f"{device}: {n} rows, 4 adapters of rank {rank}, q/k/v {hidden}->{target.out_features}")
    print("\n".join(lines))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"device": str(device), "rows": n, "us": results}))


if __name__ == "__main__":
    main()
