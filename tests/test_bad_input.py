"""Bad input never takes down a run and is never served wrong: each kind through the CLI,
where a user meets it, and a bounded, seeded fuzz of requests files and adapter configs.

A bad request gets one ``{"id", "error"}`` line and every good request in the same run is
served with the tokens peft gives it alone; a bad adapter or flag stops the command at
start-up with exit status 2 and one line on stderr, no traceback.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
import shutil

import numpy as np
import pytest
import torch
from conftest import make_pipeline, prompts
from safetensors.torch import load_file, save_file

from lora_graph.cli import main
from lora_graph.config import AdapterError
from lora_graph.engine import LLMEngine, Request, SamplingParams, sample
from lora_graph.request_files import REQUEST_FIELDS


def _run(tiny, argv_extra, *, loras=("A", "B"), stdout=None):
    argv = ["generate", "--model", str(tiny.base), "--device", "cpu", "--no-progress", *argv_extra]
    for name in loras:
        argv += ["--lora", f"{name}={tiny.adapters[name]}"]
    return main(argv, stdout=stdout or io.StringIO())


def _good_requests():
    ids = prompts(3, seed=61)
    return [
        {"id": f"g{i}", "prompt_token_ids": p, "adapter": a, "max_new_tokens": 6}
        for i, (p, a) in enumerate(zip(ids, ["A", None, "B"], strict=True))
    ]


def _check_good(results, ref):
    for req in _good_requests():
        out = results[req["id"]]
        want = ref.greedy(req["prompt_token_ids"], req["adapter"], 6)
        assert out["token_ids"] == want[: len(out["token_ids"])], req["id"]
        assert len(out["token_ids"]) == 6 or out["token_ids"][-1] == 2  # EOS (2) may end it early


def _serve_file(tiny, tmp_path, content: bytes, extra=()):
    path = tmp_path / "requests.jsonl"
    path.write_bytes(content)
    out = io.StringIO()
    assert _run(tiny, ["--requests", str(path), *extra], stdout=out) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


BAD_REQUESTS = [
    ({"seed": "abc", "temperature": 1.0}, "seed must be an integer"),
    ({"seed": 1.5, "temperature": 1.0}, "seed must be an integer"),
    ({"seed": 2**70, "temperature": 1.0}, "seed must be an integer in [0, 2**64)"),
    ({"seed": -2, "temperature": 1.0}, "seed must be an integer in [0, 2**64)"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"temperature": 1e-45}, "is below 0.01"),
    ({"temperature": True}, "temperature must be a finite number"),
    ({"temperature": "1"}, "temperature must be a finite number"),
    ({"top_p": math.nan, "temperature": 1.0}, "top_p must be a number in (0, 1]"),
    ({"top_p": True, "temperature": 1.0}, "top_p must be a number in (0, 1]"),
    ({"top_k": -2, "temperature": 1.0}, "top_k must be an integer >= 0 (or -1: all)"),
    ({"prompt": "hello"}, "either 'prompt' or 'prompt_token_ids', not both"),
    ({"adapter": "nope"}, "unknown adapter 'nope'"),
    ({"prompt_token_ids": [5] * 200}, "at most 127 fit"),
    ({"temperature": 10**400}, "temperature must be a finite number"),
    ({"top_p": 10**400, "temperature": 1.0}, "top_p must be a number in (0, 1]"),
    ({"prompt": "\ud800 hi", "prompt_token_ids": None}, "either 'prompt' or 'prompt_token_ids'"),
]


def test_bad_request_values_are_error_lines_and_the_rest_are_served(
    tiny, tmp_path, reference_factory
):
    ref = reference_factory(tiny)
    lines = [json.dumps(r) for r in _good_requests()]
    for k, (fields, _) in enumerate(BAD_REQUESTS):
        lines.insert(
            1 + k % 3, json.dumps({"id": f"bad{k}", "prompt_token_ids": [5, 6, 7], **fields})
        )
    # valid extremes sample without failing
    lines.append(
        json.dumps(
            {"id": "tiny_top_p", "prompt_token_ids": [5, 6], "temperature": 1.0, "top_p": 1e-46,
             "seed": 1, "max_new_tokens": 2}
        )
    )  # fmt: skip
    lines.append(
        json.dumps(
            {
                "id": "hot",
                "prompt_token_ids": [5, 6],
                "temperature": 0.01,
                "top_p": 1e-9,
                "seed": 2**64 - 1,
                "top_k": 10**9,
                "max_new_tokens": 3,
            }
        )
    )
    results = {r["id"]: r for r in _serve_file(tiny, tmp_path, "\n".join(lines).encode())}
    line_of = {json.loads(line)["id"]: n for n, line in enumerate(lines, 1)}
    for k, (_, message) in enumerate(BAD_REQUESTS):
        error = results[f"bad{k}"]["error"]
        assert message in error and error.startswith(f"line {line_of[f'bad{k}']}: "), error
    assert len(results["hot"]["token_ids"]) == 3
    assert len(results["tiny_top_p"]["token_ids"]) == 2  # top_p rounds to 0 in float32: argmax
    _check_good(results, ref)


def test_requests_file_encoding(tiny, tmp_path, reference_factory):
    """A byte that is not UTF-8 fails its own line; a UTF-8 byte-order mark is skipped;
    U+2028 inside a JSON string does not split the line."""
    ref = reference_factory(tiny)
    good = [json.dumps(r).encode() for r in _good_requests()]
    lines = [
        b"\xef\xbb\xbf" + good[0],
        b'{"id": "latin1", "prompt_token_ids": [5, 6], "adapter": "caf\xe9"}',
        good[1],
        json.dumps(
            {
                "id": "sep",
                "prompt_token_ids": [5, 6],
                "max_new_tokens": 2,
                "adapter": None,
                "ignore_eos": True,
            },
            ensure_ascii=False,
        )
        .replace('"ignore_eos"', '"\u2028ignore_eos"')
        .encode(),
        good[2],
    ]
    results = _serve_file(tiny, tmp_path, b"\n".join(lines))
    by_id = {r["id"]: r for r in results}
    assert by_id["line-2"]["error"] == "line 2: not valid UTF-8 (byte 0xe9 at column 61)"
    assert (
        "line 4: unknown field '\\u2028ignore_eos'" in by_id["sep"]["error"]
    )  # one line, not split at U+2028
    assert len(results) == 5
    _check_good(by_id, ref)


def test_finish_reason_says_why_a_request_ended(tiny, tmp_path, reference_factory):
    ref = reference_factory(tiny)
    ids = prompts(1, seed=62)[0]
    greedy = ref.greedy(ids, "A", 8)
    requests = [
        {
            "id": "len",
            "prompt_token_ids": ids,
            "adapter": "A",
            "max_new_tokens": 3,
            "ignore_eos": True,
        },
        {
            "id": "stop",
            "prompt_token_ids": ids,
            "adapter": "A",
            "max_new_tokens": 8,
            "stop_token_ids": [greedy[1]],
            "ignore_eos": True,
        },
        {
            "id": "row",
            "prompt_token_ids": ids,
            "adapter": "A",
            "max_new_tokens": 100,
            "ignore_eos": True,
        },
    ]
    results = {
        r["id"]: r
        for r in _serve_file(
            tiny,
            tmp_path,
            "\n".join(map(json.dumps, requests)).encode(),
            extra=["--max-seq-len", str(len(ids) + 5)],
        )
    }
    assert results["len"]["finish_reason"] == "length" and len(results["len"]["token_ids"]) == 3
    assert (
        results["stop"]["finish_reason"] == "stop" and results["stop"]["token_ids"][-1] == greedy[1]
    )
    assert (
        results["row"]["finish_reason"] == "length" and len(results["row"]["token_ids"]) == 5
    )  # the KV row's end


def test_single_prompt_refused_exits_2(tiny, capsys):
    assert _run(tiny, ["--prompt", "hi", "--adapter", "Z"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --adapter 'Z' is not one of the --lora names"
    assert _run(tiny, ["--prompt", "hi", "--adapter", "A", "--temperature", "nan"]) == 2
    assert "--temperature must be a finite number" in capsys.readouterr().err
    # undecodable bytes on the command line (Python keeps them as lone surrogates): one line,
    # exit 2 (it was a tokenizer's TypeError traceback)
    assert _run(tiny, ["--prompt", "caf\udce9"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --prompt is not valid Unicode text (surrogates not allowed at 3)"


def test_progress_bar_on_stderr(tiny, tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(map(json.dumps, _good_requests())))
    argv = ["generate", "--model", str(tiny.base), "--device", "cpu", "--requests", str(path)]
    assert main(argv, stdout=io.StringIO()) == 0
    err = capsys.readouterr().err
    assert "requests" in err and "3/3" in err


def test_requests_file_problems_say_what(tiny, tmp_path, capsys):
    """A file with no requests, a UTF-16 file, --adapter beside --requests, an output that
    cannot be written: one line, exit 2; a prompt with a lone surrogate fails its own line;
    an id-less line whose automatic id another request took is still served."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes('{"prompt": "hi"}'.encode("utf-16"))
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"id": "line-2", "prompt_token_ids": [5, 6], "max_new_tokens": 2}) + "\n"
        + json.dumps({"prompt_token_ids": [5, 7], "max_new_tokens": 2}) + "\n"
        + json.dumps({"id": "s", "prompt": "\ud800 hi"}, ensure_ascii=True) + "\n"
    )  # fmt: skip
    cases = [
        (["--requests", str(empty)], "no requests in the file"),
        (["--requests", str(utf16)], "the file is UTF-16; save it as UTF-8"),
        (["--requests", str(good), "--adapter", "A"], "--adapter applies to --prompt"),
        (
            ["--requests", str(good), "--output", "/proc/version"],
            "--output /proc/version: cannot be written",
        ),
    ]
    for extra, message in cases:
        assert _run(tiny, extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    out = io.StringIO()
    assert _run(tiny, ["--requests", str(good), "--output", "/dev/full"], stdout=out) == 2
    assert "the results went to stdout" in capsys.readouterr().err
    results = [json.loads(line) for line in out.getvalue().splitlines()]
    # the id-less line 2 does not take the name another line gave its request
    assert [r["id"] for r in results] == ["line-2", "line-2-noid", "s"]
    assert len(results[0]["token_ids"]) == 2 and len(results[1]["token_ids"]) == 2
    assert "line 3: prompt is not valid Unicode text" in results[2]["error"]


def test_model_whose_config_does_not_fit_its_weights(tiny, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny.base, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    argv = ["generate", "--model", str(model), "--device", "cpu", "--prompt", "hi"]
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the checkpoint does not fit config.json" in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("lora-graph ")


def test_size_typo_says_what_fits(tiny, capsys):
    assert _run(tiny, ["--prompt", "hi", "--max-batch-size", "1000000000"], loras=()) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "(--max-batch-size 1000000000 x --max-seq-len 128, or --kv-cache-tokens) needs" in err
    assert "GiB is free on cpu; at most --kv-cache-tokens" in err
    # a KV cache too small for one request of --max-seq-len would strand a long request
    argv = ["--prompt", "hi", "--kv-cache-tokens", "16", "--max-seq-len", "128"]
    assert _run(tiny, argv, loras=()) == 2
    assert "cannot hold one request of --max-seq-len 128" in capsys.readouterr().err


def test_default_max_seq_len_is_the_context_bounded_by_the_kv_cache(tiny, tmp_path, capsys):
    """Without --max-seq-len a request may use the model's whole context (128 here), unless
    the KV cache holds less (then its size: one request must always fit)."""
    from lora_graph.launch import build_engine

    kw = dict(max_loras=1, max_lora_rank=8, dtype="float32", device="cpu", max_batch_size=2,
              max_seq_len=None, progress=False)  # fmt: skip
    engine, _ = build_engine(str(tiny.base), [], **kw)
    assert engine.max_seq_len == 128
    assert engine.pipeline.max_seq_len_note == "max_seq_len 128 (the model's context)"
    engine, _ = build_engine(str(tiny.base), [], kv_cache_tokens=40, **kw)
    assert engine.max_seq_len == 48  # 40 positions are 3 pages of 16
    note = engine.pipeline.max_seq_len_note
    assert "the model's context 128 bounded by kv_cache_tokens 40;" in note
    # the Python pipeline's default too (it was 512: a model of a shorter context refused)
    from lora_graph.architectures import LlamaPipeline

    assert LlamaPipeline(str(tiny.base)).max_seq_len == 128
    # a lowered context is said even without the progress bar (requests ended early, unsaid)
    line = json.dumps({"id": "r", "prompt_token_ids": [5, 6], "max_new_tokens": 2})
    _serve_file(tiny, tmp_path, line.encode(), ["--kv-cache-tokens", "40"])
    assert "max_seq_len 48 (the model's context 128 bounded by" in capsys.readouterr().err
    # the start-up line still names the tensor-parallel size (a group of one rank here)
    engine, _ = build_engine(str(tiny.base), [], kv_cache_tokens=40, tensor_parallel_size=1,
                             **kw)  # fmt: skip
    try:
        assert engine.max_seq_len == 48
        assert engine.pipeline.max_seq_len_note.endswith("to choose), tensor parallel size 1")
    finally:
        engine.pipeline.close()


# ---- adapters ------------------------------------------------------------------------
def _adapter_with_config(tiny, tmp_path, text: bytes | None, name="bad"):
    path = tmp_path / name
    path.mkdir()
    shutil.copy(tiny.adapters["A"] / "adapter_model.safetensors", path)
    if text is not None:
        (path / "adapter_config.json").write_bytes(text)
    return path


def _config_a(tiny) -> dict:
    return json.loads((tiny.adapters["A"] / "adapter_config.json").read_text())


BAD_CONFIGS = [
    (b"[1, 2]", "expected a JSON object of PEFT's LoraConfig fields, got a list"),
    (b'"lora"', "got a string"),
    (b"{}", "field 'peft_type' is missing"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (b"{not json", "not valid JSON"),
    (None, "no adapter_config.json in the adapter directory"),
    ({"r": "abc"}, "field 'r' must be a positive integer, got 'abc'"),
    ({"r": 8.0}, "field 'r' must be a positive integer"),
    ({"rank_pattern": [1, 2]}, "field 'rank_pattern' must be an object of positive integers"),
    (
        {"alpha_pattern": {"q_proj": "x"}},
        "field 'alpha_pattern' must be an object of finite numbers",
    ),
    (
        {"rank_pattern": {"(": 8}},
        "field 'rank_pattern' has key '(', not a valid regular expression",
    ),
    ({"lora_alpha": None}, "field 'lora_alpha' must be a finite number, got None"),
    ({"lora_alpha": math.nan}, "field 'lora_alpha' must be a finite number"),
    ({"use_rslora": "yes"}, "field 'use_rslora' must be true or false"),
    ({"target_modules": 5}, "field 'target_modules' must be a string, a list of strings or null"),
    (
        {"target_modules": ["q_proj"]},
        "module model.layers.0.mlp.down_proj has LoRA weights, but adapter_config.json's "
        "target_modules ['q_proj'] does not select it",
    ),
    (
        {"layers_to_transform": [1]},
        "module model.layers.0.mlp.down_proj has LoRA weights, but adapter_config.json's "
        "layers_to_transform [1] leaves out its layer 0",
    ),
    (  # the field that leaves a module out is the one named (it was always target_modules)
        {"exclude_modules": ["down_proj"]},
        "module model.layers.0.mlp.down_proj has LoRA weights, but adapter_config.json's "
        "exclude_modules ['down_proj'] excludes it",
    ),
    (
        {"layers_to_transform": 1, "layers_pattern": "layers"},
        "layers_to_transform 1 (layers_pattern 'layers') leaves out its layer 0",
    ),
    ({"peft_type": "lora"}, "peft_type 'lora' is not LoRA"),
    # another PEFT method is named as such (it was "field 'target_modules' is missing")
    ({"peft_type": "PROMPT_TUNING", "target_modules": None}, "'PROMPT_TUNING' is not LoRA"),
    ({"lora_alpha": 10**400}, "field 'lora_alpha' must be a finite number"),
    ({"target_modules": None}, "field 'target_modules' is missing or null"),
    ({"task_type": "BOGUS"}, "field 'task_type' must be null or one of"),
    (
        {"layers_to_transform": [0], "layers_pattern": "(?P<idx>layers)"},
        "field 'layers_pattern' holds",
    ),
    ({"r": 4}, "has rank-8 tensors (lora_A [8, 96]) but adapter_config.json's r is 4"),
]


def _config_bytes(tiny, change) -> bytes | None:
    if change is None or isinstance(change, bytes):
        return change
    return json.dumps({**_config_a(tiny), **change}).encode()


@pytest.mark.parametrize("change, message", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_bad_adapter_config_is_refused_naming_file_and_field(
    tiny, tmp_path, change, message, capsys
):
    path = _adapter_with_config(tiny, tmp_path, _config_bytes(tiny, change))
    pipe = make_pipeline(tiny, load=())
    with pytest.raises(AdapterError) as e:
        pipe.manager.check_adapter(str(path), name="bad")
    assert message in str(e.value)
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--lora",
        f"bad={path}",
        "--prompt",
        "hi",
    ]
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err
    assert "'bad'" in err or str(path) in err


def test_config_without_r_says_peft_default_applied(tiny, tmp_path):
    """No ``r`` in the config of rank-4 tensors: the refusal says r is missing and PEFT's
    default (8) applies, not that the file says 8."""
    cfg = json.loads((tiny.adapters["B"] / "adapter_config.json").read_text())
    del cfg["r"]
    path = tmp_path / "no_r"
    path.mkdir()
    shutil.copy(tiny.adapters["B"] / "adapter_model.safetensors", path)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    pipe = make_pipeline(tiny, load=())
    with pytest.raises(AdapterError, match=r"rank-4 tensors .* r is missing \(PEFT's default: 8\)"):
        pipe.manager.check_adapter(str(path), name="no_r")


Q = "base_model.model.model.layers.0.self_attn.q_proj"
BAD_TENSORS = [
    (lambda w: {k.removeprefix("base_model.model."): v for k, v in w.items()},
     "lacks PEFT's 'base_model.model.' prefix"),
    (lambda w: {k.replace(".model.model.", ".model.vision_tower.model."): v for k, v in w.items()},
     "is outside the served targets"),
    (lambda w: {k.replace(".weight", ".foo.weight"): v for k, v in w.items()},
     "belongs to an adapter named 'foo'"),
    (lambda w: {**w, f"{Q}.lora_A.other.weight": torch.zeros(8, 64),
                f"{Q}.lora_B.other.weight": torch.zeros(64, 8)},
     "belongs to an adapter named 'other'"),
    (lambda w: {**w, f"{Q}.lora_A.default.weight": w[f"{Q}.lora_A.weight"].clone()},
     f"{Q[17:]} has two lora_A tensors"),
    (lambda w: {**w, f"{Q}.lora_A.weight": torch.zeros(0, 64),
                f"{Q}.lora_B.weight": torch.zeros(64, 0)},
     "has rank-0 tensors"),
]  # fmt: skip


@pytest.mark.parametrize("mutate, message", BAD_TENSORS, ids=[m for _, m in BAD_TENSORS])
def test_adapter_tensors_peft_would_not_load_as_we_would_are_refused(
    tiny, tmp_path, mutate, message, capsys
):
    """Keys PEFT would load differently (another adapter's name, no or a foreign prefix, two
    copies of one module) or not at all: refused, never served approximately."""
    path = tmp_path / "bad"
    path.mkdir()
    shutil.copy(tiny.adapters["A"] / "adapter_config.json", path)
    weights = load_file(str(tiny.adapters["A"] / "adapter_model.safetensors"))
    save_file(mutate(weights), str(path / "adapter_model.safetensors"))
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--lora",
        f"bad={path}",
        "--prompt",
        "hi",
    ]
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "'bad'" in err, err


def test_bin_that_is_not_a_state_dict(tiny, tmp_path):
    pipe = make_pipeline(tiny, load=())
    for i, obj in enumerate(({"a": 1}, [torch.zeros(1)], {"k": [torch.zeros(1)]})):
        path = tmp_path / f"bin{i}"
        path.mkdir()
        shutil.copy(tiny.adapters["A"] / "adapter_config.json", path)
        torch.save(obj, path / "adapter_model.bin")
        with pytest.raises(AdapterError, match="not a state dict"):
            pipe.manager.load_adapter(str(path), name=f"b{i}")


def test_adapter_config_given_as_the_path(tiny, capsys):
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--prompt",
        "hi",
        "--lora",
        f"x={tiny.adapters['A'] / 'adapter_config.json'}",
    ]
    assert main(argv, stdout=io.StringIO()) == 2
    assert (
        "this is the adapter's config; give the adapter directory that holds it"
        in capsys.readouterr().err
    )


def test_bare_file_without_config_is_served_with_scale_1(tiny, tmp_path):
    """A bare safetensors file with no adapter_config.json beside it: B is taken as already
    scaled (scale 1). Folding adapter A's scale into B by hand gives adapter A's output."""
    pipe = make_pipeline(tiny, load=("A",))
    scale = _config_a(tiny)["lora_alpha"] / _config_a(tiny)["r"]
    weights = {
        k: v * scale if "lora_B" in k else v
        for k, v in load_file(str(tiny.adapters["A"] / "adapter_model.safetensors")).items()
    }
    bare = tmp_path / "scaled.safetensors"
    save_file(weights, str(bare))
    pipe.manager.load_adapter(str(bare), name="bare")
    from test_parity import run_prefill

    batch = prompts(1, seed=63)
    torch.testing.assert_close(
        run_prefill(pipe, batch, ["bare"])[0], run_prefill(pipe, batch, ["A"])[0]
    )


def test_model_with_bin_weights_only(tiny, tmp_path, reference_factory):
    model_dir = tmp_path / "bin_model"
    shutil.copytree(tiny.base, model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    torch.save(state, model_dir / "pytorch_model.bin")
    out = io.StringIO()
    ids = prompts(1, seed=64)[0]
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"id": "x", "prompt_token_ids": ids, "max_new_tokens": 5, "ignore_eos": True})
    )
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--no-progress",
        "--requests",
        str(path),
    ]
    assert main(argv, stdout=out) == 0
    assert json.loads(out.getvalue())["token_ids"] == reference_factory(tiny).greedy(ids, None, 5)


