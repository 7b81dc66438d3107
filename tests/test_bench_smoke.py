"""Every benchmark runs: each ``bench/*.py`` with ``--smoke`` (tiny shapes on the CPU), so a
renamed method breaks CI rather than the next GPU run. Speed is not checked here. Each
script runs as ``python bench/<script>`` would, in a process forked from a server that has
imported torch, transformers and peft once (:func:`run_bench`)."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
WRITES_JSON = {
    "adapter_load.py",
    "decode_gemm.py",
    "decode.py",
    "host_time.py",
    "lora_kernels.py",
    "serve.py",
    "serve_load.py",
    "tp_overhead.py",
}
# decode.py's variants of the decode LoRA path, every switch set (a second LoRA pipeline),
# eager, its --smoke default (the compiled step is tests/test_compile.py's; on the GPU the
# script captures it); profile_step.py's mixed ranks
EXTRA = {
    "decode.py": [
        "--variants",
        "now",
        "v:ranks=4/8,fused_silu=0,slot_ranks=0",
    ],
    # adapters of two ranks in a pool of the larger; eager (the compiled step is
    # tests/test_compile.py's; on the GPU the script captures it)
    "profile_step.py": ["--ranks", "4/8", "--eager"],
}


def test_no_benchmark_edits_sys_path():
    """The package (models and compile included) is imported as installed; a benchmark
    imports its siblings (``bench/`` is first on the path of ``python bench/X.py``)."""
    for script in SCRIPTS:
        assert "sys.path" not in (BENCH / script).read_text(), script


def test_every_benchmark_is_covered():
    assert SCRIPTS == [
        "adapter_load.py",
        "attention.py",
        "decode.py",
        "decode_gemm.py",
        "host_time.py",
        "lora_kernels.py",
        "precision.py",
        "profile_step.py",
        "serve.py",
        "serve_load.py",
        "tp_overhead.py",
    ]


# the benchmarks' common imports, once a worker: each run forks from a server holding them
# (multiprocessing's forkserver) instead of importing them again (about 5 s a script)
_PRELOAD = ["torch", "transformers", "peft", "safetensors", "numpy"]
# scripts that set TRITON_INTERPRET before Triton is first imported (the forkserver's
# preloaded torch has imported it): a process of their own
OWN_PROCESS = {"attention.py", "decode_gemm.py", "lora_kernels.py"}


@functools.cache
def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _run_in_child(script: str, args: list[str], log: str) -> None:
    """In the forked child: ``python bench/<script> <args>`` (the script's directory first
    on the path, as Python puts it), its stdout and stderr into ``log``."""
    import runpy
    import traceback

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    os.chdir(BENCH.parent)
    sys.argv = [str(BENCH / script), *args]
    sys.path.insert(0, str(BENCH))
    code = 0
    try:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_bench(
    script: str, args: list[str], tmp_path: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``python bench/<script> <args>`` with the GPU hidden, in a process forked from the
    worker's forkserver; its exit code and output (stdout and stderr together)."""
    if script in OWN_PROCESS:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(
            [sys.executable, str(BENCH / script), *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env, cwd=BENCH.parent,
        )  # fmt: skip
        return done
    log = tmp_path / f"{script}.log"
    proc = _forkserver().Process(target=_run_in_child, args=(script, args, str(log)))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"{script} ran past {timeout} s:\n" + log.read_text()[-3000:])
    return subprocess.CompletedProcess(script, proc.exitcode or 0, log.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke(script, tmp_path):
    args = ["--smoke"]
    if script in WRITES_JSON:
        args += ["--json", str(tmp_path / "out.json")]
    args += EXTRA.get(script, [])
    proc = run_bench(script, args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "|---" in proc.stdout  # the results table
    if script == "decode.py":
        assert "| v | 4 |" in proc.stdout
    if script in WRITES_JSON:
        assert (tmp_path / "out.json").stat().st_size > 0


def test_serve_smoke_with_arrivals(tmp_path):
    """bench/serve.py with its own flags, asynchronous scheduling compared with sync, and
    the workload served again with logprobs and JSON-schema requests among the others."""
    args = ["--smoke", "--rate", "8", "--skip-base", "--peft-requests", "0", "--compare-sync",
            "--logprobs-share", "0.25", "--json-share", "0.25"]  # fmt: skip
    proc = run_bench("serve.py", [*args, "--json", str(tmp_path / "out.json")], tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "| lora |" in proc.stdout and "| lora (sync) |" in proc.stdout
    assert "| lora + logprobs:5 (" in proc.stdout and "with logprobs and JSON / without" in (
        proc.stdout
    )


@pytest.mark.parametrize("workload", ["shared-prefix", "chat"])
def test_serve_smoke_prefix_cache_workloads(tmp_path, workload):
    """bench/serve.py's shared-prefix and multi-turn chat workloads, the cache on and off:
    the cache serves a share of the prompt tokens, none when it is off."""
    args = ["--smoke", "--workload", workload, "--skip-base", "--peft-requests", "0",
            "--compare-prefix-caching", "--json", str(tmp_path / "out.json")]  # fmt: skip
    proc = run_bench("serve.py", args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert (
        runs["lora"]["cached_tokens"] > 0 and runs["lora (no prefix cache)"]["cached_tokens"] == 0
    )
    assert "lora: prefix cache off / on: wall" in proc.stdout


@pytest.mark.parametrize(
    "spec, message",
    [
        ("x:bogus=1", "switch 'bogus=1' is unknown"),
        ("x:ranks=abc", "ranks must be positive integers, got 'abc'"),
        ("x:ranks=0", "ranks must be positive integers, got '0'"),
        (":", "give it a name"),
        ("x:ranks", "switch 'ranks' is not key=value"),
        ("x:fused_silu=yes", "fused_silu must be 0 or 1, got 'yes'"),
        ("x:ranks=4,ranks=8", "switch 'ranks=8' is given twice"),
        ("x:k_steps=2", "switch 'k_steps=2' is unknown"),  # an experiment since removed
        ("x:slot_ranks=\u00b2", "slot_ranks must be 0 or 1, got '\u00b2'"),
    ],
)
def test_decode_variant_specs_refused_with_their_cause(spec, message):
    """bench/decode.py's --variants: a bad spec is refused by name, before anything is
    built (a new user's trial found raw tracebacks, late, and silent acceptance)."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("bench_decode", BENCH / "decode.py")
    decode = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(decode)
    with pytest.raises(SystemExit, match=re.escape(message)):
        decode.parse_variant(spec)
    assert decode.parse_variant("v:ranks=8/16,slot_ranks=0") == (
        "v",
        {"ranks": "8/16", "slot_ranks": "0"},
    )


@pytest.mark.parametrize(
    ("script", "extra"),
    [("decode.py", ["--vocab-parallel-lm-head"]), ("serve.py", [])],
)
def test_benchmarks_at_tensor_parallel_2(script, extra, tmp_path):
    """The benchmarks #31 runs on several GPUs, at 2 ranks over gloo (the tables print)."""
    args = ["--smoke", "--json", str(tmp_path / "out.json"), "--tensor-parallel-size", "2"]
    if script == "decode.py":
        args += ["--skip-peft"]
    proc = run_bench(script, [*args, *extra], tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "| lora |" in proc.stdout or "| default |" in proc.stdout


def test_random_weights_are_a_llama_checkpoint_made_when_read(monkeypatch):
    """bench/decode.py's ``RandomWeights`` (the 70B runs' weights, never whole on one GPU):
    the names and shapes of ``LlamaForCausalLM``'s state dict, the same tensor on every
    read (every rank reads the same checkpoint), std 0.02, RMSNorm weights 1; picklable."""
    import importlib.util
    import pickle

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    module_spec = importlib.util.spec_from_file_location("bench_decode", BENCH / "decode.py")
    decode = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(decode)
    monkeypatch.setitem(sys.modules, "bench_decode", decode)  # (for pickle)
    weights = decode.RandomWeights(decode.SMOKE, seed=3)
    hf = LlamaForCausalLM(LlamaConfig(**decode.SMOKE))
    want = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    assert {name: tuple(weights[name].shape) for name in weights} == want
    assert weights.nbytes() == 2 * sum(t.numel() for t in hf.state_dict().values())
    embed = weights["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16 and torch.equal(embed, weights[next(iter(weights))])
    assert abs(float(embed.float().std()) - 0.02) < 0.002
    assert not torch.equal(embed[:, :8], weights["lm_head.weight"][:, :8])
    assert (weights["model.norm.weight"] == 1).all()
    assert pickle.loads(pickle.dumps(weights)).shapes == weights.shapes
    assert set(decode.SHAPES) == {"8b", "70b"}
