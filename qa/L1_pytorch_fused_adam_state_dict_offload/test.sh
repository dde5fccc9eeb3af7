#!/usr/bin/env bash
# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.
#
# Nightly GPU entry point, for an NVIDIA PyTorch container with TransformerEngine installed:
# apply the series to that TE (or verify that it is applied), then run the single-GPU and the
# distributed tests on all visible GPUs, writing JUnit XML. Exits non-zero on any failure.
#   env: XML_LOG_DIR (default /logs), TE_FUSEDADAM_OFFLOAD (the command; default: the
#        installed te-fusedadam-offload, else python -m build_tools from this checkout)
set -uo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
cd "$HERE"
: "${XML_LOG_DIR:=/logs}"
mkdir -p "$XML_LOG_DIR"
if [ -z "${TE_FUSEDADAM_OFFLOAD:-}" ]; then
    if command -v te-fusedadam-offload >/dev/null; then
        TE_FUSEDADAM_OFFLOAD=te-fusedadam-offload
    else
        TE_FUSEDADAM_OFFLOAD="python3 -m build_tools"
    fi
fi

FAILED=()
test_fail() { FAILED+=("$1"); echo "Error: sub-test failed: $1"; }

# Apply the series, or verify that it is applied: a drifted TE fails here.
$TE_FUSEDADAM_OFFLOAD apply --installed || test_fail "apply series"
$TE_FUSEDADAM_OFFLOAD status --installed || test_fail "series status"

python3 -m pytest -v -s -rs --junitxml="$XML_LOG_DIR/pytest_fused_adam_state_dict_offload.xml" \
    tests/pytorch/test_fused_adam_state_dict_offload.py || test_fail "test_fused_adam_state_dict_offload.py"
python3 -m pytest -v -s -rs --junitxml="$XML_LOG_DIR/pytest_fused_adam_state_dict_offload_dcp.xml" \
    tests/pytorch/distributed/test_fused_adam_state_dict_offload_dcp.py || test_fail "test_fused_adam_state_dict_offload_dcp.py"

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "Error: some sub-tests failed: ${FAILED[*]}"
    exit 1
fi
echo "All tests passed"
exit 0
