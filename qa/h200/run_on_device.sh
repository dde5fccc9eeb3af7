#!/usr/bin/env bash
# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.
#
# Run the GPU tier on a GPU machine: install real TE from a kit (see CONTRIBUTING.md), or use
# the TE that python3 imports (KIT_DIR "-"), patch it with the series, run the chosen stages.
#   usage: TE_PATH=te-main qa/h200/run_on_device.sh KIT_DIR|- LOG_DIR STAGE...
# A kit is a directory with an install.sh that installs TE offline: bash install.sh KIT SITE
# puts an importable transformer_engine (with its torch extension) under SITE.
# With STACK_PREFIX=N, only the first N pull requests of the stack are applied to the installed
# TE (te-fusedadam-offload apply --installed --upto N; a later run without it applies the whole
# stack), and TE_PATH should hold TE's test files as those pull requests leave them.
#   stages: single  dist  bench  bench_omp1  export  load  nightly  dcp  dcp_oom  stall  stager
# (load: the load grid, BF16/FP16/FP8 x 16 and one intra-op thread, TE's load of the CPU
# export)
# (stall: the checkpoint stall benchmark on all GPUs, STALL_ARGS its arguments; stager: the GPU
# tests of te_fusedadam_offload.staging on all GPUs)
# The test files are TE's, as the series changes them, from TE_PATH (default te-main, the
# patched upstream main tree of 'python -m te_fusedadam_offload materialize --source ...'; carry its
# tests/pytorch to the machine). SINGLE_ARGS / DIST_ARGS add pytest arguments (e.g. -k),
# SINGLE_TIMEOUT / DIST_TIMEOUT bound those stages in seconds.
# Every stage logs to LOG_DIR/STAGE.log (JUnit XML and benchmark rows beside it); the script
# exits non-zero if any stage failed.
set -uo pipefail
KIT=${1:?kit dir}; LOG=${2:?log dir}; shift 2
mkdir -p "$LOG"
TE_PATH=$(cd "${TE_PATH:-te-main}" 2>/dev/null && pwd || echo "${TE_PATH:-te-main}")
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=/tmp/te-site
if [ "$KIT" = - ]; then  # the TE that python3 imports, where it is installed
    SITE=$(cd / && python3 -c "import importlib.util, os; s = importlib.util.find_spec('transformer_engine'); print(os.path.dirname(list(s.submodule_search_locations)[0]))") \
        || { echo "KIT_DIR is -, but python3 finds no transformer_engine"; exit 1; }
elif ! PYTHONPATH=$SITE python3 -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
    start=$(date +%s)
    bash "$KIT/install.sh" "$KIT" "$SITE" >>"$LOG/setup.log" 2>&1 || { tail -40 "$LOG/setup.log"; exit 1; }
    echo "TE installed in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/tool-site . \
    >>"$LOG/setup.log" 2>&1 || { tail -40 "$LOG/setup.log"; exit 1; }
export PATH=/tmp/tool-site/bin:$PATH PYTHONPATH=$PYTHONPATH:/tmp/tool-site
te-fusedadam-offload apply --installed ${STACK_PREFIX:+--upto "$STACK_PREFIX"} 2>&1 \
    | tee -a "$LOG/setup.log" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG/setup.log"
python3 -W ignore -c "import torch, transformer_engine as t; print('torch', torch.__version__, 'te', t.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$LOG/setup.log"

status=0
run() {  # run NAME COMMAND...: log, time, remember failure
    local name=$1; shift
    local t0=$(date +%s)
    "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    echo "stage $name: rc=$rc in $(( $(date +%s) - t0 )) s"
    tail -5 "$LOG/$name.log"
    [ $rc -eq 0 ] || status=1
}
BENCH=benchmarks/fused_adam_state_dict/benchmark_state_dict_offload.py
DCP_BENCH=benchmarks/fused_adam_state_dict/benchmark_dcp_checkpoint.py
NGPUS=$(nvidia-smi -L | wc -l)
# Shell words, quotes kept: SINGLE_ARGS='-k "load and not gpu_memory"'.
eval "single_args=(${SINGLE_ARGS:-})"
eval "dist_args=(${DIST_ARGS:-})"
for stage in "$@"; do
    case $stage in
    single) run single timeout ${SINGLE_TIMEOUT:-900} python3 -m pytest -q -rs --durations=5 \
        "$TE_PATH/tests/pytorch/test_fused_optimizer.py" \
        --junitxml="$LOG/single.xml" "${single_args[@]}" ;;
    dist) run dist timeout ${DIST_TIMEOUT:-1200} python3 -m pytest -v -rs -s \
        "$TE_PATH/tests/pytorch/distributed/test_torch_fsdp2.py" -k "fused_adam and not hybrid" \
        --junitxml="$LOG/dist.xml" "${dist_args[@]}" ;;
    bench) run bench timeout 900 python3 $BENCH --csv "$LOG/bench.csv" ${BENCH_ARGS:-} ;;
    bench_omp1) run bench_omp1 env OMP_NUM_THREADS=1 timeout 900 python3 $BENCH --csv "$LOG/bench.csv" ${BENCH_OMP1_ARGS:-${BENCH_ARGS:-}} ;;
    dcp) run dcp timeout ${DCP_TIMEOUT:-900} python3 -m torch.distributed.run --standalone \
        --nproc_per_node=$NGPUS $DCP_BENCH --out "$LOG/dcp.jsonl" ${DCP_ARGS:-} ;;
    dcp_oom) run dcp_oom timeout ${DCP_TIMEOUT:-900} python3 -m torch.distributed.run --standalone \
        --nproc_per_node=$NGPUS $DCP_BENCH --oom-demo --out "$LOG/dcp_oom.jsonl" ${DCP_ARGS:-} ;;
    export) for m in bf16 fp16 fp8; do  # issue 14's grid: N = 2^30 in 2^24-element params
            for omp in "" 1; do
                run "export_$m${omp:+_omp$omp}" env ${omp:+OMP_NUM_THREADS=$omp} timeout 300 \
                    python3 $BENCH --moments $m --total-log2 30 --largest-log2 24 \
                    --modes default_then_cpu offload --csv "$LOG/export.csv"
            done
        done
        grep -h '^{' "$LOG"/export_*.log >"$LOG/export.jsonl" ;;
    load) for m in bf16 fp16 fp8; do
            for omp in "" 1; do
                run "load_$m${omp:+_omp$omp}" env ${omp:+OMP_NUM_THREADS=$omp} timeout 300 \
                    python3 $BENCH --moments $m --total-log2 30 --largest-log2 24 \
                    --modes load_default
            done
        done
        grep -h '^{"te' "$LOG"/load_*.log >"$LOG/load.jsonl" ;;
    stall) run stall timeout ${STALL_TIMEOUT:-900} python3 -m torch.distributed.run --standalone \
        --nproc_per_node=$NGPUS benchmarks/fused_adam_state_dict/benchmark_checkpoint_stall.py \
        --out "$LOG/stall.jsonl" ${STALL_ARGS:-} ;;
    stager) run stager timeout ${STAGER_TIMEOUT:-600} python3 -m torch.distributed.run --standalone \
        --nproc_per_node=$NGPUS -m pytest -q -rs tests/staging ;;
    nightly) run nightly env XML_LOG_DIR="$LOG" TE_PATH="$TE_PATH" bash qa/L1_pytorch_fused_adam_state_dict_offload/test.sh ;;
    *) echo "unknown stage $stage"; status=1 ;;
    esac
done
exit $status