@pytest.mark.parametrize("kept", ["model.embed_tokens.weight", "lm_head.weight"])
def test_tied_checkpoint_with_either_name(tiny_factory, tmp_path, reference_factory, kept):
    """A tied model's checkpoint may hold the shared matrix under either name (safetensors'
    ``save_model`` keeps ``lm_head.weight``; SmolLM2 converted from GGUF is saved so):
    transformers loads both, and so must we, with the same greedy tokens."""
    t = tiny_factory("tied")
    model_dir = tmp_path / "tied"
    shutil.copytree(t.base, model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    shared = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state.pop(name, None)
    state[kept] = shared
    save_file(state, str(model_dir / "model.safetensors"))
    pipe = make_pipeline(dataclasses.replace(t, base=model_dir, adapters={}))
    ids = prompts(1, seed=65)[0]
    engine = LLMEngine(pipe)
    out = engine.generate([Request("x", ids, None, SamplingParams(5, ignore_eos=True))])[0]
    assert out.token_ids == reference_factory(t).greedy(ids, None, 5)


def test_sampling_never_fails_for_admitted_params():
    """Every admitted sampling configuration draws a valid token, whatever the logits' scale."""
    rng = random.Random(7)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        logits = torch.randn(50, generator=g) * 10 ** rng.uniform(-3, 6)
        params = SamplingParams(
            temperature=rng.choice([0.01, 0.5, 1.0, 1e6, 1e300]),
            top_k=rng.choice([0, 1, 5, 10**9]),
            top_p=rng.choice([1.0, 0.5, 1e-12]),
        )
        params.validate()
        token = sample(logits, params, g)
        assert 0 <= token < 50


# ---- fuzz ----------------------------------------------------------------------------
WEIRD_VALUES = [
    math.nan,
    math.inf,
    -math.inf,
    -1,
    0,
    1e-45,
    2**70,
    10**400,
    "abc",
    "",
    True,
    False,
    None,
    [],
    {},
    [1.5],
    [True],
    ["x"],
    1.5,
    "\u2028",
    "\x00",
    {"a": 1},
    [[1]],
]
FIELDS = [*sorted(REQUEST_FIELDS), "unknown"]


def test_any_odd_value_in_the_python_api_finishes_its_request_with_an_error(tiny):
    """``add_request`` never raises for a bad value (each request finishes at once with an
    error naming it, nothing else affected): every SamplingParams field and the request's
    own at each odd value. A helper found ``logit_bias={7: 5.0}`` (OpenAI's shape) and
    ``sampling=None`` raised out of ``generate``, leaving the requests before in flight."""
    engine = LLMEngine(make_pipeline(tiny, load=()))
    odd = [*WEIRD_VALUES, {7: 5.0}, [(7, 5.0, 1)], [7], (("7", 1.0),)]
    requests = [
        Request(
            f"{f.name}={v!r}", [1, 2, 3], None, dataclasses.replace(SamplingParams(), **{f.name: v})
        )
        for f in dataclasses.fields(SamplingParams)
        for v in odd
    ]
    requests += [Request(f"sampling={v!r}", [1, 2], None, v) for v in odd]
    requests += [Request(f"prompt={v!r}", v, None, SamplingParams()) for v in odd]
    for r in requests:
        engine.add_request(r)  # (never raises)
    refused = {r.id: engine.finished[r.id].error for r in requests if r.id in engine.finished}
    for name in ("logit_bias={7: 5.0}", "sampling=None", "prompt=-1", "logit_bias=None"):
        assert refused[name], name
    assert refused["logit_bias={7: 5.0}"].startswith("logit_bias must be (token id, bias) pairs")
    assert len(refused) > len(requests) * 3 // 4  # (the rest are odd but valid: served)
    served = engine.generate([Request("after", [1, 2, 3], None, SamplingParams(max_new_tokens=2))])
    assert served[0].error is None and len(served[0].token_ids) == 2
    # numpy's integers are integers (a tokenizer's return_tensors="np"; they were refused as
    # "not integers in [0, vocab)"): the same tokens as Python ints
    np_ids = Request("np", list(np.array([1, 2, 3])), None, SamplingParams(max_new_tokens=2))
    assert engine.generate([np_ids])[0].token_ids == served[0].token_ids
    # and in SamplingParams (they were refused: "must be an integer", "a finite number")
    numpy_sampling = SamplingParams(
        max_new_tokens=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(3),
        seed=np.uint64(7), stop_token_ids=[np.int64(100)], min_p=np.float64(0.0),
    )  # fmt: skip
    plain = SamplingParams(max_new_tokens=2, temperature=0.5, top_k=3, seed=7,
                           stop_token_ids=(100,))  # fmt: skip
    assert numpy_sampling == dataclasses.replace(plain, temperature=float(np.float32(0.5)))
    out = engine.generate([Request(f"n{i}", [1, 2, 3], None, s)
                           for i, s in enumerate((numpy_sampling, plain))])  # fmt: skip
    assert out[0].error is None and out[0].token_ids == out[1].token_ids
    with_bool = SamplingParams(
        ignore_eos=np.bool_(True), logit_bias=((np.int64(3), np.float32(1)),)
    )
    assert (with_bool.ignore_eos, with_bool.logit_bias) == (True, ((3, 1.0),))
    with_bool.validate()
    # vLLM's seed -1 is no seed
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=np.int8(-1)).seed is None


