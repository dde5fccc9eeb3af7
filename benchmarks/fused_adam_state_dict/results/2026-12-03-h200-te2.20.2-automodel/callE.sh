#!/usr/bin/env bash
# Call E (2026-12-03): PR 1's two new tests (test_export_strided: states of a transposed and a
# channels-last parameter; test_export_slow_copy_out: copy-outs delayed) on the stack, and on
# two mutants of it that each must fail: the ring's wait for a buffer's copy-out removed, and
# _flat_views without its reordering of the dimensions.
set -u; R=$PWD; L=$OUT; export PYTHONUNBUFFERED=1
bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) || exit 1
F=transformer_engine/pytorch/optimizers/fused_adam.py
cp -a /tmp/te-site /tmp/site-ring; cp -a /tmp/te-site /tmp/site-flat
sed -i 's/self._pending.popleft().result()  # the oldest/self._pending.popleft()  # the oldest/' /tmp/site-ring/$F
sed -i 's/order = sorted(range(state.dim()), key=state.stride, reverse=True)/order = list(range(state.dim()))/' /tmp/site-flat/$F
for s in ring flat; do echo "$s mutant: $(diff /tmp/te-site/$F /tmp/site-$s/$F | grep -c '^>') line(s) changed" | tee -a $L/summary.txt; done
run() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; PYTHONPATH=$2 timeout -k 5 100 python3 -m pytest -p no:cacheprovider -rA --tb=line -q \
  $R/.devrun/trees/stack/tests/pytorch/test_fused_optimizer.py -k "export_strided or export_slow_copy_out" > $L/$1.log 2>&1
  echo "$1 rc=$?: $(tail -1 $L/$1.log)" | tee -a $L/summary.txt; }
run stack /tmp/te-site & run ring /tmp/site-ring & run flat /tmp/site-flat & wait
grep -hE "^(PASSED|FAILED|ERROR)" $L/*.log
