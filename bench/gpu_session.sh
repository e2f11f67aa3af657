#!/usr/bin/env bash
# One call on the lent GPU machine: install enn (no network there), then run the named stages.
#   bash bench/gpu_session.sh guard epilogue       (stages: doctor guard guardinf epilogue attention precision registry tests checks bench real realdefaults hostbound state padding generate fp8 fp8train cudagraphs demo)
#   bash bench/gpu_session.sh realdefaults:hf_bert_sdpa,hf_bert_sdpa_ckpt    (a suite stage on some of its models: stage:MODELS)
#   bash bench/gpu_session.sh --gpus "hostbound:tv_resnet50 state" "fp8 generate"   (one stage list per GPU, in parallel; $OUT/gpuN/)
# Each stage's output goes to $OUT/<stage>.log and its JSON to $OUT. The tools run through the
# front door (python -m enn_backend bench --tool NAME ARGS = python bench/NAME.py ARGS).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/enn_out}; mkdir -p "$OUT"
if [ "${1:-}" = "--installed" ]; then shift  # a GPU's share of a --gpus run: installed already
else python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
fi
if [ "${1:-}" = "--gpus" ]; then  # each following argument: the stages of one GPU, run beside the others
  shift; gpu=0
  for stages in "$@"; do
    mkdir -p "$OUT/gpu$gpu"
    CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/gpu$gpu" bash "$0" --installed $stages > "$OUT/gpu$gpu/session.log" 2>&1 &
    gpu=$((gpu + 1))
  done
  wait
  for log in "$OUT"/gpu*/session.log; do echo "##### $log"; cat "$log"; done
  exit 0
fi
for arg in "$@"; do
  stage=${arg%%:*}; only=${arg#*:}; [ "$only" = "$arg" ] && only=""
  ONLY=${only:+--only $only}
  echo "=== $arg ($(date +%T))"
  case $stage in
    doctor)    python3 -m enn_backend doctor ;;
    guard)     python3 -m enn_backend bench --tool guard_overhead --device cuda --rounds 7 --steps 10 --out "$OUT" ;;
    guardinf)  python3 -m enn_backend bench --tool guard_overhead --device cuda --mode infer --rounds 7 --steps 10 --out "$OUT/infer" ;;
    epilogue)  python3 -m enn_backend bench --tool gpu_epilogue ;;
    attention) python3 -m enn_backend bench --tool gpu_attention ;;
    precision) python3 -m enn_backend bench --tool gpu_precision ;;
    # the registry's GEMM choices against the rules' and Inductor's, every shape and family (about 5 minutes)
    registry)  OUT="$OUT" python3 -m enn_backend bench --tool gemm_registry --rounds 11 --budget-s 300 ;;
    tests)     python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/ ;;
    # the correctness checks that were scripts here, as GPU tests (bench/README.md, "Correctness checks")
    checks)    python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_hf_sweep.py tests/test_guard_hidden_nan.py \
                 tests/test_attention_op.py::test_efficient_kernel_on_saturated_rows \
                 tests/test_hf_masks.py::test_hf_eager_left_padding_on_cuda_runs_a_causal_kernel_with_a_key_padding_bias \
                 tests/test_hf_masks.py::test_cuda_sdpa_kernels_on_rows_that_keep_no_key \
                 tests/test_hf_masks.py::test_cuda_efficient_kernel_under_the_left_padding_mask_equals_the_causal_flag \
                 tests/test_attention_models.py::test_benchmark_attention_patterns_fused_gpu ;;
    bench)     python3 -m enn_backend bench --preset gpu --out "$OUT/bench" ;;
    # third-party models (transformers, timm, torchvision); its own budget keeps it under 7 minutes, the
    # timeout (SIGINT) backs that up: results are rewritten after every workload, so a cut run keeps them
    real)      timeout -s INT -k 15 390 python3 -m enn_backend bench --preset real $ONLY --out "$OUT/real" ;;
    # HF models as users leave them (config defaults, gradient checkpointing) next to their twins; the same budget and timeout
    realdefaults) timeout -s INT -k 15 390 python3 -m enn_backend bench --preset real-defaults $ONLY --out "$OUT/realdefaults" ;;
    # issue #43: the host-bound models under each backend's default mode and CUDA graphs (the suite), then
    # what the suite does not show: state after N steps, dynamic padding, HF generate with a static cache
    hostbound) timeout -s INT -k 15 560 python3 -m enn_backend bench --preset host-bound $ONLY --budget 420 --out "$OUT/hostbound" ;;
    state|padding|generate) timeout -s INT -k 15 560 python3 -m enn_backend bench --tool gpu_host_bound --part $stage --budget-s ${BUDGET:-420} --out "$OUT" ;;
    fp8)       timeout -s INT -k 15 560 python3 -m enn_backend bench --tool gpu_fp8_llama --out "$OUT" ${FP8_ARGS:-} ;;
    # issue #42: FP8 loss curves against bf16's spread, faults scoped to one layer (a process each), the guard's cost
    fp8train)  timeout -s INT -k 15 560 python3 -m enn_backend bench --tool gpu_fp8_training --out "$OUT" ${FP8TRAIN_ARGS:-} ;;
    # issue #40: the first step's time against depth (HF LLaMA d=1024), Inductor and enn blocks=on, each run a new process
    blocks)    timeout -s INT -k 15 560 python3 bench/gpu_blocks_depth.py --layers ${BLOCKS_LAYERS:-2,8,32} \
                 --variants ${BLOCKS_VARIANTS:-inductor,enn-blocks} --steps 10 --out "$OUT/blocks" ;;
    cudagraphs) python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_cudagraph_cap.py tests/test_cudagraphs.py ;;
    demo)      python3 -m enn_backend demo ;;
    *) echo "unknown stage $stage" ;;
  esac 2>&1 | tee "$OUT/$stage.log" | tail -40
done
echo "=== done ($(date +%T))"