def _mutate_line(rng: random.Random, req: dict) -> bytes:
    req = dict(req)
    kind = rng.randrange(4)
    if kind == 0:
        req[rng.choice(FIELDS)] = rng.choice(WEIRD_VALUES)
    elif kind == 1:
        req.pop(rng.choice(list(req)), None)
    text = json.dumps(req, allow_nan=True, ensure_ascii=rng.random() < 0.5).encode()
    if kind >= 2:  # byte-level: overwrite, drop or insert bytes
        data = bytearray(text)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                data[i] = rng.randrange(256)
            elif op == 1:
                del data[i]
            else:
                data.insert(
                    i, rng.choice([0xFF, 0xC3, 0x80, ord("{"), ord('"'), ord("\\"), 0x0D, 0x0B])
                )
        text = bytes(data).replace(b"\n", b" ")
    return text


def test_fuzz_requests_file(tiny, tmp_path, reference_factory):
    """Random mutations of valid request lines, mixed into one file with valid ones: the run
    exits 0, every output line is a result or an error, and the unmutated requests get the
    same tokens as peft alone."""
    ref = reference_factory(tiny)
    rng = random.Random(1234)
    good = _good_requests()
    lines = [json.dumps(r).encode() for r in good]
    for k in range(60):
        base = {**rng.choice(good), "id": f"m{k}", "max_new_tokens": rng.choice([1, 3, 6])}
        lines.append(_mutate_line(rng, base))
    out = io.StringIO()
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines))
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--no-progress",
        "--max-seq-len",
        "32",
        "--requests",
        str(path),
        "--lora",
        f"A={tiny.adapters['A']}",
        "--lora",
        f"B={tiny.adapters['B']}",
    ]
    assert main(argv, stdout=out) == 0
    results = [json.loads(line) for line in out.getvalue().splitlines()]
    assert all("id" in r and (("error" in r) != ("token_ids" in r)) for r in results)
    served = sum("token_ids" in r for r in results)
    assert 3 < served < len(results)  # the fuzz made both valid and invalid requests
    _check_good({r["id"]: r for r in results[: len(good)]}, ref)


