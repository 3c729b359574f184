#!/usr/bin/env bash
# fedflat's GPU checks and benchmarks (issues 14, 48), results under OUT (default: gpu-results).
# Run from the repository root on a CUDA machine:  scripts/gpu_check.sh STAGE...
#   tests     the test suite with --device cuda (tests/test_cuda.py included), $PYTEST_N processes (default 8);
#             $PYTEST_ARGS: other test files or node ids
#   bench     fedflat bench on W1 and W2: sequential, vectorized, bare loop
#   bench3    W3 (ResNet-18-GN, FL-Simulator's setting) in TF32 with torch.profiler tables, FedAvg in float32
#   fast3     W3 in TF32, then with channels-last, bf16 autocast, and both, beside the bare loop doing the same
#   profile3  one profiled W3 round of FedAvg with channels-last and bf16 (what bounds the fast round)
#   vec3      the vectorized engine on W3 with bf16 (FedAvg), beside the sequential engine
#   models    DenseNet-121 (W3's images) and ViT-B/32 (224x224 images) local-step times, bf16
#   memory    automatic chunk sizes with ResNet-34 at $MEMORY_CLIENTS clients per round (default "10 100")
#   converge  FedAvg, FedSAM, FedLESAM (bf16, channels-last) and FedAvg (TF32) with ResNet-18-GN on Fashion-MNIST,
#             all four at once on the GPU, for at most $CONVERGE_SECONDS (default 540); the runs' metrics come
#             back in converge_runs.tgz (data.root: $FMNIST, default .gpu/fmnist; extra overrides: $CONVERGE_OVERRIDES)
#   graphs3   W3 with cuda_graphs=true: bf16, bf16 with channels-last, TF32 (or only $GRAPHS_OPTS, one option set);
#             sequential beside the bare loop, then the vectorized engine (FedAvg and FedSAM)
#   lease3    the third lease's batch: graphs3 alone on the GPU, then tests and memory side by side, all packed into
#             $OUT/session.tgz (as session does)
#   streams3  W3 in bf16 with CUDA graphs: the sequential engine beside the streams engine (FedAvg, FedSAM), then one
#             profiled streams round of 5 local steps (what bounds it)
#   pack      the FedWMSAM Table 1 FMNIST sweep's gpu-pack variant (7 cells) one cell at a time, then --workers auto
#             (data.root: $FMNIST, default .gpu/fmnist; $PACK_ORDER, default "1 auto"; $PACK_OVERRIDES, e.g.
#             rounds=100; $PACK_SECONDS a sweep); cells per hour by scripts/pack_report.py
#   pack3     the W3-sized sweep (configs/gpu_w3_sweep.yaml, 4 cells) one cell at a time, then --workers auto
#   lease4    the fourth lease's first call: streams3, pack, and the streams and footprint tests on the GPU
#   compile3  W3 in bf16 with CUDA graphs and compile=true (the streams and sequential engines, FedAvg and FedSAM),
#             then the streams engine without compile beside it (the baseline, same machine, same call)
#   profilec3 one profiled round of 5 local steps of the compiled streams engine (what bounds it)
#   lease5    the fifth lease's call: compile3, pack with 80-round cells ($PACK_OVERRIDES), the GPU tests of the
#             compiled, graphed, streams and packing paths, then profilec3
#   lease6    what the fifth lease left: pack with 100-round cells (whole-cell 3x), pack3 again, then the whole
#             suite with --device cuda
#   lora      LoRA r=8 against the bare PyTorch + peft loop (fedflat bench): W6 (ViT-B/16, 224x224) in TF32 and in
#             bf16, W5 (RoBERTa-shaped text) in TF32, one profiled W6 round of each; then the LoRA tests on the GPU
#             (tests/test_lora.py, the bench's and Flower's LoRA tests; needs peft and transformers, from .whl/)
#   session   one lease's batch: fast3, profile3, vec3 and models alone on the GPU (their times are the
#             benchmarks), then converge and tests side by side, then memory while converge runs on
# A machine without fedflat's dependencies gets them from wheels in .whl/ (docs/benchmarks.md says which).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if ! python3 -c "import pydantic, peft, transformers" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
# fedflat itself, editable, without touching the machine's torch (the tests also run the `fedflat` command)
(cd / && python3 -c "import fedflat" 2>/dev/null) || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || export PYTHONPATH="$PWD"
export PYTHONUNBUFFERED=1
FEDFLAT="python3 -m fedflat.cli"
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu with GPU_CHECK_OVERRIDES shrinking the work tries this script on a CPU
BENCH="$FEDFLAT bench --device $DEVICE --algos fedavg,fedsam"

