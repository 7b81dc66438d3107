"""The lora-graph command against per-request transformers + peft."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from conftest import prompts

from lora_graph.cli import main


def test_generate_requests_file_matches_peft(tiny, reference_factory, tmp_path):
    ref = reference_factory(tiny)
    batch = prompts(5, seed=11)
    adapters = ["A", None, "B", "C", "A"]
    lines = [
        json.dumps({"id": f"r{i}", "prompt_token_ids": ids, "adapter": a, "max_new_tokens": 12})
        for i, (ids, a) in enumerate(zip(batch, adapters, strict=True))
    ]
    lines.insert(
        2, json.dumps({"id": "bad-adapter", "prompt_token_ids": [5, 6], "adapter": "nope"})
    )
    lines.insert(4, "{not json")
    lines.append(json.dumps({"id": "bad-temp", "prompt_token_ids": [5, 6], "temperature": -1}))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--max-loras",
        "2",
        "--requests",
        str(requests),
        "--output",
        str(output),
    ]
    for name, path in tiny.adapters.items():
        argv += ["--lora", f"{name}={path}"]
    assert main(argv) == 0
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in results] == [
        "r0",
        "r1",
        "bad-adapter",
        "r2",
        "line-5",
        "r3",
        "r4",
        "bad-temp",
    ]
    by_id = {r["id"]: r for r in results}
    assert "unknown adapter 'nope'" in by_id["bad-adapter"]["error"]
    assert "line 5" in by_id["line-5"]["error"]
    assert "temperature" in by_id["bad-temp"]["error"]
    for i, (ids, a) in enumerate(zip(batch, adapters, strict=True)):
        r = by_id[f"r{i}"]
        assert r["adapter"] == a
        # EOS (id 2) may end a request early; everything up to it must match peft exactly
        expected = ref.greedy(ids, a, 12)
        assert r["token_ids"] == expected[: len(r["token_ids"])]
        assert len(r["token_ids"]) == 12 or r["token_ids"][-1] == 2
    # asynchronous scheduling on and off (the CPU's default), the prefix cache off: the same
    runs = {}
    for flag in ("--async-scheduling", "--no-async-scheduling", "--no-enable-prefix-caching"):
        runs[flag] = tmp_path / f"{flag}.jsonl"
        argv[argv.index(str(output))] = str(runs[flag])
        output = runs[flag]
        assert main([*argv, flag]) == 0
    assert {p.read_text() for p in runs.values()} == {(tmp_path / "out.jsonl").read_text()}


def test_unloadable_adapter_exits_2_with_one_line(tiny, tmp_path, capsys):
    bad = tmp_path / "dora"
    bad.mkdir()
    config = json.loads((tiny.adapters["A"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes(
        (tiny.adapters["A"] / "adapter_model.safetensors").read_bytes()
    )
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--lora",
        f"good={tiny.adapters['A']}",
        "--lora",
        f"broken={bad}",
        "--prompt",
        "hi",
    ]
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "broken" in err[0] and "use_dora" in err[0] and "Traceback" not in err[0]


def test_an_adapter_with_a_nan_weight_exits_2_at_start_up_naming_the_tensor(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(tiny.adapters["A"], bad)
    weights = load_file(str(bad / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    weights[key][0, 0] = float("nan")
    save_file(weights, str(bad / "adapter_model.safetensors"))
    argv = ["generate", "--model", str(tiny.base), "--device", "cpu", "--lora", f"nan={bad}",
            "--prompt", "hi"]  # fmt: skip
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"adapter 'nan': tensor {key} holds 1 non-finite value" in err[0]


def test_missing_adapter_path_exits_2(tiny, capsys):
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--lora",
        "x=/no/such/adapter",
        "--prompt",
        "hi",
    ]
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "'x'" in err and "no such file" in err


def test_a_bad_adapter_is_reported_before_the_capture(tiny, capsys):
    """The adapters load before the (long) capture: a missing one fails at once, and
    --no-progress hides the capture's progress bar too."""
    argv = ["generate", "--model", str(tiny.base), "--device", "cpu", "--compile", "inductor",
            "--no-progress", "--prompt", "hi", "--lora", "a=/no/such/adapter"]  # fmt: skip
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "adapter 'a'" in err and "capturing" not in err and len(err.strip().splitlines()) == 1


