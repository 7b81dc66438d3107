"""The Triton shrink/expand kernels against the torch reference and a float64 loop.

How the kernels run here:

- Without CUDA, the kernels run under Triton's CPU interpreter. Triton picks interpreter
  or compiler when a ``@triton.jit`` function is *decorated*, i.e. when
  ``lora_graph.kernels.triton_kernels`` is first imported, reading ``TRITON_INTERPRET`` at that
  moment (torch may be imported before; only that import matters). So this module sets
  ``TRITON_INTERPRET=1`` before importing triton / the kernels and restores
  it right after, so other test modules are unaffected (Triton also reads it lazily while
  launching; ``triton_launch`` sets it around each interpreted launch).
- If the kernels were already imported compiled in this process (another
  module imported it first, or CUDA is present), the interpreter tests skip here and
  ``test_interpreter_suite_in_subprocess`` re-runs them in a fresh interpreter process
  (``TRITON_INTERPRET=1``, CUDA hidden).
- ``@pytest.mark.gpu`` tests run the compiled kernels on a CUDA device against a float64
  reference (``pytest tests/test_triton_ops.py -m gpu``).

Under the interpreter bf16 ``tl.dot`` operands are upcast to fp32 first (numpy has no
bfloat16; see ``launch_shrink``); the compiled kernels use bf16 MMA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

_INTERP_SET_HERE = (
    not torch.cuda.is_available() and "lora_graph.kernels.triton_kernels" not in sys.modules
)
_PREV_INTERP = os.environ.get("TRITON_INTERPRET")
if _INTERP_SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from lora_graph.kernels import reference
    from lora_graph.kernels import triton_config as C
    from lora_graph.kernels import triton_launch as T
finally:
    if _INTERP_SET_HERE:
        if _PREV_INTERP is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _PREV_INTERP

from lora_graph.layers import slot_stack  # noqa: E402
from lora_graph.layout import SlotLayout  # noqa: E402
from lora_graph.targets import LoraTarget  # noqa: E402

INTERPRETED = T.interpreted()
interp = pytest.mark.skipif(
    not INTERPRETED,
    reason="the Triton kernels are compiled in this process; "
    "test_interpreter_suite_in_subprocess runs these under the interpreter",
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="needs CUDA and compiled (not interpreted) kernels",
)


# --------------------------------------------------------------------------------------
# helpers: a pool built as the manager builds it, routing, a float64 reference
# --------------------------------------------------------------------------------------


class Pool:
    """``num_slots`` flat slots, views of one ``[num_slots, numel]`` pool, with blocks at
    :class:`SlotLayout` offsets; slot ``s`` in ``ranks`` holds a rank-``ranks[s]`` adapter
    (zeros beyond its rank), every other slot is zero."""

    def __init__(
        self,
        targets: dict[str, LoraTarget],
        ranks: dict[int, int],
        max_rank: int,
        num_slots: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.targets, self.max_rank = targets, max_rank
        self.layout = SlotLayout(targets, 1, max_rank)
        self.pool = torch.zeros(num_slots, self.layout.numel, dtype=dtype, device=device)
        self.slots = [self.pool[s] for s in range(num_slots)]
        self.fill(ranks, seed)

    def fill(self, ranks: dict[int, int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for slot, r in ranks.items():
            self.slots[slot].zero_()
            for name, t in self.targets.items():
                a = self.layout.a_view(self.slots[slot], name, 0)
                b = self.layout.b_view(self.slots[slot], name, 0)
                a[:, :r] = (
                    torch.randn(t.num_slices, r, t.in_features, generator=g) / t.in_features**0.5
                )
                b[:, :r] = torch.randn(t.out_features, r, generator=g) / r**0.5

    def offsets(self, name: str) -> tuple[int, int]:
        return self.layout.blocks[(name, 0)]

    def stacks(self, name: str):
        """``(a [num_slots, S * R, in], b [num_slots, out, R])``: a LoRA layer's views of the
        pool."""
        t = self.targets[name]
        a_off, b_off = self.offsets(name)
        return (
            slot_stack(self.pool, a_off, (t.num_slices * self.max_rank, t.in_features)),
            slot_stack(self.pool, b_off, (t.out_features, self.max_rank)),
        )


def make_routing(groups: list[tuple[int, int]], device="cpu", pad_to: int = 0):
    """``groups``: ``(slot, rows)`` in order; padding groups (slot 0, empty) up to ``pad_to``.
    Rows after the last group are base rows."""
    ids, offs = [], [0]
    for slot, count in groups:
        ids.append(slot)
        offs.append(offs[-1] + count)
    while len(ids) < pad_to:
        ids.append(0)
        offs.append(offs[-1])
    i32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(ids, **i32), torch.tensor(offs, **i32), torch.tensor([offs[-1]], **i32)


def row_slots(n: int, lora_ids, grouped_offsets, end) -> list[int]:
    """The slot of each row by the documented rule (``-1``: at or after ``end``)."""
    ids, offs, e = lora_ids.tolist(), grouped_offsets.tolist(), int(end[0])
    out = []
    for t in range(n):
        g = min(sum(1 for o in offs[1:] if o <= t), len(ids) - 1)
        out.append(ids[g] if t < e else -1)
    return out


def reference64(pool: Pool, name: str, x, y0, routing):
    """float64 ``h`` and ``y`` of shrink + expand, looping over the slots present."""
    t = pool.targets[name]
    n = x.shape[0]
    slot_of = torch.tensor(row_slots(n, *routing), device=x.device)
    h = torch.zeros(t.num_slices, n, pool.max_rank, dtype=torch.float64, device=x.device)
    y = y0.double().clone()
    for slot in set(slot_of.tolist()):
        if slot <= 0 or slot >= len(pool.slots):
            continue
        rows = (slot_of == slot).nonzero().flatten()
        a = pool.layout.a_view(pool.slots[slot], name, 0).double()  # [S, R, in]
        b = pool.layout.b_view(pool.slots[slot], name, 0).double()  # [out, R]
        hs = torch.einsum("sri,ti->str", a, x[rows].double())
        h[:, rows] = hs
        col = 0
        for s, w in enumerate(t.out_slices):
            y[rows, col : col + w] += hs[s] @ b[col : col + w].T
            col += w
    return h, y, slot_of


def run_triton(pool: Pool, name: str, x, y0, routing):
    t = pool.targets[name]
    a, b = pool.stacks(name)
    h = T.shrink(x, a, t.num_slices, *routing)
    y = y0.clone()
    T.expand_(y, h, b, list(t.out_slices), *routing)
    return h, y


def run_reference_ops(pool: Pool, name: str, x, y0, routing):
    t = pool.targets[name]
    a, b = pool.stacks(name)
    h = reference.shrink(x, a, t.num_slices, *routing)
    y = y0.clone()
    reference.expand_(y, h, b, list(t.out_slices), *routing)
    return h, y


def poisoned_y(
    n: int, out: int, slot_of, dtype, device="cpu", seed: int = 1, sentinel: float = -1234.5
):
    """A base output: random on rows that get a delta, ``sentinel`` on the others."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, out, generator=g).to(device=device, dtype=dtype)
    untouched = slot_of <= 0
    y[untouched] = sentinel
    return y


def rel_err(got, ref) -> float:
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check(
    pool: Pool, name: str, x, routing, *, rtol_h: float, rtol_y: float, against_ops: bool = True
):
    """Run the Triton ops and compare with float64 (and the torch reference ops)."""
    t = pool.targets[name]
    n = x.shape[0]
    slot_of = torch.tensor(row_slots(n, *routing), device=x.device)
    y0 = poisoned_y(n, t.out_features, slot_of, x.dtype, x.device)
    h64, y64, slot_of = reference64(pool, name, x, y0, routing)
    h, y = run_triton(pool, name, x, y0, routing)
    assert h.dtype == torch.float32 and h.shape == (t.num_slices, n, pool.max_rank)
    assert y.dtype == y0.dtype
    live = (slot_of > 0) & (slot_of < len(pool.slots))
    # rows that get no delta: h exactly 0, y bit-for-bit unchanged (the sentinel)
    assert torch.equal(h[:, ~live], torch.zeros_like(h[:, ~live]))
    assert torch.equal(y[~live].view(torch.uint8), y0[~live].view(torch.uint8))
    if live.any():
        assert torch.isfinite(y[live]).all() and torch.isfinite(h).all()
        torch.testing.assert_close(h[:, live].double(), h64[:, live], rtol=rtol_h, atol=rtol_h)
        torch.testing.assert_close(y[live].double(), y64[live], rtol=rtol_y, atol=rtol_y)
    if against_ops:
        h_ref, y_ref = run_reference_ops(pool, name, x, y0, routing)
        torch.testing.assert_close(h, h_ref, rtol=rtol_h, atol=rtol_h)
        torch.testing.assert_close(y.double(), y_ref.double(), rtol=2 * rtol_y, atol=2 * rtol_y)
    return h, y, y0, h64, y64


