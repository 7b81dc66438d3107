"""The examples run as a user runs them (a subprocess, nothing downloaded): the guide's
new architecture (Granite) against transformers + peft, and the capture walk-through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True, text=True, timeout=600, env=env, cwd=EXAMPLES.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_new_architecture_example_matches_peft():
    out = run("new_architecture.py")
    assert "Granite: the engine equals transformers + peft" in out
    assert out.count("== peft") == 4


@pytest.mark.compile
def test_compile_and_run_example():
    out = run("compile_and_run.py")
    assert "recompiles while serving: 0" in out
