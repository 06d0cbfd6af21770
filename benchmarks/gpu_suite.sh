#!/usr/bin/env bash
# The GPU suite: benchmarks/startup.py and benchmarks/capacity.py, then the cold-versus-warm timeline PNG, then
# benchmarks/cold_start.py; tests/gpu in an invocation of its own (--tests: 270 tests took 160 s of an H100, more
# than the default steps leave of one 10-minute command). Every result goes under $OUT (default ./out):
#
#   suite.log        everything printed, with a progress line per step
#   steps.jsonl      one line per step: name, exit status, seconds (124: stopped at its timeout)
#   gpu_tests.xml    pytest's JUnit report of tests/gpu (--tests)
#   startup.json     benchmarks/startup.py (1B, 8B and 14B shapes, bfloat16)
#   capacity.json    benchmarks/capacity.py (8B shape, bfloat16)
#   startup_8b_cold_warm.png   bootstrap trace of the 8B cold and warm starts
#   cold_start.json  benchmarks/cold_start.py (fresh run and serve processes on an 8B checkpoint directory)
#   traces.tar.gz    every start's trace file
#
# Usage, from the repository root:  bash benchmarks/gpu_suite.sh [--smoke] [--tests | --served | --live-ops | --prefix-cache | --fp8 | --fp8-kv | --tp2]
#   --tests: tests/gpu alone (gpu_tests.xml; plus suite.log and steps.jsonl).
#   --smoke: tiny shapes on the CPU, to check the script itself (tests/gpu then skip). The GPU steps' caps and the
#     suite's budget are not applied: every step gets SMOKE_CAP_S (1800 s) instead, a guard against a hang only,
#     since a loaded CPU takes as long as it takes and the smoke checks what the steps write, not their time.
#   --served: instead, an 8B checkpoint written, then benchmarks/served_vs_engine.py (served and in process side by
#     side at 1, 16, 64 and 256 streams, 128/128, the clients over 4 processes) and benchmarks/serve_profile.py
#     (py-spy of the server's and the engine's processes at 256 streams; py-spy comes as a wheel in .whl/),
#     a second invocation:   served_vs_engine.json, serve_profile.json,
#       py-spy-server-idle.txt, py-spy-server-gil.txt, py-spy-engine-idle.txt, py-spy-engine-gil.txt
#   --live-ops: instead of the steps above, benchmarks/live_ops.py alone (three 8B checkpoints written,
#     a server swapped, slept, woken and updated, then 20 swap cycles under traffic: about 4 to 6 minutes,
#     which the budget above has no room for): a second invocation, with its own 10 minutes:
#       live_ops.json    benchmarks/live_ops.py (plus suite.log and steps.jsonl, as above)
#   --prefix-cache: instead, benchmarks/prefix_cache.py --preset 8b alone (an 8B checkpoint written, then one
#     fresh server with the prefix cache and one without, 64 chat requests at once on each), a second invocation:
#       prefix_cache.json    benchmarks/prefix_cache.py (plus suite.log and steps.jsonl, as above)
#   --fp8: instead, the FP8 weight and KV kernels' tests, benchmarks/fp8_products.py (per matrix and row count, with
#     the few-rows tile sweep at 16 rows), then an 8B checkpoint written with its two FP8 twins (benchmarks/quantize_checkpoint.py:
#     channel and block layouts), benchmarks/fp8_decode.py on the three and a worst case on the block checkpoint,
#     a second invocation:   fp8_tests.xml, fp8_products.json, fp8_decode.json, fp8_worst_case.json
#   --fp8-kv: instead, the same tests, the paged decode kernel and a prefill chunk's attention on a bfloat16 and an
#     e4m3 cache (decode_attention_splits.py, prefill_chunk_attention.py), the 8B and its block twin, fp8_decode.py
#     with a bfloat16 and an fp8 KV cache (batch 64, 4,096-token prompts), and worst cases on the fp8 cache (every
#     block filled) and on the block checkpoint, a third invocation:   fp8_tests.xml, fp8_kv_kernel.json,
#     prefill_chunk.json, fp8_kv_decode.json, fp8_kv_worst_case.json, fp8_worst_case.json
#     (--fp8 --fp8-kv: both in one invocation, the tests and the checkpoints once: about 8 minutes on the H200, but
#     10 files, 2 more than the device tool brings back: run them apart there)
#   --tp2 (two GPUs: nvidia-h200-x2): instead, tests/gpu/test_tensor_parallel_cuda.py (NCCL: answers of one rank, a
#     SIGTERM and a killed rank mid-stream, no process left on a GPU), then fresh run and serve processes on an 8B
#     checkpoint at --tp 1 and --tp 2 (cold_start.py), greedy agreement over 256 tokens (tp_agreement.py), decode
#     steps at batch 1, 16 and 64 with their all-reduce time from a profile (tp_profile.py), and serve_load.py at
#     1, 16 and 64 clients on a --tp 1 and a --tp 2 server side by side:
#       tp2_tests.xml, cold_start_tp1.json, cold_start_tp2.json, tp_agreement.json, tp_profile.json,
#       serve_load_tp.json
# Missing Python packages travel as wheels in .whl/ (python3 -m pip download --no-deps --only-binary=:all: -d .whl ...);
# they are installed from there, never from an index. The whole suite keeps within
# SUITE_BUDGET_S seconds: each step gets at most its own cap and what the budget has left (not with --smoke).
# Exit status 1 when a step failed, was stopped at its timeout or had no time left; every result
# is written anyway.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