# plausible values per field (a mutation draws from these or from WEIRD_VALUES)
CONFIG_VALUES = {
    "peft_type": ["LORA", "lora", "LOHA"],
    "r": [8, 4, 16],
    "lora_alpha": [8, 16, 3.5, 0, -4],
    "use_rslora": [True, False],
    "rank_pattern": [{}, {"q_proj": 8}, {"q_proj": 4}, {"layers.0.self_attn.q_proj": 8}],
    "alpha_pattern": [{}, {"q_proj": 32}, {"v_proj": 2.5}, {"layers.1.mlp.down_proj": 1}],
    "bias": ["none", "all"],
    "use_dora": [False, True],
    "modules_to_save": [None, [], ["lm_head"]],
    "init_lora_weights": [True, False, "gaussian", "pissa"],
    "fan_in_fan_out": [True, False],
    "lora_dropout": [0.0, 0.1],
    "task_type": ["CAUSAL_LM", None],
    "inference_mode": [True, False],
    "target_modules": [
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "all-linear",
        r".*_proj",
        ["q_proj"],
        None,
    ],
    "layers_to_transform": [None, [0, 1], [1], 0],
    "layers_pattern": [None, "layers", "blocks"],
    "lora_bias": [False, True],
    "unknown_field": [None, 1],
}


