"""Prototype: the base GEMM and its LoRA in one Triton kernel at decode, against cuBLAS.

Why: on the H200 a decode step's LoRA costs 10-30% over the base step at 8-64 rows though
its bytes are 2-9% (``bench/RESULTS.md``, sessions 8 and 9): the shrink and expand are
separate kernels that wait for SMs beside (or after) the cuBLAS GEMM. This measures the
other design: one kernel per target whose first programs shrink (``h = x @ A[slot].T``,
atomics into a zero workspace) and whose other programs stream the weight
(``y = x @ W.T``) and, in their epilogue, wait for the shrink (by then long done) and add
``h[m] @ B[slot(m)].T`` for each row (R gathers). If that kernel costs what cuBLAS costs plus the
adapters' bytes, the decode LoRA target is in reach with it; if a Triton GEMM alone is
slower than cuBLAS here, it is not.

Per target of Llama-3-8B (``qkv``, ``o``, ``gate_up``, ``down``) and decode rows 1 / 8 /
32 / 64, with the rows over 16 distinct rank-16 adapters (one adapter at 1 row), µs per
layer in a CUDA graph over enough layers (distinct weights and adapters) that they stream
from HBM:

    cublas          F.linear
    cublas+lora     lora_graph's decode path: linear_delta (the delta on a side stream) + the add
    triton          the prototype without LoRA (best of its tile variants)
    triton+lora     the prototype with LoRA (the same tiles)
    epilogue        the prototype with its expand epilogue only (no shrink programs, no wait)
    floor           weights + the adapters' A and B + activations over the copy bandwidth

    python bench/decode_gemm.py            # the H200 run
    python bench/decode_gemm.py --smoke    # tiny shapes on the CPU (TRITON_INTERPRET=1), a check

Not used by the engine: a measurement for issue #12's next step. Its routing is the
well-formed kind :class:`lora_graph.routing.RoutingBuffer` writes (groups of known slots
covering the rows up to ``end``), not every edge case the engine's kernels accept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lora_graph.kernels.triton_kernels import _group_table, _shrink_tile, _tile_rows  # noqa: E402


# fmt: off
@triton.jit(do_not_specialize=["M", "G", "num_slots", "n_shrink"])
def _gemm_lora_kernel(
    x_ptr, w_ptr, y_ptr, a_ptr, b_ptr, h_ptr, count_ptr, lora_ids_ptr, offsets_ptr, end_ptr,
    M, N, K, G, num_slots, n_shrink, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_as, stride_aj, stride_bs, stride_bn,
    stride_hs, stride_hm,
    R: tl.constexpr, SR: tl.constexpr, NUM_SLICES: tl.constexpr, SLICE_COL0: tl.constexpr,
    G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, S_BLOCK_M: tl.constexpr,
    S_BLOCK_N: tl.constexpr, S_BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_LORA: tl.constexpr, CAST_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_LORA and pid < n_shrink:  # a shrink item: (row tile, column block, K split)
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, M, G, num_slots, G_POW2, S_BLOCK_M, False)
        per_tile: tl.constexpr = ((SR + S_BLOCK_N - 1) // S_BLOCK_N) * SPLIT_K
        tile = pid // per_tile
        pid_n = (pid % per_tile) // SPLIT_K
        pid_k = pid % SPLIT_K
        slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, S_BLOCK_M)
        if row0 < hi:
            _shrink_tile(x_ptr, a_ptr, h_ptr, slot, R, row0, hi, pid_n, pid_k, K, k_per_split,
                         stride_xm, 1, stride_as, stride_aj, 1, stride_hs, stride_hm, 1,
                         R, SR, S_BLOCK_M, S_BLOCK_N, S_BLOCK_K, SPLIT_K, True, CAST_F32,
                         "tf32x3", False)
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")
    else:
        pid_n = pid - n_shrink if HAS_LORA else pid
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            xt = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
            wt = tl.load(w_ptrs + k0)
            if CAST_F32:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, tl.trans(wt), acc)
        if HAS_LORA:
            # the slice this column block is in (block widths divide every slice)
            n0 = pid_n * BLOCK_N
            sl = n0 * 0
            for i in tl.static_range(1, NUM_SLICES):
                sl = tl.where(n0 >= SLICE_COL0[i], i, sl)
            done = tl.load(count_ptr, volatile=True)
            while done < n_shrink:
                done = tl.load(count_ptr, volatile=True)
            tl.atomic_add(count_ptr, 0, sem="acquire")
            tl.debug_barrier()
            # each row's slot (0: no delta), from the group table in registers (names apart
            # from the shrink branch's: Triton types a name alike in both branches)
            gs = tl.arange(0, G_POW2)
            in_g = gs < G
            ids = tl.load(lora_ids_ptr + gs, mask=in_g, other=0)
            g_lo = tl.load(offsets_ptr + gs, mask=in_g, other=0)
            g_hi = tl.minimum(tl.load(offsets_ptr + gs + 1, mask=in_g, other=0), tl.load(end_ptr))
            hit = (offs_m[:, None] >= g_lo[None, :]) & (offs_m[:, None] < g_hi[None, :])
            hit = hit & in_g[None, :]
            row_slot = tl.max(tl.where(hit, ids[None, :], 0), axis=1)
            row_slot = tl.where((row_slot > 0) & (row_slot < num_slots) & mask_m, row_slot, 0)
            # delta[m, n] = sum_r h[m, r] * B[slot(m), n, r]: R independent gathers (no chain
            # of dependent loads; a row without a delta reads slot 0's zero B)
            b_rows = (b_ptr + row_slot.to(tl.int64)[:, None] * stride_bs
                      + offs_n.to(tl.int64)[None, :] * stride_bn)
            h_rows = h_ptr + sl * stride_hs + offs_m * stride_hm
            for r in tl.static_range(R):
                hr = tl.load(h_rows + r, mask=mask_m, other=0.0)
                acc += hr[:, None] * tl.load(b_rows + r).to(tl.float32)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None])
        if HAS_LORA:  # the last program leaves the workspace zero
            tl.debug_barrier()
            last = tl.atomic_add(count_ptr + 1, 1, sem="acq_rel")
            if last == tl.num_programs(0) - n_shrink - 1:
                offs_r = tl.arange(0, R)
                for s in tl.static_range(NUM_SLICES):
                    tl.store(h_ptr + s * stride_hs + offs_m[:, None] * stride_hm
                             + offs_r[None, :], tl.zeros((BLOCK_M, R), dtype=tl.float32),
                             mask=mask_m[:, None])
                tl.atomic_xchg(count_ptr, 0)
                tl.atomic_xchg(count_ptr + 1, 0)
# fmt: on


def gemm_lora(x, w, a, b, out_slices, routing, ws, *, lora=True, block_n=32, block_k=256,
              stages=4, split_k=16, shrink=True):  # fmt: skip
    """``y = x @ w.T`` (+ the LoRA delta of ``a`` ``[slots, S*R, K]``, ``b`` ``[slots, N, R]``
    under ``routing``) in one launch. ``ws = (count [2] int32, h [S, M, R] float32)``, zero.
    ``shrink=False`` (timing only): no shrink programs, the epilogue adds ``h`` as it is (0)."""
    m, k = x.shape
    n = w.shape[0]
    ids, offs, end = routing
    count, h = ws
    num_slices, r = len(out_slices), b.shape[2]
    sr = a.shape[1]
    s_block_m = 16  # (tl.dot tiles; rows past a group's end are masked)
    s_block_k = 64
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), s_block_k) * s_block_k
    split = triton.cdiv(k, k_per_split)
    g = ids.numel()
    tiles = triton.cdiv(m, s_block_m) + min(g, m)
    n_shrink = tiles * triton.cdiv(sr, 64) * split if lora and shrink else 0
    col0 = tuple(sum(out_slices[:i]) for i in range(num_slices))
    assert all(c % block_n == 0 for c in col0) and n % block_n == 0 and k % block_k == 0
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    f32 = x.dtype == torch.float32
    _gemm_lora_kernel[(n_shrink + n // block_n,)](
        x, w, y, a, b, h, count, ids, offs, end,
        m, n, k, g, a.shape[0], n_shrink, k_per_split,
        x.stride(0), w.stride(0), y.stride(0), a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), h.stride(0), h.stride(1),
        R=r, SR=sr, NUM_SLICES=num_slices, SLICE_COL0=col0,
        G_POW2=max(16, triton.next_power_of_2(g)),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=stages, S_BLOCK_M=s_block_m, S_BLOCK_N=64, S_BLOCK_K=s_block_k, SPLIT_K=split,
        HAS_LORA=lora, CAST_F32=f32, num_warps=4,
    )  # fmt: skip
    return y


def reference(x, w, a, b, out_slices, routing):
    """float64 ``x @ w.T`` + each row's ``x @ A[slot].T @ B[slot].T`` (slot 0: none)."""
    ids, offs, end = (t.tolist() for t in routing)
    y = x.double() @ w.double().T
    r = b.shape[2]
    for g, slot in enumerate(ids):
        lo, hi = offs[g], min(offs[g + 1], end[0])
        if slot <= 0 or hi <= lo:
            continue
        col = 0
        for s_, width in enumerate(out_slices):
            h = x[lo:hi].double() @ a[slot, s_ * r : (s_ + 1) * r].double().T
            y[lo:hi, col : col + width] += h @ b[slot, col : col + width].double().T
            col += width
    return y