SMOKE=0
TESTS=0
SERVED=0
LIVE_OPS=0
PREFIX_CACHE=0
FP8=0
FP8_KV=0
TP2=0
FAILED=0
for arg in "$@"; do
  case $arg in
    --smoke) SMOKE=1 ;;
    --tests) TESTS=1 ;;
    --served) SERVED=1 ;;
    --live-ops) LIVE_OPS=1 ;;
    --prefix-cache) PREFIX_CACHE=1 ;;
    --fp8) FP8=1 ;;
    --fp8-kv) FP8_KV=1 ;;
    --tp2) TP2=1 ;;
    *) echo "gpu_suite.sh: unknown flag $arg (allowed: --smoke, --tests, --served, --live-ops, --prefix-cache, --fp8, --fp8-kv, --tp2)" >&2
       exit 2 ;;
  esac
done

OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
export OUT WORK
: > "$OUT/suite.log"
: > "$OUT/steps.jsonl"
SUITE_BUDGET_S=590
SMOKE_CAP_S=1800  # --smoke: each step's timeout, in place of its cap and the budget
START=$(date +%s)
export SMOKE
exec > >(tee -a "$OUT/suite.log") 2>&1

say() { echo "[suite +$(( $(date +%s) - START ))s] $*"; }

# run_step NAME CAP_S COMMAND...: run with a timeout of min(CAP_S, what the budget leaves); --smoke: SMOKE_CAP_S.
run_step() {
  local name=$1 cap=$2
  shift 2
  local left=$(( SUITE_BUDGET_S - ($(date +%s) - START) - 5 ))
  [ "$SMOKE" = 1 ] && cap=$SMOKE_CAP_S left=$SMOKE_CAP_S
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 15 ]; then
    say "$name: skipped, ${left}s left of the budget"
    FAILED=1
    echo "{\"step\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": true}" >> "$OUT/steps.jsonl"
    return 0
  fi
  say "$name: started (timeout ${limit}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  [ "$rc" = 0 ] || FAILED=1
  say "$name: finished, exit $rc, $(( $(date +%s) - t0 ))s"
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/steps.jsonl"
}

