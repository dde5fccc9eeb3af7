#!/usr/bin/env bash
# Call F (2026-12-03): the restart's parts (restart_parts.py) under PyTorch's default pinned
# allocation, its host-register pinning, and that with glibc's malloc asking for transparent
# huge pages; the resume (benchmark_resume.py) with the last, DCP's standard resume beside, and
# again with FusedAdam converting BF16 states loaded from the CPU on the GPU (an edit of the
# installed TE, not in the series). Then PR 1's two new tests (test_export_strided,
# test_export_slow_copy_out) on the stack and on two mutants that must fail (callE.sh), and the
# stager's and reader's GPU tests.
set -u; R=$PWD; L=$OUT; D=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-restart
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
F=transformer_engine/pytorch/optimizers/fused_adam.py
cp -a /tmp/te-site /tmp/site-gpuconv
sed -i 's/scaled_state.copy_(unscaled_state.bfloat16())/scaled_state.copy_(unscaled_state.to(scaled_state.device))/' /tmp/site-gpuconv/$F
t "gpuconv edit: $(diff /tmp/te-site/$F /tmp/site-gpuconv/$F | grep -c '^>') line(s)"
REG=pinned_use_cuda_host_register:True,pinned_num_register_threads:16; HUGE=glibc.malloc.hugetlb=1
P="timeout 60 python3 $D/restart_parts.py"
$P > $L/parts.jsonl 2>$L/parts_default.err; t "parts default rc=$?"
PYTORCH_CUDA_ALLOC_CONF=$REG $P >> $L/parts.jsonl 2>$L/parts_register.err; t "parts register rc=$?"
GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG $P >> $L/parts.jsonl 2>$L/parts_huge.err; t "parts register+huge rc=$?"
cd benchmarks/fused_adam_state_dict
B="timeout 110 torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 2"
GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG PYTHONPATH=/tmp/te-site:$R $B --out $L/resume.jsonl > $L/resume_huge.log 2>&1; t "resume register+huge rc=$?"
GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG PYTHONPATH=/tmp/site-gpuconv:$R $B --out $L/resume_gpuconv.jsonl > $L/resume_gpuconv.log 2>&1; t "resume register+huge+gpuconv rc=$?"
PYTORCH_CUDA_ALLOC_CONF=$REG PYTHONPATH=/tmp/site-gpuconv:$R $B --variants parallel --out $L/resume_gpuconv.jsonl > $L/resume_gpuconv_nohuge.log 2>&1; t "resume register+gpuconv rc=$?"
cd $R
cp -a /tmp/te-site /tmp/site-ring; cp -a /tmp/te-site /tmp/site-flat
sed -i 's/self._pending.popleft().result()  # the oldest/self._pending.popleft()  # the oldest/' /tmp/site-ring/$F
sed -i 's/order = sorted(range(state.dim()), key=state.stride, reverse=True)/order = list(range(state.dim()))/' /tmp/site-flat/$F
for s in ring flat; do t "$s mutant: $(diff /tmp/te-site/$F /tmp/site-$s/$F | grep -c '^>') line(s) changed"; done
run() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; PYTHONPATH=$2 timeout -k 5 120 python3 -m pytest -p no:cacheprovider -rA --tb=line -q \
  $R/.devrun/trees/stack/tests/pytorch/test_fused_optimizer.py -k "export_strided or export_slow_copy_out" > $L/pr1_$1.log 2>&1
  t "pr1 tests on $1 rc=$?: $(tail -1 $L/pr1_$1.log)"; }
run stack /tmp/te-site & run ring /tmp/site-ring & run flat /tmp/site-flat & wait
cd $R; PYTHONPATH=/tmp/te-site:$R timeout -k 10 150 torchrun --standalone --nproc_per_node=1 -m pytest -p no:cacheprovider -q -rs tests/staging > $L/staging.log 2>&1; t "staging rc=$?: $(tail -1 $L/staging.log)"
grep -hE "^(PASSED|FAILED|ERROR)" $L/pr1_*.log | sort | uniq -c
cat $L/parts.jsonl; grep -h '"variant"' $L/resume*.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['variant'], r['alloc_conf'][:8], r.get('template_s'), r.get('dcp_load_s'), r.get('set_s'), r.get('total_s'), r.get('bitwise'), r.get('host_peak_GiB'))"
