"""``lora_graph::paged_attention``: the reference against an independent float64
computation, the Triton kernel against the reference.

The independent computation: each sequence's K and V are drawn as contiguous
``[L, Hkv, D]`` tensors (the "ground truth"), then scattered into randomly permuted pages
of the cache (unused slots and pages hold NaN, so reading a key past ``L`` shows); the
expected output is ``F.scaled_dot_product_attention`` in float64 on the contiguous tensors,
with the causal(+window) mask built from ``torch.tril`` diagonals.

How the Triton kernel runs here (as in ``test_triton_ops.py``):

- Without CUDA, under Triton's CPU interpreter: Triton picks interpreter or compiler when
  a ``@triton.jit`` function is decorated, i.e. when ``lora_graph.kernels.triton_attention``
  is first imported, so this module sets ``TRITON_INTERPRET=1`` around that import only.
- If that module was already imported compiled (CUDA present, or another module first),
  the interpreter tests skip and ``test_interpreter_suite_in_subprocess`` re-runs them in
  a fresh process (``TRITON_INTERPRET=1``, CUDA hidden).
- ``@pytest.mark.gpu`` tests run the compiled kernel at Llama-3-8B sizes against the
  reference, and capture it in a CUDA graph (``pytest tests/test_paged_attention.py -m gpu``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

_INTERP_SET_HERE = (
    not torch.cuda.is_available() and "lora_graph.kernels.triton_attention" not in sys.modules
)
_PREV_INTERP = os.environ.get("TRITON_INTERPRET")
if _INTERP_SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    from lora_graph import attention as A
    from lora_graph.kernels import triton_attention as TA
finally:
    if _INTERP_SET_HERE:
        if _PREV_INTERP is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _PREV_INTERP

INTERPRETED = TA.interpreted()
interp = pytest.mark.skipif(
    not INTERPRETED,
    reason="Triton missing, or the kernel is compiled in this process "
    "(test_interpreter_suite_in_subprocess runs these under the interpreter)",
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not TA.HAVE_TRITON or INTERPRETED,
    reason="needs CUDA, Triton and the compiled (not interpreted) kernel",
)


# --------------------------------------------------------------------------------------
# a packed step over scattered pages, and its float64 expected output
# --------------------------------------------------------------------------------------


@dataclass
class Step:
    """The op's inputs (``args``) and each sequence's contiguous ground-truth K / V."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    keys: list[torch.Tensor]  # [L, Hkv, D] per sequence
    values: list[torch.Tensor]
    scale: float
    window: int
    softcap: float = 0.0

    @property
    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start,
            self.scale,
            self.window,
        ) + ((self.softcap,) if self.softcap else ())


