#!/usr/bin/env bash
# The GPU run, one command, from the repository root of a machine with a CUDA GPU:
#
#     bash benchmarks/gpu_run.sh     # logs and results go to $OUT (default benchmarks/results/gpu)
#
# Stages, each under its own timeout so that one hang cannot eat the rest (about 7 minutes at
# worst, 4-5 expected):
#   1. the machine: nvidia-smi, Python, torch, transformers, pytest versions   -> env.log
#   2. tests/test_cuda.py on the GPU (180 s)                                      -> cuda_tests.log
#      and, beside it, the CPU test suite under this machine's torch with the GPU hidden, in
#      parallel with pytest-xdist when it is there (150 s; one line per test, so a run cut short
#      still says what passed): a torch-version check                             -> cpu_tests.log
#   3. benchmarks/gpu_bench.py on the GPU (240 s; it starts no model after 150 s)
#      -> cuda_bench.log, results_cuda.md, results_cuda.csv, results_cuda.png
# The package is used from src/ (PYTHONPATH), nothing is installed. A dry run without a GPU:
#     OUT=/tmp/gpu BENCH_ARGS="--quick --device cpu" bash benchmarks/gpu_run.sh
set -u -o pipefail
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
start=$SECONDS
stage() { echo "=== [$((SECONDS - start)) s] $*"; }
has() { python3 -c "import $1" >/dev/null 2>&1; }

stage "1. machine"
{
    nvidia-smi
    python3 - <<'EOF'
import sys

import torch

print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for name in ("transformers", "pytest", "hypothesis", "matplotlib", "xdist", "pytest_timeout"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except ImportError as exc:
        print(name, "MISSING", exc)
EOF
} 2>&1 | tee "$OUT/env.log"

stage "2. CUDA tests, and the CPU suite beside them (GPU hidden)"
cpu_opts=()
if has xdist; then cpu_opts+=(-n 10); fi
(
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout -k 5 150 python3 -m pytest tests \
        --ignore=tests/test_cuda.py -p no:cacheprovider -rfE -vv ${cpu_opts[@]+"${cpu_opts[@]}"} \
        >"$OUT/cpu_tests.log" 2>&1
    echo "cpu suite exit status $?" >>"$OUT/cpu_tests.log"
) &
cpu_pid=$!
cuda_opts=()
if has pytest_timeout; then cuda_opts+=(--timeout 90); fi
# -vv -s: each test's name and printed figures as it runs, so a run cut short still tells
timeout -k 5 180 python3 -m pytest tests/test_cuda.py -p no:cacheprovider -vv -s -rfE \
    --tb=short --durations=15 ${cuda_opts[@]+"${cuda_opts[@]}"} 2>&1 | tee "$OUT/cuda_tests.log"
echo "cuda tests exit status ${PIPESTATUS[0]}" | tee -a "$OUT/cuda_tests.log"
stage "waiting for the CPU suite"
wait "$cpu_pid"

stage "3. GPU benchmark"
# shellcheck disable=SC2086  # BENCH_ARGS (e.g. "--quick --device cpu" for a dry run) splits
timeout -k 5 240 python3 benchmarks/gpu_bench.py --out "$OUT" --time-limit 150 ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/cuda_bench.log"
echo "benchmark exit status ${PIPESTATUS[0]}" | tee -a "$OUT/cuda_bench.log"

stage "summary"
echo "--- CUDA tests:"
grep -E "FAILED|ERROR|passed|failed|exit status" "$OUT/cuda_tests.log" | tail -40
echo "--- CPU suite under this torch:"
grep -E "FAILED|ERROR|passed|failed|exit status" "$OUT/cpu_tests.log" | tail -40
ls -la "$OUT"
stage "done"