# --------------------------------------------------------------------------------------
# interpreter tests (CPU)
# --------------------------------------------------------------------------------------

TARGETS = {
    "qkv": LoraTarget(64, (40, 24, 24), slice_names=("q_proj", "k_proj", "v_proj")),
    "down": LoraTarget(96, (48,)),
}
MAX_RANK = 8
RANKS = {1: 8, 2: 1, 3: 5, 4: 3}  # mixed ranks in one batch; slot 5 is free (zero)
NUM_SLOTS = 6
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 4e-3), torch.bfloat16: (1e-5, 8e-3)}


@pytest.fixture(scope="module")
def pools():
    return {
        dt: Pool(TARGETS, RANKS, MAX_RANK, NUM_SLOTS, dt)
        for dt in (torch.float32, torch.float16, torch.bfloat16)
    }


def mixed_groups(n_lora: int) -> list[tuple[int, int]]:
    """Rows split over slots 3, 1, (an empty group of slot 2), 4, 2; plus a zero-slot group."""
    k = [n_lora // 4 + (1 if i < n_lora % 4 else 0) for i in range(4)]
    return [(3, k[0]), (1, k[1]), (2, 0), (4, k[2]), (0, min(1, k[3])), (2, k[3] - min(1, k[3]))]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 3, 33])
@pytest.mark.parametrize("name", ["qkv", "down"])
def test_matches_reference(pools, dtype, n, name):
    pool = pools[dtype]
    n_base = 0 if n == 1 else max(1, n // 4)
    routing = make_routing(mixed_groups(n - n_base), pad_to=8)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, pool.targets[name].in_features, generator=g).to(dtype)
    check(pool, name, x, routing, rtol_h=TOL[dtype][0], rtol_y=TOL[dtype][1])


@interp
def test_strided_activations_and_output(pools):
    """x, y and h as non-contiguous views (the layer passes reshaped views)."""
    pool = pools[torch.float32]
    t = pool.targets["qkv"]
    n, out = 6, t.out_features
    routing = make_routing([(1, 2), (3, 3)], pad_to=4)  # row 5 is a base row
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, 2 * t.in_features, generator=g)[:, ::2]
    ybig = torch.randn(n, out + 8, generator=g)
    ybig[5] = -1234.5
    y = ybig[:, 4 : 4 + out]  # row stride out + 8
    before = ybig.clone()
    h64, y64, _ = reference64(pool, "qkv", x, y, routing)
    a, b = pool.stacks("qkv")
    h = T.shrink(x, a, t.num_slices, *routing)
    torch.testing.assert_close(h.double(), h64, rtol=1e-5, atol=1e-5)
    h_strided = torch.empty(n, t.num_slices, MAX_RANK).transpose(0, 1)
    h_strided.copy_(h)
    T.expand_(y, h_strided, b, list(t.out_slices), *routing)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    assert torch.equal(ybig[:, :4], before[:, :4]) and torch.equal(
        ybig[:, 4 + out :], before[:, 4 + out :]
    )
    assert torch.equal(ybig[5], before[5])


@interp
@pytest.mark.parametrize(
    "shrink_cfg, expand_cfg",
    [
        # broadcast paths; K splits with atomics; slices not multiples of BLOCK_N; 5 programs
        # looping over all work items
        (
            C.ShrinkConfig(
                block_m=2, block_n=16, block_k=16, split_k=3, k_per_split=32, max_programs=5
            ),
            C.ExpandConfig(block_m=2, block_n=16, block_r=16, max_programs=3),
        ),
        # dot paths; 3 K steps per split; several row tiles per group; one program per item
        (
            C.ShrinkConfig(block_m=16, block_n=16, block_k=16, split_k=2, k_per_split=48),
            C.ExpandConfig(block_m=16, block_n=32, block_r=16),
        ),
        # no split (plain stores); a single program does every item
        (
            C.ShrinkConfig(
                block_m=16, block_n=32, block_k=32, split_k=1, k_per_split=96, max_programs=1
            ),
            C.ExpandConfig(block_m=4, block_n=16, block_r=16, max_programs=1),
        ),
        # runs of 3 column blocks an item (7 blocks: 3 + 2 + 2 by slice; runs cross slice
        # boundaries, the last run is short), pipelined; and the same looped by 2 programs
        (
            C.ShrinkConfig(block_m=16, block_n=16, block_k=16, split_k=2, k_per_split=48),
            C.ExpandConfig(block_m=16, block_n=16, block_r=16, blocks_per_item=3),
        ),
        (
            C.ShrinkConfig(block_m=16, block_n=16, block_k=16, split_k=2, k_per_split=48),
            C.ExpandConfig(block_m=16, block_n=16, block_r=16, max_programs=2, blocks_per_item=2),
        ),
    ],
    ids=["bcast-split3-loop", "dot-split2", "dot-nosplit-1prog", "runs-of-3", "runs-of-2-loop"],
)
def test_forced_configs(pools, shrink_cfg, expand_cfg):
    """Row blocks inside long groups, several column blocks, K splits with atomics,
    K tails, slice boundaries inside the column-block sequence."""
    pool = pools[torch.float32]
    name = "qkv"
    t = pool.targets[name]
    t_in = 90  # K = 90: not a multiple of any BLOCK_K
    targets = {name: LoraTarget(t_in, t.out_slices)}
    pool = Pool(targets, RANKS, MAX_RANK, NUM_SLOTS, torch.float32, seed=3)
    n = 37
    routing = make_routing([(2, 19), (4, 0), (1, 5), (3, 9)], pad_to=6)  # rows 33.. are base rows
    x = torch.randn(n, t_in, generator=torch.Generator().manual_seed(5))
    slot_of = torch.tensor(row_slots(n, *routing))
    y0 = poisoned_y(n, t.out_features, slot_of, torch.float32)
    h64, y64, _ = reference64(pool, name, x, y0, routing)
    a, b = pool.stacks(name)
    cfg = C._finish_shrink(
        t_in,
        shrink_cfg.block_m,
        shrink_cfg.block_n,
        shrink_cfg.block_k,
        shrink_cfg.split_k,
        4,
        1,
        shrink_cfg.max_programs,
    )
    assert cfg == C.ShrinkConfig(**{**shrink_cfg.__dict__, "num_stages": 1})
    h = torch.zeros(t.num_slices, n, MAX_RANK)
    T.launch_shrink(x, a, h, *routing, MAX_RANK, config=cfg)
    torch.testing.assert_close(h.double(), h64, rtol=1e-5, atol=1e-5)
    y = y0.clone()
    T.launch_expand(y, h, b, t.out_slices, *routing, config=expand_cfg)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[33:], y0[33:])