def make_step(
    seqs: list[tuple[int, int]],
    *,
    kv_heads: int = 2,
    groups: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    window: int = 0,
    pad_rows: int = 2,
    spare_pages: int = 3,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    softcap: float = 0.0,
) -> Step:
    """``seqs``: ``(q_len, seq_len)`` per sequence (``(0, 0)``: a padding sequence), whose
    rows are packed in order, then ``pad_rows`` rows of no sequence. Pages are a random
    permutation of pages ``1..``; table entries past a sequence's pages name page 0."""
    g = torch.Generator().manual_seed(seed)
    hq = kv_heads * groups
    pages_of = [-(-length // page_size) for _, length in seqs]
    num_pages = 1 + sum(pages_of) + spare_pages
    width = max(pages_of + [1]) + 1
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    keys, values = [], []
    for s, (_, length) in enumerate(seqs):
        k = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        pages = [perm.pop() for _ in range(pages_of[s])]
        block_tables[s, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for j in range(length):
            k_cache[pages[j // page_size], j % page_size] = k[j]
            v_cache[pages[j // page_size], j % page_size] = v[j]
        keys.append(k)
        values.append(v)
    starts = [0]
    for q_len, length in seqs:
        assert q_len <= length
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1] + pad_rows, hq, head_dim, generator=g).to(dtype)
    i32 = dict(dtype=torch.int32, device=device)
    return Step(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        torch.tensor([length for _, length in seqs], **i32),
        torch.tensor(starts, **i32),
        keys,
        values,
        head_dim**-0.5,
        window,
        softcap,
    )


def expected64(step: Step) -> torch.Tensor:
    """float64 attention on each sequence's contiguous K / V (rows of no sequence: 0)."""
    n, hq, d = step.q.shape
    groups = hq // step.keys[0].shape[1] if step.keys else 1
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    starts = step.query_start.tolist()
    for s, (k, v) in enumerate(zip(step.keys, step.values, strict=True)):
        q0, q1 = starts[s], starts[s + 1]
        q_len, length = q1 - q0, k.shape[0]
        if q_len == 0:
            continue
        ones = torch.ones(q_len, length, dtype=torch.bool)
        mask = ones.tril(diagonal=length - q_len)  # key j <= position of row i
        if step.window > 0:
            mask &= ~ones.tril(diagonal=length - q_len - step.window)
        qs = step.q[q0:q1].cpu().double().transpose(0, 1)  # [Hq, q_len, D]
        ks = k.double().transpose(0, 1).repeat_interleave(groups, 0)  # [Hq, L, D]
        vs = v.double().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qs @ ks.transpose(1, 2) * step.scale
        if step.softcap:
            scores = step.softcap * torch.tanh(scores / step.softcap)
        o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs
        out[q0:q1] = o.transpose(0, 1)
    return out


def check(got: torch.Tensor, step: Step, atol: float) -> None:
    """Right shape and dtype; rows of no sequence exactly 0; the rest within ``atol``."""
    assert got.shape == step.q.shape and got.dtype == step.q.dtype
    end = int(step.query_start[-1])
    got = got.cpu()
    assert torch.equal(got[end:], torch.zeros_like(got[end:]))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected64(step), rtol=0, atol=atol)


# A mixed step: decode rows (q_len 1), prefill chunks with context before them and a whole
# prompt, padding sequences in the middle and at the end, and rows of no sequence after.
MIXED = [(1, 7), (5, 9), (0, 0), (1, 30), (11, 11), (1, 1), (6, 23), (0, 0)]
# bfloat16 inputs: the reference computes in float32 from the same bf16 values as the
# float64 expectation, so it differs only by rounding its output to bf16 (|out| < 3 here:
# half an ulp is <= 2^-8 * 2); the Triton kernel also rounds the probabilities to bf16
# before the P @ V product on a GPU (relative 2^-9 per term), well inside 2e-2.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


# --------------------------------------------------------------------------------------
# the reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 24, 64])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_reference_against_float64(groups, window, page_size, head_dim):
    step = make_step(
        MIXED, groups=groups, window=window, page_size=page_size, head_dim=head_dim, seed=groups
    )
    check(A.paged_attention_reference(*step.args), step, ATOL[torch.float32])


def test_reference_bfloat16_and_op_dispatch():
    """bf16 inputs; and on the CPU the op runs the reference (bit-identical)."""
    step = make_step(MIXED, groups=4, window=6, dtype=torch.bfloat16)
    got = A.paged_attention_reference(*step.args)
    check(got, step, ATOL[torch.bfloat16])
    assert torch.equal(torch.ops.lora_graph.paged_attention(*step.args), got)
    assert A.paged_attention_impl("auto", torch.device("cpu")) is A.paged_attention
    assert A.paged_attention_impl("torch", torch.device("cpu")) is A.paged_attention_reference


@pytest.mark.parametrize("window", [0, 5])
def test_reference_soft_cap_against_float64(window):
    """Gemma 2's attention logit soft-capping (``softcap * tanh(x / softcap)``), a cap the
    logits reach (q scaled up so the cap matters)."""
    step = make_step(MIXED, groups=2, window=window, softcap=1.5)
    step.q.mul_(4)
    check(A.paged_attention_reference(*step.args), step, ATOL[torch.float32])
    assert not torch.allclose(
        A.paged_attention_reference(*step.args[:-1]), A.paged_attention_reference(*step.args)
    )


def test_window_larger_than_context_is_full_attention():
    full = make_step(MIXED, window=0)
    wide = make_step(MIXED, window=64)
    assert torch.equal(
        A.paged_attention_reference(*wide.args), A.paged_attention_reference(*full.args)
    )


def test_opcheck():
    """Schema, fake (meta) implementation and dispatch are consistent (torch.library)."""
    step = make_step(MIXED[:4], window=3)
    torch.library.opcheck(torch.ops.lora_graph.paged_attention.default, step.args)
    step = make_step(MIXED[:4], window=3, softcap=2.0)
    torch.library.opcheck(torch.ops.lora_graph.paged_attention.default, step.args)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of kv heads"),
        (lambda a: {**a, "v_cache": a["v_cache"].double()}, "v_cache"),
        (lambda a: {**a, "block_tables": a["block_tables"].long()}, "block_tables"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:-1]}, "seq_lens"),
        (lambda a: {**a, "query_start": a["query_start"].flip(0)}, "query_start"),
        (lambda a: {**a, "seq_lens": a["seq_lens"] * 0}, "seq_len 0 must be >= its 1"),
        (lambda a: {**a, "seq_lens": a["seq_lens"] + 40}, "fit its block table"),
    ],
)
def test_reference_rejects_bad_input(change, match):
    step = make_step(MIXED[:4])
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start"]
    args = change(dict(zip(names, step.args[:6], strict=True)))
    with pytest.raises(ValueError, match=match):
        A.paged_attention_reference(*args.values(), step.scale, step.window)


