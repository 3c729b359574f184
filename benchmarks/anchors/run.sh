#!/usr/bin/env bash
# Side-by-side speed of the SAME W1 FedAvg workload in several FL simulators (see README.md).
#
# usage: bash run.sh ROUNDS REPEATS          (from the repository root: bash benchmarks/anchors/run.sh 11 3)
#   ROUNDS  rounds per process: round 1 is the warm-up (untimed), rounds 2..ROUNDS are timed
#   REPEATS how many times every contestant runs; the order of the contestants is rotated each repeat
#           (repeat r starts with contestant r mod n), so a change of load hits all of them alike
# env: NICE="nice -n 19"    prefix of every run (default: none; use it while other jobs must keep priority)
#      ONLY="bare fedflat"  run only these runners (names: bare fedflat flwr pfl blazefl)
#      ANCHORS=/tmp/anchors venvs, problem file (w1/), logs and results (results/)
#      TIMEOUT=secs         per process (default 120 + 40 * ROUNDS)
# Output: the table (table.py) and results/<stamp>.jsonl + .json + logs/<stamp>/*.log under $ANCHORS.
set -u
ROUNDS=${1:?usage: run.sh ROUNDS REPEATS}
REPEATS=${2:?usage: run.sh ROUNDS REPEATS}
HERE=$(cd "$(dirname "$0")" && pwd)
A=${ANCHORS:-/tmp/anchors}
NICE=${NICE:-}
TIMEOUT=${TIMEOUT:-$((120 + 40 * ROUNDS))}
export ANCHORS_DATA=${ANCHORS_DATA:-$A/w1}
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=ignore
export PYTHONDONTWRITEBYTECODE=1  # (no __pycache__ next to these scripts)
# the torch threads of every process: 1 (the runners call torch.set_num_threads; these cap OpenMP/MKL too)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0 FLWR_TELEMETRY_ENABLED=0 RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
export TQDM_DISABLE=1

# runner|variant|venv|script
CONTESTANTS=(
  "bare|1 thread|fedflat|run_bare.py"
  "fedflat|local|fedflat|run_fedflat.py"
  "fedflat|threads:2|fedflat|run_fedflat.py"
  "fedflat|ray:2|fedflat|run_fedflat.py"
  "flwr|1 actor|flwr|run_flwr.py"
  "flwr|2 actors|flwr|run_flwr.py"
  "pfl|1 process|pfl|run_pfl.py"
  "blazefl|base|blazefl|run_blazefl.py"
  "blazefl|process:2|blazefl|run_blazefl.py"
  "blazefl|process:2/fork|blazefl|run_blazefl.py"
  "blazefl|thread:2|blazefl|run_blazefl.py"
)
if [ -n "${ONLY:-}" ]; then
  kept=()
  for c in "${CONTESTANTS[@]}"; do
    for o in $ONLY; do [ "${c%%|*}" = "$o" ] && kept+=("$c"); done
  done
  CONTESTANTS=("${kept[@]}")
fi

stamp=$(date +%Y%m%d-%H%M%S)
mkdir -p "$A/results" "$A/logs/$stamp"
RES="$A/results/$stamp.jsonl"
: >"$RES"

if [ ! -f "$ANCHORS_DATA/meta.json" ]; then
  echo "exporting the W1 problem to $ANCHORS_DATA (once) ..."
  $NICE "$A/venv-fedflat/bin/python" "$HERE/export_w1.py" --out "$ANCHORS_DATA" || exit 1
fi

echo "W1 FedAvg: $ROUNDS rounds per process (1 warm-up + $((ROUNDS - 1)) timed) x $REPEATS repeats;" \
     "${#CONTESTANTS[@]} contestants; load: $(cut -d' ' -f1-3 /proc/loadavg); nice: '${NICE:-none}'"
n=${#CONTESTANTS[@]}
t0=$(date +%s)
for ((r = 0; r < REPEATS; r++)); do
  for ((i = 0; i < n; i++)); do
    c=${CONTESTANTS[$(((i + r) % n))]}
    IFS='|' read -r runner variant venv script <<<"$c"
    py="$A/venv-$venv/bin/python"
    log="$A/logs/$stamp/$runner-${variant//[^A-Za-z0-9]/_}-r$r.log"
    if [ ! -x "$py" ]; then
      printf '{"runner": "%s", "variant": "%s", "error": "venv %s missing (run setup.sh %s)"}\n' \
        "$runner" "$variant" "$A/venv-$venv" "$venv" >>"$RES"
      echo "  [r$r] $runner $variant: skipped (no venv)"
      continue
    fi
    s=$(date +%s.%N)
    $NICE timeout -k 10 "$TIMEOUT" "$py" "$HERE/$script" --rounds "$ROUNDS" --variant "$variant" >"$log" 2>&1
    rc=$?
    line=$(grep -a '^RESULT ' "$log" | tail -n 1)
    if [ -n "$line" ]; then
      echo "${line#RESULT }" >>"$RES"
      med=$(echo "${line#RESULT }" | "$py" -c 'import json,sys,statistics; s=json.load(sys.stdin)["seconds"]; print(f"{statistics.median(s):.3f}" if s else "-")')
      printf '  [r%d] %-8s %-12s median %s s/round   (process %.0f s)\n' "$r" "$runner" "$variant" "$med" \
        "$(echo "$(date +%s.%N) - $s" | bc)"
    else
      err=$(tail -n 5 "$log" | tr '\n"\\' '   ' | cut -c1-400)
      [ $rc -eq 124 ] && err="timeout after ${TIMEOUT}s: $err"
      printf '{"runner": "%s", "variant": "%s", "error": "rc %s: %s"}\n' "$runner" "$variant" "$rc" "$err" >>"$RES"
      echo "  [r$r] $runner $variant: FAILED rc=$rc (log: $log)"
    fi
  done
done
echo "total $(( $(date +%s) - t0 )) s; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
"${PYTHON:-python3}" "$HERE/table.py" "$RES" --json "${RES%.jsonl}.json"
echo "results: $RES"