for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    tests)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      timeout "${PYTEST_SECONDS:-330}" python3 -m pytest -v -p no:cacheprovider -p no:benchmark --device $DEVICE -n "${PYTEST_N:-8}" \
        --tb=short -rfE ${PYTEST_ARGS:-tests/} \
        > "$OUT/pytest_cuda.txt" 2>&1
      echo "pytest rc $?"; tail -n 25 "$OUT/pytest_cuda.txt" ;;
    bench)
      timeout 240 $BENCH --workload W1,W2 --rounds 5 --json "$OUT/bench_w1_w2.json" --quiet ${GPU_CHECK_OVERRIDES:-} ;;
    bench3)
      timeout 150 $BENCH --workload W3 --rounds 2 --json "$OUT/bench_w3_tf32.json" --quiet \
        --profile /tmp/profiles tf32=true ${GPU_CHECK_OVERRIDES:-}
      tar czf "$OUT/profiles.tgz" -C /tmp profiles
      timeout 60 $FEDFLAT bench --device $DEVICE --algos fedavg --workload W3 --rounds 1 \
        --json "$OUT/bench_w3_fp32.json" --quiet ${GPU_CHECK_OVERRIDES:-} ;;
    fast3)
      # FedAvg beside its bare loop, FedSAM alone (its bare loop took 13.5 s a round in TF32), each option set
      for opts in "" "channels_last=true precision=bf16" "channels_last=true" "precision=bf16"; do
        name=$(echo tf32 $opts | tr ' =' '_-')
        engines=sequential; [ -z "$opts" ] || [ "$opts" = "channels_last=true precision=bf16" ] && engines=sequential,bare
        timeout 100 $FEDFLAT bench --device $DEVICE --algos fedavg --workload W3 --engines $engines --rounds 1 --quiet \
          --json "$OUT/bench_w3_fedavg_$name.json" tf32=true $opts ${GPU_CHECK_OVERRIDES:-}
        case $opts in *channels_last=true\ precision=bf16|"")
          timeout 100 $FEDFLAT bench --device $DEVICE --algos fedsam --workload W3 --engines sequential --rounds 1 \
            --quiet --json "$OUT/bench_w3_fedsam_$name.json" tf32=true $opts ${GPU_CHECK_OVERRIDES:-} ;;
        esac
      done ;;
    graphs3)
      sets=("precision=bf16" "precision=bf16 channels_last=true" ""); [ -n "${GRAPHS_OPTS+x}" ] && sets=("$GRAPHS_OPTS")
      for opts in "${sets[@]}"; do
        name=$(echo tf32 $opts | tr ' =' '_-')
        engines=sequential; [ "$opts" = "precision=bf16" ] && engines=sequential,bare
        timeout 150 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --workload W3 --engines $engines --rounds 1 \
          --quiet --json "$OUT/bench_w3_graphs_$name.json" tf32=true cuda_graphs=true $opts ${GPU_CHECK_OVERRIDES:-}
      done
      timeout 150 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --workload W3 --engines vectorized --rounds 1 \
        --quiet --json "$OUT/bench_w3_graphs_vectorized_bf16.json" tf32=true cuda_graphs=true precision=bf16 \
        ${GPU_CHECK_OVERRIDES:-} ;;
    streams3)
      timeout 240 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --workload W3 --engines sequential,streams \
        --rounds 1 --quiet --json "$OUT/bench_w3_streams_bf16.json" tf32=true cuda_graphs=true precision=bf16 \
        ${GPU_CHECK_OVERRIDES:-}
      timeout 100 $FEDFLAT bench --device $DEVICE --algos fedavg --engines streams --workload W3 --rounds 1 --quiet \
        --json "$OUT/bench_w3_streams_profile.json" --profile /tmp/profiles_streams tf32=true cuda_graphs=true \
        precision=bf16 train.local_steps=5 ${GPU_CHECK_OVERRIDES:-}
      tar czf "$OUT/profiles_streams.tgz" -C /tmp profiles_streams ;;
    compile3)
      timeout "${COMPILE_SECONDS:-240}" $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --workload W3 \
        --engines streams,sequential --rounds 1 --quiet --json "$OUT/bench_w3_compile_bf16.json" tf32=true \
        cuda_graphs=true precision=bf16 compile=true ${GPU_CHECK_OVERRIDES:-}
      echo "compile bench rc $?"
      timeout 120 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --workload W3 --engines streams --rounds 1 \
        --quiet --json "$OUT/bench_w3_streams_bf16.json" tf32=true cuda_graphs=true precision=bf16 \
        ${GPU_CHECK_OVERRIDES:-}
      echo "baseline bench rc $?" ;;
    profilec3)
      timeout 100 $FEDFLAT bench --device $DEVICE --algos fedavg --engines streams --workload W3 --rounds 1 --quiet \
        --json "$OUT/bench_w3_compile_profile.json" --profile /tmp/profiles_compile tf32=true cuda_graphs=true \
        precision=bf16 compile=true train.local_steps=5 ${GPU_CHECK_OVERRIDES:-}
      tar czf "$OUT/profiles_compile.tgz" -C /tmp profiles_compile ;;
    lease5)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$0" compile3
      PACK_OVERRIDES="${PACK_OVERRIDES:-rounds=80}" "$0" pack
      PYTEST_ARGS="${PYTEST_ARGS:-tests/test_compile.py tests/test_cuda_graphs.py tests/test_packing.py tests/test_cuda.py}" \
        PYTEST_SECONDS="${PYTEST_SECONDS:-120}" "$0" tests
      "$0" profilec3 ;;
    lease6)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      PACK_OVERRIDES="${PACK_OVERRIDES:-rounds=100}" "$0" pack
      "$0" pack3
      PYTEST_N="${PYTEST_N:-12}" "$0" tests ;;
    pack|pack3)
      if [ $stage = pack ]; then
        sweep=(configs/papers/fedwmsam_table1_fmnist.yaml --variant gpu-pack data.root="${FMNIST:-.gpu/fmnist}")
      else
        sweep=(configs/gpu_w3_sweep.yaml)
      fi
      for workers in ${PACK_ORDER:-1 auto}; do
        rm -rf /tmp/$stage-$workers; start=$EPOCHREALTIME
        timeout "${PACK_SECONDS:-300}" $FEDFLAT sweep "${sweep[@]}" device=$DEVICE ${GPU_CHECK_OVERRIDES:-} \
          ${PACK_OVERRIDES:-} --workers $workers --no-progress --out /tmp/$stage-$workers > "$OUT/${stage}_$workers.txt" 2>&1
        rc=$?; wall=$(python3 -c "print(round($EPOCHREALTIME - $start, 2))")
        echo "sweep --workers $workers rc $rc in $wall s" | tee -a "$OUT/${stage}_$workers.txt"
        eval "start_$workers=$start"
        grep "sweep:" "$OUT/${stage}_$workers.txt"
      done
      at_once=$(grep -o "[0-9]* cell(s) at once" "$OUT/${stage}_auto.txt" | head -n 1 | cut -d' ' -f1)
      python3 scripts/pack_report.py /tmp/$stage-1 "$start_1" /tmp/$stage-auto "$start_auto" "${at_once:-1}" \
        | tee "$OUT/${stage}_report.txt"
      (cd /tmp && find $stage-1 $stage-auto -type f ! -name '*.pt' -print0 | tar czf "$OUT/${stage}_runs.tgz" --null -T -) ;;
    lease4)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$0" streams3; "$0" pack
      timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --device $DEVICE -n 4 --tb=short -rfE \
        tests/test_cuda_graphs.py tests/test_packing.py tests/test_engines.py -k "streams or footprint or graphed" \
        > "$OUT/pytest_streams.txt" 2>&1; echo "pytest rc $?"; tail -n 15 "$OUT/pytest_streams.txt" ;;
    lease3)
      results=/tmp/gpu-session; mkdir -p $results
      pack() { tar czf "$OUT/session.tgz.tmp" -C /tmp gpu-session && mv "$OUT/session.tgz.tmp" "$OUT/session.tgz"; }
      OUT=$results "$0" graphs3 > "$results/stage_graphs3.txt" 2>&1; pack; tail -n 40 "$results/stage_graphs3.txt"
      OUT=$results MEMORY_CLIENTS=${MEMORY_CLIENTS:-"10 100"} MEMORY_ALGOS=${MEMORY_ALGOS:-fedsam} \
        "$0" memory > "$results/stage_memory.txt" 2>&1 &
      remembering=$!
      OUT=$results PYTEST_N=${PYTEST_N:-10} PYTEST_SECONDS=${PYTEST_SECONDS:-240} "$0" tests; pack
      wait $remembering; pack; tail -n 20 "$results/stage_memory.txt" ;;
    lora)
      if ! python3 -c "import peft, transformers" 2>/dev/null; then
        echo "lora: peft and transformers are not installed (bring their wheels in .whl/: docs/benchmarks.md)"; continue
      fi
      timeout 200 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --workload W6 --engines sequential,bare \
        --rounds 3 --quiet --json "$OUT/bench_w6_lora_tf32.json" tf32=true ${GPU_CHECK_OVERRIDES:-}
      echo "W6 tf32 rc $?"
      timeout 150 $FEDFLAT bench --device $DEVICE --algos fedavg --workload W6 --engines sequential,bare --rounds 3 \
        --quiet --json "$OUT/bench_w6_lora_bf16.json" tf32=true precision=bf16 ${GPU_CHECK_OVERRIDES:-}
      echo "W6 bf16 rc $?"
      timeout 150 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --workload W5 --engines sequential,bare \
        --rounds 3 --quiet --json "$OUT/bench_w5_lora_tf32.json" tf32=true ${GPU_CHECK_OVERRIDES:-}
      echo "W5 tf32 rc $?"
      timeout 120 $FEDFLAT bench --device $DEVICE --algos fedavg --workload W6 --engines sequential,bare --rounds 1 \
        --warmup 1 --quiet --json "$OUT/bench_w6_lora_profile.json" --profile /tmp/profiles_lora tf32=true \
        ${GPU_CHECK_OVERRIDES:-}
      tar czf "$OUT/profiles_lora.tgz" -C /tmp profiles_lora
      PYTEST_ARGS="${PYTEST_ARGS:-tests/test_lora.py tests/test_lora_flower.py tests/test_bench.py}" \
        PYTEST_SECONDS="${PYTEST_SECONDS:-200}" "$0" tests ;;
    profile3)
      timeout 100 $FEDFLAT bench --device $DEVICE --algos fedavg --engines sequential --workload W3 --rounds 1 \
        --quiet --json "$OUT/bench_w3_profile.json" --profile /tmp/profiles_fast tf32=true channels_last=true \
        precision=bf16 train.local_steps=5 ${GPU_CHECK_OVERRIDES:-}
      tar czf "$OUT/profiles_fast.tgz" -C /tmp profiles_fast ;;
    vec3)
      timeout 150 $FEDFLAT bench --device $DEVICE --algos fedavg --engines sequential,vectorized --workload W3 \
        --rounds 1 --quiet --json "$OUT/bench_w3_vectorized_bf16.json" tf32=true precision=bf16 ${GPU_CHECK_OVERRIDES:-} ;;
    models)
      timeout 120 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --engines sequential,bare --workload W3 \
        --rounds 1 --quiet --json "$OUT/bench_densenet121.json" tf32=true channels_last=true precision=bf16 \
        model=densenet121 train.local_steps=5 ${GPU_CHECK_OVERRIDES:-}
      timeout 120 $FEDFLAT bench --device $DEVICE --algos fedavg,fedsam --engines sequential,bare --workload W3 \
        --rounds 1 --quiet --json "$OUT/bench_vit_b32.json" tf32=true precision=bf16 model=vit model.variant=base32 \
        data.options.shape=[3,224,224] data.options.train_size=1000 train.local_steps=5 ${GPU_CHECK_OVERRIDES:-} ;;
    memory)
      for k in ${MEMORY_CLIENTS:-10 100}; do
        timeout 200 $FEDFLAT bench --device $DEVICE --workload W3 --algos "${MEMORY_ALGOS:-fedsam,fedsmoo}" --engines vectorized \
          --rounds 1 --warmup 0 --json "$OUT/memory_resnet34_$k.json" --quiet model=resnet34 \
          data.num_clients=100 data.options.train_size=50000 sampling.clients_per_round=$k train.local_steps=2 ${GPU_CHECK_OVERRIDES:-}
      done ;;
    converge)
      timeout "${CONVERGE_SECONDS:-540}" $FEDFLAT sweep configs/gpu_converge.yaml data.root="${FMNIST:-.gpu/fmnist}" \
        ${CONVERGE_OVERRIDES:-} ${GPU_CHECK_OVERRIDES:-} --no-progress --workers 4 --out /tmp/gpu_converge > "$OUT/converge.txt" 2>&1
      echo "sweep rc $?"; tail -n 5 "$OUT/converge.txt"
      # the runs' records without their weights (model.pt of ResNet-18 is 45 MB a run)
      (cd /tmp && find gpu_converge -type f ! -name '*.pt' -print0 | tar czf "$OUT/converge_runs.tgz" --null -T -) ;;
    session)
      # Everything lands in /tmp/gpu-session (and the convergence runs in /tmp/gpu_converge) and is packed, weights
      # left out, into $OUT/session.tgz after each stage and every minute: a lease brings back at most 8 files, and
      # a run cut off at its limit keeps what it had. The benchmarks run alone on the GPU; then the convergence
      # runs get what is left of $SESSION_SECONDS (default 560), beside the tests and the memory stage.
      results=/tmp/gpu-session; mkdir -p $results
      pack() { tar czf "$OUT/session.tgz.tmp" -C /tmp --exclude='*.pt' gpu-session $(cd /tmp && ls -d gpu_converge 2>/dev/null) \
        && mv "$OUT/session.tgz.tmp" "$OUT/session.tgz"; }
      for s in fast3 profile3 vec3 models; do OUT=$results "$0" $s; pack; done
      left=$(( ${SESSION_SECONDS:-560} - SECONDS - 20 )); echo "converge gets ${left} s"
      (while sleep 45; do pack; done) & packer=$!
      OUT=$results CONVERGE_SECONDS=$left "$0" converge > "$results/stage_converge.txt" 2>&1 &
      converging=$!
      OUT=$results PYTEST_N=${PYTEST_N:-6} PYTEST_SECONDS=$(( left < 200 ? left : 200 )) "$0" tests; pack
      left=$(( ${SESSION_SECONDS:-560} - SECONDS - 30 ))
      [ $left -gt 30 ] && OUT=$results MEMORY_CLIENTS=${MEMORY_CLIENTS:-100} MEMORY_ALGOS=${MEMORY_ALGOS:-fedsam} \
        timeout $left "$0" memory
      wait $converging; kill $packer; pack; cat "$results/stage_converge.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
