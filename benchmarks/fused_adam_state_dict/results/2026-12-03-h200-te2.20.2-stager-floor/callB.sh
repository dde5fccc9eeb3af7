#!/usr/bin/env bash
# Call B (2026-12-03, fourth round): the resume (benchmark_resume.py, register + huge, warm) on
# TE + the whole stack and on TE + the stack without PR 3, in turn, twice: what PR 3 gives the
# set of the resume, side by side in one run.
set -u; R=$PWD; L=$OUT
export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs; bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
P=$R/patches; cp -a /tmp/te-site /tmp/site-nopr3
(cd /tmp/te-site && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch $P/2-upstream-3507/0001-*.patch $P/3-bf16-load/0001-*.patch) && t "stack applied"
(cd /tmp/site-nopr3 && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch $P/2-upstream-3507/0001-*.patch) && t "stack without PR 3 applied"
cd $R/benchmarks/fused_adam_state_dict
REG=pinned_use_cuda_host_register:True,pinned_num_register_threads:16; HUGE=glibc.malloc.hugetlb=1
for round in 1 2; do for s in te-site site-nopr3; do
  PYTHONPATH=/tmp/$s:$R GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG timeout 120 torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 1 --out /tmp/logs/resume-$s.jsonl > /tmp/logs/resume-$s-$round.log 2>&1; t "resume $s round $round rc=$?"
done; done
for s in te-site site-nopr3; do python3 -c "
import json
for l in open('/tmp/logs/resume-$s.jsonl'):
    r=json.loads(l); print('$s', r['variant'], r['cold'], r.get('template_s'), r.get('dcp_load_s'), r.get('set_s'), r.get('total_s'), r.get('bitwise'), r.get('host_peak_GiB'), r.get('next_stage_s'), r.get('next_reused'))"; done | tee -a $L/summary.txt
cp /tmp/logs/resume-*.jsonl $L/; tar czf $L/logs.tgz -C /tmp logs
