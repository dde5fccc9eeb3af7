#!/usr/bin/env bash
# Call G (2026-12-03): the tests first, at once: the stager's and reader's GPU tests
# (tests/staging); test_fused_optimizer.py of main + the stack on TE 2.20.2 + the stack; PR 3's
# test on TE + PR 3 alone (main's test file + PR 3's test), and on a mutant of PR 3 whose
# pinned branch rounds through FP16 (it must fail). Then, quiet, one after the other:
# restart_parts.py (BF16 states set from pinned and pageable FP32 values, each way) under
# host-register pinning without and with glibc's transparent huge pages, and the resume
# (benchmark_resume.py, warm and cold, DCP's standard resume beside) with the stack.
set -u; R=$PWD; L=$OUT; D=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-restart
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs
bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
F=transformer_engine/pytorch/optimizers/fused_adam.py
cp -a /tmp/te-site /tmp/site-pr3
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch $R/patches/3-bf16-load/0001-*.patch) && t "stack applied"
(cd /tmp/site-pr3 && git apply --include='transformer_engine/*' $R/patches/3-bf16-load/0001-*.patch) && t "PR 3 alone applied"
cp -a /tmp/site-pr3 /tmp/site-mut
sed -i 's/unscaled_state = unscaled_state.to(scaled_state.device)$/unscaled_state = unscaled_state.to(scaled_state.device).half().float()/' /tmp/site-mut/$F
t "PR 3 mutant: $(diff /tmp/site-pr3/$F /tmp/site-mut/$F | grep -c '^>') line(s) changed"
sha256sum /tmp/te-site/$F /tmp/site-pr3/$F | tee -a $L/summary.txt
pt() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; local s=$(date +%s); PYTHONPATH=$2 timeout -k 5 200 python3 -m pytest -p no:cacheprovider -rs --tb=short -q $3 "${@:4}" > /tmp/logs/$1.log 2>&1
  t "$1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/$1.log)"; }
( cd $R; s=$(date +%s); PYTHONPATH=/tmp/te-site:$R timeout -k 10 320 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > $L/staging.log 2>&1
  t "tests/staging rc=$? $(( $(date +%s) - s )) s: $(tail -1 $L/staging.log)" ) &
pt stack /tmp/te-site $R/.devrun/trees/stack/tests/pytorch/test_fused_optimizer.py &
pt pr3 /tmp/site-pr3 $R/.devrun/trees/pr3/tests/pytorch/test_fused_optimizer.py -k "TestFusedAdam or set_bf16" &
pt pr3_mutant /tmp/site-mut $R/.devrun/trees/pr3/tests/pytorch/test_fused_optimizer.py -k set_bf16 -rA &
wait
grep -hE "^(FAILED|ERROR)|Error" /tmp/logs/stack.log /tmp/logs/pr3.log | head -10
grep -hE "^(PASSED|FAILED)" /tmp/logs/pr3_mutant.log | tee -a $L/summary.txt
REG=pinned_use_cuda_host_register:True,pinned_num_register_threads:16; HUGE=glibc.malloc.hugetlb=1
PYTORCH_CUDA_ALLOC_CONF=$REG timeout 60 python3 $D/restart_parts.py >> $L/parts.jsonl 2>>/tmp/logs/parts.err; t "parts register rc=$?"
GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG timeout 60 python3 $D/restart_parts.py >> $L/parts.jsonl 2>>/tmp/logs/parts.err; t "parts register+huge rc=$?"
cd $R/benchmarks/fused_adam_state_dict; export PYTHONPATH=/tmp/te-site:$R
B="torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 2 --out $L/resume.jsonl"
GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG timeout 170 $B --cold > /tmp/logs/resume_huge.log 2>&1; t "resume register+huge (warm, cold) rc=$?"
PYTORCH_CUDA_ALLOC_CONF=$REG timeout 90 $B --variants parallel > /tmp/logs/resume_register.log 2>&1; t "resume register rc=$?"
tar czf $L/logs.tgz -C /tmp logs
cat $L/parts.jsonl; python3 -c "
import json
for l in open('$L/resume.jsonl'):
    r=json.loads(l); print(r['variant'], r['cold'], r['alloc_conf'][:6], r.get('template_s'), r.get('dcp_load_s'), r.get('set_s'), r.get('total_s'), r.get('bitwise'), r.get('host_peak_GiB'), r.get('next_stage_s'), r.get('next_reused'), r.get('disk_GBps'), r.get('cached_fraction'))"
