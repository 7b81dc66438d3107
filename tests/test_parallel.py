"""Tensor parallelism's sharding rules (:mod:`lora_graph.parallel`): each rank's share of a
base weight and of an adapter's A and B, for column, row, replicated (GQA's K/V) and
vocabulary-parallel targets at sizes 2, 4 and 8, against slices cut by hand, and the
shares' outputs put back together equal the whole layer's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lora_graph.ops
from lora_graph.parallel import (
    TPRank,
    column_rows,
    local_target,
    shard_lora,
    shard_weight,
    unit_rows,
)
from lora_graph.routing import RoutingBuffer
from lora_graph.targets import LoraTarget

HEAD = 2  # head_dim
# q: 8 heads (16 rows), k and v: 2 heads (4 rows each): fused rows q 0-15, k 16-19, v 20-23
QKV = LoraTarget(16, (16, 4, 4), "column", ("q_proj", "k_proj", "v_proj"), slice_units=(8, 2, 2))
GATE_UP = LoraTarget(16, (24, 24), "column", ("gate_proj", "up_proj"))
O_PROJ = LoraTarget(16, (16,), "row", ("o_proj",))
DOWN = LoraTarget(24, (16,), "row", ("down_proj",))
EMBED = LoraTarget(64, (16,), "none", ("embed_tokens",), kind="embedding")
LM_HEAD = LoraTarget(16, (64,), "column", ("lm_head",), per_segment=True)
RANK = 4


def _adapter(target: LoraTarget, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(RANK, target.in_features, generator=g) for _ in target.out_slices]
    b = [torch.randn(w, RANK, generator=g) for w in target.out_slices]
    return a, b


def test_hand_cut_shares_at_size_2():
    w = torch.arange(24 * 16.0).reshape(24, 16)
    a, b = _adapter(QKV, 0)
    tp = TPRank(1, 2)
    # rank 1: q heads 4-7 (rows 8-15), k head 1 (rows 18-19), v head 1 (rows 22-23)
    assert torch.equal(shard_weight(QKV, w, tp), torch.cat([w[8:16], w[18:20], w[22:24]]))
    a1, b1 = shard_lora(QKV, a, b, tp)
    assert all(torch.equal(x, y) for x, y in zip(a1, a, strict=True))  # A replicated
    assert [torch.equal(x, y) for x, y in zip(b1, [b[0][8:16], b[1][2:4], b[2][2:4]],
                                              strict=True)] == [True] * 3  # fmt: skip
    # row: o_proj's input columns 8-15, A's too, B whole
    wo = torch.arange(16 * 16.0).reshape(16, 16)
    ao, bo = _adapter(O_PROJ, 1)
    assert torch.equal(shard_weight(O_PROJ, wo, tp), wo[:, 8:16])
    ao1, bo1 = shard_lora(O_PROJ, ao, bo, tp)
    assert torch.equal(ao1[0], ao[0][:, 8:16]) and torch.equal(bo1[0], bo[0])
    # vocabulary-parallel embedding: rows 32-63 of the table, A's columns 32-63, B whole
    we = torch.arange(64 * 16.0).reshape(64, 16)
    ae, be = _adapter(EMBED, 2)
    assert torch.equal(shard_weight(EMBED, we, tp), we[32:64])
    ae1, be1 = shard_lora(EMBED, ae, be, tp)
    assert torch.equal(ae1[0], ae[0][:, 32:64]) and torch.equal(be1[0], be[0])
    # the LM head over the vocabulary: rows 32-63, B's rows too, A whole
    wl = torch.arange(64 * 16.0).reshape(64, 16)
    al, bl = _adapter(LM_HEAD, 3)
    assert torch.equal(shard_weight(LM_HEAD, wl, tp), wl[32:64])
    al1, bl1 = shard_lora(LM_HEAD, al, bl, tp)
    assert torch.equal(al1[0], al[0]) and torch.equal(bl1[0], bl[0][32:64])


@pytest.mark.parametrize(
    "size, rank, q, kv",
    [
        (4, 3, (12, 16), (2, 4)),  # q heads 6-7; k/v 2 heads < 4 ranks: ranks 2-3 share head 1
        (4, 1, (4, 8), (0, 2)),  # ranks 0-1 share K/V head 0
        (8, 5, (10, 12), (2, 4)),  # q head 5; ranks 4-7 share K/V head 1
        (8, 0, (0, 2), (0, 2)),
    ],
)
def test_kv_heads_replicated_across_groups_of_ranks(size, rank, q, kv):
    tp = TPRank(rank, size)
    assert column_rows(QKV, tp) == [q, kv, kv]
    w = torch.randn(24, 16)
    want = torch.cat([w[q[0] : q[1]], w[16 + kv[0] : 16 + kv[1]], w[20 + kv[0] : 20 + kv[1]]])
    assert torch.equal(shard_weight(QKV, w, tp), want)


def _column_output(target, w, a, b, x, size):
    """Each rank's output rows (its base share plus its LoRA delta) written into the whole
    output; a replicated unit is written by each of its ranks, which must agree."""
    out = torch.full((x.shape[0], target.out_features), float("nan"), dtype=x.dtype)
    for r in range(size):
        tp = TPRank(r, size)
        wr = shard_weight(target, w, tp)
        ar, br = shard_lora(target, a, b, tp)
        delta = torch.cat([x @ a_s.T @ b_s.T for a_s, b_s in zip(ar, br, strict=True)], dim=1)
        y = x @ wr.T + delta
        at = 0
        for s, (start, stop) in enumerate(column_rows(target, tp)):
            offset = target.slice_rows(s)[0]
            part = y[:, at : at + stop - start]
            seen = out[:, offset + start : offset + stop]
            if not seen.isnan().all():
                torch.testing.assert_close(part, seen)  # a replica computes the same rows
            out[:, offset + start : offset + stop] = part
            at += stop - start
    return out


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("target", [QKV, GATE_UP, LM_HEAD], ids=["qkv", "gate_up", "lm_head"])
def test_column_shares_put_together_equal_the_whole_layer(size, target):
    g = torch.Generator().manual_seed(size)
    w = torch.randn(target.out_features, target.in_features, generator=g, dtype=torch.float64)
    a, b = _adapter(target, size)
    a, b = [t.double() for t in a], [t.double() for t in b]
    x = torch.randn(5, target.in_features, generator=g, dtype=torch.float64)
    whole = x @ w.T + torch.cat([x @ a_s.T @ b_s.T for a_s, b_s in zip(a, b, strict=True)], 1)
    torch.testing.assert_close(_column_output(target, w, a, b, x, size), whole)


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("target", [O_PROJ, DOWN], ids=["o", "down"])
def test_row_partial_sums_with_the_delta_equal_the_whole_layer(size, target):
    """Each rank's partial output, its LoRA delta added before the all-reduce: the sum over
    ranks (the all-reduce) is the whole layer's output."""
    g = torch.Generator().manual_seed(10 + size)
    w = torch.randn(target.out_features, target.in_features, generator=g, dtype=torch.float64)
    a, b = _adapter(target, size)
    a, b = [a[0].double()], [b[0].double()]
    x = torch.randn(5, target.in_features, generator=g, dtype=torch.float64)
    total = torch.zeros(5, target.out_features, dtype=torch.float64)
    step = target.in_features // size
    for r in range(size):
        tp = TPRank(r, size)
        xr = x[:, r * step : (r + 1) * step]  # the rank's input: the column part before it
        (ar,), (br,) = shard_lora(target, a, b, tp)
        total += xr @ shard_weight(target, w, tp).T + xr @ ar.T @ br.T
    torch.testing.assert_close(total, x @ w.T + x @ a[0].T @ b[0].T)


