#!/usr/bin/env bash
# The server's dependencies (structured output's xgrammar and the tests' jsonschema too) as
# wheels for the GPU image (Python 3.12, no internet there):
#   bash bench/server_wheels.sh            # here, once: fills bench/out/wheels (ignored by git)
# then give the device call carry=["bench/out/wheels"] and run
#   bash bench/gpu_run.sh serveload     (or extras)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/out/wheels
python -m pip download -q --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  fastapi uvicorn prometheus_client openai httpx jsonschema -d bench/out/wheels
# xgrammar and its binding without their torch / transformers / triton (the image has them)
python -m pip download -q --python-version 3.12 --only-binary=:all: --no-deps \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_28_x86_64 "xgrammar==0.2.9" apache-tvm-ffi -d bench/out/wheels
ls bench/out/wheels | wc -l
