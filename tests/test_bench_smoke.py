"""Every benchmark runs: each ``bench/*.py`` with ``--smoke`` (tiny shapes on the CPU), so a
renamed method breaks CI rather than the next GPU run. Speed is not checked here."""

from __future__ import annotations

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
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke(script, tmp_path):
    argv = [sys.executable, str(BENCH / script), "--smoke"]
    if script in WRITES_JSON:
        argv += ["--json", str(tmp_path / "out.json")]
    argv += EXTRA.get(script, [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env=env, cwd=BENCH.parent
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "|---" in proc.stdout  # the results table
    if script == "decode.py":
        assert "| v | 4 |" in proc.stdout
    if script in WRITES_JSON:
        assert (tmp_path / "out.json").stat().st_size > 0


def test_serve_smoke_with_arrivals(tmp_path):
    """bench/serve.py with its own flags, asynchronous scheduling compared with sync."""
    argv = [sys.executable, str(BENCH / "serve.py"), "--smoke", "--rate", "8", "--skip-base"]
    argv += ["--peft-requests", "0", "--compare-sync", "--json", str(tmp_path / "out.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env=env, cwd=BENCH.parent
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| lora |" in proc.stdout and "| lora (sync) |" in proc.stdout


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