def routing_for(m: int, adapters: int, g: int, device) -> tuple:
    """``m`` rows over ``adapters`` distinct slots 1.. in contiguous groups, ``g`` entries."""
    per = -(-m // adapters)
    cuts = [min(i * per, m) for i in range(adapters + 1)]
    ids = list(range(1, adapters + 1)) + [0] * (g - adapters)
    offs = cuts + [m] * (g - adapters)
    i32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(ids, **i32), torch.tensor(offs, **i32), torch.tensor([m], **i32)


def time_graph(fn, reps: int) -> float:
    """Seconds a replay of ``fn`` captured in a CUDA graph takes (median)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
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


def time_case(row, x, weights, pools, slices, routing, ws, variants, reps) -> None:
    """Fill ``row`` with µs per layer of cuBLAS, cuBLAS + lora_graph's decode LoRA, and the
    prototype without and with LoRA (its best tiles without), over ``len(weights)`` layers."""
    from lora_graph.kernels import triton_launch as T

    layers, k = len(weights), x.shape[1]

    def per_layer(fn_one) -> float:
        return time_graph(lambda: [fn_one(i) for i in range(layers)], reps) / layers * 1e6

    def lora_path(i):
        y, buf = T.linear_delta(x, weights[i], None, *pools[i], len(slices), list(slices), *routing)
        return (y + buf[: y.numel()].view(y.shape)).to(y.dtype)

    row["cublas_us"] = per_layer(lambda i: torch.nn.functional.linear(x, weights[i]))
    row["cublas_lora_us"] = per_layer(lora_path)
    best = None
    for bn, bk, st in variants:
        if any(c % bn for c in slices) or k % bk:
            continue

        def proto(i, bn=bn, bk=bk, st=st):
            return gemm_lora(x, weights[i], *pools[i], slices, routing, ws, lora=False,
                             block_n=bn, block_k=bk, stages=st)  # fmt: skip

        try:
            t = per_layer(proto)
        except Exception as e:  # noqa: BLE001 (a tile that does not fit: skip it)
            print(f"  {row['target']} {row['rows']} {bn}x{bk}x{st}: {e!r:.200}", flush=True)
            torch.cuda.synchronize()
            continue
        if best is None or t < best[0]:
            best = (t, bn, bk, st)
    t, bn, bk, st = best
    row.update(triton_us=t, tiles=f"{bn}x{bk}x{st}")
    row["triton_lora_us"] = per_layer(
        lambda i: gemm_lora(
            x, weights[i], *pools[i], slices, routing, ws, block_n=bn, block_k=bk, stages=st
        )  # fmt: skip
    )
    row["triton_epilogue_us"] = per_layer(  # the expand epilogue alone (no shrink, no wait)
        lambda i: gemm_lora(
            x,
            weights[i],
            *pools[i],
            slices,
            routing,
            ws,
            block_n=bn,
            block_k=bk,
            stages=st,
            shrink=False,
        )  # fmt: skip
    )
    assert not ws[0].any() and not ws[1].any()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 8, 32, 64],
        help="decode rows on a GPU (default 1 8 32 64; --smoke checks 1 8 20)",
    )
    p.add_argument(
        "--targets",
        nargs="+",
        choices=["qkv", "o", "gate_up", "down"],
        default=None,
        help="targets to time on a GPU (default all; --smoke checks its own tiny two)",
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default="bench/out/decode_gemm.json")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rank, adapters_max = 16, 16
    if cuda:
        shapes = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
                  "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}  # fmt: skip
        rows = args.rows
        shapes = {k: v for k, v in shapes.items() if args.targets is None or k in args.targets}
    else:
        shapes = {"qkv": (256, (128, 32, 32)), "down": (512, (64,))}
        rows = [1, 8, 20]
    results = []
    copy_bw = None
    if cuda:
        src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        t = time_graph(lambda: dst.copy_(src), args.reps)
        copy_bw = 2 * src.numel() / t
        del src, dst
        print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    variants = [(16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 256, 4)]
    for name, (k, slices) in shapes.items():
        n = sum(slices)
        s_ = len(slices)
        w_bytes = n * k * 2
        layers = max(4, min(64, (1 << 29) // w_bytes)) if cuda else 1
        g = torch.Generator().manual_seed(0)
        ws_ = [(torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype) for _ in range(layers)]
        slots = adapters_max + 1
        pools = []
        for _ in range(layers):
            a = (torch.randn(slots, s_ * rank, k, generator=g) * k**-0.5).to(device, dtype)
            b = (torch.randn(slots, n, rank, generator=g) * 0.05).to(device, dtype)
            a[0].zero_()
            b[0].zero_()
            pools.append((a, b))
        for m in rows:
            adapters = min(m, adapters_max)
            routing = routing_for(m, adapters, slots, device)
            x = torch.randn(m, k, generator=g).to(device, dtype)
            ws = (torch.zeros(2, dtype=torch.int32, device=device),
                  torch.zeros(s_, m, rank, dtype=torch.float32, device=device))  # fmt: skip
            a, b = pools[0]
            want = reference(
                x.cpu(), ws_[0].cpu(), a.cpu(), b.cpu(), slices, [t_.cpu() for t_ in routing]
            )
            got = gemm_lora(x, ws_[0], a, b, slices, routing, ws)
            err = float((got.double().cpu() - want).norm() / want.norm())
            zero = not ws[0].any() and not ws[1].any()
            row = dict(target=name, rows=m, adapters=adapters, rel_err=err, ws_zero=bool(zero))
            assert err < (2e-2 if cuda else 1e-4) and zero, row
            if cuda:
                floor_b = w_bytes + adapters * (s_ * rank * k + n * rank) * 2 + m * (k + n) * 2
                row["floor_us"] = floor_b / copy_bw * 1e6
                time_case(row, x, ws_, pools, slices, routing, ws, variants, args.reps)
            results.append(row)
            print({k_: format(v, ".3g") if isinstance(v, float) else v for k_, v in row.items()},
                  flush=True)  # fmt: skip

    if cuda:
        print()
        print("| target | rows | adapters | floor µs | cublas µs | cublas+lora µs | triton µs | "
              "triton+lora µs | epilogue µs | tiles | (cublas+lora)/cublas | "
              "(triton+lora)/cublas |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
        for r in results:
            print(f"| {r['target']} | {r['rows']} | {r['adapters']} | {r['floor_us']:.2f} | "
                  f"{r['cublas_us']:.2f} | {r['cublas_lora_us']:.2f} | {r['triton_us']:.2f} | "
                  f"{r['triton_lora_us']:.2f} | {r['triton_epilogue_us']:.2f} | {r['tiles']} | "
                  f"{r['cublas_lora_us'] / r['cublas_us']:.2f} | "
                  f"{r['triton_lora_us'] / r['cublas_us']:.2f} |")  # fmt: skip
    else:  # the smoke run checks only
        print("| target | rows | adapters | rel err | workspace zero after |")
        print("|---|---:|---:|---:|---|")
        for r in results:
            print(f"| {r['target']} | {r['rows']} | {r['adapters']} | {r['rel_err']:.1e} | "
                  f"{r['ws_zero']} |")  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"copy_bw": copy_bw, "rows": results}, indent=1))
    print("ok: every case matches float64 and leaves the workspace zero")


if __name__ == "__main__":
    main()
