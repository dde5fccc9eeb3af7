"""What ships and what CI sets up: the wheel, and the CPU tier's own venv."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import REPO, listing

import te_fusedadam_offload
from te_fusedadam_offload import upstream


def test_wheel_carries_the_series(wheel):
    """pip install . ships the series and the pin as package data of te_fusedadam_offload,
    and the version that the package says."""
    assert wheel.name.startswith(f"te_fusedadam_offload-{te_fusedadam_offload.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "te_fusedadam_offload/cli.py" in names
    assert "te_fusedadam_offload/_data/upstream.json" in names
    assert "te_fusedadam_offload/_data/patches/series" in names
    assert "te_fusedadam_offload/_data/compat/te-2.14.0-2.16.1.patch" in names
    assert "te_fusedadam_offload/staging/__init__.py" in names
    assert "te_fusedadam_offload/maintainers/commands.py" in names
    assert not any(n.startswith("build_tools/") for n in names)
    entry = [n for n in names if n.endswith("entry_points.txt")][0]
    assert (
        "te-fusedadam-offload = te_fusedadam_offload.__main__:main"
        in zipfile.ZipFile(wheel).read(entry).decode()
    )
    pinned = json.loads(zipfile.ZipFile(wheel).read("te_fusedadam_offload/_data/upstream.json"))
    assert pinned == upstream.load_pin()
    # torch and numpy (DCP's gather_object unpickles through it): only for the stager, as an
    # extra with no version bound (never replaced by pip).
    metadata = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        .decode()
    )
    assert "Provides-Extra: staging" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "staging" in r] == [
        'Requires-Dist: torch; extra == "staging"',
        'Requires-Dist: numpy; extra == "staging"',
    ]


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the tool's tests run outside a venv")
def test_cpu_tier_leaves_the_active_venv_untouched(tmp_path):
    """With a user's virtualenv active, the CPU tier sets up and uses its own venv (here the
    one these tests run in, as from .ci/run) and installs nothing into the active one."""
    active = tmp_path / "training-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(active)], check=True)
    before = listing(active)
    env = dict(
        os.environ,
        VIRTUAL_ENV=str(active),
        PATH=f"{active / 'bin'}{os.pathsep}{os.environ['PATH']}",
        CPU_TIER_VENV=sys.prefix,
    )
    result = subprocess.run(
        ["bash", str(REPO / "qa" / "cpu_tier.sh"), "--setup-only"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(Path(sys.prefix) / "bin" / "python")
    assert listing(active) == before
