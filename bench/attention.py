"""Paged attention (``lora_graph::paged_attention``; the Triton kernel of
``lora_graph.kernels.triton_attention`` on CUDA) at Llama-3-8B attention shapes, against
copy bandwidth (decode) and in TFLOP/s (prefill).

What it measures (H100/H200-class GPU; 32 query heads, 8 kv heads, head dim 128, bf16,
pages of 16 tokens scattered over the cache in random order):

- device copy bandwidth: a 1 GiB device-to-device ``copy_``; bytes read + written / time.
- decode: batch 1, 8, 32, 64, one query token per sequence, contexts "1k" (uniform in
  [64, 1984], mean about 1k, mixed lengths) and "4k" (every context 4096). One "layer" is
  one op call on its own K/V cache (the block tables and metadata are shared, as in an
  engine). ``L`` layers, enough that one replay reads ``--hbm-bytes`` (past the L2), are
  captured in one ``torch.cuda.CUDAGraph``; replays are timed with CUDA events (median of
  ``--reps``); time per layer = replay time / ``L``. KV bytes = ``sum_s L_s * 8 * 128 * 2
  (K and V) * 2 bytes``; ``floor`` = KV bytes / copy bandwidth (a read-only stream at copy
  speed); printed: µs per layer, GB/s, % of copy bandwidth, time / floor.
- prefill: 8 prompts of 512 tokens packed in one step (causal), in TFLOP/s with
  ``FLOPs = 4 * Hq * D * sum q_len * (q_len + 1) / 2`` (the causal half of QK^T and PV);
  beside it ``F.scaled_dot_product_attention(is_causal=True)`` (flash) on the same
  ``[8, 32, 512, 128]`` batch, contiguous, as a yardstick.
- every case is checked against the torch reference on layer 0 (``rel err``).
- ``--sweep`` also times split / tile variants of the kernel.

    python bench/attention.py               # the H200 run
    python bench/attention.py --sweep       # also tile / split variants
    python bench/attention.py --smoke       # tiny shapes on the CPU (Triton interpreter), seconds

Prints a markdown table at the end; writes JSON to ``--json`` when given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--json", default=None, help="where to write the results (optional)")
    p.add_argument("--decode", type=int, nargs="+", default=None, help="decode batch sizes")
    p.add_argument("--reps", type=int, default=20, help="timed replays per measurement")
    p.add_argument("--hbm-bytes", type=float, default=512e6, help="KV bytes one replay reads")
    p.add_argument("--max-layers", type=int, default=128)
    p.add_argument("--sweep", action="store_true", help="also time split / tile variants")
    p.add_argument(
        "--mixed-contexts",
        type=int,
        nargs="+",
        default=None,
        help="decode at these mean contexts, mixed lengths each (default: mixed 1k and fixed 4k)",
    )
    p.add_argument("--skip-prefill", action="store_true", help="decode cases only")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    import torch as _torch

    if not _torch.cuda.is_available():  # the interpreter flag must precede the kernel import
        os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lora_graph import attention as A  # noqa: E402
from lora_graph.kernels import triton_attention as TA  # noqa: E402

FULL = dict(
    kv_heads=8, groups=4, head_dim=128, page=16, decode=(1, 8, 32, 64), contexts=(1024, 4096),
    prefill=(8, 512),
)  # fmt: skip
SMOKE = dict(
    kv_heads=2, groups=2, head_dim=16, page=4, decode=(1, 3), contexts=(12, 20), prefill=(2, 8)
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device: torch.device, reps: int) -> tuple[float, str]:
    """Median seconds of ``fn()``: CUDA graph replays timed with CUDA events on a GPU (eager
    calls where capture fails), wall clock elsewhere."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), "eager"
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
    run, how = graph.replay, "cudagraph"
    for _ in range(3):
        run()
    sync(device)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del graph
    return statistics.median(times), how


