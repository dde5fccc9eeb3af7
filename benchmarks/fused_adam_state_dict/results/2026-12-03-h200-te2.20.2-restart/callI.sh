#!/usr/bin/env bash
# Call I (2026-12-03): PR 3 after a fresh TE review (the BF16 result no longer kept apart on the
# GPU; its test also asserts where the conversion ran, by the GPU memory taken): its test on TE
# + PR 3 alone and on two mutants (the pinned branch removed; it rounding through FP16), which
# must fail, and test_fused_optimizer.py of main + the stack on TE + the stack, side by side;
# then, quiet, the review's smaller design for PR 1 (direct_copy.py).
set -u; R=$PWD; L=$OUT; D=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-restart
export PYTHONUNBUFFERED=1; T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs; bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
F=transformer_engine/pytorch/optimizers/fused_adam.py
cp -a /tmp/te-site /tmp/site-pr3
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch $R/patches/3-bf16-load/0001-*.patch) && t "stack applied"
(cd /tmp/site-pr3 && git apply --include='transformer_engine/*' $R/patches/3-bf16-load/0001-*.patch) && t "PR 3 alone applied"
cp -a /tmp/site-pr3 /tmp/site-nobranch; cp -a /tmp/site-pr3 /tmp/site-fp16
sed -i 's/            if unscaled_state.is_pinned():/            if False:  # mutant/' /tmp/site-nobranch/$F
sed -i 's/scaled_state.copy_(unscaled_state.to(scaled_state.device))$/scaled_state.copy_(unscaled_state.to(scaled_state.device).half())/' /tmp/site-fp16/$F
for m in nobranch fp16; do t "mutant $m: $(diff /tmp/site-pr3/$F /tmp/site-$m/$F | grep -c '^>') line(s) changed"; done
pt() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; local s=$(date +%s); PYTHONPATH=$2 timeout -k 5 120 python3 -m pytest -p no:cacheprovider -rA --tb=line -q $3 "${@:4}" > /tmp/logs/$1.log 2>&1
  t "$1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/$1.log)"; }
T=$R/.devrun/trees
pt stack /tmp/te-site $T/stack/tests/pytorch/test_fused_optimizer.py &
pt pr3 /tmp/site-pr3 $T/pr3/tests/pytorch/test_fused_optimizer.py -k "TestFusedAdam or set_bf16" &
pt nobranch /tmp/site-nobranch $T/pr3/tests/pytorch/test_fused_optimizer.py -k set_bf16 &
pt fp16 /tmp/site-fp16 $T/pr3/tests/pytorch/test_fused_optimizer.py -k set_bf16 &
wait
for f in stack pr3 nobranch fp16; do grep -E "^(PASSED|FAILED).*set_bf16" /tmp/logs/$f.log | sed "s|::| |; s|^\([A-Z]*\) .* |$f \1 |"; done | tee -a $L/summary.txt
grep -hE "^(FAILED|ERROR)" /tmp/logs/stack.log /tmp/logs/pr3.log | head
grep -h "AssertionError\|assert " /tmp/logs/nobranch.log /tmp/logs/fp16.log | head -6
timeout 60 python3 $D/direct_copy.py > $L/direct_copy.jsonl 2>/tmp/logs/direct.err; t "direct_copy rc=$?"; cat $L/direct_copy.jsonl
tar czf $L/logs.tgz -C /tmp logs
