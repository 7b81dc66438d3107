"""LoRA shrink + expand kernels: Triton (``lora_graph.kernels.triton_launch``) against the
torch reference (``lora_graph.kernels.reference``), at decode and prefill sizes, against
copy bandwidth.

What it measures (H100/H200-class GPU, bf16, max_rank 16, rank-16 adapters, 8 slots):

- device copy bandwidth: a 1 GiB device-to-device ``copy_``; bytes read + written over time.
- per case, one "layer" = ``h = shrink(x)`` then ``expand_(y, h)`` for one target:
  ``qkv``  (in 4096, out slices 4096/1024/1024; Llama-3-8B q/k/v fused) and
  ``down`` (in 14336, out 4096),
  at decode batch sizes 1, 8, 32, 64 and prefill sizes 2048, 4096, 8192 tokens, with the
  rows split evenly over 4 distinct adapters (and over 1 adapter).
- timing: the ops of ``L`` layers (each layer its own A/B blocks in the slot pool, so the
  adapters' bytes come from HBM, not L2) are captured in one ``torch.cuda.CUDAGraph``;
  replays are timed with CUDA events; the time per layer is the replay time over ``L``.
  Launch overhead inside a graph is therefore included, as in a served step. (The torch
  reference, dozens of kernels per layer, is captured over at most 32 layers.)
  ``--no-graph`` times eager calls with ``triton.testing.do_bench`` (median) instead.
- achieved bandwidth = bytes needed / time per layer, where bytes needed = the distinct
  adapters' A and B at their rank (``n_adapters * (S*r*in + out*r) * 2``) + activations
  (x read, y read and written, h written and read in fp32); and its ratio to the copy
  bandwidth ("% copy"). ``floor_us`` is bytes needed / copy bandwidth.
- each case's Triton output is checked against the reference on layer 0 (``rel_err``).
- at decode sizes, ``delta``: the same layer as one launch (``delta_``: shrink + expand in
  one kernel, what an eager decode call runs), timed and checked likewise.
- ``--sweep`` also times tile variants of both kernels at decode.

    python bench/lora_kernels.py                 # the H200 run (writes bench/out/kernels.json)
    python bench/lora_kernels.py --sweep         # also try shrink/expand tile variants at decode
    python bench/lora_kernels.py --smoke         # tiny shapes, CPU (Triton interpreter), seconds

Prints a markdown table at the end and writes JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# the model shapes (Llama-3-8B) and the tiny ones of --smoke
FULL = dict(
    targets={"qkv": (4096, (4096, 1024, 1024)), "down": (14336, (4096,))},
    decode=(1, 8, 32, 64),
    prefill=(512, 2048, 4096, 8192),  # 512: a mixed step at bench/serve.py's token budget
)
# targets timed only when --targets names them
EXTRA_TARGETS = {"gate_up": (4096, (14336, 14336)), "o": (4096, (4096,))}
SMOKE = dict(
    targets={"qkv": (64, (64, 16, 16)), "down": (112, (64,))}, decode=(1, 8), prefill=(33,)
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU (Triton interpreter if installed)",
    )
    p.add_argument("--json", default="bench/out/kernels.json", help="where to write the results")
    p.add_argument(
        "--adapters", type=int, nargs="+", default=[4, 1], help="distinct adapters per batch"
    )
    p.add_argument("--rank", type=int, default=16, help="adapter rank")
    p.add_argument("--max-rank", type=int, default=16, help="the pool's max_rank (>= --rank)")
    p.add_argument(
        "--max-slots", type=int, default=8, help="slots (and routing groups) of the pool"
    )
    p.add_argument("--decode", type=int, nargs="+", default=None, help="decode batch sizes")
    p.add_argument("--prefill", type=int, nargs="+", default=None, help="prefill token counts")
    p.add_argument(
        "--targets", nargs="+", default=None, help="subset of: qkv down (also: gate_up o)"
    )
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement")
    p.add_argument(
        "--hbm-bytes",
        type=float,
        default=256e6,
        help="adapter bytes one replay streams at least (sets the number of layers; > L2)",
    )
    p.add_argument("--max-layers", type=int, default=512)
    p.add_argument("--skip-torch", action="store_true", help="time the Triton ops only")
    p.add_argument(
        "--no-graph", action="store_true", help="time eager calls with triton.testing.do_bench"
    )
    p.add_argument("--sweep", action="store_true", help="also time tile variants of both kernels")
    p.add_argument(
        "--sweep-sizes",
        type=int,
        nargs="+",
        default=None,
        help="row counts of the sweep (default: 1 32 64)",
    )
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    # only to ask for CUDA: the interpreter flag must precede the kernels' import
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from lora_graph.kernels import reference  # noqa: E402
from lora_graph.kernels import triton_config as C  # noqa: E402
from lora_graph.kernels import triton_launch as T  # noqa: E402
from lora_graph.layers import slot_stack  # noqa: E402
from lora_graph.layout import SlotLayout  # noqa: E402
from lora_graph.targets import LoraTarget  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_graph(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of ``fn`` (which runs all layers), captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    sync(device)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del graph
    return statistics.median(times)


def time_eager(fn, device: torch.device, reps: int) -> float:
    """Median seconds of eager ``fn()`` (``triton.testing.do_bench`` on a GPU)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        for _ in range(3):
            dst.copy_(src)
        sync(device)
        times = []
        for _ in range(10):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        t = statistics.median(times)
    else:
        t = time_eager(lambda: dst.copy_(src), device, 5)
    return 2 * nbytes / t


