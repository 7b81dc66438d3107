"""Decode step time: the engine with and without LoRA, against the bandwidth floor and PEFT.

Llama-3-8B shapes (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab
128256; ``--shapes 70b``: Llama-3-70B's, hidden 8192, 80 layers, 64 heads, FFN 28672),
random bfloat16 weights (made on each rank, its share kept: :class:`RandomWeights`),
rank-16 adapters on all seven linears. For each batch
size it times one packed decode step (median of CUDA-event-timed replays; the requests'
contexts spread around ``--context``, read through their block tables) for:

    (a) the engine with LoRA disabled          (b) LoRA enabled, base-only batches
    (c) one adapter for every row              (d) 4 distinct adapters mixed
    (e) 16 distinct adapters mixed             peft: transformers + peft, (a) and (d)

and the floor: the weight bytes plus the KV bytes the step reads on one GPU (under tensor
parallelism a rank's share, the replicated LM head whole), over the device copy
bandwidth measured in the same run.

    python bench/decode.py                      # the H200 run (writes bench/out/decode.json)
    python bench/decode.py --smoke              # tiny shapes on the CPU, to check it runs

``--variants`` times (b)-(e) again for each variant of the decode LoRA path (a fresh LoRA
pipeline each, captured with the variant's kernel policy), e.g.
``--variants now "unfused:fused_silu=0" "mixed:ranks=8/16/32/64"``; the switches:

    fused_silu=0|1     KernelPolicy.fused_silu_decode (gate/up: side shrink + fused
                       expand/SwiGLU)
    ranks=R1/R2/...    the adapters' ranks, cycled over the 16 (pool max_rank: the largest)
    slot_ranks=0|1     the kernels told each slot's rank (1) or reading every slot to max_rank
    reduce_apart=0|1   KernelPolicy.reduce_delta_apart (tensor parallel: a row-parallel
                       layer's delta all-reduced beside its output, or added before)

(The switches of experiments since removed from the library, ``overwrite``,
``fused_delta``, ``k_steps``, ``rope_kv`` and ``rank_loop``, are in ``bench/RESULTS.md``
with their measurements.)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from lora_graph.kernels.policy import KernelPolicy

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)  # fmt: skip
SMOKE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}


class RandomWeights(Mapping[str, torch.Tensor]):
    """A Llama checkpoint (Hugging Face names) of ``shapes`` whose tensors are made when
    read: linear and embedding weights normal with std 0.02 (as ``LlamaForCausalLM``
    initializes them), RMSNorm weights 1, all bfloat16 on the current device (a rank's GPU
    in a worker; the CPU without CUDA). Each tensor comes from a generator seeded by
    ``seed`` and its name, so every rank reads the same checkpoint. Picklable (the shapes
    and the seed): a tensor-parallel pipeline hands it to its workers."""

    def __init__(self, shapes: dict, seed: int = 0) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**shapes))
        self.shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self.seed = seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16, device=device)
        g = torch.Generator(device).manual_seed(self.seed * 7919 + zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=g, dtype=torch.bfloat16, device=device)
        return t.mul_(0.02)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def nbytes(self, tied: bool = False) -> int:
        """The checkpoint's bytes (bfloat16), the LM head left out when ``tied``."""
        return sum(
            2 * math.prod(shape) for name, shape in self.shapes.items()
            if not (tied and name == "lm_head.weight")
        )  # fmt: skip


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def copy_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth in bytes/s (bytes read + written), median of 20 copies of 1 GiB."""
    if device.type != "cuda":
        return float("nan")
    n = 1 << 29
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[5:])


def release_memory(device: torch.device) -> None:
    """Give a dropped pipeline's device memory back before the next one sizes its KV cache
    from what is free: its compiled graphs and dynamo's caches hold it through reference
    cycles until collected (without this, the LoRA pipeline after the max_seq_len
    comparison found 0 GiB left for its KV cache)."""
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write_adapter(
    path: Path, config: dict, rank: int, seed: int, modules: tuple[str, ...] = LINEARS
) -> None:
    """A random PEFT adapter on ``modules`` (default: all seven linears) of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            if name not in modules:
                continue
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            ).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=g) * 0.01
            ).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(modules),
                "bias": "none",
                "task_type": "CAUSAL_LM",
            }
        )
    )