@interp
def test_routing_edge_cases(pools):
    pool = pools[torch.float32]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    cases = {
        "all base (end = 0)": make_routing([], pad_to=3),
        "one group, all rows": make_routing([(4, 5)], pad_to=1),
        "more groups than rows": make_routing([(1, 1), (2, 1), (3, 1), (4, 1), (1, 1)], pad_to=9),
        "slot 0 and an unknown slot in the middle": make_routing(
            [(1, 1), (0, 2), (NUM_SLOTS + 3, 1), (2, 1)], pad_to=5
        ),
        "a free (all-zero) slot": make_routing([(5, 3), (1, 2)], pad_to=2),
    }
    # not what the manager builds, but the reference defines it: rows before grouped_offsets[0]
    # belong to group 0, rows in [grouped_offsets[G], end) to group G - 1
    ids, offs, _ = make_routing([(2, 2), (3, 1)], pad_to=2)
    cases["offsets[0] > 0, end past offsets[G]"] = (
        ids,
        offs + 1,
        torch.tensor([5], dtype=torch.int32),
    )
    for what, routing in cases.items():
        check(pool, "qkv", x, routing, rtol_h=1e-5, rtol_y=1e-5)
        if what == "all base (end = 0)":
            h, _ = run_triton(pool, "qkv", x, torch.zeros(5, 88), routing)
            assert not h.any()
    # zero rows
    h, y = run_triton(pool, "qkv", x[:0], torch.zeros(0, 88), make_routing([], pad_to=2))
    assert h.shape == (3, 0, MAX_RANK) and y.shape == (0, 88)


GATE_UP = LoraTarget(64, (40, 40), slice_names=("gate_proj", "up_proj"))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "groups, n",
    [
        (mixed_groups(30), 37),  # groups with an empty one and a slot-0 one, then base rows
        ([(1, 5), (NUM_SLOTS + 3, 2), (4, 3)], 10),  # an unknown slot: no delta; no base rows
        ([], 6),  # all base (end = 0)
        ([(2, 1)], 1),
    ],
)
def test_expand_silu_mul_matches_expand_then_activation(dtype, groups, n):
    """The fused kernel equals expand (in place, rounding into y) then ``silu(g) * u`` on
    every row: rows with a delta, rows of slot 0 or an unknown slot, base and padding rows;
    ``y`` is left unchanged."""
    pool = Pool({"gate_up": GATE_UP}, RANKS, MAX_RANK, NUM_SLOTS, dtype, seed=5)
    routing = make_routing(groups, pad_to=8)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 64, generator=g).to(dtype)
    y = torch.randn(n, 80, generator=g).to(dtype)
    before = y.clone()
    a, b = pool.stacks("gate_up")
    h = T.shrink(x, a, 2, *routing)
    got = T.expand_silu_mul(y, h, b, *routing)
    assert torch.equal(y, before) and got.shape == (n, 40) and got.dtype == dtype
    y_exp = y.clone()
    T.expand_(y_exp, h, b, [40, 40], *routing)
    gate, up = y_exp.float().split(40, dim=1)
    want = (gate * torch.sigmoid(gate) * up).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    ref = reference.expand_silu_mul(y, reference.shrink(x, a, 2, *routing), b, *routing)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * tol, atol=2 * tol)
    # rows without a delta read neither h nor B: NaN there changes nothing
    no_delta = torch.tensor(row_slots(n, *routing)) <= 0
    no_delta |= torch.tensor(row_slots(n, *routing)) >= NUM_SLOTS
    h_poisoned = h.clone()
    h_poisoned[:, no_delta] = float("nan")
    assert torch.equal(T.expand_silu_mul(y, h_poisoned, b, *routing), got)
    # 16-column blocks (3 per half), walked 2 a program: the last program's run is short
    cfg = C.ExpandConfig(16, 16, MAX_RANK if MAX_RANK >= 16 else 16)
    for per_program in (1, 2, 3):
        out = torch.full_like(got, float("nan"))
        T.launch_expand_silu_mul(y, h, b, out, *routing, config=cfg, blocks_per_program=per_program)
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "groups, n",
    [(mixed_groups(30), 37), ([(1, 5), (NUM_SLOTS + 3, 2), (4, 3)], 10), ([], 6), ([(2, 1)], 1)],
)
def test_decode_ops_write_every_row(pools, dtype, groups, n):
    """The decode ops against the float64 reference: ``linear_delta``'s delta (an
    overwriting expand into an unzeroed buffer: rows without a delta are exactly 0, whatever
    the buffer held) and ``linear_shrink``'s ``(y, h)``; and ``launch_expand(overwrite=True)``
    under forced tiles into a NaN-filled output."""
    pool = pools[dtype]
    t = pool.targets["qkv"]
    a, b = pool.stacks("qkv")
    routing = make_routing(groups, pad_to=8)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, t.in_features, generator=g).to(dtype)
    w = torch.randn(t.out_features, t.in_features, generator=g).to(dtype)
    h64, d64, slot_of = reference64(pool, "qkv", x, torch.zeros(n, t.out_features), routing)
    no_delta = (slot_of <= 0) | (slot_of >= NUM_SLOTS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    y, buf = T.linear_delta(x, w, None, a, b, t.num_slices, list(t.out_slices), *routing)
    d = buf[: n * t.out_features].view(n, t.out_features)
    assert torch.equal(y, torch.nn.functional.linear(x, w))
    assert not d[no_delta].any()
    torch.testing.assert_close(d.double(), d64, rtol=tol, atol=tol)
    y2, h = T.linear_shrink(x, w, None, a, t.num_slices, *routing)
    assert torch.equal(y2, y) and not h[:, no_delta].any()
    torch.testing.assert_close(h.double(), h64, rtol=tol, atol=tol)
    cfg = C.ExpandConfig(16, 16, 16, max_programs=3)
    for config in (None, cfg):
        out = torch.full((n, t.out_features), float("nan"))
        T.launch_expand(out, h, b, t.out_slices, *routing, config, overwrite=True)
        assert not out[no_delta].any()
        torch.testing.assert_close(out.double(), d64, rtol=tol, atol=tol)


def workspace_is_zero() -> bool:
    """Whether every stream's workspace of ``launch_delta`` is all zero (its invariant)."""
    from lora_graph.kernels import triton_delta

    return all(not c.any() and not h.any() for c, h in triton_delta._WORKSPACES.values())


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "groups, n",
    [(mixed_groups(30), 37), ([(1, 5), (NUM_SLOTS + 3, 2), (4, 3)], 10), ([], 6), ([(2, 1)], 1),
     ([(1, 2), (3, 1)], 3)],
)  # fmt: skip
def test_one_launch_delta_against_float64(pools, dtype, groups, n):
    """``launch_delta`` (shrink + expand in one launch, the expand items waiting for their
    tile's shrink items) against the float64 reference: in place (``delta_``: rows without
    a delta bit-for-bit unchanged) and overwriting a NaN-filled buffer (rows without a delta
    exactly 0); its workspace is all zero again after every launch, whatever the target's
    slices and rank."""
    pool = pools[dtype]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(n)
    routing = make_routing(groups, pad_to=8)
    for name, t in pool.targets.items():
        a, b = pool.stacks(name)
        x = torch.randn(n, t.in_features, generator=g).to(dtype)
        y0 = torch.randn(n, t.out_features, generator=g).to(dtype)
        _, y64, slot_of = reference64(pool, name, x, y0, routing)
        _, d64, _ = reference64(pool, name, x, torch.zeros(n, t.out_features), routing)
        no_delta = (slot_of <= 0) | (slot_of >= NUM_SLOTS)
        y = y0.clone()
        T.delta_(y, x, a, b, list(t.out_slices), *routing)
        assert torch.equal(y[no_delta], y0[no_delta])
        torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
        assert workspace_is_zero()
        d = torch.full((n, t.out_features), float("nan"))
        T.launch_delta(d, x, a, b, t.out_slices, *routing, MAX_RANK, overwrite=True)
        assert not d[no_delta].any()
        torch.testing.assert_close(d.double(), d64, rtol=tol, atol=tol)
        assert workspace_is_zero()


@interp
def test_one_launch_delta_with_a_callers_plans(pools):
    """``delta_`` with a caller's own cache of launches (a LoRA layer's): calls with other
    row counts, another group count (a second routing buffer) and the same ones again each
    get the launch that fits them, against float64; a plan is kept per signature."""
    pool = pools[torch.float32]
    t = pool.targets["qkv"]
    a, b = pool.stacks("qkv")
    plans: dict = {}
    g = torch.Generator().manual_seed(5)
    many = [(1 + i % 4, 1) for i in range(10)] + [(3, 2)]  # 11 groups: past 8 entries
    cases = [
        (mixed_groups(30), 37, 8),
        ([(1, 5), (4, 3), (2, 4)], 12, 8),
        (many, 12, 16),  # the same rows, 16 routing entries: another plan
        (mixed_groups(30), 37, 8),
    ]
    for groups, n, pad in cases:
        routing = make_routing(groups, pad_to=pad)
        x = torch.randn(n, t.in_features, generator=g)
        y0 = torch.randn(n, t.out_features, generator=g)
        _, y64, _ = reference64(pool, "qkv", x, y0, routing)
        y = y0.clone()
        T.delta_(y, x, a, b, list(t.out_slices), *routing, plans=plans)
        torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
        assert workspace_is_zero()
    assert len(plans) == 3


