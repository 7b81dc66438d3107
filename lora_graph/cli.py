"""The ``lora-graph`` command: ``generate`` over a model and adapters, ``serve`` (an
OpenAI-compatible HTTP server), ``embed`` (sentence embeddings from an encoder), and
``demo``."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch

from lora_graph.config import package_version
from lora_graph.detokenize import completion_text
from lora_graph.engine import Request, RequestOutput, SamplingParams, check_text
from lora_graph.launch import CliError, build_engine, check_engine_args, engine_from_args
from lora_graph.request_files import (
    embed_entries,
    embed_row,
    output_json,
    parse_requests,
    read_request_lines,
)

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT (128 + 2)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15)


def _assets_dir() -> Path:
    for candidate in (
        Path.cwd() / "examples" / "assets",
        Path(__file__).resolve().parents[1] / "examples" / "assets",
    ):
        if (candidate / "base" / "config.json").is_file():
            return candidate
    raise CliError(
        "the bundled demo assets (examples/assets) were not found; run from the repository root"
    )


def _check_output(path: str | None) -> None:
    if path is None:
        return
    out = Path(path)
    if out.is_dir() or not out.parent.is_dir():
        why = "is a directory" if out.is_dir() else "its directory does not exist"
        raise CliError(f"--output {path}: {why}")
    existed = out.exists()
    try:
        with open(out, "a"):
            pass
    except OSError as e:
        raise CliError(f"--output {path}: cannot be written ({e.strerror or e})") from e
    if not existed:
        out.unlink()


def _check_sampling(defaults: SamplingParams) -> None:
    try:
        defaults.validate()
    except ValueError as e:
        raise CliError(
            str(e)
            .replace("max_new_tokens", "--max-new-tokens")
            .replace("temperature", "--temperature")
            .replace("top_k", "--top-k")
            .replace("top_p", "--top-p")
            .replace("seed must", "--seed must")
        ) from e


def cmd_generate(args: argparse.Namespace, stdout: TextIO) -> int:
    _check_output(args.output)
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise CliError(f"--seed must be an integer in [0, 2**64), got {args.seed}")
    _check_sampling(
        SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    )
    if args.adapter is not None and args.requests:
        raise CliError(
            "--adapter applies to --prompt; a requests file names each request's adapter"
        )
    if args.adapter is not None and args.adapter not in {
        spec.partition("=")[0] for spec in args.lora
    }:
        raise CliError(f"--adapter {args.adapter!r} is not one of the --lora names")
    if args.prompt is not None:
        try:
            check_text(args.prompt, "--prompt")
        except ValueError as e:
            raise CliError(str(e)) from None
    lines = read_request_lines(args.requests) if args.requests else []
    engine, tokenizer = engine_from_args(args)
    pipe = engine.pipeline
    if pipe.max_seq_len_from_model and (args.progress or pipe.max_seq_len_bounded):
        print(pipe.max_seq_len_note, file=sys.stderr)  # (a lowered context always said)
    defaults = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    if args.requests:
        entries = parse_requests(lines, tokenizer, defaults)
    else:
        if tokenizer is None:
            raise CliError("the model has no tokenizer; use --requests with prompt_token_ids")
        ids = tokenizer(args.prompt)["input_ids"]
        entries = [(Request("0", ids, args.adapter, defaults), "0", None)]
    if args.seed is not None:  # vLLM's --seed: the run's, one seed a request drawn from it
        draws = random.Random(args.seed)
        for r, _, error in entries:
            seed = draws.getrandbits(64)  # (drawn for every line: a line's seed is its own)
            if error is None and r.sampling.seed is None:
                r.sampling = replace(r.sampling, seed=seed)
    outputs = engine.generate(
        [r for r, _, error in entries if error is None], progress=args.progress
    )
    by_key = {o.id: o for o in outputs}
    results = []
    for r, out_id, error in entries:
        out = by_key[r.id] if error is None else RequestOutput(r.id, r.adapter, error=error)
        line = f"line {r.id.removeprefix('line-')}:"
        if out.error is not None and not out.error.startswith(line) and args.requests:
            out.error = f"{line} {out.error}"  # refused by the engine: name the line too
        out.id = out_id
        results.append(output_json(out, tokenizer, r, engine.eos_token_ids))
    if not args.requests and results[0].get("error") is not None:
        raise CliError(results[0]["error"])  # one prompt: its refusal is the command's
    _write_results("".join(json.dumps(result) + "\n" for result in results), args.output, stdout)
    return 0


def cmd_embed(args: argparse.Namespace, stdout: TextIO) -> int:
    """Sentence embeddings from an encoder (BERT), each text under its adapter."""
    _check_output(args.output)
    if args.adapter is not None and args.requests:
        raise CliError("--adapter applies to --text; a requests file names each line's adapter")
    if args.adapter is not None and args.adapter not in {s.partition("=")[0] for s in args.lora}:
        raise CliError(f"--adapter {args.adapter!r} is not one of the --lora names")
    lines = read_request_lines(args.requests) if args.requests else []
    if args.compile == "cudagraph":
        raise CliError("--compile cudagraph is not verified for encoders yet; use inductor")
    if args.kv_cache_tokens is not None:
        raise CliError("--kv-cache-tokens: an encoder has no KV cache")
    engine, tokenizer = engine_from_args(args, encoder=True)
    pipe = engine.pipeline
    known = set(engine.list_loras())
    limit, flag = min((pipe.max_seq_len, "--max-seq-len"),
                      (pipe.max_num_batched_tokens, "--max-num-batched-tokens"))  # fmt: skip

    def row(obj: dict[str, Any]) -> tuple[list[int], str | None]:
        return embed_row(obj, tokenizer, known, limit, flag, args.truncate, pipe.config.vocab_size)

    if args.requests:
        entries = embed_entries(lines, row)
    else:
        entries = []
        for i, text in enumerate(args.text):
            try:
                entries.append((i, row({"text": text, "adapter": args.adapter}), None))
            except ValueError as e:
                raise CliError(f"--text {i + 1}: {e}") from e
    good = [r for _, r, error in entries if error is None and r is not None]
    vectors = engine.embed(good).tolist() if good else []
    results, k = [], 0
    for out_id, r, error in entries:
        if error is not None or r is None:
            results.append({"id": out_id, "error": error})
            continue
        results.append({"id": out_id, "adapter": r[1], "embedding": vectors[k]})
        k += 1
    _write_results("".join(json.dumps(result) + "\n" for result in results), args.output, stdout)
    return 0


def _write_results(text: str, output: str | None, stdout: TextIO) -> None:
    """The results to ``output``, or to stdout if it is None or cannot be written."""
    if output is None:
        stdout.write(text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as e:
        stdout.write(text)
        raise CliError(
            f"--output {output}: cannot be written ({e.strerror or e}); the results went to stdout"
        ) from e


def _read_chat_template(path: str | None) -> str | None:
    """``serve --chat-template FILE``'s text (None without the flag).

    Raises:
        CliError: for a file that cannot be read as UTF-8, or is empty.
    """
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"--chat-template {path!r}: cannot read it ({e})") from e
    if not text.strip():
        raise CliError(f"--chat-template {path!r} is empty")
    return text


def cmd_serve(args: argparse.Namespace, stdout: TextIO) -> int:
    from lora_graph import server

    if not server.HAVE_SERVER_DEPS:
        raise CliError("serve needs fastapi, uvicorn and prometheus_client: "
                       "pip install 'lora_graph[serve]'")  # fmt: skip

    if args.allow_runtime_lora and not args.lora_root:
        raise CliError("--allow-runtime-lora needs at least one --lora-root DIR to load from")
    if args.lora_root and not args.allow_runtime_lora:  # (it would do nothing, unsaid)
        raise CliError("--lora-root is where runtime loads read from: give --allow-runtime-lora")
    for root in args.lora_root:
        if not os.path.isdir(root):
            raise CliError(f"--lora-root {root!r} is not a directory")
    if args.default_max_tokens < 1:
        raise CliError(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}")
    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in [1, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise CliError(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    if args.max_request_bytes < 1024:
        raise CliError(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    name = args.served_model_name or args.model
    if name in {spec.partition("=")[0] for spec in args.lora}:
        raise CliError(f"--lora {name!r}: the base model is served under that name")
    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key is empty (leave it out to serve without a key)")
    chat_template = _read_chat_template(args.chat_template)
    check_engine_args(args)
    # every flag is checked before the network is touched; the port before the model loads,
    # so a taken port fails at once (what needs the model, after it)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as e:
            raise CliError(f"--host {args.host} --port {args.port}: cannot bind ({e})") from e
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving on {args.host} without --api-key: anyone who can reach it may "
            "use it",
            file=sys.stderr,
        )
    engine, tokenizer = engine_from_args(args, enable_lora=args.allow_runtime_lora, encoder=None)
    if tokenizer is None:
        raise CliError(f"--model {args.model!r}: no tokenizer found; the server needs one")
    config = server.ServerConfig(
        model_name=name,
        api_key=args.api_key,
        allow_runtime_lora=args.allow_runtime_lora,
        lora_roots=list(args.lora_root),
        default_max_tokens=args.default_max_tokens,
        max_request_bytes=args.max_request_bytes,
        strict_fields=args.strict_fields,
        api_key_metrics=args.api_key_metrics,
        chat_template=chat_template,
    )
    app = server.create_app(engine, tokenizer, config)
    print(
        f"serving {config.model_name!r} and adapters {engine.list_loras()} "
        f"({engine.pipeline.max_seq_len_note}) on http://{args.host}:{args.port}/v1",
        file=stdout,
        flush=True,
    )
    server.run_server(app, host=args.host, port=args.port, grace=args.shutdown_timeout)
    return 0


def cmd_demo(args: argparse.Namespace, stdout: TextIO) -> int:
    _check_sampling(SamplingParams(max_new_tokens=args.max_new_tokens))
    assets = Path(args.assets) if args.assets else _assets_dir()
    if not (assets / "base" / "config.json").is_file() or not (assets / "adapters").is_dir():
        raise CliError(
            f"--assets {assets}: expected base/config.json and an adapters/ directory in it "
            "(examples/make_demo_assets.py builds them)"
        )
    adapters = sorted(
        p for p in (assets / "adapters").iterdir() if (p / "adapter_config.json").is_file()
    )
    engine, tokenizer = build_engine(
        str(assets / "base"),
        [f"{p.name}={p}" for p in adapters],
        max_loras=max(1, len(adapters)),
        max_lora_rank=64,
        dtype=args.dtype,
        device=args.device,
        max_batch_size=16,
        max_seq_len=256,
        compile_mode=args.compile,
    )
    names: list[str | None] = [None, *(p.name for p in adapters)]
    requests = []
    for i, prompt in enumerate(args.prompts):
        ids = tokenizer(prompt)["input_ids"]
        for name in names:
            requests.append(
                Request(
                    f"{i}:{name or 'base'}",
                    ids,
                    name,
                    SamplingParams(max_new_tokens=args.max_new_tokens),
                )
            )
    print(
        f"serving {len(requests)} requests in one batch: base + adapters "
        f"{', '.join(p.name for p in adapters)}",
        file=stdout,
    )
    start = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    for req, out in zip(requests, outputs, strict=True):
        ends = req.sampling.stop_tokens(engine.eos_token_ids)
        text = out.error or completion_text(tokenizer, req.prompt_token_ids, out.token_ids, ends)
        prompt = tokenizer.decode(req.prompt_token_ids, skip_special_tokens=True)
        print(f"[{req.adapter or 'base':>8}] {prompt!r} -> {text!r}", file=stdout)
    generated = sum(len(o.token_ids) for o in outputs)
    print(
        f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s "
        f"({engine.steps['prefill']} prefill + {engine.steps['decode']} decode steps, "
        f"{args.device})",
        file=stdout,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lora-graph", description="Serve one base model and many LoRA adapters in one batch."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default: float32)",
    )
    common.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="where to run (default: cuda if available, else cpu)",
    )
    common.add_argument(
        "--compile",
        default="none",
        choices=["none", "inductor", "cudagraph"],
        help="step execution: eager, torch.compile (inductor), or CUDA graphs over it "
        "(default: none)",
    )

    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument(
        "--model",
        required=True,
        help="Hugging Face model directory or repo id (Llama, Mistral, Qwen2, Qwen3, Phi-3, "
        "Gemma 2; BERT for embed)",
    )
    engine.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve an adapter under NAME: a PEFT directory, safetensors file or hub repo id "
        "(repeatable)",
    )
    engine.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="device slots: adapters resident at once (default: 4)",
    )
    engine.add_argument(
        "--max-lora-rank", type=int, default=64, help="largest adapter rank served (default: 64)"
    )
    engine.add_argument(
        "--max-batch-size",
        type=int,
        default=16,
        help="requests running at once, and in one step (default: 16)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens in one step: decodes plus prompt chunks; longer prompts are prefilled in "
        "chunks across steps while others decode (default: 2048, at least --max-batch-size)",
    )
    engine.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="token positions of the paged KV cache (default: on CUDA, what "
        "--gpu-memory-utilization leaves; elsewhere --max-batch-size x --max-seq-len); when "
        "it runs out, the newest request is preempted and recomputed later",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on CUDA, the fraction of device memory for weights, adapters, activations and "
        "the KV cache (default: 0.9)",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule each step while the device still runs the one before (the same "
        "outputs, the host's work hidden; default: on with CUDA, off on the CPU, where "
        "nothing runs in the background)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of a prompt's full pages computed for an earlier request "
        "under the same base model or adapter version (never across adapters, nor across a "
        "reload); the rest of the prompt is computed (default: on; "
        "--no-enable-prefix-caching turns it off)",
    )
    sharded = argparse.ArgumentParser(add_help=False)  # (a decoder's: not embed's)
    sharded.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="shard the model over this many GPUs of the host (cuda:0..N-1; on the CPU, N "
        "processes over gloo): tensor parallelism, as vLLM's flag; the worker processes are "
        "started here, adapters are sharded with their layers (default: one device, no "
        "process group; Llama-family models)",
    )
    engine.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="prompt + generated tokens per request (default: the model's context, "
        "max_position_embeddings, bounded by what the KV cache memory holds, said at start-up)",
    )
    gen = sub.add_parser(
        "generate",
        parents=[common, engine, sharded],
        help="generate for one prompt or a JSON-lines requests file",
        description="Generate text for one prompt or for a requests file, each request under its "
        "adapter, batched together.",
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (with --adapter to choose its adapter)")
    src.add_argument(
        "--requests",
        metavar="FILE.jsonl",
        help='one JSON object a line: {"id", "prompt" | "prompt_token_ids", "adapter", '
        '"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", '
        '"ignore_eos"}; other fields are refused',
    )
    gen.add_argument(
        "--adapter", default=None, help="adapter name for --prompt (default: the base model)"
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=32, help="default tokens to generate (default: 32)"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="default temperature; 0 is greedy (default: 0)",
    )
    gen.add_argument("--top-k", type=int, default=0, help="default top-k; 0 keeps all (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="default top-p (default: 1.0)")
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the run's seed, as vLLM's --seed: each request without a seed of its own gets "
        "one drawn from it in input order, so a run repeats exactly and equal prompts still "
        "sample differently (default: unseeded)",
    )
    gen.add_argument("--output", metavar="FILE.jsonl", help="write results here instead of stdout")
    gen.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar on stderr (default: shown while requests are served)",
    )
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser(
        "serve",
        parents=[common, engine, sharded],
        help="an OpenAI-compatible HTTP server (completions, chat, streaming, adapters)",
        description="Serve the model and its adapters over HTTP with OpenAI's API: "
        "POST /v1/completions and /v1/chat/completions (model = the base model's name or an "
        "adapter's), /v1/embeddings (an encoder), /v1/tokenize, /v1/detokenize; GET /v1/models, "
        "/v1/models/{id}, /version, /health, /metrics; POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter with --allow-runtime-lora. Which request fields are served, "
        "accepted at their no-op value only, or refused: the README's table. Needs the serve "
        "extra: "
        "pip install 'lora_graph[serve]'.",
    )
    srv.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)"
    )
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    srv.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests give the base model in 'model' (default: --model as given)",
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get("LORA_GRAPH_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $LORA_GRAPH_API_KEY; none: anyone who can reach the port may use it)",
    )
    srv.add_argument(
        "--api-key-metrics",
        action="store_true",
        help="/metrics needs the API key too (default: open to anyone who can reach the port, "
        "as vLLM's)",
    )
    srv.add_argument(
        "--strict-fields",
        action="store_true",
        help="answer 400 'unknown field' to a request field the server does not know (default: "
        "ignore it and log its name once, as vLLM does)",
    )
    srv.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template to use instead of the tokenizer's (a model without one then "
        "serves /v1/chat/completions)",
    )
    srv.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default); "
        "runtime adapters are not bounded by --max-loras (that is the device slots)",
    )
    srv.add_argument(
        "--lora-root",
        action="append",
        default=[],
        metavar="DIR",
        help="directory runtime loads may read adapters from (repeatable; required with "
        "--allow-runtime-lora)",
    )
    srv.add_argument(
        "--default-max-tokens",
        type=int,
        default=16,
        help="max_tokens of a completions request that gives none (default: 16, as OpenAI's; "
        "a chat request without one may run to the end of the context, as OpenAI's and vLLM's)",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 << 20,
        help="larger request bodies are refused with 413, before they are read when their "
        "Content-Length says so (default: 8 MiB)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGTERM / Ctrl-C; then they are "
        "cut off (finish_reason 'abort'); a second signal cuts them off at once (default: 10)",
    )
    srv.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar while the CUDA graphs are captured at start-up (--compile)",
    )
    srv.set_defaults(func=cmd_serve)

    emb = sub.add_parser(
        "embed",
        parents=[common, engine],
        help="sentence embeddings from an encoder (BERT), each text under its adapter",
        description="Mean-pooled, L2-normalised sentence embeddings (as sentence-transformers' "
        "all-MiniLM-L6-v2 computes them) of texts, each under its adapter, batched together. "
        'One JSON line a text: {"id", "adapter", "embedding"} or {"id", "error"}.',
    )
    esrc = emb.add_mutually_exclusive_group(required=True)
    esrc.add_argument("--text", action="append", help="a text to embed (repeatable)")
    esrc.add_argument(
        "--requests",
        metavar="FILE.jsonl",
        help='one JSON object a line: {"id", "text" | "input_ids", "adapter"}',
    )
    emb.add_argument("--adapter", default=None, help="adapter for --text (default: the base model)")
    emb.add_argument(
        "--truncate",
        action="store_true",
        help="cut texts longer than --max-seq-len (keeping the closing special token), as "
        "sentence-transformers does at its max_seq_length (default: refuse them); "
        "all-MiniLM-L6-v2's is 256: --max-seq-len 256 --truncate embeds as it does",
    )
    emb.add_argument("--output", metavar="FILE.jsonl", help="write results here instead of stdout")
    emb.set_defaults(func=cmd_embed, progress=False)

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="one mixed batch on the bundled demo model and adapters",
        description="Run the base model and every bundled adapter, interleaved in one batch, and "
        "print the outputs.",
    )
    demo.add_argument("--assets", default=None, help="assets directory (default: examples/assets)")
    demo.add_argument(
        "--max-new-tokens", type=int, default=24, help="tokens per request (default: 24)"
    )
    demo.add_argument(
        "--prompts",
        nargs="+",
        default=["Once upon a time", "The little dog"],
        help="prompts to run",
    )
    demo.set_defaults(func=cmd_demo)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread (as vLLM's command line does), so a command ends
    through :func:`main`'s cleanup: a tensor-parallel run's workers stopped, not orphaned."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated


def main(argv: list[str] | None = None, stdout: TextIO | None = None) -> int:
    """Entry point of ``lora-graph``; returns the exit status (130 after Ctrl-C, 143 after
    SIGTERM, each once the command has stopped: the server's requests in flight finished
    or aborted first, ``--shutdown-timeout``)."""
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return EXIT_BAD_INPUT
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.func(args, stdout or sys.stdout)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Terminated:  # (the server re-raises it after its graceful shutdown)
        return EXIT_TERMINATED
    except KeyboardInterrupt:  # Ctrl-C (the same)
        return EXIT_INTERRUPTED
    finally:
        from lora_graph.distributed import shutdown

        if previous is not None:  # (a second SIGTERM during the cleanup ends the process)
            signal.signal(signal.SIGTERM, previous)
        shutdown()  # (a tensor-parallel run's workers)


if __name__ == "__main__":
    sys.exit(main())