# --------------------------------------------------------------------------------------
# one target's pool, routing and layer calls
# --------------------------------------------------------------------------------------


class Bed:
    """A slot pool holding ``layers`` copies of one target (as the manager lays it out),
    adapters of rank ``rank`` in slots ``1..n_adapters``, and x / y buffers."""

    def __init__(
        self,
        name: str,
        target: LoraTarget,
        layers: int,
        n_rows: int,
        n_adapters: int,
        *,
        rank: int,
        max_rank: int,
        max_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.name, self.target, self.layers, self.max_rank = name, target, layers, max_rank
        self.layout = SlotLayout({name: target}, layers, max_rank)
        num_slots = max_slots + 1
        self.pool = torch.zeros(num_slots, self.layout.numel, dtype=dtype, device=device)
        self.slots = [self.pool[s] for s in range(num_slots)]
        g = torch.Generator(device=device).manual_seed(0)
        for slot in range(1, n_adapters + 1):
            for layer in range(layers):
                a = self.layout.a_view(self.slots[slot], name, layer)
                b = self.layout.b_view(self.slots[slot], name, layer)
                a[:, :rank] = (
                    torch.randn(a[:, :rank].shape, generator=g, device=device, dtype=dtype)
                    / target.in_features**0.5
                )
                b[:, :rank] = (
                    torch.randn(b[:, :rank].shape, generator=g, device=device, dtype=dtype)
                    / rank**0.5
                )
        r = max_rank
        self.stacks = [
            (
                slot_stack(self.pool, a_off, (target.num_slices * r, target.in_features)),
                slot_stack(self.pool, b_off, (target.out_features, r)),
            )
            for a_off, b_off in (self.layout.blocks[(name, layer)] for layer in range(layers))
        ]
        # routing as LoRAManager builds it: max_slots groups, unused ones empty on slot 0
        n_groups = min(n_adapters, n_rows)
        cuts = [round(i * n_rows / n_groups) for i in range(n_groups + 1)]
        ids = list(range(1, n_groups + 1)) + [0] * (max_slots - n_groups)
        offs = cuts + [n_rows] * (max_slots - n_groups)
        i32 = dict(dtype=torch.int32, device=device)
        self.routing = (
            torch.tensor(ids, **i32),
            torch.tensor(offs, **i32),
            torch.tensor([n_rows], **i32),
        )
        self.n_adapters = n_groups
        self.x = torch.randn(n_rows, target.in_features, generator=g, device=device, dtype=dtype)
        self.y_init = torch.randn(
            n_rows, target.out_features, generator=g, device=device, dtype=dtype
        )
        self.y = self.y_init.clone()

    def step(self, backend: str, layers: int | None = None, shrink_cfg=None, expand_cfg=None):
        """``fn()`` running shrink + expand for the first ``layers`` layers (``backend``:
        ``torch`` or ``triton``; with configs, the Triton launchers with forced tiles)."""
        t, r = self.target, self.max_rank
        slices = list(t.out_slices)
        stacks = self.stacks[: layers or self.layers]
        x, y, routing = self.x, self.y, self.routing
        if backend == "torch":

            def fn():
                for a, b in stacks:
                    h = reference.shrink(x, a, t.num_slices, *routing)
                    reference.expand_(y, h, b, slices, *routing)
        elif backend == "delta":  # shrink + expand in one launch (eager decode calls)

            def fn():
                for a, b in stacks:
                    T.delta_(y, x, a, b, slices, *routing)
        elif shrink_cfg is None and expand_cfg is None:

            def fn():
                for a, b in stacks:
                    h = T.shrink(x, a, t.num_slices, *routing)
                    T.expand_(y, h, b, slices, *routing)
        else:  # forced tiles, through the launchers
            n = x.shape[0]

            def fn():
                for a, b in stacks:
                    h = torch.zeros(t.num_slices, n, r, dtype=torch.float32, device=x.device)
                    T.launch_shrink(x, a, h, *routing, r, config=shrink_cfg)
                    T.launch_expand(y, h, b, tuple(slices), *routing, config=expand_cfg)

        return fn

    def bytes_needed(self, rank: int) -> tuple[int, int]:
        """(adapter bytes, activation bytes) one layer needs to move."""
        t = self.target
        e = self.x.element_size()
        n = self.x.shape[0]
        adapters = (
            self.n_adapters * (t.num_slices * rank * t.in_features + t.out_features * rank) * e
        )
        acts = (
            n * t.in_features * e
            + 2 * n * t.out_features * e
            + 2 * t.num_slices * n * self.max_rank * 4
        )
        return adapters, acts

    def check(self, backend: str = "triton") -> float:
        """Relative error of one Triton layer (``backend``: the pair, or ``delta``, the one
        launch) against the torch reference, from the same y; relative to the delta."""
        t = self.target
        a, b = self.stacks[0]
        ref = self.y_init.clone()
        reference.expand_(
            ref,
            reference.shrink(self.x, a, t.num_slices, *self.routing),
            b,
            list(t.out_slices),
            *self.routing,
        )
        got = self.y_init.clone()
        if backend == "delta":
            T.delta_(got, self.x, a, b, list(t.out_slices), *self.routing)
        else:
            T.expand_(
                got,
                T.shrink(self.x, a, t.num_slices, *self.routing),
                b,
                list(t.out_slices),
                *self.routing,
            )
        delta_ref = ref.double() - self.y_init.double()
        err = (got.double() - ref.double()).norm() / delta_ref.norm().clamp_min(1e-30)
        return float(err)


def layer_bytes(target: LoraTarget, n: int, n_adapters: int, dtype: torch.dtype) -> int:
    """Bytes one layer streams (pool rows at max_rank, x, y, h): sets how many layers a
    replay runs so that they do not all sit in L2."""
    e = torch.finfo(dtype).bits // 8
    r = ARGS.max_rank
    adapters = (
        n_adapters * (target.num_slices * r * target.in_features + target.out_features * r) * e
    )
    return (
        adapters
        + n * (target.in_features + 2 * target.out_features) * e
        + 2 * target.num_slices * n * r * 4
    )


def layers_for(bed_bytes_per_layer: int, smoke: bool) -> int:
    if smoke:
        return 2
    return max(8, min(ARGS.max_layers, math.ceil(ARGS.hbm_bytes / max(1, bed_bytes_per_layer))))


def per_layer_time(
    bed: Bed, backend: str, layers: int, device: torch.device, **cfg
) -> tuple[float, str]:
    fn = bed.step(backend, layers, **cfg)
    if device.type == "cuda" and not ARGS.no_graph:
        try:
            return time_graph(fn, device, ARGS.reps) / layers, "cudagraph"
        except Exception as e:  # a backend that cannot be captured is timed eagerly
            print(
                f"  ({backend}: graph capture failed: {type(e).__name__}: {e}; timing eager)",
                flush=True,
            )
            torch.cuda.synchronize()
    return time_eager(fn, device, ARGS.reps) / layers, "eager"


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not ARGS.smoke:
        sys.exit("no CUDA device: run with --smoke for a CPU sanity check")
    shapes = SMOKE if ARGS.smoke else FULL
    dtype = DTYPES[ARGS.dtype]
    triton_ok = T.HAVE_TRITON and (device.type == "cuda" or T.interpreted())
    if ARGS.smoke:  # (the Triton interpreter runs a launch in a fraction of a second)
        ARGS.reps = min(ARGS.reps, 1)
        ARGS.adapters = ARGS.adapters[:1]
    torch.manual_seed(0)

    info = dict(
        device=torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or "cpu",
        torch=torch.__version__,
        triton=getattr(T.triton, "__version__", None),
        interpreted=T.interpreted(),
        dtype=ARGS.dtype,
        rank=ARGS.rank,
        max_rank=ARGS.max_rank,
        max_slots=ARGS.max_slots,
        smoke=ARGS.smoke,
        timing="eager" if ARGS.no_graph or device.type != "cuda" else "cudagraph",
    )
    copy_bw = copy_bandwidth(device)
    info["copy_bw_GBps"] = copy_bw / 1e9
    print(
        f"# {info['device']}  torch {info['torch']}  triton {info['triton']}  copy bandwidth "
        f"{copy_bw / 1e9:.0f} GB/s",
        flush=True,
    )
    if not triton_ok:
        print("# Triton unavailable here: timing the torch reference only", flush=True)

    known = {**shapes["targets"], **({} if ARGS.smoke else EXTRA_TARGETS)}
    targets = {
        k: v
        for k, v in known.items()
        if (k in ARGS.targets if ARGS.targets is not None else k in shapes["targets"])
    }
    sizes = [("decode", n) for n in (ARGS.decode or shapes["decode"])]
    sizes += [("prefill", n) for n in (ARGS.prefill or shapes["prefill"])]
    rows = []
    seen = set()
    for tname, (k, slices) in targets.items():
        target = LoraTarget(k, tuple(slices))
        for phase, n in sizes:
            for n_ad in ARGS.adapters:
                if (tname, n, min(n_ad, n)) in seen:  # batch 1 has one adapter whatever was asked
                    continue
                seen.add((tname, n, min(n_ad, n)))
                layers = layers_for(layer_bytes(target, n, min(n_ad, n), dtype), ARGS.smoke)
                bed = Bed(
                    tname,
                    target,
                    layers,
                    n,
                    n_ad,
                    rank=ARGS.rank,
                    max_rank=ARGS.max_rank,
                    max_slots=ARGS.max_slots,
                    dtype=dtype,
                    device=device,
                )
                ad_bytes, act_bytes = bed.bytes_needed(ARGS.rank)
                total = ad_bytes + act_bytes
                row = dict(
                    target=tname,
                    phase=phase,
                    tokens=n,
                    adapters=bed.n_adapters,
                    layers=layers,
                    adapter_MB=ad_bytes / 1e6,
                    activation_MB=act_bytes / 1e6,
                    floor_us=total / copy_bw * 1e6,
                )
                if triton_ok:
                    row["rel_err"] = bed.check()
                    t_tri, how = per_layer_time(bed, "triton", layers, device)
                    row.update(
                        triton_us=t_tri * 1e6,
                        timing=how,
                        triton_GBps=total / t_tri / 1e9,
                        triton_pct_copy=100 * total / t_tri / copy_bw,
                    )
                    if phase == "decode":  # also shrink + expand in one launch (delta_)
                        row["delta_rel_err"] = bed.check("delta")
                        t_delta, _ = per_layer_time(bed, "delta", layers, device)
                        row.update(
                            delta_us=t_delta * 1e6, delta_pct_copy=100 * total / t_delta / copy_bw
                        )
                if not ARGS.skip_torch:
                    ref_layers = min(layers, 32 if device.type == "cuda" else layers)
                    t_ref, how_ref = per_layer_time(bed, "torch", ref_layers, device)
                    row.update(
                        torch_us=t_ref * 1e6,
                        torch_timing=how_ref,
                        torch_GBps=total / t_ref / 1e9,
                        torch_pct_copy=100 * total / t_ref / copy_bw,
                    )
                if "triton_us" in row and "torch_us" in row:
                    row["speedup"] = row["torch_us"] / row["triton_us"]
                rows.append(row)
                print(
                    "  "
                    + "  ".join(
                        f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                        for k_, v in row.items()
                    ),
                    flush=True,
                )
                del bed
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    sweep = run_sweep(targets, device, dtype, copy_bw) if ARGS.sweep and triton_ok else []

    print()
    print(
        f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s ({info['device']}, {ARGS.dtype}, rank "
        f"{ARGS.rank}, max_rank {ARGS.max_rank}, timing per layer: {info['timing']})"
    )
    print()
    print(
        "| target | phase | tokens | adapters | floor µs | triton µs | delta µs | torch µs "
        "| speedup | triton GB/s | triton % copy | delta % copy | rel err | delta rel err |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:

        def f(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"

        cells = [r["target"], r["phase"], r["tokens"], r["adapters"], f("floor_us", ".2f"),
                 f("triton_us", ".2f"), f("delta_us", ".2f"), f("torch_us", ".2f"),
                 f("speedup", ".1f"), f("triton_GBps", ".0f"), f("triton_pct_copy", ".1f"),
                 f("delta_pct_copy", ".1f"), f("rel_err", ".1e"),
                 f("delta_rel_err", ".1e")]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    if sweep:
        print()
        print(
            "| target | tokens | shrink (BM,BN,BK,SPLIT_K,cap) | expand (BM,BN,cap) | µs | "
            "default µs | default shrink | default expand |"
        )
        print("|---|---:|---|---|---:|---:|---|---|")
        for s in sweep:
            print(
                f"| {s['target']} | {s['tokens']} | {s['shrink']} | {s['expand']} | "
                f"{s['us']:.2f} | {s['default_us']:.2f} | {s['default_shrink']} | "
                f"{s['default_expand']} |"
            )

    out = Path(ARGS.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(info=info, cases=rows, sweep=sweep), indent=1))
    print(f"\nwrote {out}")


def run_sweep(targets, device, dtype, copy_bw) -> list[dict]:
    """Time tile variants of both kernels (4 adapters) at ``--sweep-sizes`` rows; report the
    best few.

    Shrink: BLOCK_M (above 64 rows) x BLOCK_K x SPLIT_K x program cap (the default
    BLOCK_N); then expand: BLOCK_M (above 64 rows) x BLOCK_N x program cap, with the best
    shrink.
    """
    out = []
    sizes = (1, 8) if ARGS.smoke else tuple(ARGS.sweep_sizes or (1, 32, 64))
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 132
    )
    caps = (0, 4) if ARGS.smoke else (0, 2 * sms, 4 * sms, 8 * sms)
    for tname, (k, slices) in targets.items():
        target = LoraTarget(k, tuple(slices))
        sr = target.num_slices * ARGS.max_rank
        for n in sizes:
            caps_n = caps if n <= 64 else (0,)
            layers = layers_for(layer_bytes(target, n, min(4, n), dtype), ARGS.smoke)
            bed = Bed(
                tname,
                target,
                layers,
                n,
                4,
                rank=ARGS.rank,
                max_rank=ARGS.max_rank,
                max_slots=ARGS.max_slots,
                dtype=dtype,
                device=device,
            )
            default_s, _ = per_layer_time(bed, "triton", layers, device)
            base_s = C.shrink_config(n, k, sr, bed.x.element_size(), sms)
            base_e = C.expand_config(n, max(slices), ARGS.max_rank, bed.x.element_size(), sms)
            results = []
            row_tiles = (base_s.block_m,) if n <= 64 or ARGS.smoke else (16, 32, 64, 128)
            splits = (1, 2) if ARGS.smoke else (1, 2, 4, 8, 16, 32, 64, 128)
            for bm in row_tiles:
                for bk in (32,) if ARGS.smoke else (32, 64, 128):
                    for split in splits:
                        for cap in caps_n:
                            if bm <= 4 and bm * base_s.block_n * bk > 8192:
                                continue
                            if bm * bk > 8192:  # register spills
                                continue
                            cfg = C._finish_shrink(
                                k,
                                bm,
                                base_s.block_n,
                                bk,
                                split,
                                4 if bm <= 32 else 8,
                                base_s.num_stages,
                                cap,
                            )
                            t_s, _ = per_layer_time(
                                bed, "triton", layers, device, shrink_cfg=cfg, expand_cfg=base_e
                            )
                            results.append((t_s, cfg, base_e))
            best_shrink = min(results, key=lambda r: r[0])[1]
            row_tiles = (base_e.block_m,) if n <= 64 or ARGS.smoke else (16, 32, 64, 128)
            for bm, bn, cap in (
                (bm, bn, cap)
                for bm in row_tiles
                for bn in ((16,) if ARGS.smoke else (32, 64, 128, 256))
                for cap in caps_n
            ):
                if bm <= 4 and bm * bn * base_e.block_r > 16384:
                    continue
                if bm * bn > 32768:
                    continue
                ecfg = C.ExpandConfig(
                    bm,
                    bn,
                    base_e.block_r,
                    num_warps=4 if bm * bn < 4096 else 8,
                    max_programs=cap,
                )
                t_e, _ = per_layer_time(
                    bed, "triton", layers, device, shrink_cfg=best_shrink, expand_cfg=ecfg
                )
                results.append((t_e, best_shrink, ecfg))
            results.sort(key=lambda r: r[0])
            for t_, s_, e_ in results[:3]:
                out.append(
                    dict(
                        target=tname,
                        tokens=n,
                        us=t_ * 1e6,
                        default_us=default_s * 1e6,
                        shrink=(s_.block_m, s_.block_n, s_.block_k, s_.split_k, s_.max_programs),
                        expand=(e_.block_m, e_.block_n, e_.max_programs),
                        default_shrink=(
                            base_s.block_m,
                            base_s.block_n,
                            base_s.block_k,
                            base_s.split_k,
                            base_s.max_programs,
                        ),
                        default_expand=(base_e.block_m, base_e.block_n, base_e.max_programs),
                    )
                )
                print(f"  sweep {tname} n={n}: {out[-1]}", flush=True)
            del bed
    return out


if __name__ == "__main__":
    main()