def test_fuzz_adapter_config(tiny, tmp_path):
    """Random mutations of a valid adapter_config.json: the engine either refuses it with an
    AdapterError, or serves exactly what peft serves from the same directory."""
    from peft import PeftModel
    from test_parity import run_prefill
    from transformers import AutoModelForCausalLM

    rng = random.Random(99)
    pipe = make_pipeline(tiny, load=())
    config = _config_a(tiny)
    batch = prompts(1, seed=65)
    accepted = refused = 0
    for k in range(60):
        mutated = dict(config)
        for _ in range(rng.randint(1, 2)):
            field = rng.choice(list(CONFIG_VALUES))
            if rng.random() < 0.15:
                mutated.pop(field, None)
            else:
                mutated[field] = rng.choice(
                    CONFIG_VALUES[field] if rng.random() < 0.7 else WEIRD_VALUES
                )
        text = json.dumps(mutated, allow_nan=True).encode()
        if rng.random() < 0.1:
            data = bytearray(text)
            data[rng.randrange(len(data))] = rng.randrange(256)
            text = bytes(data)
        path = _adapter_with_config(tiny, tmp_path, text, name=f"m{k}")
        try:
            pipe.manager.load_adapter(str(path), name=f"m{k}")
        except AdapterError:
            refused += 1
            continue
        accepted += 1
        got = run_prefill(pipe, batch, [f"m{k}"])[0]
        pipe.manager.unload_adapter(f"m{k}")
        peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny.base), str(path)
        ).eval()
        with torch.no_grad():
            want = peft(torch.tensor([batch[0]])).logits[0]
        torch.testing.assert_close(
            got, want, rtol=1e-4, atol=1e-4, msg=f"served differently from peft: {mutated}"
        )
    print(f"accepted {accepted}, refused {refused}")
    assert accepted >= 3 and refused >= 10


