#!/usr/bin/env bash
# Call C (2026-12-03, fourth round): after PR 1's assertion that a piece fits a pinned buffer,
# test_fused_optimizer.py of main + the stack on TE + the stack and of main + PR 1 on TE + PR 1
# alone, side by side.
set -u; R=$PWD; L=$OUT
export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs; bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
P=$R/patches; cp -a /tmp/te-site /tmp/site-pr1
(cd /tmp/te-site && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch $P/2-upstream-3507/0001-*.patch $P/3-bf16-load/0001-*.patch) && t "stack applied"
(cd /tmp/site-pr1 && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch) && t "PR 1 alone applied"
grep -c "a piece larger than a pinned buffer" /tmp/te-site/transformer_engine/pytorch/optimizers/fused_adam.py /tmp/site-pr1/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
pt() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; local s=$(date +%s); PYTHONPATH=$2 timeout -k 5 240 python3 -m pytest -p no:cacheprovider -rA --tb=short -q $3 > /tmp/logs/$1.log 2>&1
  t "$1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/$1.log)"; }
T=$R/.devrun/trees
pt stack /tmp/te-site $T/stack/tests/pytorch/test_fused_optimizer.py &
pt pr1 /tmp/site-pr1 $T/pr1/tests/pytorch/test_fused_optimizer.py &
wait; grep -hE "^(FAILED|ERROR)" /tmp/logs/*.log | head | tee -a $L/summary.txt
tar czf $L/logs.tgz -C /tmp logs