def time_eager(fn, device: torch.device, reps: int) -> float:
    """Median seconds of eager ``fn()`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        return time_fn(fn, device, reps)[0]
    for _ in range(3):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def bandwidths(device: torch.device) -> tuple[float, float]:
    """``(copy, read)``: bytes read + written per second by a large device-to-device copy
    (timed eagerly: a copy captured in a graph becomes a copy-engine node), and bytes read
    per second by a sum over the same buffer (a read-only stream, as attention's)."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t_copy = time_eager(lambda: dst.copy_(src), device, 10)
    words = src.view(torch.float32)
    t_read = time_eager(lambda: words.sum(), device, 10)
    return 2 * nbytes / t_copy, nbytes / t_read


class Bed:
    """``layers`` K/V caches sharing one packed step: ``seqs`` ``(q_len, seq_len)``, pages
    in random order; the op's arguments of layer ``i`` from :meth:`args`."""

    def __init__(self, seqs, shape: dict, layers: int, dtype, device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        page, hkv, d = shape["page"], shape["kv_heads"], shape["head_dim"]
        self.seqs, self.layers = seqs, layers
        pages_of = [-(-length // page) for _, length in seqs]
        num_pages = 1 + sum(pages_of)
        perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
        tables = torch.zeros(len(seqs), max(pages_of), dtype=torch.int32)
        for s, n in enumerate(pages_of):
            tables[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        starts = [0]
        for q_len, _ in seqs:
            starts.append(starts[-1] + q_len)
        i32 = dict(dtype=torch.int32, device=device)
        self.block_tables = tables.to(device)
        self.seq_lens = torch.tensor([length for _, length in seqs], **i32)
        self.query_start = torch.tensor(starts, **i32)
        self.q = torch.randn(starts[-1], hkv * shape["groups"], d, device=device, dtype=dtype)
        shape4 = (num_pages, page, hkv, d)
        self.caches = [
            (
                torch.randn(shape4, device=device, dtype=dtype),
                torch.randn(shape4, device=device, dtype=dtype),
            )
            for _ in range(layers)
        ]
        self.scale = d**-0.5
        elt = torch.finfo(dtype).bits // 8
        self.kv_bytes = sum(length for _, length in seqs) * hkv * d * 2 * elt
        self.flops = sum(4 * hkv * shape["groups"] * d * q * (q + 1) // 2 for q, _ in seqs)

    def args(self, layer: int) -> tuple:
        k, v = self.caches[layer]
        meta = (self.block_tables, self.seq_lens, self.query_start)
        return (self.q, k, v, *meta, self.scale, 0)

    def step(self, fn, layers: int | None = None):
        args = [self.args(i) for i in range(layers or self.layers)]

        def run():
            for a in args:
                fn(*a)

        return run

    def rel_err(self, fn) -> float:
        got = fn(*self.args(0)).double()
        ref = A.paged_attention_reference(*self.args(0)).double()
        return float((got - ref).norm() / ref.norm())


def decode_seqs(batch: int, context: int, mixed: bool, seed: int) -> list[tuple[int, int]]:
    if not mixed:
        return [(1, context)] * batch
    g = torch.Generator().manual_seed(seed)
    lo = max(1, context // 16)
    lengths = torch.randint(lo, 2 * context - lo + 1, (batch,), generator=g)
    return [(1, int(n)) for n in lengths]


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not ARGS.smoke:
        sys.exit("no CUDA device: run with --smoke for a CPU sanity check")
    shape = SMOKE if ARGS.smoke else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    triton_ok = TA.HAVE_TRITON and (device.type == "cuda" or TA.interpreted())
    op = A.paged_attention_impl("triton" if triton_ok else "torch", device)
    reps = 2 if ARGS.smoke else ARGS.reps
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    copy_bw, read_bw = bandwidths(device)
    print(
        f"# {name}  torch {torch.__version__}  triton {getattr(TA.triton, '__version__', None)}"
        f"  interpreted {TA.interpreted()}  copy bandwidth {copy_bw / 1e9:.0f} GB/s  read "
        f"bandwidth {read_bw / 1e9:.0f} GB/s",
        flush=True,
    )
    if not triton_ok:
        print("# Triton unavailable here: timing the torch reference", flush=True)
    sms = TA.device_sms(device)
    rows, sweep = [], []
    contexts = list(zip(shape["contexts"], (True, False), strict=True))
    if ARGS.mixed_contexts:
        contexts = [(c, True) for c in ARGS.mixed_contexts]
    for batch in ARGS.decode or shape["decode"]:
        for ctx, mixed in contexts:
            seqs = decode_seqs(batch, ctx, mixed, seed=batch)
            per_layer = Bed(seqs, shape, 0, dtype, device).kv_bytes
            layers = 2 if ARGS.smoke else math.ceil(ARGS.hbm_bytes / per_layer)
            bed = Bed(seqs, shape, max(1, min(ARGS.max_layers, layers)), dtype, device)
            t, how = time_fn(bed.step(op), device, reps)
            t /= bed.layers
            max_ctx = bed.block_tables.shape[1] * shape["page"]
            hkv = shape["kv_heads"]
            cfg = TA.attention_config(batch, batch, shape["groups"], shape["head_dim"], max_ctx,
                                      hkv, dtype.itemsize, sms)  # fmt: skip
            floor = bed.kv_bytes / copy_bw
            row = dict(
                phase="decode",
                batch=batch,
                context=f"{'mixed ' if mixed else ''}{sum(n for _, n in seqs) // batch}",
                layers=bed.layers,
                splits=cfg.splits,
                us=t * 1e6,
                kv_MB=bed.kv_bytes / 1e6,
                GBps=bed.kv_bytes / t / 1e9,
                pct_copy=100 * bed.kv_bytes / t / copy_bw,
                pct_read=100 * bed.kv_bytes / t / read_bw,
                floor_us=floor * 1e6,
                x_floor=t / floor,
                rel_err=bed.rel_err(op),
                timing=how,
            )
            rows.append(row)
            print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items()), flush=True)  # fmt: skip
            if ARGS.sweep and triton_ok:
                sweep += sweep_decode(bed, shape, row, device, reps)
            del bed
    hq, d = shape["kv_heads"] * shape["groups"], shape["head_dim"]
    if not ARGS.skip_prefill:
        prefill_case(shape, dtype, device, op, reps, rows, sweep)
    print_tables(rows, sweep, copy_bw, read_bw, name, shape, hq, d, dtype)


def prefill_case(shape, dtype, device, op, reps, rows, sweep) -> None:
    n_seqs, q_len = shape["prefill"]
    bed = Bed([(q_len, q_len)] * n_seqs, shape, 1, dtype, device)
    t, how = time_fn(bed.step(op), device, reps)
    hq, d = shape["kv_heads"] * shape["groups"], shape["head_dim"]
    qb = torch.randn(n_seqs, hq, q_len, d, device=device, dtype=dtype)
    t_sdpa, _ = time_fn(lambda: F.scaled_dot_product_attention(qb, qb, qb, is_causal=True),
                        device, reps)  # fmt: skip
    row = dict(
        phase="prefill", batch=n_seqs, context=str(q_len), layers=1, splits=1, us=t * 1e6,
        TFLOPs=bed.flops / t / 1e12, sdpa_us=t_sdpa * 1e6, sdpa_TFLOPs=bed.flops / t_sdpa / 1e12,
        rel_err=bed.rel_err(op), timing=how,
    )  # fmt: skip
    rows.append(row)
    print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)  # fmt: skip
    if ARGS.sweep and TA.HAVE_TRITON and (device.type == "cuda" or TA.interpreted()):
        sweep += sweep_prefill(bed, shape, row, device, reps)


def print_tables(rows, sweep, copy_bw, read_bw, name, shape, hq, d, dtype) -> None:
    print()
    print(
        f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, read {read_bw / 1e9:.0f} GB/s ({name}; "
        f"heads {hq}/{shape['kv_heads']}, D {d}, page {shape['page']}, {str(dtype)[6:]}; time "
        "per layer; floor = KV bytes / copy bandwidth)"
    )
    print()
    print(
        "| phase | batch | context | splits | µs | KV MB | GB/s | % copy | % read | floor µs "
        "| x floor | TFLOP/s | sdpa TFLOP/s | rel err |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:

        def f(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"

        cells = [r["phase"], r["batch"], r["context"], r["splits"], f("us", ".1f"),
                 f("kv_MB", ".1f"), f("GBps", ".0f"), f("pct_copy", ".0f"), f("pct_read", ".0f"),
                 f("floor_us", ".1f"),
                 f("x_floor", ".2f"), f("TFLOPs", ".0f"), f("sdpa_TFLOPs", ".0f"),
                 f("rel_err", ".1e")]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    if sweep:
        print()
        print("| phase | batch | context | config | µs | default µs |")
        print("|---|---:|---|---|---:|---:|")
        for s in sorted(sweep, key=lambda s: (s["phase"], s["batch"], s["context"], s["us"])):
            print(
                f"| {s['phase']} | {s['batch']} | {s['context']} | {s['config']} | "
                f"{s['us']:.1f} | {s['default_us']:.1f} |"
            )
    if ARGS.json:
        out = Path(ARGS.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        info = dict(device=name, torch=torch.__version__, copy_bw_GBps=copy_bw / 1e9,
                    read_bw_GBps=read_bw / 1e9)  # fmt: skip
        out.write_text(json.dumps(dict(info=info, cases=rows, sweep=sweep), indent=1))
        print(f"\nwrote {out}")


def forced(cfg: TA.AttentionConfig):
    def fn(*args):
        return TA.paged_attention(*args, config=cfg)

    return fn


def sweep_decode(bed: Bed, shape: dict, row: dict, device, reps: int) -> list[dict]:
    """Splits x BLOCK_N x warps x stages at one decode case."""
    out = []
    groups = shape["groups"]
    for splits in (1, 2) if ARGS.smoke else (1, 2, 4, 8, 16, 32):
        for block_n in (16,) if ARGS.smoke else (32, 64, 128):
            for warps in (4,):  # 2 and 8 never fastest (sessions 4 and 10)
                for stages in (2,) if ARGS.smoke else (1, 2):
                    cfg = TA.make_config(
                        groups, block_q=max(1, 16 // groups), block_n=block_n, splits=splits,
                        num_warps=warps, num_stages=stages,
                    )  # fmt: skip
                    t, _ = time_fn(bed.step(forced(cfg)), device, reps)
                    out.append(dict(phase="decode", batch=row["batch"], context=row["context"],
                                    config=f"splits {splits} BN {block_n} w{warps} s{stages}",
                                    us=t / bed.layers * 1e6, default_us=row["us"]))  # fmt: skip
    return out


def sweep_prefill(bed: Bed, shape: dict, row: dict, device, reps: int) -> list[dict]:
    """Rows per tile x BLOCK_N x warps x stages at the prefill case."""
    out = []
    groups = shape["groups"]
    for rows_ in (16,) if ARGS.smoke else (64, 128):
        for block_n in (16,) if ARGS.smoke else (16, 32, 64):
            for warps in (4,) if ARGS.smoke else (4, 8):
                for stages in (2,) if ARGS.smoke else (2, 3, 4):
                    cfg = TA.make_config(groups, block_q=rows_ // groups, block_n=block_n,
                                         num_warps=warps, num_stages=stages)  # fmt: skip
                    try:
                        t, _ = time_fn(bed.step(forced(cfg)), device, reps)
                    except Exception as e:  # e.g. out of shared memory
                        print(f"  ({cfg}: {type(e).__name__})", flush=True)
                        sync(device)
                        continue
                    out.append(dict(phase="prefill", batch=row["batch"], context=row["context"],
                                    config=f"rows {rows_} BN {block_n} w{warps} s{stages}",
                                    us=t * 1e6, default_us=row["us"]))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