@pytest.mark.parametrize("vocab", [64, 61, 9])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_vocabulary_parallel_embedding_sums_to_the_whole(size, vocab):
    """Each rank looks up the tokens of its vocabulary range (zeros for the others), its
    LoRA delta from its columns of A: the sum over ranks is the whole embedding's. A
    vocabulary the size does not split (61; 9 over 8 ranks: the last ones hold no token)
    is padded: every rank holds ceil(vocab / size) rows of the table and columns of A,
    those past its range zeros."""
    target = replace(EMBED, in_features=vocab)
    g = torch.Generator().manual_seed(20 + size)
    w = torch.randn(vocab, 16, generator=g, dtype=torch.float64)
    (a,), (b,) = _adapter(target, size)
    a, b = a.double(), b.double()
    tokens = torch.randint(0, vocab, (9,), generator=g)
    total = torch.zeros(9, 16, dtype=torch.float64)
    held = -(-vocab // size)
    for r in range(size):
        tp = TPRank(r, size)
        (ar,), (br,) = shard_lora(target, [a], [b], tp)
        wr = shard_weight(target, w, tp)
        start, stop = min(r * held, vocab), min((r + 1) * held, vocab)  # (cut by hand)
        assert wr.shape == (held, 16) and ar.shape == (RANK, held)
        assert local_target(target, tp).in_features == held
        assert torch.equal(wr[: stop - start], w[start:stop]) and not wr[stop - start :].any()
        assert torch.equal(ar[:, : stop - start], a[:, start:stop])
        assert not ar[:, stop - start :].any() and torch.equal(br, b)
        local = tokens - start
        mine = (local >= 0) & (local < stop - start)
        rows = torch.where(mine, local, 0)
        part = wr[rows] + ar[:, rows].T @ br.T
        total += torch.where(mine[:, None], part, 0.0)
    torch.testing.assert_close(total, w[tokens] + a[:, tokens].T @ b.T)


def test_units_that_do_not_split_are_refused_by_name():
    with pytest.raises(ValueError, match="slice 'q_proj': 8 units .* do not split among 3"):
        column_rows(QKV, TPRank(0, 3))
    odd = LoraTarget(16, (12, 6, 6), "column", ("q_proj", "k_proj", "v_proj"),
                     slice_units=(4, 2, 2))  # fmt: skip
    with pytest.raises(ValueError, match="slice 'k_proj': 8 ranks do not split among its 3"):
        unit_rows(6, 3, TPRank(0, 8), "slice 'k_proj'")
    with pytest.raises(ValueError, match="slice 'q_proj': 12 rows are not 5 equal units"):
        unit_rows(12, 5, TPRank(0, 2), "slice 'q_proj'")
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TPRank(2, 2)
    assert column_rows(odd, TPRank(1, 2)) == [(6, 12), (3, 6), (3, 6)]


def _row_parallel_rank(rank: int, size: int, store: str, out: str) -> None:
    """One rank of a row-parallel o_proj with an adapter (a spawned process): its input
    columns, its share of the weight and of A, B whole, the delta added to the partial
    output before ``tp_all_reduce``; the sum written by rank 0."""
    from lora_graph.distributed import (
        close_tensor_parallel,
        exit_worker,
        init_tensor_parallel,
        tp_all_reduce,
    )

    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method=store, backend="gloo")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g, dtype=torch.float64)
    (a,), (b,) = _adapter(O_PROJ, 7)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    (ar,), (br,) = shard_lora(O_PROJ, [a.double()], [b.double()], tp)
    step = 16 // size
    xr = x[:, rank * step : (rank + 1) * step]
    y = tp_all_reduce(xr @ shard_weight(O_PROJ, w, tp).T + xr @ ar.T @ br.T)
    layers = _row_parallel_lora_layers(tp, shard_weight(O_PROJ, w, tp), ar, br)
    routing = RoutingBuffer(2, torch.device("cpu")).fill([1], [0, 5], [0, 1])  # slot 1
    lora_graph.ops.in_graph = lambda x: True  # as if captured: the side-stream delta
    # LoRALinear.reduced: the delta stacked beside the partial output (one all-reduce of
    # both, the add after it), and added before the all-reduce
    got = {apart: layer.reduced(xr.float(), routing) for apart, layer in layers.items()}
    if rank == 0:
        want = x @ w.T + x @ a.double().T @ b.double().T
        torch.save({"got": y, "want": want, **{f"reduced {k}": v for k, v in got.items()}}, out)
    close_tensor_parallel()
    exit_worker()  # (as the engine's workers do: finalization could race gloo's threads)


