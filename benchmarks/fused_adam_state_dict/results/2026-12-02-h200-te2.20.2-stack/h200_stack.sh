#!/usr/bin/env bash
# The H200 runs of 2026-12-02 for the stack with the thread override and the in-place load as
# its own option. Phase A: install TE 2.20.2 from .te-kit, PR 1 alone (its tests as it leaves
# them, single GPU and the FSDP2 cases at world size 1), the thread rows (8 and 1 processes at
# once). Phase B: the whole stack (tests, FSDP2 cases, TE's FusedAdam tests with both options
# forced on), the load-memory rows (default vs in-place load, in one process per shape).
#   usage (on the device, repository root): bash .devrun/h200_stack.sh A|B   (writes $OUT)
set -uo pipefail
REPO=$(pwd); PHASE=${1:?A or B}; START=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/phase$PHASE; mkdir -p "$L"
exec > >(tee "$L/driver.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
if PYTHONPATH=/tmp/te-site python3 -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
    export PYTHONPATH=/tmp/te-site; echo "TE already installed"
else
    t0=$(date +%s); line=$(bash .te-kit/install.sh .te-kit 2>"$L/install.log" | tail -1) && eval "$line"
    echo "TE installed in $(( $(date +%s) - t0 )) s: $PYTHONPATH"; tail -3 "$L/install.log"
fi
SITE=/tmp/te-site; FA=$SITE/transformer_engine/pytorch/optimizers/fused_adam.py; P=$REPO/.devrun/patches
original() {
    python3 -c "import zipfile,sys; sys.stdout.buffer.write(zipfile.ZipFile('.te-kit/transformer_engine-2.20.2-py3-none-any.whl').read('transformer_engine/pytorch/optimizers/fused_adam.py'))" > $FA
}
python3 -W ignore -c "import torch, transformer_engine as t; print('torch', torch.__version__, 'te', t.__version__)"
T_END=$(( START + ${BUDGET_S:-100000} ))  # no stage starts or runs past it
stage() {  # stage NAME TIMEOUT COMMAND...
    local name=$1 limit=$2; shift 2; local t0=$(date +%s)
    local left=$(( T_END - t0 )); [ $left -lt 10 ] && { echo "== $name: not run (device budget)"; return; }
    [ $left -lt $limit ] && limit=$left
    timeout "$limit" "$@" > "$L/$name.log" 2>&1; local rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"; grep -v "^  \|Warning\|warn" "$L/$name.log" | tail -4
}
fsdp2() {  # fsdp2 TESTS_ROOT XML: the command line of the FSDP2 cases at world size 1
    echo "cd $1/distributed/fsdp2_tests && PYTHONPATH=$PYTHONPATH:$1 torchrun --nproc_per_node=1 -m pytest \
        -q -rs -p no:cacheprovider run_fsdp2_fused_adam.py -k state_dict_cpu_offload --junitxml=$2"
}
if [ "$PHASE" = A ]; then
    original; (cd $SITE && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch) && echo "PR 1 applied"
    sha256sum $FA
    T=$REPO/.devrun/pr1/tests/pytorch
    stage pr1_single 150 python3 -m pytest -q -rs -p no:cacheprovider $T/test_fused_optimizer.py --junitxml=$L/pr1_single.xml
    stage pr1_fsdp2 120 bash -c "$(fsdp2 $T $L/pr1_fsdp2.xml)"
    stage threads 240 python3 benchmarks/fused_adam_state_dict/benchmark_state_dict_threads.py \
        --processes 8 1 --threads 16 2 1 --rounds 4 --numel-log2 28 --out $L/threads.jsonl
else
    original; (cd $SITE && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch \
        $P/2-load-without-casts/0001-*.patch $P/3-bounded-load/0001-*.patch) && echo "stack applied"
    sha256sum $FA
    T=$REPO/.devrun/stack/tests/pytorch
    stage stack_single 70 python3 -m pytest -q -rs -p no:cacheprovider --durations=5 $T/test_fused_optimizer.py --junitxml=$L/stack_single.xml
    for config in "fp8 fp32" "bf16 fp16"; do
        set -- $config
        stage load_memory_$1_master_$2 40 python3 benchmarks/fused_adam_state_dict/benchmark_state_dict_offload.py \
            --moments $1 --master $2 --total-log2 30 --largest-log2 0 --square --modes load_default load_in_place
    done
    stage stack_fsdp2 55 bash -c "$(fsdp2 $T $L/stack_fsdp2.xml)"
    stage forced_on 30 python3 -c "
import sys, pytest, transformer_engine.pytorch as te
te.optimizers.FusedAdam.__init__.__kwdefaults__['state_dict_cpu_offload'] = True
te.optimizers.FusedAdam.__init__.__kwdefaults__['load_state_dict_in_place'] = True
sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '$T/test_fused_optimizer.py', '-k', 'TestFusedAdam and not StateDictCPUOffload and not LoadStateDict', '--junitxml=$L/forced_on.xml']))"
    stage load_memory_bf16_master_fp32 40 python3 benchmarks/fused_adam_state_dict/benchmark_state_dict_offload.py \
        --moments bf16 --master fp32 --total-log2 30 --largest-log2 0 --square --modes load_default load_in_place
    grep -h '^{"te' $L/load_memory_*.log > $L/load_memory.jsonl
fi
date -u
cd "$OUT" && tar czf phase$PHASE.tar.gz phase$PHASE && rm -rf phase$PHASE
