#!/usr/bin/env bash
# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.
#
# Nightly GPU entry point, for an NVIDIA PyTorch container with TransformerEngine installed:
# apply the series to that TE (or verify that it is applied) and to TE's source tree, then run
# the tests that the series adds to TE's own test files, from that source tree, on all visible
# GPUs, writing JUnit XML. Exits non-zero on any failure.
#   env: TE_PATH (TE's source tree; default /opt/transformerengine): a git checkout gets the
#          series with git am if it lacks it; any other tree must hold it already (te-main/,
#          made by 'python -m te_fusedadam_offload materialize --source ...', does)
#        XML_LOG_DIR (default /logs)
#        TE_FUSEDADAM_OFFLOAD (the command; default: the installed te-fusedadam-offload,
#          else python -m te_fusedadam_offload from this checkout)
set -uo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
cd "$HERE"
: "${TE_PATH:=/opt/transformerengine}"
: "${XML_LOG_DIR:=/logs}"
mkdir -p "$XML_LOG_DIR"
if [ -z "${TE_FUSEDADAM_OFFLOAD:-}" ]; then
    if command -v te-fusedadam-offload >/dev/null; then
        TE_FUSEDADAM_OFFLOAD=te-fusedadam-offload
    else
        TE_FUSEDADAM_OFFLOAD="python3 -m te_fusedadam_offload"
    fi
fi

FAILED=()
test_fail() { FAILED+=("$1"); echo "Error: sub-test failed: $1"; }

# The installed TE: apply the series, or verify that it is applied (a drifted TE fails here).
$TE_FUSEDADAM_OFFLOAD apply --installed || test_fail "apply series to the installed TE"
$TE_FUSEDADAM_OFFLOAD status --installed || test_fail "series status of the installed TE"

# TE's source tree, whose test files the series extends.
if [ -d "$TE_PATH/.git" ]; then
    $TE_FUSEDADAM_OFFLOAD apply "$TE_PATH" || test_fail "apply series to $TE_PATH"
fi
if ! grep -q "state_dict_cpu_offload" "$TE_PATH/tests/pytorch/test_fused_optimizer.py" 2>/dev/null; then
    echo "Error: $TE_PATH is not a TE source tree with the series applied (set TE_PATH)"
    exit 1
fi

python3 -m pytest -v -s -rs --junitxml="$XML_LOG_DIR/pytest_test_fused_optimizer.xml" \
    "$TE_PATH/tests/pytorch/test_fused_optimizer.py" || test_fail "test_fused_optimizer.py"
# FSDP2 + DCP with FusedAdam (2 GPUs; the DP4 -> DP2 resharding case needs 4 and skips otherwise).
python3 -m pytest -v -s -rs --junitxml="$XML_LOG_DIR/pytest_test_torch_fsdp2_fused_adam.xml" \
    "$TE_PATH/tests/pytorch/distributed/test_torch_fsdp2.py" -k "fused_adam and not hybrid" \
    || test_fail "test_torch_fsdp2.py -k 'fused_adam and not hybrid'"

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "Error: some sub-tests failed: ${FAILED[*]}"
    exit 1
fi
echo "All tests passed"
exit 0