@interp
def test_one_launch_delta_refuses_what_does_not_fit(pools):
    """``delta_`` refuses, naming the shapes, what its launch cannot serve (a new user's
    trial: too few ``out_slices`` for the stack ran and changed every row; other mismatches
    raised a bare ``AssertionError``); and a caller's plans told apart by whether ``ranks``
    is given (the trial: the second call read the routing as the rank table)."""
    pool = pools[torch.float32]
    t = pool.targets["qkv"]
    a, b = pool.stacks("qkv")
    routing = make_routing([(1, 3), (4, 2)], pad_to=8)
    x = torch.randn(5, t.in_features)
    y = torch.zeros(5, t.out_features)
    slices = list(t.out_slices)
    bad = [
        (dict(out_slices=slices[:2]), "shapes disagree"),
        (dict(out_slices=[]), "one or more out_slices"),
        (dict(y=torch.zeros(5, t.out_features + 1)), "shapes disagree"),
        (dict(y=torch.zeros(4, t.out_features)), "shapes disagree"),
        (dict(y=torch.zeros(5 * t.out_features)), "y [N, out]"),
        (dict(x=torch.randn(5, t.in_features + 1)), "shapes disagree"),
        (dict(y=torch.zeros(5, t.out_features, dtype=torch.int32)), "floating-point"),
    ]
    for change, message in bad:
        args = dict(y=y, x=x, out_slices=slices) | change
        with pytest.raises(ValueError, match=re.escape(message)):
            T.delta_(args["y"], args["x"], a, b, args["out_slices"], *routing)
    assert not y.any()
    ranks = torch.tensor([RANKS.get(s, 0) for s in range(NUM_SLOTS)], dtype=torch.int32)
    _, y64, _ = reference64(pool, "qkv", x, y, routing)
    plans: dict = {}
    for r in (ranks, None, ranks):
        got = y.clone()
        T.delta_(got, x, a, b, slices, *routing, ranks=r, plans=plans)
        torch.testing.assert_close(got.double(), y64, rtol=1e-5, atol=1e-5)
    assert len(plans) == 2


@interp
def test_linear_delta_and_the_one_launch_delta(pools):
    """``linear_delta`` (the base linear, and the float32 delta of a shrink and an expand
    that writes every row; ``linear_delta_stacked``: both stacked, with a bias) and
    ``delta_`` (one ``launch_delta``) at 37 mixed rows, against float64; the one launch's
    workspace zero after it; more than 64 rows is refused."""
    pool = pools[torch.float32]
    routing = make_routing(mixed_groups(30), pad_to=8)
    n = 37
    g = torch.Generator().manual_seed(3)
    for name in ("qkv", "down"):
        t = pool.targets[name]
        a, b = pool.stacks(name)
        x = torch.randn(n, t.in_features, generator=g)
        w = torch.randn(t.out_features, t.in_features, generator=g)
        y0 = torch.randn(n, t.out_features, generator=g)
        _, d64, _ = reference64(pool, name, x, torch.zeros(n, t.out_features), routing)
        y, buf = T.linear_delta(x, w, None, a, b, t.num_slices, list(t.out_slices), *routing)
        assert torch.equal(y, torch.nn.functional.linear(x, w))
        d = buf[: n * t.out_features].view(n, -1)
        torch.testing.assert_close(d.double(), d64, rtol=1e-5, atol=1e-5)
        bias = torch.randn(t.out_features, generator=g)
        stacked = T.linear_delta_stacked(x, w, bias, a, b, t.num_slices, list(t.out_slices),
                                         *routing)  # fmt: skip
        torch.testing.assert_close(stacked[0], torch.nn.functional.linear(x, w, bias))
        assert torch.equal(stacked[1], d)
        got = y0.clone()
        T.delta_(got, x, a, b, list(t.out_slices), *routing)
        torch.testing.assert_close(got.double(), y0.double() + d64, rtol=1e-5, atol=1e-5)
        assert workspace_is_zero()
    x = torch.zeros(65, t.in_features)
    with pytest.raises(ValueError, match="at most 64 rows, got 65"):
        T.delta_(torch.zeros(65, t.out_features), x, a, b, list(t.out_slices), *routing)


# ranks over several 16-column chunks of a rank-48 pool (rounded up: 48, 16, 32, 48)
WIDE_RANKS = {1: 40, 2: 1, 3: 20, 4: 33}


F32, BF16 = torch.float32, torch.bfloat16


@interp
@pytest.mark.parametrize(
    "dtype, max_rank, slot_ranks, n",
    [
        (F32, MAX_RANK, RANKS, 37),
        (F32, MAX_RANK, RANKS, 3),
        (F32, 48, WIDE_RANKS, 37),
        (F32, 48, WIDE_RANKS, 3),
        (BF16, MAX_RANK, RANKS, 3),
        (BF16, 48, WIDE_RANKS, 37),
    ],  # (a rank-32 pool, and each case in both dtypes, cut for the suite's time: the
    # rank-48 pool's three 16-column chunks cover a rank-32 pool's two)
    ids=["r8", "r8-3rows", "r48", "r48-3rows", "r8-3rows-bf16", "r48-bf16"],
)
def test_columns_past_a_slots_rank_are_not_read(dtype, max_rank, slot_ranks, n):
    """With ``ranks``, every kernel skips a slot's A rows and B columns from its rank on
    (rounded up to a multiple of 16 in a pool whose ``max_rank`` is one): garbage put there
    changes nothing (without ``ranks`` it does), and the results equal the float64 reference
    of the clean pool; h stays exact (0 past the rank). In pools wider than 16 the shrink's
    tiles of 3 rows (broadcast tiles) number only a slot's live columns (``COMPACT``) and
    the expands loop over 16-column rank chunks (``RANK_CHUNK``: three for a rank-48 slot);
    37 rows take ``tl.dot`` tiles of ``max_rank`` columns, masked."""
    check_ranks_skipped(dtype, max_rank, slot_ranks, n, "cpu")


