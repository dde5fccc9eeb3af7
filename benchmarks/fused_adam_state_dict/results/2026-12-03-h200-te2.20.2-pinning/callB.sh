#!/usr/bin/env bash
# Call B (2026-12-03, third round): load_template() makes the buffers it lacks by 8 threads
# first; PR 1 takes NVTE_FUSED_ADAM_STATE_DICT_THREADS as the count where it is set. Side by
# side: test_fused_optimizer.py of main + the stack; tests/staging with it; TE's L1 FSDP2 FusedAdam selection at world size 2
# on TE + the whole stack (PR 3 included) and on pristine TE, and DP4 -> DP2 resharding
# (DelayedScaling) on the stack, through the multirank-one-gpu harness (ws2.sh). Then quiet:
# pin_ways.py (torch.empty(pin_memory=True) by 1, 8, 16 threads; PyTorch's default pinned
# allocator by 1 and 8) and the resume, warm and cold (benchmark_resume.py, register + huge).
set -u; R=$PWD; L=$OUT; D=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-pinning
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs; bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
F=transformer_engine/pytorch/optimizers/fused_adam.py
cp -a /tmp/te-site /tmp/site-pristine
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch $R/patches/3-bf16-load/0001-*.patch) && t "stack applied"
cp -a /tmp/site-pristine /tmp/site-prevpr1; (cd /tmp/site-prevpr1 && git apply --include='transformer_engine/*' $R/.devrun/prev-pr1/000[1-4]-*.patch) && t "PR 1 of before (the rule's mutant) applied"
sha256sum /tmp/te-site/$F /tmp/site-pristine/$F | tee -a $L/summary.txt
T=$R/.devrun/trees; export HARNESS=$R/.devrun/multirank
( cd $R; s=$(date +%s); PYTHONPATH=/tmp/te-site:$R timeout -k 10 330 torchrun --standalone --nproc_per_node=1 --master-port=29500 -m pytest -q -rs -p no:cacheprovider tests/staging > /tmp/logs/staging.log 2>&1
  t "tests/staging rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/staging.log)" ) &
bash $D/ws2.sh l1 stack /tmp/te-site $T/stack /tmp/logs 300 > /dev/null 2>&1 &
bash $D/ws2.sh l1 pristine /tmp/site-pristine $T/pristine /tmp/logs 300 > /dev/null 2>&1 &
( mkdir -p /tmp/run-stack; cd /tmp/run-stack; s=$(date +%s); PYTHONPATH=/tmp/te-site timeout -k 5 200 python3 -m pytest -p no:cacheprovider -rA --tb=short -q $T/stack/tests/pytorch/test_fused_optimizer.py > /tmp/logs/stack.log 2>&1
  t "stack test_fused_optimizer.py rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/stack.log)"; grep -cE "^PASSED.*test_threads" /tmp/logs/stack.log | sed 's/^/test_threads cases passed: /' | tee -a $L/summary.txt ) &
( mkdir -p /tmp/run-prev; cd /tmp/run-prev; PYTHONPATH=/tmp/site-prevpr1 timeout -k 5 100 python3 -m pytest -p no:cacheprovider -rA --tb=line -q $T/pr1/tests/pytorch/test_fused_optimizer.py -k test_threads > /tmp/logs/prevpr1.log 2>&1
  grep -E "^(PASSED|FAILED)" /tmp/logs/prevpr1.log | sed 's/^/PR 1 of before, new test: /' | tee -a $L/summary.txt ) &
bash $D/ws2.sh reshard stack /tmp/te-site $T/stack /tmp/logs DelayedScaling > /dev/null 2>&1 &
wait; cat /tmp/logs/summary.txt | tee -a $L/summary.txt; t "tests done"
grep -hE "^(FAILED|ERROR)" /tmp/logs/staging.log | head
cd $D; REG=pinned_use_cuda_host_register:True,pinned_num_register_threads:16; HUGE=glibc.malloc.hugetlb=1
P="timeout 60 python3 pin_ways.py --way torch"
for n in 1 8 16; do GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG $P --threads $n; done >> $L/pin_ways.jsonl 2>>/tmp/logs/pin_ways.err
for n in 1 8; do GLIBC_TUNABLES=$HUGE $P --threads $n; done >> $L/pin_ways.jsonl 2>>/tmp/logs/pin_ways.err; t "pin_ways rc=$?"
cat $L/pin_ways.jsonl
cd $R/benchmarks/fused_adam_state_dict; export PYTHONPATH=/tmp/te-site:$R
GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG timeout 190 torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 2 --cold --out $L/resume.jsonl > /tmp/logs/resume.log 2>&1; t "resume register+huge (warm, cold) rc=$?"
python3 -c "
import json
for l in open('$L/resume.jsonl'):
    r=json.loads(l); print(r['variant'], r['cold'], r.get('template_s'), r.get('dcp_load_s'), r.get('set_s'), r.get('total_s'), r.get('bitwise'), r.get('host_peak_GiB'), r.get('next_stage_s'), r.get('next_reused'), r.get('disk_GBps'), r.get('cached_fraction'))" | tee -a $L/summary.txt
cp /tmp/logs/staging.log $L/; tar czf $L/logs.tgz -C /tmp logs