def _row_parallel_lora_layers(tp, w, a, b):
    """A rank's o_proj as a LoRALinear (float32, the adapter in slot 1 of 2), on the
    reference kernels with the side-stream ops, stacking the delta apart or not."""
    from lora_graph.kernels import reference
    from lora_graph.kernels.policy import KernelPolicy
    from lora_graph.layers import LoRALinear
    from lora_graph.ops import Kernels
    from lora_graph.parallel import local_target

    base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    base.weight.data = w.float()
    a_stack = torch.zeros(2, *a.shape)
    b_stack = torch.zeros(2, *b.shape)
    a_stack[1], b_stack[1] = a, b
    layers = {}
    for apart in (True, False):
        kernels = Kernels(
            reference.shrink, reference.embedding_shrink, reference.expand_,
            linear_delta=reference.linear_delta,
            linear_delta_stacked=reference.linear_delta_stacked,
            policy=KernelPolicy(reduce_delta_apart=apart),
        )  # fmt: skip
        layers[apart] = LoRALinear(
            base, target=local_target(O_PROJ, tp), target_name="o_proj", layer=0, a=a_stack,
            b=b_stack, kernels=kernels,
        )  # fmt: skip
    return layers


def test_row_parallel_all_reduce_over_two_gloo_processes(tmp_path):
    """``lora_graph::tp_all_reduce`` over 2 processes (gloo, the CPU's backend): the
    row-parallel layer's partial outputs with their LoRA deltas sum to the whole layer's
    output, by hand and through ``LoRALinear.reduced`` with the side-stream delta both
    stacked beside the output (one all-reduce, the add after) and added before; without a
    group the op is the identity."""
    import torch.multiprocessing as mp

    from lora_graph.distributed import tensor_parallel, tp_all_reduce

    out = tmp_path / "out.pt"
    mp.spawn(_row_parallel_rank, args=(2, f"file://{tmp_path / 'store'}", str(out)), nprocs=2)
    result = torch.load(out)
    torch.testing.assert_close(result["got"], result["want"])
    for apart in (True, False):
        torch.testing.assert_close(
            result[f"reduced {apart}"].double(), result["want"], rtol=1e-5, atol=1e-4
        )
    x = torch.randn(3, 4)
    assert tensor_parallel() is None and torch.equal(tp_all_reduce(x), x)