# --------------------------------------------------------------------------------------
# the Triton kernel under the interpreter (CPU)
# --------------------------------------------------------------------------------------

# (groups, window, page_size, head_dim, dtype, tiles): every axis at least twice; tiles None
# is the heuristic config, else (block_q, block_n, splits)
TRITON_CASES = [
    (1, 0, 4, 16, torch.float32, None),
    (2, 5, 16, 64, torch.float32, None),
    (4, 0, 16, 16, torch.bfloat16, None),
    (4, 5, 4, 24, torch.float32, (4, 16, 1)),
    (2, 0, 4, 16, torch.float32, (2, 32, 1)),  # key blocks spanning 8 pages
    (1, 6, 4, 64, torch.bfloat16, (16, 16, 1)),
    (3, 3, 4, 16, torch.float32, (5, 16, 1)),  # 3 heads a group: 15 of 16 rows used
]


@interp
@pytest.mark.parametrize("groups, window, page_size, head_dim, dtype, tiles", TRITON_CASES)
def test_triton_matches_reference(groups, window, page_size, head_dim, dtype, tiles):
    step = make_step(
        MIXED,
        groups=groups,
        window=window,
        page_size=page_size,
        head_dim=head_dim,
        dtype=dtype,
        seed=7 + groups,
    )
    cfg = None
    if tiles is not None:
        block_q, block_n, splits = tiles
        cfg = TA.make_config(groups, block_q=block_q, block_n=block_n, splits=splits)
    got = TA.paged_attention(*step.args, config=cfg)
    check(got, step, ATOL[dtype])
    ref = A.paged_attention_reference(*step.args)
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=ATOL[dtype])


@interp
@pytest.mark.parametrize("window, splits", [(0, 1), (1, 1), (17, 1), (26, 1), (26, 2)])
def test_triton_block_boundaries(window, splits):
    """Every alignment of a context, a chunk and a window with the 16-key blocks: decode
    rows of contexts 1..40 and chunks at several offsets, windows from 1 to past two blocks
    (blocks wholly inside every row's window and before the causal edge run unmasked)."""
    seqs = [(1, n) for n in range(1, 41)] + [(7, 40), (13, 13), (16, 33), (17, 49), (5, 21)]
    step = make_step(seqs, kv_heads=1, groups=2, page_size=4, window=window, seed=window)
    cfg = TA.make_config(2, block_q=8, block_n=16, splits=splits)
    check(TA.paged_attention(*step.args, config=cfg), step, ATOL[torch.float32])


@interp
@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("splits", [3, 4])
def test_triton_split_kv(splits, window, monkeypatch):
    """Decode rows only, keys split over ``splits`` programs (some get no key) and combined;
    contexts of one 16-key block (1, 9, 16) served by split 0 alone, written directly. The
    output of a split launch is not zeroed first (the reduction writes every row): it is
    made NaN here, and the rows of no sequence must still come out 0."""
    seqs = [(1, 37), (1, 1), (0, 0), (1, 64), (1, 18), (1, 16), (1, 9)]
    step = make_step(seqs, groups=4, window=window, page_size=16, seed=splits)
    cfg = TA.make_config(4, block_q=4, block_n=16, splits=splits)
    empty_like, empty = torch.empty_like, torch.empty
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))
    # the partials too: a split with no key writes only its max, and nothing else of it is read
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    check(TA.paged_attention(*step.args, config=cfg), step, ATOL[torch.float32])


