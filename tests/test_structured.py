"""Structured output (``lora_graph/grammar.py``, xgrammar): 200 seeded requests over 10
JSON schemas and 5 regexes, mixed with free rows, under the demo model's adapters and base:
every constrained output parses and validates, and the free rows are what they are
without the constrained ones beside them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from lora_graph.engine import Request, SamplingParams  # noqa: E402
from lora_graph.grammar import GrammarCompiler, GrammarError  # noqa: E402
from lora_graph.launch import build_engine  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "examples" / "assets"
ADAPTERS = (None, "pirate", "shout", "numbers")
WORD = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },  # fmt: skip
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },  # fmt: skip
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 3,
    },  # fmt: skip
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": WORD, "maxItems": 2}},
        "required": ["tags"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
        },
        "required": ["a"],
    },  # fmt: skip
    {"type": "string", "maxLength": 6},
    {"enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},
            "y": {"type": "null"},
        },
        "required": ["x", "y"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"}},
        "required": ["id"],
    },  # fmt: skip
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no)", r"[a-z]{2,6}@[a-z]{2,5}\.com", r"\(\d{1,3}, \d{1,3}\)",
           r"[A-Z][a-z]{1,8}"]  # fmt: skip


@pytest.fixture(scope="module")
def served():
    engine, tokenizer = build_engine(
        str(ASSETS / "base"), [f"{a}={ASSETS / 'adapters' / a}" for a in ADAPTERS if a],
        max_loras=4, max_lora_rank=64, dtype="float32", device="cpu", max_batch_size=32,
        max_seq_len=160, max_num_batched_tokens=256, progress=False,
    )  # fmt: skip
    compiler = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    return engine, tokenizer, compiler


def test_200_constrained_requests_parse_validate_and_leave_free_rows_alone(served):
    check_200(*served)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graphs_200_constrained_requests():
    """The same on CUDA, captured graphs, asynchronous scheduling, float32."""
    engine, tokenizer = build_engine(
        str(ASSETS / "base"), [f"{a}={ASSETS / 'adapters' / a}" for a in ADAPTERS if a],
        max_loras=4, max_lora_rank=64, dtype="float32", device="cuda", max_batch_size=32,
        max_seq_len=160, max_num_batched_tokens=256, compile_mode="cudagraph", progress=False,
    )  # fmt: skip
    compiler = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    check_200(engine, tokenizer, compiler)


def check_200(engine, tokenizer, compiler) -> None:
    grammars = [("schema", s, compiler.json_schema(s)) for s in SCHEMAS]
    grammars += [("regex", r, compiler.regex(r)) for r in REGEXES]
    prompts = ["Once upon a time", "The little dog", "Answer in JSON:", "Tell me"]
    reqs, kinds = [], []
    for i in range(200):
        kind, spec, grammar = grammars[i % len(grammars)] if i % 4 else ("free", None, None)
        ids = tokenizer(prompts[i % len(prompts)])["input_ids"]
        s = SamplingParams(64, temperature=1.0 if i % 3 else 0.0, seed=i, grammar=grammar)
        reqs.append(Request(f"r{i}", ids, ADAPTERS[i % len(ADAPTERS)], s))
        kinds.append((kind, spec))
    outs = engine.generate(reqs)
    for (kind, spec), out in zip(kinds, outs, strict=True):
        assert out.error is None, out.error
        if kind == "free":
            continue
        assert out.finish_reason == "stop", (spec, out.token_ids)  # the grammar ended it
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        if kind == "schema":
            jsonschema.validate(json.loads(text), spec)
        else:
            assert re.fullmatch(spec, text), (spec, text)
    free = [r for r, (k, _) in zip(reqs, kinds, strict=True) if k == "free"]
    alone = engine.generate([Request(r.id + "a", r.prompt_token_ids, r.adapter, r.sampling)
                             for r in free])  # fmt: skip
    got = [o.token_ids for o, (k, _) in zip(outs, kinds, strict=True) if k == "free"]
    assert got == [o.token_ids for o in alone]


def test_json_object_choice_and_ebnf(served):
    engine, tokenizer, compiler = served
    ids = tokenizer("The little dog")["input_ids"]
    # (a character past U+FFFF: JSON's escape of it, two surrogates, forced 6 bytes of U+FFFD)
    cases = [(compiler.choice(["left", "right"]), lambda t: t in ("left", "right")),
             (compiler.choice(["yes 😀", "no 🎉"]), lambda t: t in ("yes 😀", "no 🎉")),
             (compiler.ebnf('root ::= "a" ("b" | "c")'), lambda t: t in ("ab", "ac"))]  # fmt: skip
    for i, (grammar, ok) in enumerate(cases):
        out = engine.generate(
            [Request(f"g{i}", ids, "pirate", SamplingParams(48, grammar=grammar))]
        )
        text = tokenizer.decode(out[0].token_ids, skip_special_tokens=True)
        assert out[0].finish_reason == "stop" and ok(text), text
    # any JSON object: its keys are free strings, which this tiny model may not close in 48
    # tokens; what it wrote is then a prefix the grammar accepts, else a whole object
    grammar = compiler.json()
    out = engine.generate([Request("j", ids, "pirate", SamplingParams(48, grammar=grammar))])[0]
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
        matcher = grammar.matcher()
        assert all(matcher.accept_token(t) for t in out.token_ids)


def test_constrained_requests_survive_preemption(served):
    """A KV cache of 96 positions for 8 requests of up to 40 tokens: requests are
    preempted and recomputed; their grammars (matchers advanced by the tokens read) still
    hold every output to its schema."""
    _, tokenizer, compiler = served
    engine, _ = build_engine(
        str(ASSETS / "base"), [f"{a}={ASSETS / 'adapters' / a}" for a in ADAPTERS if a],
        max_loras=4, max_lora_rank=64, dtype="float32", device="cpu", max_batch_size=8,
        max_seq_len=48, max_num_batched_tokens=32, kv_cache_tokens=96, progress=False,
    )  # fmt: skip
    grammar = compiler.json_schema(SCHEMAS[0])
    ids = tokenizer("Answer in JSON:")["input_ids"]
    reqs = [Request(f"p{i}", ids, ADAPTERS[i % 4], SamplingParams(40, temperature=1.0,
                    seed=i, grammar=grammar)) for i in range(8)]  # fmt: skip
    outs = engine.generate(reqs)
    assert engine.preemptions > 0
    for out in outs:
        assert out.error is None and out.finish_reason == "stop", out
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids, skip_special_tokens=True)),
                            SCHEMAS[0])  # fmt: skip


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda c: c.json_schema("{not json"), "the json schema cannot be compiled: Failed to"),
        (lambda c: c.json_schema({"type": "bogus"}), 'Unsupported type "bogus"'),
        (lambda c: c.regex("(open"), "the regex cannot be compiled: Regex parsing error"),
        (lambda c: c.choice([]), "the choices must be a non-empty list"),
    ],
)
def test_a_grammar_the_library_refuses_is_named(served, make, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        make(served[2])
