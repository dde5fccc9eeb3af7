# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""FusedAdam(state_dict_cpu_offload=True) with FSDP2 and DCP on several GPUs.

Each case runs fsdp2_tests/run_fsdp2_state_dict_offload.py under torchrun on an even number
of GPUs (all of them, or 2 for resharding), with the default path as control.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NUM_PROCS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_WORKER = Path(__file__).parent.resolve() / "fsdp2_tests" / "run_fsdp2_state_dict_offload.py"
_TIMEOUT_S = 600

if NUM_PROCS < 2:
    pytest.skip(
        f"FSDP2 + DCP offload tests need 2+ GPUs, found {NUM_PROCS}.", allow_module_level=True
    )

VARIANTS = ["bf16", "fp8", "remainders"]


def _torchrun(nproc, test, ckpt_dir, offload=(1, 0)):
    """Run one worker test; a failing rank fails the test with its output, a hang times out."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        str(_WORKER),
        "--test",
        test,
        "--variant",
        *VARIANTS,
        "--offload",
        *[str(o) for o in offload],
        "--ckpt-dir",
        str(ckpt_dir),
    ]
    try:
        result = subprocess.run(
            cmd,
            env=os.environ,
            timeout=_TIMEOUT_S,
            check=False,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{test} timed out after {_TIMEOUT_S} s:\n{exc.output}")
    print(result.stdout)
    assert result.returncode == 0, f"{test} failed:\n{result.stdout[-20000:]}"


@pytest.fixture
def ckpt_dir(tmp_path):
    """A checkpoint directory for one test, removed afterwards."""
    path = tmp_path / "ckpt"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _even_procs():
    return NUM_PROCS - NUM_PROCS % 2


def test_export(ckpt_dir):
    """Sharded and full get_optimizer_state_dict(cpu_offload=True) against the default path."""
    _torchrun(_even_procs(), "export", ckpt_dir)


@pytest.mark.parametrize("mode", ["roundtrip", "async_sync", "async_async"])
def test_dcp_roundtrip(mode, ckpt_dir):
    """dcp.save / async_save -> fresh model -> dcp.load -> continue, bitwise."""
    _torchrun(_even_procs(), mode, ckpt_dir)


def test_dcp_load_memory(ckpt_dir):
    """dcp.load + set_optimizer_state_dict: bounded GPU peak, bitwise the default path's."""
    _torchrun(_even_procs(), "load_memory", ckpt_dir, offload=(1,))


def test_dcp_resharding_2_to_1(ckpt_dir):
    """Save with 2 ranks, load with 1, continue, bitwise against the default path."""
    _torchrun(2, "reshard_save", ckpt_dir)
    _torchrun(1, "reshard_load", ckpt_dir)


@pytest.mark.skipif(NUM_PROCS < 4, reason="DP4 -> DP2 resharding needs 4+ GPUs")
def test_dcp_resharding_4_to_2(ckpt_dir):
    """Save with 4 ranks, load with 2, continue, bitwise against the default path."""
    _torchrun(4, "reshard_save", ckpt_dir, offload=(1,))
    _torchrun(2, "reshard_load", ckpt_dir, offload=(1,))