def test_a_wire_header_too_long_is_refused():
    """A command with more arguments than the wire's header holds is refused before
    anything is sent (never cut short on the way to the workers)."""
    from lora_graph.distributed import HEADER, Wire

    wire = Wire([torch.zeros(3, dtype=torch.int32)], torch.device("cpu"))
    with pytest.raises(ValueError, match=f"a wire header holds {HEADER} ints, got {HEADER + 1}"):
        wire.send(1, *range(HEADER))


@pytest.mark.parametrize("vocab_parallel_head", [False, True])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_tied_checkpoint_shares_from_either_name(size, vocab_parallel_head):
    """A tied checkpoint holds the shared matrix under the embedding's name
    (``save_pretrained``), the head's (safetensors' ``save_model``; SmolLM2 converted from
    GGUF) or both: each rank's shares are the same from all three, the embedding's its
    vocabulary rows cut by hand, the head's whole or its rows; every other tensor its share
    as from the full file."""
    from conftest import make_hf_model

    from lora_graph.loading.model_files import select_state
    from lora_graph.models.llama import LlamaConfig, lora_targets
    from lora_graph.tensor_parallel import checkpoint_shares, served_targets

    hf = make_hf_model("tied")
    full = {k: v.clone() for k, v in hf.state_dict().items()}
    table = full["model.embed_tokens.weight"]
    assert torch.equal(full["lm_head.weight"], table)
    ties = {"lm_head": "model.embed_tokens"}
    files = {
        "both": full,
        "embedding": {k: v for k, v in full.items() if k != "lm_head.weight"},
        "head": {k: v for k, v in full.items() if k != "model.embed_tokens.weight"},
    }
    for rank in range(size):
        tp = TPRank(rank, size)
        targets = served_targets(lora_targets(LlamaConfig.from_hf(hf.config)), tp,
                                 vocab_parallel_head)  # fmt: skip
        shares = {}
        for kind, state in files.items():

            def read(select, state=state):
                return dict(state) if select is None else select_state(state, select)

            shares[kind] = checkpoint_shares(read, targets, 2, tp, ties)
        rows = slice(rank * 128 // size, (rank + 1) * 128 // size)
        for kind, got in shares.items():
            assert got.keys() == full.keys(), kind
            assert torch.equal(got["model.embed_tokens.weight"], table[rows]), kind
            head = table[rows] if vocab_parallel_head else table
            assert torch.equal(got["lm_head.weight"], head), kind
            for name, t in got.items():
                assert torch.equal(t, shares["both"][name]), (kind, name)
        if size > 1:  # (and the rest are shares: q's rows)
            q = shares["head"]["model.layers.0.self_attn.q_proj.weight"]
            assert q.shape[0] == 64 // size
