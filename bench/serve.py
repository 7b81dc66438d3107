"""A whole serving workload, end to end: many requests, prompts of mixed length, mixed
adapters, arrivals over time.

Random bfloat16 weights of Llama-3-8B shapes (``--shapes 70b``: Llama-3-70B's, with
``--tensor-parallel-size`` 2 or more; no PEFT run) and random rank-16 PEFT adapters on all
seven linears (as ``bench/decode.py``). The workload (every knob on the command line):
``--requests`` prompts with lengths uniform in ``--prompt-len MIN MAX``, ``--output-len``
new tokens each (EOS ignored), each under one of ``--adapters`` adapters drawn by
``--popularity`` or, with probability ``--base-share``, the base model; all at once
(``--rate inf``) or Poisson arrivals at ``--rate`` requests/s. It is served by:

    base   the engine with LoRA disabled, every request on the base model
    lora   the LoRA engine on the mixed workload
    peft   transformers + peft (``generate`` one request at a time), on the first
           ``--peft-requests`` requests only

and for each prints wall time (first arrival to last token), output and total (prompt +
output) tokens/s, time to first token and inter-token latency (p50, p90), and the share of
prompt tokens the prefix cache served. Capture time is reported apart and not counted.

``--workload`` picks the requests: ``mixed`` (above); ``shared-prefix``: ``--adapters``
adapters and the base model, each with its own ``--shared-len``-token system prompt shared
by ``--per-group`` requests, then a unique suffix of ``--prompt-len`` tokens (in random
order); ``chat``: ``--conversations`` conversations of ``--turns`` turns, each turn
resending the conversation so far (its first message of ``--prompt-len`` MIN tokens, the
answers, ``--user-len`` new tokens a turn), the next turn sent when the answer is done.
``--compare-prefix-caching`` serves each engine's workload again with the cache off, on
the same captured graphs (each run starts from a cold cache).

    python bench/serve.py                      # the H200 run (writes bench/out/serve.json)
    python bench/serve.py --rate 8             # Poisson arrivals, 8 requests/s
    python bench/serve.py --smoke              # tiny shapes on the CPU, to check it runs
    python bench/serve.py --workload shared-prefix --compare-prefix-caching --skip-base
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from decode import LLAMA3_8B, SHAPES, SMOKE, RandomWeights, write_adapter  # bench/decode.py


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--requests", type=int, default=256, help="requests in the workload (default: 256)"
    )
    p.add_argument(
        "--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
        help="prompt lengths (shared-prefix: the suffix's; chat: MIN is the first message's; "
        "default: 128 1024, shared-prefix 128 512)",
    )  # fmt: skip
    p.add_argument(
        "--output-len", type=int, default=128, help="new tokens per request (default: 128)"
    )
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters (default: 8)")
    p.add_argument(
        "--popularity",
        default="skewed",
        choices=["uniform", "zipf", "skewed"],
        help="how requests pick adapters (skewed: half on one adapter; default)",
    )
    p.add_argument("--base-share", type=float, default=0.2, help="share of base-model requests")
    p.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals/s (default: inf, all at once)",
    )
    p.add_argument(
        "--max-batch-size", type=int, default=64, help="requests in flight (default: 64)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens in one step, decodes plus prompt chunks (default: 512, the fastest of "
        "512/1024/2048 on this workload on an H200: smaller chunks spread admissions, so "
        "prefill overlaps other requests' decodes)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="the pipelines' max_seq_len (default: the longest prompt + --output-len + 1)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache positions (default: sized from free memory on CUDA)",
    )
    p.add_argument("--max-loras", type=int, default=8, help="device slots (default: 8)")
    p.add_argument(
        "--side-stream-rows",
        type=int,
        default=None,
        help="row counts up to which a LoRA linear runs its delta on a side stream beside the "
        "base GEMM (KernelPolicy.side_stream_max_rows, default 64)",
    )
    p.add_argument("--compile", default="cudagraph", choices=["cudagraph", "inductor", "none"])
    p.add_argument("--peft-requests", type=int, default=4, help="requests peft serves (0: skip)")
    p.add_argument(
        "--shapes",
        choices=sorted(SHAPES),
        default="8b",
        help="the model's shapes: Llama-3-8B (default) or Llama-3-70B (141 GB in bfloat16: "
        "give --tensor-parallel-size 2 or more on H200s; no PEFT run)",
    )
    p.add_argument("--skip-base", action="store_true", help="do not run the base-only engine")
    p.add_argument(
        "--compare-sync",
        action="store_true",
        help="also serve each engine's workload with async_scheduling off (every step's "
        "tokens read back before the next is scheduled), on the same captured graphs",
    )
    p.add_argument(
        "--logprobs-share",
        type=float,
        default=0.0,
        help="share of requests asking for logprobs: 5 (with --json-share: the LoRA run is "
        "served again with these, on the same graphs, and compared)",
    )
    p.add_argument(
        "--json-share",
        type=float,
        default=0.0,
        help="share of requests whose output follows a JSON schema (an object of one free "
        "string, which random weights rarely close: the rows run their whole length), "
        "compiled by xgrammar over the demo model's tokenizer",
    )
    p.add_argument(
        "--workload", default="mixed", choices=["mixed", "shared-prefix", "chat"],
        help="which requests (module docstring; default: mixed)",
    )  # fmt: skip
    p.add_argument("--shared-len", type=int, default=2048, help="shared-prefix: system prompt")
    p.add_argument("--per-group", type=int, default=32, help="shared-prefix: requests a prompt")
    p.add_argument("--conversations", type=int, default=64, help="chat: conversations")
    p.add_argument("--turns", type=int, default=8, help="chat: turns a conversation")
    p.add_argument("--user-len", type=int, default=64, help="chat: new tokens a turn")
    p.add_argument(
        "--compare-prefix-caching", action="store_true",
        help="also serve each engine's workload with the prefix cache off",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="serve over this many ranks (tensor parallelism; default: one device, no group)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--json", default="bench/out/serve.json")
    args = p.parse_args()
    if args.prompt_len is None:
        args.prompt_len = [128, 512] if args.workload == "shared-prefix" else [128, 1024]
    return args


def workload(args: argparse.Namespace, names: list[str], vocab: int) -> list[dict]:
    """The requests: prompt ids, adapter (None: base) and arrival offset in seconds (a chat
    turn after the first: ``parent``, the turn it follows, and ``user``, its new tokens;
    its prompt is built when the parent finishes)."""
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args, names, vocab)
    if args.workload == "chat":
        return chat_workload(args, names, vocab)
    rng = random.Random(args.seed)
    weights = {
        "uniform": [1.0] * len(names),
        "zipf": [1.0 / (i + 1) for i in range(len(names))],
        "skewed": [0.5] + [0.5 / max(1, len(names) - 1)] * (len(names) - 1),
    }[args.popularity][: len(names)]
    t = 0.0
    out = []
    for i in range(args.requests):
        n = rng.randint(*args.prompt_len)
        adapter = (
            None if rng.random() < args.base_share or not names else rng.choices(names, weights)[0]
        )
        out.append(
            dict(
                id=str(i),
                prompt=[rng.randrange(3, vocab) for _ in range(n)],
                adapter=adapter,
                arrival=t,
            )
        )
        if math.isfinite(args.rate):
            t += rng.expovariate(args.rate)
    return out


def arrivals(args: argparse.Namespace, n: int, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if math.isfinite(args.rate):
            t += rng.expovariate(args.rate)
    return out


def shared_prefix_workload(args: argparse.Namespace, names: list[str], vocab: int) -> list[dict]:
    """Each of ``names`` and the base model: a system prompt of ``--shared-len`` tokens
    shared by ``--per-group`` requests, each with its own suffix."""
    rng = random.Random(args.seed)
    groups = [*names, None]
    system = {a: [rng.randrange(3, vocab) for _ in range(args.shared_len)] for a in groups}
    reqs = []
    for a in groups:
        for _ in range(args.per_group):
            suffix = [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
            reqs.append(dict(prompt=system[a] + suffix, adapter=a))
    rng.shuffle(reqs)
    for i, (r, t) in enumerate(zip(reqs, arrivals(args, len(reqs), rng), strict=True)):
        r.update(id=str(i), arrival=t)
    return reqs


def chat_workload(args: argparse.Namespace, names: list[str], vocab: int) -> list[dict]:
    """``--conversations`` conversations (adapters as the mixed workload) of ``--turns``
    turns: the first sent at its arrival, each later one when the answer before it is done,
    resending the conversation."""
    rng = random.Random(args.seed)
    reqs = []
    for c, t in enumerate(arrivals(args, args.conversations, rng)):
        adapter = None if rng.random() < args.base_share or not names else rng.choice(names)
        first = [rng.randrange(3, vocab) for _ in range(args.prompt_len[0])]
        reqs.append(dict(id=f"c{c}t0", prompt=first, adapter=adapter, arrival=t))
        for turn in range(1, args.turns):
            user = [rng.randrange(3, vocab) for _ in range(args.user_len)]
            reqs.append(dict(id=f"c{c}t{turn}", parent=f"c{c}t{turn - 1}", user=user,
                             adapter=adapter, arrival=math.inf))  # fmt: skip
    return reqs


def mark_extras(args: argparse.Namespace, reqs: list[dict]) -> None:
    """Draw which requests ask for logprobs or a JSON schema (a generator of their own:
    the prompts and adapters stay those of the plain workload)."""
    rng = random.Random(args.seed + 1)
    for r in reqs:
        x = rng.random()
        r["logprobs"] = x < args.logprobs_share
        r["json"] = args.logprobs_share <= x < args.logprobs_share + args.json_share


def json_grammar(vocab: int):
    """The JSON rows' grammar: ``{"text": "..."}``, over the demo model's tokenizer (ids
    past its 1,024 are never allowed)."""
    from transformers import AutoTokenizer

    from lora_graph.grammar import GrammarCompiler

    root = Path(__file__).resolve().parents[1]
    tokenizer = AutoTokenizer.from_pretrained(root / "examples" / "assets" / "base")
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    return GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id]).json_schema(schema)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def serve(
    engine, reqs: list[dict], output_len: int, *, base_only: bool, extras: bool = False,
    grammar=None,
) -> dict:  # fmt: skip
    """Feed the requests at their arrival times, step until all finish; the metrics (with
    ``extras``, the requests marked by :func:`mark_extras` ask for logprobs or follow
    ``grammar``; the ``plain_`` metrics are those of the unmarked, either way)."""
    from lora_graph.engine import Request, SamplingParams

    plain = SamplingParams(max_new_tokens=output_len, ignore_eos=True)

    def params(r: dict) -> SamplingParams:
        if not extras or not (r.get("logprobs") or r.get("json")):
            return plain
        if r["logprobs"]:
            return SamplingParams(max_new_tokens=output_len, ignore_eos=True, logprobs=5)
        return SamplingParams(max_new_tokens=output_len, grammar=grammar)

    pending = [r for r in reqs if "parent" not in r]
    after = {r["parent"]: r for r in reqs if "parent" in r}  # chat: the next turn
    prompts = {r["id"]: r["prompt"] for r in pending}
    start = time.perf_counter()
    outputs = {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request(
                Request(r["id"], prompts[r["id"]], None if base_only else r["adapter"],
                        params(r))
            )  # fmt: skip
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0]["arrival"] - now))
        for i, o in engine.finished.items():  # a chat turn done: the next one resends it all
            turn = after.get(i)
            if turn is not None and o.error is None:
                prompts[turn["id"]] = prompts[i] + o.token_ids + turn["user"]
                arrival = time.perf_counter() - start
                bisect.insort(pending, dict(turn, arrival=arrival), key=lambda r: r["arrival"])
        outputs.update(engine.finished)
        engine.finished.clear()
    wall = max(t for o in outputs.values() for t in o.token_times) - start
    if engine.pages.num_free != engine.pages.capacity:
        raise RuntimeError("pages were not all returned to the pool")
    errors = [o.error for o in outputs.values() if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    generated = sum(len(o.token_ids) for o in outputs.values())
    prompt = sum(map(len, prompts.values()))
    ttft = [o.ttft for o in outputs.values()]
    itl = [
        b - a
        for o in outputs.values()
        for a, b in zip(o.token_times, o.token_times[1:], strict=False)
    ]
    extra = {r["id"] for r in reqs if r.get("logprobs") or r.get("json")}
    free = [o for i, o in outputs.items() if i not in extra]
    plain_itl = [
        b - a for o in free for a, b in zip(o.token_times, o.token_times[1:], strict=False)
    ]
    return dict(
        plain_ttft_p50_ms=1e3 * pct([o.ttft for o in free], 0.5),
        plain_itl_p50_ms=1e3 * pct(plain_itl, 0.5),
        json_tokens=sum(len(outputs[i].token_ids) for i in extra if i in outputs),
        wall_s=wall,
        output_tok_s=generated / wall,
        total_tok_s=(generated + prompt) / wall,
        ttft_p50_ms=1e3 * pct(ttft, 0.5),
        ttft_p90_ms=1e3 * pct(ttft, 0.9),
        itl_p50_ms=1e3 * pct(itl, 0.5),
        itl_p90_ms=1e3 * pct(itl, 0.9),
        steps=dict(engine.steps),
        preemptions=engine.preemptions,
        requests=len(outputs),
        prompt_tokens=prompt,
        cached_tokens=sum(o.cached_tokens for o in outputs.values()),
    )


@torch.inference_mode()
def serve_peft(hf, work: Path, names: list[str], reqs: list[dict], output_len: int) -> dict:
    """transformers + peft, one request at a time (``generate``, greedy, EOS ignored)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf, str(work / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(work / name), adapter_name=name)
    dev = next(hf.parameters()).device
    ttft, itl, generated = [], [], 0
    start = time.perf_counter()
    for r in reqs:
        ids = torch.tensor([r["prompt"]], device=dev)
        kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        t0 = time.perf_counter()
        if r["adapter"] is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, **kwargs)
        else:
            model.set_adapter(r["adapter"])
            out = model.generate(input_ids=ids, **kwargs)
        elapsed = time.perf_counter() - t0
        n = out.shape[1] - ids.shape[1]
        generated += n
        ttft.append(elapsed / n)  # (a lower bound: generate does not report the first token)
        itl.append(elapsed / n)
    wall = time.perf_counter() - start
    prompt = sum(len(r["prompt"]) for r in reqs)
    model.unload()
    return dict(
        wall_s=wall,
        output_tok_s=generated / wall,
        total_tok_s=(generated + prompt) / wall,
        ttft_p50_ms=float("nan"),
        ttft_p90_ms=float("nan"),
        itl_p50_ms=1e3 * pct(itl, 0.5),
        itl_p90_ms=1e3 * pct(itl, 0.9),
        requests=len(reqs),
    )