def check_ranks_skipped(dtype, max_rank: int, slot_ranks: dict[int, int], n: int, device):
    """:func:`test_columns_past_a_slots_rank_are_not_read` on ``device``."""
    targets = {**TARGETS, "gate_up": GATE_UP}
    clean = Pool(targets, slot_ranks, max_rank, NUM_SLOTS, dtype, device=device, seed=21)
    dirty = Pool(targets, slot_ranks, max_rank, NUM_SLOTS, dtype, device=device, seed=21)
    ranks = torch.tensor(
        [slot_ranks.get(s, 0) for s in range(NUM_SLOTS)], dtype=torch.int32, device=device
    )
    for name, t in targets.items():
        a, b = dirty.stacks(name)
        for slot in range(NUM_SLOTS):
            r = int(ranks[slot])
            read = r if max_rank % 16 else min(-(-r // 16) * 16, max_rank)
            a[slot].view(t.num_slices, max_rank, -1)[:, read:] = 1e3
            b[slot, :, read:] = -1e3
    groups = mixed_groups(n - 7) if n > 7 else [(3, 1), (0, 0), (1, 1)]  # + base rows
    routing = make_routing(groups, device=device, pad_to=8)
    g = torch.Generator().manual_seed(3)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name in ("qkv", "down"):
        t = targets[name]
        x = torch.randn(n, t.in_features, generator=g).to(device, dtype)
        y0 = torch.randn(n, t.out_features, generator=g).to(device, dtype)
        h64, y64, _ = reference64(clean, name, x, y0, routing)
        a, b = dirty.stacks(name)
        h = T.shrink(x, a, t.num_slices, *routing, ranks=ranks)
        torch.testing.assert_close(h.double(), h64, rtol=tol, atol=tol)
        y = y0.clone()
        T.expand_(y, h, b, list(t.out_slices), *routing, ranks=ranks)
        torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
        y_blind = y0.clone()
        T.expand_(y_blind, T.shrink(x, a, t.num_slices, *routing), b, list(t.out_slices), *routing)
        assert rel_err(y_blind, y64) > 1e-1  # the garbage is read without ranks
        w = torch.randn(t.out_features, t.in_features, generator=g).to(device, dtype)
        zeros = torch.zeros(n, t.out_features, device=device)
        _, d, _ = reference64(clean, name, x, zeros, routing)
        _, buf = T.linear_delta(x, w, None, a, b, t.num_slices, list(t.out_slices), *routing,
                                ranks=ranks)  # fmt: skip
        torch.testing.assert_close(
            buf[: n * t.out_features].view(n, -1).double(), d, rtol=tol, atol=tol
        )
        _, h2 = T.linear_shrink(x, w, None, a, t.num_slices, *routing, ranks=ranks)
        torch.testing.assert_close(h2.double(), h64, rtol=tol, atol=tol)
        y1 = y0.clone()
        T.delta_(y1, x, a, b, list(t.out_slices), *routing, ranks=ranks)
        torch.testing.assert_close(y1.double(), y64, rtol=tol, atol=tol)
        assert workspace_is_zero()
    x = torch.randn(n, 64, generator=g).to(device, dtype)
    y = torch.randn(n, 80, generator=g).to(device, dtype)
    a, b = dirty.stacks("gate_up")
    ca, cb = clean.stacks("gate_up")
    h = T.shrink(x, a, 2, *routing, ranks=ranks)
    want = reference.expand_silu_mul(y, reference.shrink(x, ca, 2, *routing), cb, *routing)
    got = T.expand_silu_mul(y, h, b, *routing, ranks=ranks)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * tol, atol=2 * tol)


@interp
def test_routing_changes_in_place_need_nothing_new(pools):
    """Persistent routing buffers refilled in place: from 2 groups to every group in use,
    and a slot rewritten in place; the ops see both (as a graph replay would)."""
    pool = Pool(TARGETS, RANKS, MAX_RANK, NUM_SLOTS, torch.float32, seed=11)
    ids, offs, end = make_routing([(1, 3), (2, 4)], pad_to=5)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8))
    check(pool, "qkv", x, (ids, offs, end), rtol_h=1e-5, rtol_y=1e-5, against_ops=False)
    ids2, offs2, end2 = make_routing([(4, 1), (3, 2), (1, 2), (2, 1), (4, 2)], pad_to=5)
    ids.copy_(ids2)
    offs.copy_(offs2)
    end.copy_(end2)
    pool.fill({3: 2}, seed=99)  # slot 3 now holds a rank-2 adapter
    check(pool, "qkv", x, (ids, offs, end), rtol_h=1e-5, rtol_y=1e-5)