@interp
@pytest.mark.parametrize("vector_max", [0, 256])
def test_triton_sequence_lookup(vector_max, monkeypatch):
    """A program finds its sequence by one vector load of the query starts (up to
    ``SEQS_VECTOR_MAX`` sequences) or by binary search: both, on a mixed step with padding
    sequences and on a split decode step."""
    monkeypatch.setattr(TA, "SEQS_VECTOR_MAX", vector_max)
    assert (TA.seqs_pad(8) > 0) == (vector_max > 0)
    step = make_step(MIXED, groups=2, page_size=4, window=5, seed=21)
    check(TA.paged_attention(*step.args), step, ATOL[torch.float32])
    step = make_step([(1, 37), (1, 1), (0, 0), (1, 64), (1, 18)], groups=4, seed=22)
    cfg = TA.make_config(4, block_q=4, block_n=16, splits=3)
    check(TA.paged_attention(*step.args, config=cfg), step, ATOL[torch.float32])


@interp
@pytest.mark.parametrize("split", [False, True])
def test_triton_soft_cap(split):
    """The soft cap in the kernel: a mixed step (two launches) and a split-KV decode step,
    against the float64 expectation, with logits the cap bends (q scaled up)."""
    seqs = [(1, 37), (1, 1), (0, 0), (1, 64), (1, 18)] if split else MIXED
    step = make_step(seqs, groups=2, window=0 if split else 5, softcap=1.5, seed=11)
    step.q.mul_(4)
    cfg = TA.make_config(2, block_q=8, block_n=16, splits=3) if split else None
    check(TA.paged_attention(*step.args, config=cfg), step, ATOL[torch.float32])


@interp
@pytest.mark.parametrize("window", [0, 6])
def test_triton_mixed_step_two_launches(window):
    """A step that may mix decodes and prefill chunks runs two launches (decode tiles for
    sequences of at most ``16 // groups`` query rows, prefill tiles for the rest): every
    sequence is served by exactly one of them, at the boundary lengths too."""
    groups = 4  # decode tiles hold 4 query rows
    seqs = [(1, 30), (4, 17), (5, 21), (1, 1), (3, 3), (12, 40), (0, 0), (1, 9)]
    step = make_step(seqs, groups=groups, page_size=4, window=window, seed=11 + window)
    n, s = step.q.shape[0], step.block_tables.shape[0]
    plan = TA.attention_plan(n, s, groups, 16, step.block_tables.shape[1] * 4, 2, 4)
    assert [(lo, hi) for _, lo, hi in plan] == [(0, 4), (5, 1 << 30)]
    assert plan[0][0].block_q == 4 and plan[1][0].block_q == 16
    check(TA.paged_attention(*step.args), step, ATOL[torch.float32])


@interp
def test_triton_through_backend_selection_and_heuristics():
    """``paged_attention_impl("triton", cpu)`` is the interpreted kernel; the heuristic
    config of a decode step of long contexts splits the keys."""
    fn = A.paged_attention_impl("triton", torch.device("cpu"))
    assert fn is TA.paged_attention
    step = make_step([(1, 300), (1, 41)], groups=2, page_size=16, pad_rows=0, seed=3)
    cfg = TA.attention_config(2, 2, 2, 16, step.block_tables.shape[1] * 16, 2, 4)
    assert cfg.splits > 1 and cfg.block_m == 16
    check(fn(*step.args), step, ATOL[torch.float32])


@interp
def test_triton_strided_inputs():
    """q a view of a fused q/k/v projection, K and V views of one ``[pages, 2, ...]`` cache."""
    step = make_step(MIXED[:5], groups=2, page_size=4, window=4, seed=5)
    n, hq, d = step.q.shape
    qkv = torch.randn(n, hq + 4, d)
    qkv[:, :hq] = step.q
    kv = torch.stack([step.k_cache, step.v_cache], dim=1)  # [pages, 2, page, Hkv, D]
    args = (qkv[:, :hq], kv[:, 0], kv[:, 1], *step.args[3:])
    assert not any(t.is_contiguous() for t in args[:3])
    check(TA.paged_attention(*args), step, ATOL[torch.float32])


@interp
def test_triton_empty_and_all_padding():
    step = make_step([(0, 0), (0, 0)], pad_rows=3)
    got = TA.paged_attention(*step.args)
    assert torch.equal(got, torch.zeros_like(step.q))


def test_interpreter_suite_in_subprocess():
    """Runs the interpreter tests in a fresh process when they could not run in this one."""
    if INTERPRETED or not TA.HAVE_TRITON:
        pytest.skip("the interpreter tests ran in this process (or there is no Triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider"]
    argv += ["-m", "not gpu", "-k", "test_triton_ and not subprocess", __file__]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 10, proc.stdout[-2000:]


