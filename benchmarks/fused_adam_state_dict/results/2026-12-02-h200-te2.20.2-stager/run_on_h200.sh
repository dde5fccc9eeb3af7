#!/usr/bin/env bash
# One H200 call: real TE 2.20.2 from .te-kit, patched with the committed series (HEAD's tree
# in .devrun/headtree), then the stager's GPU tests (the working tree's stager) and the stall
# rows of the recommended recipe with the stager before (.devrun/before, the module at
# 3511af6) and after (the working tree), one process each, in this order.
set -uo pipefail
OUT=${OUT:?}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
SITE=/tmp/te-site-stager; rm -rf $SITE
# The committed series, from a checkout of HEAD (the tool finds series.toml there).
apply() { (cd .devrun/headtree && PYTHONPATH=$SITE python3 -m te_fusedadam_offload apply --installed) >>"$OUT/setup.log" 2>&1; }
fast=0
if [ -d /tmp/te-site ] && PYTHONPATH=/tmp/te-site python3 -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
    # A warm machine: its built TE, with the release's Python files put back, then patched.
    cp -a /tmp/te-site $SITE && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target $SITE .te-kit/transformer_engine-2.20.2-py3-none-any.whl >>"$OUT/setup.log" 2>&1 && apply && fast=1
    echo "warm machine: TE copied from /tmp/te-site, fast=$fast" >>"$OUT/setup.log"
fi
if [ $fast = 0 ]; then
    rm -rf $SITE
    bash .te-kit/install.sh .te-kit $SITE >>"$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
    apply || { tail -30 "$OUT/setup.log"; exit 1; }
fi
export PYTHONPATH=$SITE
stamp "TE ready (fast=$fast)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$OUT/setup.log"
python3 -W ignore -c "import torch, transformer_engine as t; print('torch', torch.__version__, 'te', t.__version__, 'gpus', torch.cuda.device_count(), 'cpus', __import__('os').cpu_count())" >>"$OUT/setup.log" 2>&1
git_rev=$(cat .devrun/head_commit 2>/dev/null); echo "series and tool from commit $git_rev; stager from the working tree" >>"$OUT/setup.log"
stamp "applied"; tail -3 "$OUT/setup.log"
export PYTHONPATH=$PWD:$PYTHONPATH
stamp "tests"
timeout ${TEST_TIMEOUT:-240} python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m pytest -q -rs -p no:cacheprovider tests/staging --junitxml="$OUT/stager.xml" >"$OUT/stager.log" 2>&1
stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/stager.log" | tail -15
STALL=(--local-log2 29 --modes offload --iterations short --checkpoints 4 --variants none te_snapshot)
for which in after before; do
    pp=$PYTHONPATH; [ $which = before ] && pp=$PWD/.devrun/before:$PYTHONPATH
    stamp "stall $which"
    PYTHONPATH=$pp timeout ${STALL_TIMEOUT:-120} python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
        benchmarks/fused_adam_state_dict/benchmark_checkpoint_stall.py "${STALL[@]}" \
        --out "$OUT/stall_$which.jsonl" >"$OUT/stall_$which.log" 2>&1
    stamp "stall $which rc=$?"
    grep -h '"te_snapshot"' "$OUT/stall_$which.jsonl" | python3 -c "import sys, json; [print(r['variant'], r['n'], 'stall', r['stall_s'], 'returned', r['returned_s'], 'iter', r['iteration_s']) for r in map(json.loads, sys.stdin)]"
done
python3 -c "import importlib.util as u; print('torch_checkpointing', u.find_spec('torch_checkpointing') is not None)"
stamp done