def test_fake_registration_and_compile(pools):
    """The ops' ``register_fake`` shapes, and a fullgraph ``torch.compile`` of shrink + expand
    on slot stacks (CPU: the reference implementation behind the op)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pool = pools[torch.float32]
    t = pool.targets["qkv"]
    a, b = pool.stacks("qkv")
    routing = make_routing([(1, 2), (2, 2)], pad_to=3)
    x = torch.randn(5, 64)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fa, fb = mode.from_tensor(x), mode.from_tensor(a), mode.from_tensor(b)
        froute = [mode.from_tensor(r) for r in routing]
        fh = torch.ops.lora_graph.lora_shrink(fx, fa, 3, *froute)
        assert fh.shape == (3, 5, MAX_RANK) and fh.dtype == torch.float32
        fy, fbuf = torch.ops.lora_graph.lora_linear_delta(
            fx, torch.empty(88, 64), None, fa, fb, 3, list(t.out_slices), *froute
        )
        assert (
            fy.shape == (5, 88)
            and fbuf.shape == (5 * 88 + 3 * 5 * MAX_RANK,)
            and fbuf.dtype == torch.float32
        )

    def step(x, y, a, b, lora_ids, grouped_offsets, end):
        h = torch.ops.lora_graph.lora_shrink(x, a, t.num_slices, lora_ids, grouped_offsets, end)
        torch.ops.lora_graph.lora_expand_(
            y, h, b, list(t.out_slices), lora_ids, grouped_offsets, end
        )
        return y

    y0 = torch.randn(5, t.out_features)
    expected = step(x, y0.clone(), a, b, *routing)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, y0.clone(), a, b, *routing)
    torch.testing.assert_close(got, expected)
    _, y64, _ = reference64(pool, "qkv", x, y0, routing)
    torch.testing.assert_close(got.double(), y64, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.lora_graph.lora_shrink.default, (x, a.clone(), 3, *routing))


@interp
@pytest.mark.parametrize(
    "dtype, slot_dtype, max_len, graph",
    [
        (torch.float32, None, 8, False),
        (torch.float32, None, 8, True),
        (torch.float32, None, 16, True),
        (torch.bfloat16, torch.float32, 8, True),
    ],
)
def test_pipeline_on_triton_matches_torch_backend(
    tiny_factory, monkeypatch, dtype, slot_dtype, max_len, graph
):
    """The whole model on the Triton backend (interpreted) against the torch reference ops,
    on a tied model with every target kind: fused q/k/v, the embedding (its expand is the
    Triton one), the per-request LM head; and float32 slots under a bfloat16 model. In a
    graph (``graph``: as if captured) and up to ``side_stream_max_rows`` rows, the base linear and
    the delta run in ``lora_linear_delta`` (the delta on a side stream on CUDA) and the
    MLP's gate/up in ``lora_linear_shrink``; otherwise shrink and expand run in place."""
    import dataclasses

    from conftest import make_pipeline, prompts
    from test_parity import MIX, run_prefill

    import lora_graph.ops
    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline

    t = tiny_factory("tied")
    pipe = LlamaPipeline(
        str(t.base),
        dtype=dtype,
        max_batch_size=8,
        max_seq_len=64,
        lora=LoRAConfig(max_slots=4, max_rank=16, backend="triton", dtype=slot_dtype),
    )
    for name, path in t.adapters.items():
        pipe.manager.load_adapter(str(path), name=name)
    kernels = pipe.manager.kernels
    assert kernels.shrink is T.shrink and kernels.linear_delta is T.linear_delta
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        assert kwargs["ranks"] is pipe.manager.slots.ranks
        return T.linear_delta(*args, **kwargs)

    gated = []

    def counted_gated(*args, **kwargs):
        gated.append(1)
        return T.expand_silu_mul(*args, **kwargs)

    for layer in pipe.manager.layers.values():
        layer._kernels = dataclasses.replace(
            kernels, linear_delta=counted, expand_silu_mul=counted_gated
        )
    monkeypatch.setattr(lora_graph.ops, "in_graph", lambda x: graph)  # as if captured
    batch = prompts(len(MIX), seed=61, min_len=max_len - 2, max_len=max_len)
    got = run_prefill(pipe, batch, MIX)
    forks = len(calls)
    small = graph and len(MIX) * max_len <= kernels.policy.side_stream_max_rows
    # q/k/v, o and down of 2 layers + the LM head; gate/up through linear_shrink, its expand
    # and activation fused at every size
    assert forks == (7 if small else 0)
    assert len(gated) == 2
    want = run_prefill(make_pipeline(t, dtype=dtype, slot_dtype=slot_dtype), batch, MIX)
    truth = run_prefill(make_pipeline(t), batch, MIX)
    for adapter, g, w, f in zip(MIX, got, want, truth, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(
                g, w, rtol=1e-4, atol=1e-4, msg=lambda m, a=adapter: f"{a}: {m}"
            )
        else:  # bfloat16: as far from float32 as the torch backend is, give or take rounding order
            err, err_torch = (float((x.float() - f).norm() / f.norm()) for x in (g, w))
            assert err <= 1.5 * err_torch + 2e-3, (adapter, err, err_torch)


@interp
def test_compiling_the_interpreted_backend_is_refused_by_name(tiny_factory, reference_factory):
    """``backend="triton"`` on the CPU calls the Triton interpreter's launches directly,
    which ``torch.compile`` cannot trace: asking to compile it is refused with the cause,
    before anything is traced (it was a dynamo traceback from deep inside the interpreter,
    ``bench/decode.py --smoke --backend triton --mode inductor``), and the pipeline still
    serves eagerly."""
    from conftest import prompts, run_prefill

    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline

    t = tiny_factory("tied")
    pipe = LlamaPipeline(
        str(t.base),
        max_batch_size=2,
        max_seq_len=32,
        lora=LoRAConfig(max_slots=2, max_rank=16, backend="triton"),
    )
    pipe.manager.load_adapter(str(t.adapters["A"]), name="A")
    with pytest.raises(ValueError, match="torch.compile cannot trace"):
        pipe.enable_compile("inductor", token_buckets=(2,), progress=False)
    assert pipe.graphs is None
    batch = prompts(1, seed=5, min_len=3, max_len=3)
    (out,) = run_prefill(pipe, batch, ["A"])  # against transformers + peft
    want = reference_factory(t).logits(batch[0], "A")
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_interpreter_suite_in_subprocess():
    """Runs the interpreter tests in a fresh process when they could not run in this one."""
    if INTERPRETED:
        pytest.skip("the interpreter tests ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-o",
            "addopts=",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not gpu",
            "-k",
            "not subprocess and not without_triton",
            __file__,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 20, proc.stdout[-2000:]


def test_imports_without_triton():
    """Without triton: ``HAVE_TRITON`` is False, the ops run the reference, and the Triton
    implementations and ``backend="triton"`` raise a clear error."""
    code = (
        "import sys\nsys.modules['triton'] = None\nsys.modules['triton.language'] = None\nimport "
        "torch\nfrom lora_graph import ops\nfrom lora_graph.kernels import triton_launch as "
        "T\nassert not T.HAVE_TRITON and not T.interpreted() and not ops.have_triton()\nassert "
        "ops.kernels('auto', torch.device('cpu')).shrink is ops.lora_shrink\ntry:\n    "
        "T.shrink(torch.zeros(1, 4), torch.zeros(2, 1, 4), 1, torch.zeros(1, "
        "dtype=torch.int32),\n             torch.zeros(2, dtype=torch.int32), torch.zeros(1, "
        "dtype=torch.int32))\nexcept RuntimeError as e:\n    assert 'Triton' in str(e)\nelse:\n  "
        "  raise AssertionError('no error')\ntry:\n    ops.kernels('triton', "
        "torch.device('cpu'))\nexcept ValueError as e:\n    assert 'not installed' in "
        "str(e)\nelse:\n    raise AssertionError('no error')\nprint('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_cpu_start_up_does_not_import_triton():
    """The default backend on the CPU never needs Triton, so making its kernels does not
    import it (0.2 s of start-up); the ops run the reference."""
    code = (
        "import sys, torch\nfrom lora_graph import ops\n"
        "k = ops.kernels('auto', torch.device('cpu'))\n"
        "assert k.shrink is ops.lora_shrink and k.direct is None\n"
        "assert 'triton' not in sys.modules, 'triton imported'\nprint('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


_SM90_COMPILE = r"""
import os, re, subprocess, sys, tempfile
import torch, triton
try:  # a stand-in driver: the real launch path (binder, specialisation, compile) without a GPU
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    class FakeDriver:
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")

    triton.runtime.driver.set_active(FakeDriver())
    compiled = []

    def getitem(self, grid):
        def compile_only(*args, **kwargs):
            compiled.append(self.run(*args, grid=grid, warmup=True, **kwargs))
        return compile_only

    JITFunction.__getitem__ = getitem
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    assert os.path.exists(cuobjdump)
except Exception as e:
    print("setup:", type(e).__name__, e)
    sys.exit(77)
from lora_graph.kernels import triton_launch as T
from lora_graph.layers import slot_stack
from lora_graph.layout import SlotLayout
from lora_graph.targets import LoraTarget
target = LoraTarget(4096, (4096, 1024, 1024))
for dtype, sizes in ((torch.bfloat16, (1, 3, 33, 2048)), (torch.float32, (33,))):
    layout = SlotLayout({"qkv": target}, 2, 16)
    pool = torch.zeros(9, layout.numel, dtype=dtype)
    a_off, b_off = layout.blocks[("qkv", 1)]
    a, b = slot_stack(pool, a_off, (48, 4096)), slot_stack(pool, b_off, (6144, 16))
    i32 = dict(dtype=torch.int32)
    routing = (torch.zeros(8, **i32), torch.zeros(9, **i32), torch.zeros(1, **i32))
    for n in sizes:
        x, y = torch.zeros(n, 4096, dtype=dtype), torch.zeros(n, 6144, dtype=dtype)
        h = T.shrink(x, a, 3, *routing)
        T.expand_(y, h, b, [4096, 1024, 1024], *routing)
for n in (512, 2048):  # the gated MLP's fused expand + activation (prefill sizes)
    b2 = slot_stack(torch.zeros(9, 2 * 14336 * 16, dtype=torch.bfloat16), 0, (2 * 14336, 16))
    y2 = torch.zeros(n, 2 * 14336, dtype=torch.bfloat16)
    T.expand_silu_mul(y2, torch.zeros(2, n, 16), b2, *routing)
# a rank-64 pool told each slot's rank (decode): compact shrink columns, expand rank chunks
ranks = torch.full((9,), 16, dtype=torch.int32)
a64 = slot_stack(torch.zeros(9, 192 * 4096, dtype=torch.bfloat16), 0, (192, 4096))
b64 = slot_stack(torch.zeros(9, 6144 * 64, dtype=torch.bfloat16), 0, (6144, 64))
g64 = slot_stack(torch.zeros(9, 2 * 14336 * 64, dtype=torch.bfloat16), 0, (2 * 14336, 64))
for n in (1, 3, 33):
    x, y = torch.zeros(n, 4096, dtype=torch.bfloat16), torch.zeros(n, 6144, dtype=torch.bfloat16)
    h = T.shrink(x, a64, 3, *routing, ranks=ranks)
    T.expand_(y, h, b64, [4096, 1024, 1024], *routing, ranks=ranks)
    y2 = torch.zeros(n, 2 * 14336, dtype=torch.bfloat16)
    T.expand_silu_mul(y2, torch.zeros(2, n, 64), g64, *routing, ranks=ranks)
for k in compiled:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        dump = [cuobjdump, "--dump-resource-usage", f.name]
        usage = subprocess.run(dump, capture_output=True, text=True).stdout
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert stack == 0, (k.name, usage)  # no register spills
print("compiled", len(compiled))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    """The real launch path (argument binding, specialisation, every kernel variant the
    heuristics pick for decode and prefill) compiles for sm_90 with no register spills,
    on a machine without a GPU (Triton's bundled ptxas; no launch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode == 77:
        pytest.skip(f"cannot compile for sm_90 here: {proc.stdout.strip()}")
    assert proc.returncode == 0 and "compiled 21" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )


# --------------------------------------------------------------------------------------
# GPU tests (compiled kernels; H100/H200-class device)
# --------------------------------------------------------------------------------------

GPU_RANKS = {1: 1, 2: 4, 3: 8, 4: 16, 5: 32, 6: 64}  # slot -> rank; slot 7 is free
GPU_MAX_RANK = 64
GPU_SLOTS = 8
GPU = "cuda"  # the GPU tests' device


def gpu_targets(hidden: int) -> dict[str, LoraTarget]:
    targets = {"qkv": LoraTarget(hidden, (hidden, hidden // 4, hidden // 4))}
    if hidden == 4096:
        targets["down"] = LoraTarget(3 * hidden, (hidden,))
    return targets


@pytest.fixture(scope="module")
def gpu_pools():
    cache: dict[int, Pool] = {}

    def get(hidden: int) -> Pool:
        if hidden not in cache:
            cache[hidden] = Pool(
                gpu_targets(hidden),
                GPU_RANKS,
                GPU_MAX_RANK,
                GPU_SLOTS,
                torch.bfloat16,
                device=GPU,
                seed=hidden,
            )
        return cache[hidden]

    return get


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "max_rank, slot_ranks", [(MAX_RANK, RANKS), (48, WIDE_RANKS)], ids=["r8", "r48"]
)
@pytest.mark.parametrize("n", [1, 3, 37])
@pytest.mark.gpu
@needs_gpu
def test_gpu_columns_past_a_slots_rank_are_not_read(dtype, max_rank, slot_ranks, n):
    """The compiled kernels given ``ranks`` (the rank-following paths at 1 and 3 rows; the
    masked ``tl.dot`` tiles at 37; :func:`test_columns_past_a_slots_rank_are_not_read`):
    garbage past each slot's rank changes nothing, and every result equals the float64
    reference."""
    check_ranks_skipped(dtype, max_rank, slot_ranks, n, GPU)


def popularity_groups(kind: str, n_lora: int, seed: int) -> list[tuple[int, int]]:
    """Rows per adapter for a popularity pattern, as contiguous groups (sorted batch)."""
    g = torch.Generator().manual_seed(seed)
    slots = list(GPU_RANKS)
    if n_lora == 0:
        return []
    if kind == "distinct":  # every request its own group (adapters cycle: one group per row)
        return [(slots[i % len(slots)], 1) for i in range(n_lora)]
    if kind == "identical":
        return [(slots[seed % len(slots)], n_lora)]
    if kind == "uniform":
        p = torch.ones(len(slots))
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, len(slots) + 1, dtype=torch.float)
    elif kind == "skewed":
        p = torch.full((len(slots),), 0.1 / (len(slots) - 1))
        p[seed % len(slots)] = 0.9
    else:
        raise ValueError(kind)
    choice = torch.multinomial(p / p.sum(), n_lora, replacement=True, generator=g)
    counts = torch.bincount(choice, minlength=len(slots)).tolist()
    order = torch.randperm(len(slots), generator=g).tolist()
    return [(slots[i], counts[i]) for i in order]  # zero-count groups stay: empty groups


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical", "skewed"])
@pytest.mark.parametrize("n", [1, 3, 33, 133])
@pytest.mark.parametrize("hidden", [2048, 4096, 5120])
@pytest.mark.gpu
@needs_gpu
def test_gpu_against_float64(gpu_pools, hidden, n, popularity):
    pool = gpu_pools(hidden)
    seed = hidden + 7 * n + len(popularity)
    n_base = n // 4
    groups = popularity_groups(popularity, n - n_base, seed)
    routing = make_routing(groups, device=GPU, pad_to=max(GPU_SLOTS, len(groups) + 1))
    for name, t in pool.targets.items():
        x = torch.randn(n, t.in_features, generator=torch.Generator().manual_seed(seed)).to(
            GPU, torch.bfloat16
        )
        h, y, y0, h64, y64 = check(
            pool, name, x, routing, rtol_h=2e-2, rtol_y=6e-2, against_ops=False
        )
        slot_of = torch.tensor(row_slots(n, *routing), device=GPU)
        live = slot_of > 0
        if live.any():
            assert rel_err(h[:, live], h64[:, live]) < 1e-2
            assert rel_err(y[live], y64[live]) < 1e-2
            # the delta alone, so the base output cannot hide an error in it
            assert (
                rel_err(y[live].double() - y0[live].double(), y64[live] - y0[live].double()) < 1e-2
            )


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_replay(gpu_pools):
    """Capture shrink + expand once; replay after refilling routing in place with more
    groups than at capture, and after rewriting a slot in place."""
    pool = gpu_pools(4096)
    name, t = "qkv", pool.targets["qkv"]
    a, b = pool.stacks(name)
    n = 32
    ids, offs, end = make_routing([(4, 20)], device=GPU, pad_to=GPU_SLOTS)
    x = torch.randn(n, t.in_features, device=GPU).to(torch.bfloat16)
    y = torch.zeros(n, t.out_features, device=GPU, dtype=torch.bfloat16)
    y_init = torch.randn(n, t.out_features, device=GPU).to(torch.bfloat16)

    def step():
        y.copy_(y_init)
        h = T.shrink(x, a, t.num_slices, ids, offs, end)
        T.expand_(y, h, b, list(t.out_slices), ids, offs, end)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def verify():
        routing = (ids, offs, end)
        _, y64, slot_of = reference64(pool, name, x, y_init, routing)
        live = slot_of > 0
        assert rel_err(y[live], y64[live]) < 1e-2
        assert torch.equal(y[~live], y_init[~live])

    graph.replay()
    torch.cuda.synchronize()
    verify()
    groups = [(1, 3), (2, 4), (3, 2), (4, 5), (5, 6), (6, 4), (2, 3)]  # 7 groups, 27 rows
    for src, dst in zip(
        make_routing(groups, device=GPU, pad_to=GPU_SLOTS), (ids, offs, end), strict=True
    ):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    verify()
    pool.fill({2: 64}, seed=1234)  # slot 2 rewritten in place, now rank 64
    graph.replay()
    torch.cuda.synchronize()
    verify()


@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.gpu
@needs_gpu
def test_gpu_side_stream_delta_in_a_graph_and_one_launch_delta(gpu_pools, n):
    """``linear_delta`` (its shrink and expand on the side stream) and its stacked twin
    ``linear_delta_stacked`` captured in a CUDA graph and replayed after the routing changes
    in place (one group, then one group a row over
    every rank 1..64, then a few with base rows), against float64; the eager ``delta_``
    (one ``launch_delta``) likewise, its workspace all zero after each."""
    torch.manual_seed(n)  # (its draws must not depend on the tests before it)
    pool = gpu_pools(4096)
    ids, offs, end = make_routing([(4, n)], device=GPU, pad_to=max(GPU_SLOTS, n + 1))
    layouts = [
        [(4, n)],
        popularity_groups("distinct", n, 1),
        popularity_groups("zipf", n - n // 4, 2),
    ]
    for name, t in pool.targets.items():
        a, b = pool.stacks(name)
        x = torch.randn(n, t.in_features, device=GPU).to(torch.bfloat16)
        w = torch.randn(t.out_features, t.in_features, device=GPU).to(torch.bfloat16) * 0.02
        out: list[torch.Tensor] = []

        bias = torch.randn(t.out_features, device=GPU).to(torch.bfloat16)

        def step(x=x, w=w, a=a, b=b, t=t, out=out, bias=bias):
            out[:] = T.linear_delta(x, w, None, a, b, t.num_slices, list(t.out_slices), ids,
                                    offs, end)  # fmt: skip
            out.append(T.linear_delta_stacked(x, w, bias, a, b, t.num_slices,
                                              list(t.out_slices), ids, offs, end))  # fmt: skip

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for groups in layouts:
            routing = make_routing(groups, device=GPU, pad_to=max(GPU_SLOTS, n + 1))
            for src, dst in zip(routing, (ids, offs, end), strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            zeros = torch.zeros(n, t.out_features, device=GPU)
            _, d64, slot_of = reference64(pool, name, x, zeros, routing)
            d = out[1][: n * t.out_features].view(n, -1)
            live = slot_of > 0
            assert not d[~live].any()
            # the stacked twin (a row-parallel layer's): the same delta in bfloat16 (its own
            # call: a split-k shrink's atomic sums may round otherwise), beside the base
            # linear with its bias
            assert not out[2][1][~live].any()
            if live.any():
                assert rel_err(out[2][1][live].float(), d[live]) < 1e-2, (name, groups)
            want_y = torch.nn.functional.linear(x, w, bias)
            torch.testing.assert_close(out[2][0], want_y, rtol=0, atol=0.02)
            if live.any():
                assert rel_err(d[live], d64[live]) < 1e-2, (name, groups)
            assert workspace_is_zero()
            y0 = torch.randn(n, t.out_features, device=GPU).to(torch.bfloat16)
            y = y0.clone()
            T.delta_(y, x, a, b, list(t.out_slices), *routing)
            _, y64, _ = reference64(pool, name, x, y0, routing)
            assert torch.equal(y[~live], y0[~live])
            if live.any():
                # y0 + delta in float32, rounded once to bfloat16: within one unit in the last
                # place of the float64 sum, plus 1% of the largest delta for the float32
                # products of bfloat16 operands (a missing or wrong delta is far outside it;
                # y - y0 cannot be compared closer: y's rounding is in it)
                scale = float((y64[live] - y0[live].double()).abs().max())
                err = (y[live].double() - y64[live]).abs()
                bound = 2**-7 * y64[live].abs() + 1e-2 * scale
                assert (err <= bound).all(), (name, float((err - bound).max()), scale)
            assert workspace_is_zero()


@pytest.mark.gpu
@needs_gpu
def test_gpu_ops_dispatch_to_triton(gpu_pools, monkeypatch):
    """On CUDA each op runs its Triton implementation (one op per meaning, per-device
    kernels), and agrees with the reference."""
    pool = gpu_pools(4096)
    t = pool.targets["qkv"]
    a, b = pool.stacks("qkv")
    routing = make_routing([(1, 3), (4, 2)], device=GPU, pad_to=GPU_SLOTS)
    x = torch.randn(6, t.in_features, device=GPU).to(torch.bfloat16)
    calls = []

    def counting(name):
        impl = getattr(T, name)

        def run(*args, **kwargs):
            calls.append(name)
            return impl(*args, **kwargs)

        return run

    for name in ("shrink", "expand_", "linear_delta"):
        monkeypatch.setattr(T, name, counting(name))
    h = torch.ops.lora_graph.lora_shrink(x, a, t.num_slices, *routing)
    y = torch.zeros(6, t.out_features, device=GPU, dtype=torch.bfloat16)
    torch.ops.lora_graph.lora_expand_(y, h, b, list(t.out_slices), *routing)
    w = torch.randn(t.out_features, t.in_features, device=GPU).to(torch.bfloat16)
    y2, buf = torch.ops.lora_graph.lora_linear_delta(
        x, w, None, a, b, t.num_slices, list(t.out_slices), *routing
    )
    assert calls == ["shrink", "expand_", "linear_delta"]
    y_ref = torch.zeros_like(y)
    reference.expand_(
        y_ref, reference.shrink(x, a, t.num_slices, *routing), b, list(t.out_slices), *routing
    )
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(buf[: y.numel()].view(y.shape), y_ref) < 1e-2
    torch.testing.assert_close(y2, x @ w.T)


@pytest.mark.gpu
@needs_gpu
def test_gpu_fast_launch_runs_what_triton_runs(gpu_pools):
    """The second launch of a key goes through the cached compiled kernel
    (:mod:`lora_graph.kernels.fast_launch`) and gives bit-for-bit what the first, launched by
    Triton, gave; a misaligned input is a new key (compiled by Triton, right too); and the
    decode ops agree with the float64 reference through it."""
    from lora_graph.kernels import fast_launch

    pool = gpu_pools(4096)
    t = pool.targets["qkv"]
    a, b = pool.stacks("qkv")
    routing = make_routing([(1, 3), (4, 2), (2, 2)], device=GPU, pad_to=GPU_SLOTS)
    x = torch.randn(9, t.in_features, device=GPU).to(torch.bfloat16)
    assert fast_launch.enabled()
    outs = []
    for _ in range(3):
        h = T.shrink(x, a, t.num_slices, *routing)
        y = torch.zeros(9, t.out_features, device=GPU, dtype=torch.bfloat16)
        T.expand_(y, h, b, list(t.out_slices), *routing)
        outs.append((h, y))
    assert fast_launch.cached() >= 2
    # split-K adds partial sums with atomics, in no fixed order: equal up to fp32 rounding
    for h, y in outs[1:]:
        torch.testing.assert_close(h, outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, outs[0][1], rtol=1e-2, atol=1e-2)
    raw = torch.empty(x.numel() + 1, device=GPU, dtype=torch.bfloat16)
    x_odd = raw[1:].view_as(x).copy_(x)  # 2 bytes past a 16-byte boundary
    assert x_odd.data_ptr() % 16 != 0
    h_odd = T.shrink(x_odd, a, t.num_slices, *routing)
    torch.testing.assert_close(h_odd, outs[0][0], rtol=1e-5, atol=1e-5)
    _, y64, _ = reference64(pool, "qkv", x, torch.zeros(9, t.out_features, device=GPU), routing)
    assert rel_err(outs[0][1], y64) < 1e-2
    w = torch.randn(t.out_features, t.in_features, device=GPU).to(torch.bfloat16)
    for _ in range(2):
        y2, buf = T.linear_delta(x, w, None, a, b, t.num_slices, list(t.out_slices), *routing)
        d = buf[: y2.numel()].view(y2.shape)
        assert rel_err(d, y64) < 1e-2 and torch.equal(y2, x @ w.T)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [65, 512, 2048])
def test_gpu_expand_silu_mul_against_float64(n):
    """The fused expand + SwiGLU activation at Llama-3-8B's MLP width (gate/up 14336), rows
    over mixed-rank adapters, slot 0 and base rows: against float64 expand then
    ``silu(g) * u`` (each half rounded to bf16 after its delta, as the in-place expand
    leaves it)."""
    target = LoraTarget(4096, (14336, 14336))
    pool = Pool({"gate_up": target}, GPU_RANKS, GPU_MAX_RANK, GPU_SLOTS, torch.bfloat16, GPU, 3)
    n_base = n // 5
    groups = popularity_groups("skewed", n - n_base, seed=n) + [(0, 1)]
    routing = make_routing(groups, device=GPU, pad_to=GPU_SLOTS)
    g = torch.Generator(device=GPU).manual_seed(n)
    x = torch.randn(n, 4096, generator=g, device=GPU).to(torch.bfloat16)
    y = torch.randn(n, 2 * 14336, generator=g, device=GPU).to(torch.bfloat16)
    a, b = pool.stacks("gate_up")
    h = T.shrink(x, a, 2, *routing)
    got = T.expand_silu_mul(y, h, b, *routing)
    _, y64, slot_of = reference64(pool, "gate_up", x, y, routing)
    gate, up = y64.to(torch.bfloat16).double().split(14336, dim=1)
    want = gate * torch.sigmoid(gate) * up
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2
    base = slot_of <= 0  # no delta: silu(g) * u of y in float32, rounded once
    gy, uy = y[base].float().split(14336, dim=1)
    want_base = (gy * torch.sigmoid(gy) * uy).to(torch.bfloat16)
    torch.testing.assert_close(got[base], want_base, rtol=8e-3, atol=1e-5)


def test_fast_launch_key_and_fallbacks():
    """The fast launch's key tells apart what Triton specialises on (dtype, 16-byte
    alignment, the value of a specialised integer, a 64-bit unspecialised one) and nothing
    else; launch hooks, CPU tensors and the interpreter take Triton's own path."""
    from lora_graph.kernels import fast_launch as F

    if F.triton is None:
        pytest.skip("needs Triton")
    x = torch.zeros(64)
    no_spec = frozenset({1})
    base = F._key((x, 5, 16), no_spec)
    assert F._key((torch.zeros(64), 6, 16), no_spec) == base  # unspecialised: value free
    assert F._key((x[1:], 5, 16), no_spec) != base  # 4 bytes past a 16-byte boundary
    assert F._key((x.double(), 5, 16), no_spec) != base
    assert F._key((x, 5, 17), no_spec) != base  # specialised: by value
    assert F._key((x, 2**40, 16), no_spec) != base  # no longer a 32-bit integer
    runtime = F.triton.knobs.runtime
    assert F.enabled() == (F._VERSION >= (3, 3))

    def hook(*args):
        pass

    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert not F.enabled()
        finally:
            chain.remove(hook)
    else:
        runtime.launch_enter_hook = hook
        try:
            assert not F.enabled()
        finally:
            runtime.launch_enter_hook = chain
    assert F.enabled() == (F._VERSION >= (3, 3))

    launched = []

    class Kernel:  # not a JITFunction (as under the interpreter): launched through [grid]
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((grid, a, kw))

    F.launch(Kernel(), (3,), (x, 1), {"B": 2}, num_warps=4, num_stages=2, device=x.device)
    assert launched == [((3,), (x, 1), {"B": 2, "num_warps": 4, "num_stages": 2})]