def summary(m: dict) -> str:
    return json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()})


def main() -> None:
    args = parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_graph import LoRAConfig
    from lora_graph.architectures import LlamaPipeline
    from lora_graph.engine import LLMEngine
    from lora_graph.kernels.policy import KernelPolicy

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shapes = dict(SHAPES[args.shapes])
    if shapes != LLAMA3_8B:
        args.peft_requests = 0  # (one GPU cannot hold the transformers model)
    if args.smoke:
        shapes = dict(SMOKE)
        args.requests, args.prompt_len, args.output_len = min(args.requests, 8), [4, 40], 4
        args.max_batch_size, args.adapters, args.max_loras = 4, min(args.adapters, 3), 2
        # chunked prefill and a KV cache small enough to preempt
        args.max_num_batched_tokens, args.kv_cache_tokens = 16, 64
        args.compile = "none" if args.compile == "cudagraph" else args.compile
        args.peft_requests = min(args.peft_requests, 2)
        if math.isfinite(args.rate):
            args.rate = max(args.rate, 50.0)
        args.shared_len, args.per_group, args.conversations, args.turns = 16, 3, 3, 3
        args.user_len = 6
    longest = {
        "mixed": args.prompt_len[1],
        "shared-prefix": args.shared_len + args.prompt_len[1],
        "chat": args.prompt_len[0] + (args.turns - 1) * (args.user_len + args.output_len),
    }[args.workload]
    max_seq_len = args.max_seq_len or longest + args.output_len + 1
    shapes["max_position_embeddings"] = max(shapes["max_position_embeddings"], max_seq_len)
    work = Path(tempfile.mkdtemp(prefix="lora_graph_serve_"))
    hf_config = LlamaConfig(**shapes)
    hf_config.save_pretrained(work / "base")
    weights = RandomWeights(shapes, seed=args.seed)  # (made on each rank, its share kept)
    hf = None
    if args.peft_requests:  # the same weights
        with torch.device(device):
            hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
        hf.load_state_dict(dict(weights))
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_adapter(work / name, shapes, 16, seed=100 + i)
    policy = KernelPolicy()
    if args.side_stream_rows is not None:
        policy = KernelPolicy(side_stream_max_rows=args.side_stream_rows)
    reqs = workload(args, names, shapes["vocab_size"])
    mark_extras(args, reqs)
    first = [r for r in reqs if "prompt" in r]  # (a chat's later turns are built as it goes)
    mean = statistics.mean(len(r["prompt"]) for r in first)
    print(
        f"{args.workload}: {len(reqs)} requests, first prompts {mean:.0f} tokens on average,"
        f" {args.output_len} new tokens each, "
        f"{sum(r['adapter'] is None for r in reqs)} base, rate {args.rate}/s, {device}",
        flush=True,
    )
    common = dict(
        dtype=torch.bfloat16,
        device=device,
        max_batch_size=args.max_batch_size,
        max_seq_len=max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        weights=weights,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "runs": {},
    }

    def run(label: str, lora: LoRAConfig | None, base_only: bool) -> None:
        pipe = LlamaPipeline(str(work / "base"), lora=lora, **common)
        for name in names if lora is not None else []:
            pipe.manager.load_adapter(str(work / name), name=name)
        t0 = time.perf_counter()
        if args.compile != "none":
            pipe.enable_compile(args.compile, progress=False)
        capture = time.perf_counter() - t0
        engine = LLMEngine(pipe, async_scheduling=True)
        warm = [dict(r, id=f"warm{i}", arrival=0.0) for i, r in enumerate(first[:2])]
        serve(engine, warm, 2, base_only=base_only)  # first-call costs out of the numbers
        for caching in (True, False) if args.compare_prefix_caching else (True,):
            engine = LLMEngine(pipe, async_scheduling=True, enable_prefix_caching=caching)
            engine.reset_prefix_cache()  # (a cold cache: nothing of the runs before)
            m = serve(engine, reqs, args.output_len, base_only=base_only)
            m["capture_s"] = capture
            name = label if caching else f"{label} (no prefix cache)"
            results["runs"][name] = m
            print(f"{name}: {summary(m)}", flush=True)
        if lora is not None and (args.logprobs_share or args.json_share):
            engine = LLMEngine(pipe, async_scheduling=True)
            engine.reset_prefix_cache()
            grammar = json_grammar(shapes["vocab_size"]) if args.json_share else None
            n_lp = sum(r["logprobs"] for r in reqs)
            n_json = sum(r["json"] for r in reqs)
            m = serve(engine, reqs, args.output_len, base_only=False, extras=True, grammar=grammar)
            m["capture_s"] = capture
            label_x = f"{label} + logprobs:5 ({n_lp}) + JSON ({n_json})"
            results["runs"][label_x] = m
            print(f"{label_x}: {summary(m)}", flush=True)
        if args.compare_sync:
            engine = LLMEngine(pipe, async_scheduling=False)
            engine.reset_prefix_cache()
            m = serve(engine, reqs, args.output_len, base_only=base_only)
            m["capture_s"] = capture
            results["runs"][f"{label} (sync)"] = m
            print(f"{label} (sync): {summary(m)}", flush=True)
        pipe.close()  # (a tensor-parallel group: one a process)
        del engine, pipe
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if not args.skip_base:
        run("base", None, True)
    run("lora", LoRAConfig(max_slots=args.max_loras, max_rank=16, kernel_policy=policy), False)
    if hf is not None:
        sub = first[: args.peft_requests]
        m = serve_peft(hf, work, names, sub, args.output_len)
        results["runs"][f"peft ({len(sub)} req)"] = m
        print(f"peft: {summary(m)}", flush=True)

    print()
    print(
        "| run | requests | wall s | output tok/s | total tok/s | TTFT p50 ms | TTFT p90 ms | "
        "ITL p50 ms | ITL p90 ms | cached % | capture s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, m in results["runs"].items():
        cells = [label, m["requests"], f"{m['wall_s']:.2f}", f"{m['output_tok_s']:.0f}",
                 f"{m['total_tok_s']:.0f}", f"{m['ttft_p50_ms']:.0f}", f"{m['ttft_p90_ms']:.0f}",
                 f"{m['itl_p50_ms']:.1f}", f"{m['itl_p90_ms']:.1f}",
                 f"{100 * m.get('cached_tokens', 0) / m.get('prompt_tokens', 1):.1f}",
                 f"{m.get('capture_s', float('nan')):.1f}"]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    runs = results["runs"]
    if "base" in runs:
        ratio = runs["lora"]["wall_s"] / runs["base"]["wall_s"]
        print(f"\nLoRA mixed / base-only wall time: {ratio:.2f}")
    for label in ("base", "lora"):
        off = runs.get(f"{label} (no prefix cache)")
        if off is not None:
            on = runs[label]
            print(
                f"{label}: prefix cache off / on: wall {off['wall_s'] / on['wall_s']:.2f}, TTFT "
                f"p90 {off['ttft_p90_ms'] / on['ttft_p90_ms']:.2f}; on / off wall "
                f"{on['wall_s'] / off['wall_s']:.3f}"
            )
    extra = [k for k in results["runs"] if "logprobs:5" in k]
    if extra:
        lora, x = results["runs"]["lora"], results["runs"][extra[0]]
        print(
            f"with logprobs and JSON / without: wall {x['wall_s'] / lora['wall_s']:.3f}, the "
            f"plain requests' ITL p50 {x['plain_itl_p50_ms'] / lora['plain_itl_p50_ms']:.3f}, "
            f"TTFT p50 {x['plain_ttft_p50_ms'] / lora['plain_ttft_p50_ms']:.3f}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