def test_cudagraph_without_cuda_exits_2(tiny, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--compile",
        "cudagraph",
        "--prompt",
        "hi",
    ]
    assert main(argv, stdout=io.StringIO()) == 2
    assert "cudagraph mode needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-loras", "0"], "--max-loras must be at least 1"),
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
        (["--max-seq-len", "1"], "--max-seq-len must be at least 2"),
        (["--max-seq-len", "4096"], "exceeds the model's max_position_embeddings 128"),
        (["--lora", "a=/x", "--lora", "a=/y"], "adapter name 'a' is given more than once"),
        (["--lora", "pirate"], "--lora 'pirate': expected NAME=PATH"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 16"),
        (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens must be at least 16"),
        (["--kv-cache-tokens", "0"], "--kv-cache-tokens must be at least 1"),
        # (without --max-seq-len the default is bounded by the KV cache: see below)
        (
            ["--kv-cache-tokens", "100", "--max-seq-len", "128"],
            "--kv-cache-tokens 100 cannot hold one request of",
        ),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (
            ["--output", "/no/such/dir/out.jsonl"],
            "--output /no/such/dir/out.jsonl: its directory does not exist",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(tiny, capsys, extra, message):
    argv = ["generate", "--model", str(tiny.base), "--device", "cpu", "--prompt", "hi", *extra]
    assert main(argv, stdout=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["generate", "--model", "/no/such/model", "--prompt", "hi"],
            "/no/such/model: no such model directory",
        ),
        (
            ["demo", "--assets", "/no/such/assets"],
            "--assets /no/such/assets: expected base/config.json",
        ),
        (["demo", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    ],
)
def test_bad_paths_and_values_exit_2(argv, message, capsys):
    assert main([*argv, "--device", "cpu"], stdout=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_request_fields_unknown_refused_stop_tokens_honoured(tiny, tmp_path, reference_factory):
    """A request line with a field the engine does not know (a misspelt adapter key would
    silently run the base model) is an error line; stop_token_ids and ignore_eos apply."""
    ref = reference_factory(tiny)
    ids = prompts(1, seed=12)[0]
    greedy = ref.greedy(ids, "A", 6)
    stop = greedy[2]
    lines = [
        {"id": "typo", "prompt_token_ids": ids, "adaptor": "A"},
        {"id": "vllm", "prompt_token_ids": ids, "lora_name": "A"},
        {
            "id": "stop",
            "prompt_token_ids": ids,
            "adapter": "A",
            "max_new_tokens": 6,
            "stop_token_ids": [stop],
            "ignore_eos": True,
        },
        {"id": "bool", "prompt_token_ids": ids, "max_new_tokens": True},
    ]
    requests = tmp_path / "r.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines))
    out = io.StringIO()
    argv = [
        "generate",
        "--model",
        str(tiny.base),
        "--device",
        "cpu",
        "--lora",
        f"A={tiny.adapters['A']}",
        "--requests",
        str(requests),
    ]
    assert main(argv, stdout=out) == 0
    by_id = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert "unknown field 'adaptor'" in by_id["typo"]["error"]
    assert "unknown field 'lora_name'" in by_id["vllm"]["error"]
    assert by_id["stop"]["token_ids"] == greedy[: greedy.index(stop) + 1]
    assert "max_new_tokens must be a positive integer" in by_id["bool"]["error"]


def test_repeated_request_id_is_an_error_line_and_the_rest_are_served(tiny, tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text(
        "\n".join(
            json.dumps({"id": "x", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 3})
            for _ in range(2)
        )
    )
    out = io.StringIO()
    assert (
        main(
            ["generate", "--model", str(tiny.base), "--device", "cpu", "--requests", str(requests)],
            stdout=out,
        )
        == 0
    )
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert len(first["token_ids"]) == 3
    assert "repeats an earlier request's id" in second["error"]


def test_ctrl_c_while_torch_imports_exits_130_quietly():
    """The command interrupted while torch still imports (its first second or two) ends
    with 130 and no traceback, as later (a helper saw a KeyboardInterrupt traceback): the
    entry point (``lora_graph.__main__``) imports nothing heavy before it can catch it, and
    ``import lora_graph`` alone imports no torch."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = "import sys, lora_graph; print('torch' in sys.modules, 'LoRAConfig' in dir(lora_graph))"
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert light.stdout.split() == ["False", "True"], light.stdout + light.stderr
    import lora_graph

    assert lora_graph.config.LoRAConfig is lora_graph.LoRAConfig  # (submodules as before)
    # at torch's library load and after it (a helper found the import swallowing a
    # KeyboardInterrupt there, leaving numpy half-imported: a RecursionError traceback)
    for delay in (0.0, 0.1, 0.25, 0.5):
        proc = subprocess.Popen(
            [sys.executable, "-m", "lora_graph", "demo"], stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 60
        maps = f"/proc/{proc.pid}/maps"
        while time.monotonic() < deadline and proc.poll() is None:  # torch's library loading
            with open(maps) as f:
                if "libtorch" in f.read():
                    break
            time.sleep(0.005)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (delay, err)
        assert "Traceback" not in err, (delay, err)
