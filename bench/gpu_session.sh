#!/usr/bin/env bash
# One call on the lent GPU machine: install enn (no network there), then run the named stages.
#   bash bench/gpu_session.sh guard epilogue       (stages: doctor guard guardinf epilogue attention precision tests hfguard bench real demo)
# Each stage's output goes to $OUT/<stage>.log and its JSON to $OUT. The tools run through the
# front door (python -m enn_backend bench --tool NAME ARGS = python bench/NAME.py ARGS).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/enn_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    doctor)    python3 -m enn_backend doctor ;;
    guard)     python3 -m enn_backend bench --tool guard_overhead --device cuda --rounds 7 --steps 10 --out "$OUT" ;;
    guardinf)  python3 -m enn_backend bench --tool guard_overhead --device cuda --mode infer --rounds 7 --steps 10 --out "$OUT/infer" ;;
    epilogue)  python3 -m enn_backend bench --tool gpu_epilogue ;;
    attention) python3 -m enn_backend bench --tool gpu_attention ;;
    precision) python3 -m enn_backend bench --tool gpu_precision ;;
    tests)     python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/ ;;
    hfguard)   python3 bench/gpu_hf_guard.py ;;      # a correctness check (bench/README.md)
    bench)     python3 -m enn_backend bench --preset gpu --out "$OUT/bench" ;;
    # third-party models (transformers, timm, torchvision); its own budget keeps it under 7 minutes, the
    # timeout (SIGINT) backs that up: results are rewritten after every workload, so a cut run keeps them
    real)      timeout -s INT -k 15 390 python3 -m enn_backend bench --preset real --out "$OUT/real" ;;
    demo)      python3 -m enn_backend demo ;;
    *) echo "unknown stage $stage" ;;
  esac 2>&1 | tee "$OUT/$stage.log" | tail -40
done
echo "=== done ($(date +%T))"