def test_without_triton():
    """Without triton the op runs the reference on the CPU and the Triton backend raises."""
    code = """
import sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import torch
from lora_graph import attention as A
from lora_graph.kernels import triton_attention as TA
assert not TA.HAVE_TRITON and not TA.interpreted()
q = torch.randn(2, 2, 16)
kv = torch.randn(2, 4, 1, 16)
i32 = dict(dtype=torch.int32)
meta = (torch.tensor([[1]], **i32), torch.tensor([2], **i32), torch.tensor([0, 2], **i32))
out = torch.ops.lora_graph.paged_attention(q, kv, kv, *meta, 0.25, 0)
assert torch.isfinite(out).all()
try:
    A.paged_attention_impl("triton", torch.device("cpu"))
except ValueError as e:
    assert "not installed" in str(e)
else:
    raise AssertionError("no error")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------
# GPU tests (the compiled kernel; Llama-3-8B attention: 32 query heads, 8 kv heads, D 128)
# --------------------------------------------------------------------------------------

GPU = "cuda"


def gpu_step(seqs, *, window=0, dtype=torch.bfloat16, seed=0, pad_rows=0) -> Step:
    return make_step(
        seqs,
        kv_heads=8,
        groups=4,
        head_dim=128,
        page_size=16,
        window=window,
        pad_rows=pad_rows,
        dtype=dtype,
        device=GPU,
        seed=seed,
        spare_pages=16,
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def decode_seqs(batch: int, max_ctx: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    return [(1, int(n)) for n in torch.randint(1, max_ctx + 1, (batch,), generator=g)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize(
    "kind, seqs",
    [
        ("decode64", decode_seqs(64, 2048, 0)),
        ("decode1_4k", [(1, 4096)]),  # split-KV
        ("prefill", [(500, 500), (500, 800), (500, 1500), (500, 2000), (1, 900), (0, 0)]),
    ],
)
def test_gpu_against_reference(kind, seqs, window):
    step = gpu_step(seqs, window=window, pad_rows=5)
    got = A.paged_attention(*step.args)  # the op: Triton on CUDA
    ref = A.paged_attention_reference(*step.args)
    end = int(step.query_start[-1])
    assert torch.equal(got[end:], torch.zeros_like(got[end:]))
    assert torch.isfinite(got).all()
    # bf16 rounding of the output and of P before P @ V (module comment on ATOL)
    assert rel_err(got[:end], ref[:end]) < 1e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=2e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seqs", [decode_seqs(64, 2048, 1), [(1, 4096)], [(300, 900), (1, 50)]])
def test_gpu_soft_cap(seqs):
    """Gemma 2's soft cap in the compiled kernel (decode, split-KV, prefill), a cap the
    logits reach, against the reference."""
    step = gpu_step(seqs, window=0)
    step.softcap = 2.0
    got, ref = A.paged_attention(*step.args), A.paged_attention_reference(*step.args)
    end = int(step.query_start[-1])
    assert rel_err(got[:end], ref[:end]) < 1e-2
    assert rel_err(A.paged_attention_reference(*step.args[:-1])[:end], ref[:end]) > 0.05


@pytest.mark.gpu
@needs_gpu
def test_gpu_float32():
    step = gpu_step([(1, 1500), (37, 600), (1, 33)], window=0, dtype=torch.float32)
    got = A.paged_attention(*step.args)
    torch.testing.assert_close(got, A.paged_attention_reference(*step.args), rtol=0, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_replay():
    """Capture the op once at a decode bucket of 8 sequences; replay with new q, seq_lens,
    block tables, query_start and cache contents written in place (fewer live sequences,
    padding ones, other pages, a context long enough to split the keys)."""
    first = gpu_step([(1, n) for n in (5, 100, 17, 1000, 1, 64, 300, 2)], seed=1)
    seqs = [(1, 2000), (1, 3), (0, 0), (1, 777), (0, 0), (0, 0), (0, 0), (0, 0)]
    second = gpu_step(seqs, seed=2, pad_rows=5)
    # the graph's buffers, large enough for both steps
    pages = max(first.k_cache.shape[0], second.k_cache.shape[0])
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    q = torch.empty_like(first.q)
    kc = torch.empty((pages, *first.k_cache.shape[1:]), dtype=q.dtype, device=GPU)
    vc = torch.empty_like(kc)
    bt = torch.empty((8, width), dtype=torch.int32, device=GPU)
    sl, qs = torch.empty_like(first.seq_lens), torch.empty_like(first.query_start)
    args = (q, kc, vc, bt, sl, qs, first.scale, first.window)

    def fill(step: Step) -> None:
        bt.zero_()
        bt[:, : step.block_tables.shape[1]].copy_(step.block_tables)
        kc[: step.k_cache.shape[0]].copy_(step.k_cache)
        vc[: step.v_cache.shape[0]].copy_(step.v_cache)
        for dst, src in ((q, step.q), (sl, step.seq_lens), (qs, step.query_start)):
            dst.copy_(src)

    fill(first)
    for _ in range(2):  # warm up (compile) outside the capture
        A.paged_attention(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = A.paged_attention(*args)
    for step, live in ((first, 8), (second, 3)):
        fill(step)
        graph.replay()
        want = A.paged_attention_reference(*args)
        assert torch.equal(out[live:], torch.zeros_like(out[live:]))
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)
        check(out, step, 2e-2)


# --------------------------------------------------------------------------------------
# rope_kv_write: RoPE on q and k, k and v into the flat cache (torch ops)
# --------------------------------------------------------------------------------------
def rope_case(t, hq, hkv, d, rd, dtype, device="cpu", seed=0):
    """q/k/v as views of one fused projection, rotary tables of real frequencies at random
    positions, distinct random slots, caches full of NaN (a slot written twice or a row
    missed shows)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g).to(dtype)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    pos = torch.randint(0, 5000, (t,), generator=g).double()
    inv = 1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slots = torch.randperm(3 * t + 5, generator=g)[:t]
    k_cache = torch.full((3 * t + 5, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    to = dict(device=device)
    return [x.to(**to) for x in (q, k, v, cos, sin, slots, k_cache, v_cache)]


def rope64(x, cos, sin):
    """RoPE in float64 from the same (rounded) inputs: the expectation."""
    x, cos, sin = x.double().cpu(), cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    rd, half = cos.shape[-1], cos.shape[-1] // 2
    rot = x[..., :rd]
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + turned * sin, x[..., rd:]), dim=-1)