def contexts(batch: int, mean: int) -> list[int]:
    """Mixed context lengths with mean ``mean``: spread evenly over ``[mean/2, 3*mean/2]``."""
    if batch == 1:
        return [mean]
    return [round(mean / 2 + mean * i / (batch - 1)) for i in range(batch)]


def compile_step(pipe, mode: str, buckets: list[int]) -> None:
    """Capture ``pipe``'s step at ``buckets`` (``mode`` ``"eager"``: leave it uncompiled)."""
    if mode != "eager":
        pipe.enable_compile(mode, token_buckets=buckets)


def time_engine_step(
    pipe, batch: int, adapters: list[str | None], *, context: int, reps: int
) -> float:
    """Median ms of one packed decode step of ``batch`` requests at mixed contexts of mean
    ``context`` (:func:`contexts`; their pages hold zeros): the step inputs' copy and the
    graph replay, over ``reps`` replays."""
    from lora_graph.step import SeqChunk

    dev = pipe.device
    g = torch.Generator().manual_seed(batch)
    chunks = []
    for adapter, ctx in zip(adapters, contexts(batch, context), strict=True):
        token = int(torch.randint(0, pipe.config.vocab_size, (), generator=g))
        pages = pipe.pages.allocate(pipe.pages.pages_for(ctx + 1))
        chunks.append(SeqChunk(adapter, [token], ctx, pages))
    try:
        inputs = pipe.prepare(chunks)
        for _ in range(3):
            pipe.execute(inputs)
        times = []
        for _ in range(reps):
            if dev.type != "cuda":
                t0 = time.perf_counter()
                pipe.execute(inputs)
                times.append((time.perf_counter() - t0) * 1e3)
                continue
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            pipe.execute(inputs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    finally:
        for c in chunks:
            pipe.pages.free(c.pages)
    return statistics.median(times)


@torch.inference_mode()
def time_peft_step(
    model, batch: int, adapter_names: list[str] | None, *, context: int, reps: int
) -> float:
    """Median ms of one ``transformers`` decode step with a DynamicCache of ``context``
    tokens (``adapter_names``: PEFT's mixed-batch routing, one name a row)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    kwargs = {"adapter_names": adapter_names} if adapter_names is not None else {}
    cache = DynamicCache()
    model(
        torch.randint(0, vocab, (batch, context), device=dev),
        past_key_values=cache,
        use_cache=True,
        **kwargs,
    )
    step = torch.randint(0, vocab, (batch, 1), device=dev)
    times = []
    for i in range(reps + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(step, past_key_values=cache, use_cache=True, **kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


VARIANT_SWITCHES = ("fused_silu", "ranks", "slot_ranks", "reduce_apart")


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``name`` or ``name:key=value,...`` (module docstring).

    Raises:
        SystemExit: naming the variant and the cause, for an empty name, a switch that is
            not ``key=value``, unknown or given twice, or a value out of its range.
    """
    name, _, rest = spec.partition(":")
    if not name:
        raise SystemExit(f"variant {spec!r}: give it a name (name:key=value,...)")
    switches: dict[str, str] = {}
    for kv in filter(None, rest.split(",")):
        key, eq, value = kv.partition("=")
        if not eq or key not in VARIANT_SWITCHES or key in switches:
            why = "not key=value" if not eq else "given twice" if key in switches else "unknown"
            known = ", ".join(VARIANT_SWITCHES)
            raise SystemExit(f"variant {name!r}: switch {kv!r} is {why} (switches: {known})")
        if key == "ranks":
            ranks = value.split("/")
            if not all(r.isdigit() and int(r) > 0 for r in ranks):
                raise SystemExit(
                    f"variant {name!r}: ranks must be positive integers, got {value!r}"
                )
        elif value not in ("0", "1"):
            raise SystemExit(f"variant {name!r}: {key} must be 0 or 1, got {value!r}")
        switches[key] = value
    return name, switches


def variant_policy(switches: dict[str, str], no_side_stream: bool) -> KernelPolicy:
    """The kernel policy of a variant (the defaults for the switches not named)."""
    return KernelPolicy(
        side_stream_max_rows=0 if no_side_stream else KernelPolicy().side_stream_max_rows,
        fused_silu_decode=switches.get("fused_silu", "1") == "1",
        reduce_delta_apart=switches.get(
            "reduce_apart", "1" if KernelPolicy().reduce_delta_apart else "0"
        )
        == "1",
    )


def mix(n_rows: int, names: list[str]) -> list[str]:
    """Rows spread round-robin over ``names`` (as many distinct as rows allow)."""
    return [names[i % len(names)] for i in range(n_rows)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument(
        "--mode",
        default=None,
        choices=["cudagraph", "inductor", "eager"],
        help="how the steps run: captured in CUDA graphs (the default), compiled by inductor, "
        "or eager, not compiled (--smoke's default: the script's path without a compiler)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=64,
        help="mean KV positions before the timed step, spread over [context/2, 3*context/2] "
        "across the batch (default 64)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="the pipelines' max_seq_len (default: 3*context/2 + 64); a decode step reads "
        "the pages its requests hold, so this should not change its time",
    )
    parser.add_argument(
        "--compare-max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="also time (a) on a pipeline of max_seq_len N (a step should not depend on it)",
    )
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "torch", "triton"], help="LoRA kernels"
    )
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument(
        "--targets",
        default="all",
        choices=["all", "linears"],
        help="served targets: all the model's (the default config: with the embedding and LM head) "
        "or the four linear families only",
    )
    parser.add_argument(
        "--no-side-stream",
        action="store_true",
        help="run decode LoRA in place after each base linear instead of on the side stream",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["default"],
        metavar="SPEC",
        help="variants of the decode LoRA path to time (module docstring; default: the code's "
        "defaults)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="serve every pipeline over this many ranks (tensor parallelism; 1: the "
        "distributed path on one GPU, an NCCL group of one rank; default: no group)",
    )
    parser.add_argument(
        "--vocab-parallel-lm-head",
        action="store_true",
        help="with --tensor-parallel-size: the LM head split by vocabulary, its logits "
        "gathered (default: whole on every rank)",
    )
    parser.add_argument(
        "--shapes",
        choices=sorted(SHAPES),
        default="8b",
        help="the model's shapes: Llama-3-8B (default) or Llama-3-70B (141 GB in bfloat16: "
        "give --tensor-parallel-size 2 or more on H200s; no PEFT run)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--json", default="bench/out/decode.json")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants]  # refused before anything is built

    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.mode, args.reps, args.batch_sizes = args.mode or "eager", 3, [1, 4]
    args.mode = args.mode or "cudagraph"
    shapes = SMOKE if args.smoke else SHAPES[args.shapes]
    if shapes is not LLAMA3_8B and not args.smoke:
        args.skip_peft = True  # (one GPU cannot hold the transformers model)
    work = Path(tempfile.mkdtemp(prefix="lora_graph_bench_"))
    hf_config = LlamaConfig(**shapes)
    hf_config.save_pretrained(work / "base")
    max_batch = max(args.batch_sizes)
    weights = RandomWeights(shapes)
    hf = None
    if not args.skip_peft:
        t0 = time.time()
        torch.manual_seed(0)
        with torch.device(device):
            hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
        print(f"transformers model built in {time.time() - t0:.1f} s", flush=True)

    bw = copy_bandwidth(device)
    size = args.tensor_parallel_size or 1
    head_bytes = 2 * shapes["vocab_size"] * shapes["hidden_size"]
    weight_bytes = weights.nbytes(tied=hf_config.tie_word_embeddings)
    # one GPU's: its share of every sharded tensor (the norms are noise), the LM head whole
    # unless split by vocabulary
    head_share = head_bytes / size if args.vocab_parallel_lm_head else head_bytes
    rank_bytes = (weight_bytes - head_bytes) / size + head_share
    head_dim = shapes["hidden_size"] // shapes["num_attention_heads"]
    kv_heads = max(1, shapes["num_key_value_heads"] // size)  # (replicated past kv ranks)
    kv_token_bytes = 2 * shapes["num_hidden_layers"] * kv_heads * head_dim * 2

    def floor_ms(batch: int) -> float:
        """Weights plus the KV bytes the step reads, over the copy bandwidth."""
        kv = sum(c + 1 for c in contexts(batch, args.context)) * kv_token_bytes
        return (rank_bytes + kv) / bw * 1e3

    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.2f} GB "
        f"({rank_bytes / 1e9:.2f} GB a GPU), KV {kv_token_bytes / 1e3:.0f} kB a token a GPU, "
        f"mean context {args.context}",
        flush=True,
    )

    names = [f"a{i}" for i in range(16)]  # written per variant (their ranks may differ)
    common = dict(
        dtype=torch.bfloat16,
        device=device,
        max_batch_size=max_batch,
        max_seq_len=args.max_seq_len or (3 * args.context // 2 + 64),
        max_num_batched_tokens=max(max_batch, 16),
        weights=weights,
        tensor_parallel_size=args.tensor_parallel_size,
        vocab_parallel_lm_head=args.vocab_parallel_lm_head,
    )
    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_TBps": bw / 1e12,
        "shapes": "smoke" if args.smoke else args.shapes,
        "weight_GB": weight_bytes / 1e9,
        "weight_GB_per_gpu": rank_bytes / 1e9,
        "context": args.context,
        "kv_bytes_per_token": kv_token_bytes,
        "mode": args.mode,
        "backend": args.backend,
        "targets": args.targets,
        "side_stream": not args.no_side_stream,
        "variants": args.variants,
        "tensor_parallel_size": args.tensor_parallel_size,
        "vocab_parallel_lm_head": args.vocab_parallel_lm_head,
        "rows": [],
    }

    t0 = time.time()
    plain = LlamaPipeline(str(work / "base"), **common)
    compile_step(plain, args.mode, args.batch_sizes)
    print(f"(a) captured in {time.time() - t0:.1f} s", flush=True)
    a_ms = {
        b: time_engine_step(plain, b, [None] * b, context=args.context, reps=args.reps)
        for b in args.batch_sizes
    }
    plain.close()  # (a tensor-parallel group: one a process)
    del plain
    release_memory(device)
    a_long_ms = {}
    if args.compare_max_seq_len:
        long_pipe = LlamaPipeline(
            str(work / "base"), **{**common, "max_seq_len": args.compare_max_seq_len}
        )
        compile_step(long_pipe, args.mode, args.batch_sizes)
        for b in args.batch_sizes:
            a_long_ms[b] = time_engine_step(
                long_pipe, b, [None] * b, context=args.context, reps=args.reps
            )
            print(
                f"(a) batch {b}: max_seq_len {common['max_seq_len']} {a_ms[b]:.3f} ms, "
                f"{args.compare_max_seq_len} {a_long_ms[b]:.3f} ms "
                f"({a_long_ms[b] / a_ms[b] - 1:+.1%})",
                flush=True,
            )
        results["compare_max_seq_len"] = {
            "max_seq_len": [common["max_seq_len"], args.compare_max_seq_len],
            "a_ms": {b: [a_ms[b], a_long_ms[b]] for b in args.batch_sizes},
        }
        long_pipe.close()
        del long_pipe
        release_memory(device)

    targets = None if args.targets == "all" else ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    written: dict[str, int] = {}
    rows: dict = {}
    lora = None
    for variant, switches in variants:
        # free the previous variant's graphs now: a CUDA graph destroyed by the garbage
        # collector while the next one is being captured invalidates that capture
        gc.collect()
        torch._dynamo.reset()  # each pipeline compiles the same layer code afresh
        ranks = [int(r) for r in switches.get("ranks", "16").split("/")]
        for i, name in enumerate(names):
            rank = ranks[i % len(ranks)]
            if written.get(name) != rank:
                write_adapter(work / name, shapes, rank, seed=i)
                written[name] = rank
        t0 = time.time()
        lora = LlamaPipeline(
            str(work / "base"),
            **common,
            lora=LoRAConfig(
                max_slots=16,
                max_rank=max(ranks),
                backend=args.backend,
                targets=targets,
                kernel_policy=variant_policy(switches, args.no_side_stream),
            ),
        )
        if switches.get("slot_ranks", "1") == "0":
            for layer in lora.manager.layers.values():
                layer.ranks = None
        compile_step(lora, args.mode, args.batch_sizes)
        print(f"[{variant}] (b-e) captured in {time.time() - t0:.1f} s", flush=True)
        t0 = time.time()
        for name in names:
            lora.manager.load_adapter(str(work / name), name=name)
        print(f"[{variant}] 16 adapters loaded in {time.time() - t0:.1f} s", flush=True)
        for b in args.batch_sizes:
            time_step = functools.partial(
                time_engine_step, lora, b, context=args.context, reps=args.reps
            )
            rows[(variant, b)] = {
                "a": a_ms[b],
                "b": time_step([None] * b),
                "c": time_step([names[0]] * b),
                "d": time_step(mix(b, names[:4])),
                "e": time_step(mix(b, names)),
            }
            print(variant, b, {k: round(v, 3) for k, v in rows[(variant, b)].items()}, flush=True)
        assert lora.graphs is None or lora.graphs.recompiles == 0
        lora.close()  # (a tensor-parallel group: one a process)
        lora = None
        torch.cuda.empty_cache() if device.type == "cuda" else None

    if hf is not None:
        from peft import PeftModel

        first = variants[0][0]
        for b in args.batch_sizes:
            rows[(first, b)]["peft_a"] = time_peft_step(
                hf, b, None, context=args.context, reps=min(args.reps, 10)
            )
        peft_model = PeftModel.from_pretrained(
            hf, str(work / names[0]), adapter_name=names[0]
        ).eval()
        for name in names[1:4]:
            peft_model.load_adapter(str(work / name), adapter_name=name)
        for b in args.batch_sizes:
            r = rows[(first, b)]
            r["peft_d"] = time_peft_step(
                peft_model, b, mix(b, names[:4]), context=args.context, reps=min(args.reps, 10)
            )
            print(b, "peft", round(r["peft_a"], 2), round(r["peft_d"], 2), flush=True)

    header = [
        "variant",
        "batch",
        "floor ms",
        "(a) ms",
        "(b) ms",
        "(c) ms",
        "(d) ms",
        "(e) ms",
        "(a) tok/s",
        "(d) tok/s",
        "(e) tok/s",
        "(a)/floor",
        "(b)/(a)",
        "(c)/(a)",
        "(d)/(a)",
        "(e)/(a)",
        "peft (a) ms",
        "peft (d) ms",
        "peft (d) tok/s",
        "(d) vs peft (d)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (variant, b), r in rows.items():
        peft_a, peft_d = r.get("peft_a", float("nan")), r.get("peft_d", float("nan"))
        floor = floor_ms(b)
        cells = [
            variant,
            b,
            floor,
            r["a"],
            r["b"],
            r["c"],
            r["d"],
            r["e"],
            b / r["a"] * 1e3,
            b / r["d"] * 1e3,
            b / r["e"] * 1e3,
            r["a"] / floor,
            r["b"] / r["a"],
            r["c"] / r["a"],
            r["d"] / r["a"],
            r["e"] / r["a"],
            peft_a,
            peft_d,
            b / peft_d * 1e3,
            peft_d / r["d"],
        ]
        lines.append(
            "| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |"
        )
        results["rows"].append({"variant": variant, "batch": b, "floor_ms": floor, **r})
    table = "\n".join(lines)
    results["table"] = table
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(table)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
