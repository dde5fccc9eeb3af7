#!/usr/bin/env bash
# The last H200 call of 2026-12-02: real TE 2.20.2 from .te-kit; the whole stack from
# .devrun/patches (a copy of patches/): TE's FusedAdam tests, the stager's GPU tests (the
# working tree's te_fusedadam_offload.staging), the FSDP2 cases at world size 1, TE's FusedAdam
# tests with both options forced on; then PR 1 alone: its TE tests. Stages in priority order;
# none starts or runs past BUDGET_S seconds from the start.
#   usage (on the device, repository root): BUDGET_S=380 bash .devrun/final.sh   (writes $OUT)
set -uo pipefail
REPO=$(pwd); START=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/final; mkdir -p "$L"
exec > >(tee "$L/driver.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
git_rev=$(cat .devrun/head_commit 2>/dev/null); echo "repository at $git_rev (+ working tree)"
t0=$(date +%s); line=$(bash .te-kit/install.sh .te-kit 2>/tmp/install.log | tail -1) && eval "$line"
echo "TE installed in $(( $(date +%s) - t0 )) s: $PYTHONPATH"
SITE=/tmp/te-site; FA=$SITE/transformer_engine/pytorch/optimizers/fused_adam.py; P=$REPO/.devrun/patches
original() {
    python3 -c "import zipfile,sys; sys.stdout.buffer.write(zipfile.ZipFile('.te-kit/transformer_engine-2.20.2-py3-none-any.whl').read('transformer_engine/pytorch/optimizers/fused_adam.py'))" > $FA
}
python3 -W ignore -c "import torch, transformer_engine as t; print('torch', torch.__version__, 'te', t.__version__)"
T_END=$(( START + ${BUDGET_S:-100000} ))
stage() {  # stage NAME TIMEOUT COMMAND...
    local name=$1 limit=$2; shift 2; local t0=$(date +%s)
    local left=$(( T_END - t0 )); [ $left -lt 15 ] && { echo "== $name: not run (device budget)"; return; }
    [ $left -lt $limit ] && limit=$left
    timeout "$limit" "$@" > "$L/$name.log" 2>&1; local rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^ERROR" "$L/$name.log" | tail -8
}
fsdp2() {  # fsdp2 TESTS_ROOT XML: the FSDP2 cases at world size 1
    echo "cd $1/distributed/fsdp2_tests && PYTHONPATH=$PYTHONPATH:$1 torchrun --nproc_per_node=1 -m pytest \
        -q -rs -p no:cacheprovider run_fsdp2_fused_adam.py -k state_dict_cpu_offload"
}
original; (cd $SITE && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch \
    $P/2-load-without-casts/0001-*.patch $P/3-bounded-load/0001-*.patch) && echo "stack applied"
sha256sum $FA
T=$REPO/.devrun/stack/tests/pytorch
stage stack_single 90 python3 -m pytest -q -rs -p no:cacheprovider $T/test_fused_optimizer.py --junitxml=$L/stack_single.xml
stage stager 150 env PYTHONPATH=$REPO:$PYTHONPATH python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m pytest -q -rs -p no:cacheprovider tests/staging --junitxml=$L/stager.xml
stage stack_fsdp2 70 bash -c "$(fsdp2 $T)"
stage forced_on 40 python3 -c "
import sys, pytest, transformer_engine.pytorch as te
te.optimizers.FusedAdam.__init__.__kwdefaults__['state_dict_cpu_offload'] = True
te.optimizers.FusedAdam.__init__.__kwdefaults__['load_state_dict_in_place'] = True
sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '$T/test_fused_optimizer.py', '-k', 'TestFusedAdam and not StateDictCPUOffload and not LoadStateDict']))"
original; (cd $SITE && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch) && echo "PR 1 alone applied"
sha256sum $FA
T1=$REPO/.devrun/pr1/tests/pytorch
stage pr1_single 60 python3 -m pytest -q -rs -p no:cacheprovider $T1/test_fused_optimizer.py
date -u
cd "$OUT" && tar czf final.tar.gz final && rm -rf final
