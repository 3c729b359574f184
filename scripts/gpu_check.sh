#!/usr/bin/env bash
# fedflat's GPU checks and benchmarks (issue 14), one stage per call, results under OUT (default: gpu-results).
# Run from the repository root on a CUDA machine:  scripts/gpu_check.sh STAGE...
#   tests     the test suite with --device cuda (tests/test_cuda.py included), 8 processes
#   bench     fedflat bench on W1 and W2: sequential, vectorized, bare loop
#   bench3    W3 (ResNet-18-GN, FL-Simulator's setting) in TF32 with torch.profiler tables, FedAvg in float32
#   fast3     W3 with the options meant to close its targets: channels-last, then bf16 autocast (both in TF32)
#   memory    automatic chunk sizes with ResNet-34 at 10 and 100 clients per round (peak memory, OOM retries)
#   converge  FedAvg, FedSAM, FedLESAM with ResNet-18-GN on Fashion-MNIST, all three at once on the GPU
#             (data.root: $FMNIST, default .gpu/fmnist; extra overrides: $CONVERGE_OVERRIDES)
# A machine without fedflat's dependencies gets them from wheels in .whl/ (docs/benchmarks.md says which).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if ! python3 -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
# fedflat itself, editable, without touching the machine's torch (the tests also run the `fedflat` command)
python3 -c "import fedflat" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || export PYTHONPATH="$PWD"
export PYTHONUNBUFFERED=1
FEDFLAT="python3 -m fedflat.cli"
BENCH="$FEDFLAT bench --device cuda --algos fedavg,fedsam"

for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    tests)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      timeout 330 python3 -m pytest -q -p no:cacheprovider --device cuda -n 8 --tb=short -rfE tests/ \
        > "$OUT/pytest_cuda.txt" 2>&1
      echo "pytest rc $?"; tail -n 25 "$OUT/pytest_cuda.txt" ;;
    bench)
      timeout 240 $BENCH --workload W1,W2 --rounds 5 --json "$OUT/bench_w1_w2.json" --quiet ;;
    bench3)
      timeout 150 $BENCH --workload W3 --rounds 2 --json "$OUT/bench_w3_tf32.json" --quiet \
        --profile /tmp/profiles tf32=true
      tar czf "$OUT/profiles.tgz" -C /tmp profiles
      timeout 60 $FEDFLAT bench --device cuda --algos fedavg --workload W3 --rounds 1 \
        --json "$OUT/bench_w3_fp32.json" --quiet ;;
    profile3)
      timeout 100 $FEDFLAT bench --device cuda --algos fedavg --engines sequential,bare --workload W3 --rounds 1 \
        --json "$OUT/bench_w3_tf32_fedavg.json" --quiet --profile /tmp/profiles tf32=true
      tar czf "$OUT/profiles.tgz" -C /tmp profiles ;;
    fast3)
      for opts in "channels_last=true" "channels_last=true precision=bf16"; do
        timeout 150 $BENCH --workload W3 --engines sequential,bare --rounds 2 --quiet \
          --json "$OUT/bench_w3_$(echo "$opts" | tr ' =' '_-').json" tf32=true $opts
      done ;;
    memory)
      for k in 10 100; do
        timeout 200 $FEDFLAT bench --device cuda --workload W3 --algos fedsam,fedsmoo --engines vectorized \
          --rounds 1 --warmup 0 --json "$OUT/memory_resnet34_$k.json" --quiet model=resnet34 \
          data.num_clients=100 data.options.train_size=50000 sampling.clients_per_round=$k train.local_steps=2
      done ;;
    converge)
      timeout "${CONVERGE_SECONDS:-540}" $FEDFLAT sweep configs/gpu_converge.yaml data.root="${FMNIST:-.gpu/fmnist}" \
        ${CONVERGE_OVERRIDES:-} --no-progress --workers 3 --out /tmp/gpu_converge > "$OUT/converge.txt" 2>&1
      echo "sweep rc $?"; tail -n 5 "$OUT/converge.txt"
      $FEDFLAT report /tmp/gpu_converge --target-acc 0.8 0.85 | tee "$OUT/converge_report.txt"
      tar czf "$OUT/converge_runs.tgz" -C /tmp gpu_converge ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