def test_seed_flag_is_the_runs_seed_as_vllms(tiny, tmp_path):
    """``--seed`` seeds the run, as vLLM's: equal lines without a seed of their own sample
    differently (a helper found them copied the flag's seed: equal samples), the run repeats
    exactly, and a line's own seed is its own whatever the flag."""
    line = {"prompt_token_ids": [5, 6, 7], "max_new_tokens": 8, "temperature": 1.0}
    lines = [{**line, "id": "r0"}, {**line, "id": "r1"}, {**line, "id": "own", "seed": 3}]
    content = "\n".join(map(json.dumps, lines)).encode()

    def run(seed: int) -> dict[str, list[int]]:
        results = _serve_file(tiny, tmp_path, content, ["--seed", str(seed)])
        return {r["id"]: r["token_ids"] for r in results}

    first, again, other = run(5), run(5), run(6)
    assert first == again
    assert first["r0"] != first["r1"] and first["r0"] != other["r0"]
    assert first["own"] == other["own"]
    # a line's -1 is no seed of its own (vLLM's), so the run's seed decides; the flag
    # itself takes no -1 (its message said "or null")
    minus = [{**line, "id": "r0", "seed": -1}, {**line, "id": "r1"}]
    got = _serve_file(tiny, tmp_path, "\n".join(map(json.dumps, minus)).encode(), ["--seed", "5"])
    assert {r["id"]: r["token_ids"] for r in got} == {"r0": first["r0"], "r1": first["r1"]}


def test_seed_flag_out_of_range_is_named(tiny, capsys):
    assert _run(tiny, ["--prompt", "hi", "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--seed must be an integer in [0, 2**64), got -1" in err and "null" not in err