install_wheels() {
  if [ "$SMOKE" = 1 ]; then
    echo "smoke run: using this machine's packages"
    return 0
  fi
  if ! ls .whl/*.whl > /dev/null 2>&1; then
    echo "no .whl/ here: using the packages already installed"
    return 0
  fi
  # byte-compiled as pip installs for a user: with --no-compile every fresh process compiled the serve stack's
  # sources again (a profile of a warm 8B serve start spent 24 % of its samples in source_to_code)
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-cache-dir --upgrade \
    --target "$WORK/site" .whl/*.whl
}

render_png() {  # the 8B start (else the first) whose cold and warm times startup.json reports
  local files
  files=$(python3 -c 'import json, sys
models = [m for m in json.load(open(sys.argv[1]))["models"] if "cold" in m]
pick = next((m for m in models if "8b" in m["model"] and m.get("cuda_graphs")), None)
pick = pick or next((m for m in models if "8b" in m["model"]), models[0] if models else None)
print(pick["cold"]["trace_file"], pick["warm"]["trace_file"]) if pick else sys.exit("no start to draw")' "$OUT/startup.json") || return 1
  python3 -m bootstrap.cli trace $files --png "$OUT/startup_8b_cold_warm.png"
}
export -f install_wheels render_png

if [ "$SMOKE" = 1 ]; then
  cat > "$WORK/tiny.json" << 'EOF'
{"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "torch_dtype": "float32"}
EOF
  DEVICE=(--device cpu)
  STARTUP=(--models "random:$WORK/tiny.json" --max-seq-len 64 --max-num-tokens 64 --max-batch-size 4 --repeats 1)
  CAPACITY=(--model "random:$WORK/tiny.json" --max-seq-len 64 --max-num-tokens 64 --max-batch-size 4 --load-timeout-s 60)
  COLD=(--shape "$WORK/tiny.json" --device cpu --repeats 1 --max-seq-len 64 --max-num-tokens 64 --max-batch-size 4)
  LIVE=(--preset tiny --device cpu --cycles 2)
  PREFIX=(--preset tiny)
  TP_COLD=(--shape "$WORK/tiny.json" --device cpu --repeats 1 --max-seq-len 64 --max-num-tokens 64 --max-batch-size 4)
  TP_MODEL="$WORK/cold/checkpoint-tiny"
  TP_RUN=(--device cpu --max-tokens 32 --run-args "--max-seq-len 64 --max-num-tokens 64 --max-batch-size 4")
  TP_LOAD=(--device cpu --levels 1,4 --requests 8 --prompt-len 8 --gen-len 8 --max-batch-size 4 --max-seq-len 64
           --vocab 128)  # tiny.json's: ids past it are refused
  TP_PROFILE=(--device cpu --batch-sizes 1,4 --context 32 --steps 5)
  TP_SIZES="2"
else
  DEVICE=(--device cuda --dtype bfloat16)
  STARTUP=(--models random:llama-3.2-1b,random:llama-3.1-8b,random:qwen2.5-14b --max-seq-len 8192
           --max-num-tokens 8192 --max-batch-size 64 --repeats 3)
  CAPACITY=(--model random:llama-3.1-8b --max-seq-len 8192 --max-num-tokens 8192 --max-batch-size 256
            --load-timeout-s 100)
  COLD=(--shape llama-3.1-8b --device cuda --repeats 3)
  LIVE=(--preset 8b --device cuda --cycles 20)
  PREFIX=(--preset 8b)
  TP_COLD=(--shape llama-3.1-8b --device cuda --repeats 1)
  TP_MODEL="$WORK/cold/checkpoint-llama-3.1-8b"
  TP_RUN=(--device cuda --dtype bfloat16 --max-tokens 256)
  TP_LOAD=(--device cuda --levels 1,16,64 --requests 64 --prompt-len 128 --gen-len 128 --max-batch-size 64
           --max-seq-len 4096 --vocab 512 --serve-args "--free-gpu-memory-fraction 0.4")  # two servers share GPU 0
  TP_PROFILE=(--device cuda --dtype bfloat16 --batch-sizes 1,16,64 --context 512 --steps 50)
  TP_SIZES="1 2"
fi

say "results under $OUT"
run_step install_wheels 90 bash -c install_wheels
export PYTHONPATH="$WORK/site:$PWD" PATH="$WORK/site/bin:$PATH"  # py-spy (--served) comes as a wheel
run_step environment 60 python3 -c "import torch, transformers, pydantic, opentelemetry.sdk, tenacity, pytest; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'pytest', pytest.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
if [ "$TESTS" = 1 ]; then
  run_step gpu_tests 400 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider -p no:asyncio \
    --junitxml="$OUT/gpu_tests.xml"
  say "done; steps:"
  cat "$OUT/steps.jsonl"
  rm -rf "$WORK"
  exit "$FAILED"
fi
if [ "$SERVED" = 1 ]; then
  if [ "$SMOKE" = 1 ]; then
    run_step served_vs_engine 600 python3 benchmarks/served_vs_engine.py --smoke --out "$OUT/served_vs_engine.json"
  else
    run_step write_8b 120 python3 benchmarks/write_checkpoint.py --model llama-3.1-8b --out "$WORK/8b" --device cuda
    run_step served_vs_engine 330 python3 benchmarks/served_vs_engine.py --model "$WORK/8b" --device cuda \
      --levels 1,16,64,256 --prompt-len 128 --gen-len 128 --max-seq-len 1024 --vocab 120000 \
      --out "$OUT/served_vs_engine.json"
    run_step serve_profile 120 python3 benchmarks/serve_profile.py --model "$WORK/8b" --device cuda --streams 256 \
      --prompt-len 128 --gen-len 128 --max-batch-size 256 --max-seq-len 1024 --vocab 120000 --warmup-s 8 \
      --duration-s 8 --out "$OUT/serve_profile.json"
  fi
  say "done; steps:"
  cat "$OUT/steps.jsonl"
  rm -rf "$WORK"
  exit "$FAILED"
fi
if [ "$LIVE_OPS" = 1 ]; then  # the stress stops early (--deadline-s) rather than meet the step's timeout
  run_step live_ops 560 python3 benchmarks/live_ops.py "${LIVE[@]}" --deadline-s 480 --work-dir "$WORK/live" \
    --out "$OUT/live_ops.json"
  say "done; steps:"
  cat "$OUT/steps.jsonl"
  rm -rf "$WORK"
  exit "$FAILED"
fi
if [ "$PREFIX_CACHE" = 1 ]; then
  run_step prefix_cache 560 python3 benchmarks/prefix_cache.py "${PREFIX[@]}" --work-dir "$WORK/prefix" \
    --out "$OUT/prefix_cache.json"
  say "done; steps:"
  cat "$OUT/steps.jsonl"
  rm -rf "$WORK"
  exit "$FAILED"
fi
if [ "$TP2" = 1 ]; then
  run_step tp2_tests 150 python3 -m pytest tests/gpu/test_tensor_parallel_cuda.py -q -rA -s -p no:cacheprovider \
    -p no:asyncio --junitxml="$OUT/tp2_tests.xml"
  # the first writes the checkpoint, the second reuses it; --smoke: --tp 2 alone (the smoke's cold_start is --tp 1's)
  for tp in $TP_SIZES; do
    run_step "cold_start_tp$tp" 120 python3 benchmarks/cold_start.py "${TP_COLD[@]}" --tp "$tp" --workdir "$WORK/cold" \
      --out "$OUT/cold_start_tp$tp.json"
  done
  run_step tp_agreement 90 python3 benchmarks/tp_agreement.py --model "$TP_MODEL" "${TP_RUN[@]}" --tp-sizes 1,2 \
    --out "$OUT/tp_agreement.json"
  run_step tp_profile 100 python3 benchmarks/tp_profile.py --model "$TP_MODEL" "${TP_PROFILE[@]}" --tp-sizes 1,2 \
    --out "$OUT/tp_profile.json"
  run_step serve_load_tp 150 python3 benchmarks/serve_load.py --model "$TP_MODEL" "${TP_LOAD[@]}" --tp-sizes 1,2 \
    --out "$OUT/serve_load_tp.json"
  say "done; steps:"
  cat "$OUT/steps.jsonl"
  rm -rf "$WORK"
  exit "$FAILED"
fi
if [ "$FP8" = 1 ] || [ "$FP8_KV" = 1 ]; then  # both flags: one checkpoint written, the tests run once
  run_step fp8_tests 120 python3 -m pytest tests/gpu/test_fp8_gemm_cuda.py tests/gpu/test_fp8_kv_cuda.py -q -rA \
    -p no:cacheprovider -p no:asyncio --junitxml="$OUT/fp8_tests.xml"
  [ "$FP8" = 1 ] && run_step fp8_products 150 python3 benchmarks/fp8_products.py --sweep 16 --out "$OUT/fp8_products.json"
  run_step write_8b 120 python3 benchmarks/write_checkpoint.py --model llama-3.1-8b --out "$WORK/8b" --device cuda
  for layout in $([ "$FP8" = 1 ] && echo channel) block; do
    run_step "quantize_$layout" 90 python3 benchmarks/quantize_checkpoint.py --source "$WORK/8b" \
      --out "$WORK/8b-$layout" --layout "$layout" --device cuda
  done
  if [ "$FP8" = 1 ]; then
    run_step fp8_decode 240 python3 benchmarks/fp8_decode.py --checkpoint "bf16=$WORK/8b" \
      --checkpoint "channel=$WORK/8b-channel" --checkpoint "block=$WORK/8b-block" --out "$OUT/fp8_decode.json"
  fi
  if [ "$FP8_KV" = 1 ]; then
    run_step fp8_kv_kernel 60 python3 benchmarks/decode_attention_splits.py --rows 1,64 --contexts 4096 \
      --kv-dtypes bfloat16,fp8 --splits 2,4 --blocks-per-step 2,4 --float16-dots --out "$OUT/fp8_kv_kernel.json"
    run_step prefill_chunk 60 python3 benchmarks/prefill_chunk_attention.py --kv-dtypes bfloat16,fp8 \
      --out "$OUT/prefill_chunk.json"
    # G/2 = 128 decode steps outlast the 128 prefill steps of 64 x 4,096 tokens (2,048 a step): all decoding
    run_step fp8_kv_decode 240 python3 benchmarks/fp8_decode.py --checkpoint "bf16=$WORK/8b" \
      --checkpoint "fp8kv=$WORK/8b,kv_cache_dtype=fp8" --batch-sizes 64 --prompt-len 4096 --gen-len 256 \
      --repeats 1 --out "$OUT/fp8_kv_decode.json"
    # 256 x 7,200 prompt tokens prefilled in 225 steps, then 512 tokens each: more than the pool's ~1.9M tokens
    # while every request is still running, so every block is taken and the scheduler must preempt
    run_step fp8_kv_worst_case 300 python3 benchmarks/worst_case_after_capture.py --model "$WORK/8b" \
      --kv-cache-dtype fp8 --max-batch-size 256 --max-num-tokens 8192 --prompt-len 7200 --gen-len 512 \
      --out "$OUT/fp8_kv_worst_case.json"
  fi
  run_step fp8_worst_case 90 python3 benchmarks/worst_case_after_capture.py --model "$WORK/8b-block" \
    --out "$OUT/fp8_worst_case.json"
  say "done; steps:"
  cat "$OUT/steps.jsonl"
  rm -rf "$WORK"
  exit "$FAILED"
fi
run_step startup 160 python3 benchmarks/startup.py "${DEVICE[@]}" "${STARTUP[@]}" \
  --trace-dir "$WORK/traces" --out "$OUT/startup.json"
run_step capacity 120 python3 benchmarks/capacity.py "${DEVICE[@]}" "${CAPACITY[@]}" --out "$OUT/capacity.json"
run_step timeline_png 30 bash -c render_png
run_step cold_start 300 python3 benchmarks/cold_start.py "${COLD[@]}" --workdir "$WORK/cold" --out "$OUT/cold_start.json"
tar -czf "$OUT/traces.tar.gz" -C "$WORK" traces 2> /dev/null || { rm -f "$OUT/traces.tar.gz"; say "no traces to pack"; }
say "done; steps:"
cat "$OUT/steps.jsonl"
rm -rf "$WORK"
exit "$FAILED"  # 1 when a step failed or ran out of time