def check_rope(fn, case, atol, rtol=0.0):
    q, k, v, cos, sin, slots, k_cache, v_cache = case
    got = fn(*case)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    torch.testing.assert_close(got.double().cpu(), rope64(q, cos, sin), rtol=rtol, atol=atol)
    s = slots.cpu()
    kc, vc = k_cache.cpu(), v_cache.cpu()
    torch.testing.assert_close(kc[s].double(), rope64(k, cos, sin), rtol=rtol, atol=atol)
    assert torch.equal(vc[s], v.cpu())  # v is copied, bit for bit
    untouched = torch.ones(kc.shape[0], dtype=torch.bool)
    untouched[s] = False
    assert kc[untouched].isnan().all() and vc[untouched].isnan().all()


# (tokens, q heads, kv heads, head dim, rotary dim): whole and partial rotary, head counts
# and dims that are not powers of two, one token
ROPE_CASES = [(5, 4, 2, 16, 16), (3, 6, 3, 24, 8), (1, 2, 1, 32, 32), (7, 4, 4, 10, 6)]
# float32: rotated in float32; bfloat16: rounded op by op (x * cos, then the rotated half
# times sin, then the sum: three roundings of |x| < 5)
ROPE_ATOL = {torch.float32: 1e-5, torch.bfloat16: 8e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, hq, hkv, d, rd", ROPE_CASES)
def test_rope_kv_write_against_float64(t, hq, hkv, d, rd, dtype):
    check_rope(A.rope_kv_write, rope_case(t, hq, hkv, d, rd, dtype), ROPE_ATOL[dtype])


@interp
def test_triton_strided_index_inputs():
    """Strided views of the step's index tensors (lengths, starts, block table) read as
    the reference reads them: the launcher copies them contiguous."""
    step = make_step([(1, 30), (1, 7), (0, 0), (1, 19)], groups=2, seed=4)
    q, k, v, bt, lens, starts = step.args[:6]

    def strided(x):
        return torch.stack([x, x], -1)[..., 0]

    args = (q, k, v, bt.t().contiguous().t(), strided(lens), strided(starts), *step.args[6:])
    assert args[3].stride(1) != 1 and args[4].stride(0) == 2
    check(TA.paged_attention(*args), step, ATOL[torch.float32])
    cfg = TA.make_config(2, block_q=8, block_n=16, splits=3)
    check(TA.paged_attention(*args, config=cfg), step, ATOL[torch.float32])
