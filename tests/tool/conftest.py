"""Fixtures of the tool's tests: the pinned release (downloaded once per cache,
TE_FUSEDADAM_OFFLOAD_CACHE), copies of it to patch, the tool without the repository's
materialized trees, and synthetic series that change two files of the release."""

import shutil
import subprocess
import sys
import zipfile

import pytest
from support import FUSED_ADAM, FUSED_SGD, REPO, git

from te_fusedadam_offload import paths, upstream
from te_fusedadam_offload.maintainers import commands as maintainers
from te_fusedadam_offload.patching import apply_in_order


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "network: downloads from the package index beyond the pinned release (which the "
        "cache keeps after the first run); -m 'not network' runs without it",
    )


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The wheel of this package, as pip install . builds it (pip's stderr if it fails)."""
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["-w", str(out), str(REPO)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"pip wheel failed:\n{result.stderr}"
    return next(out.glob("te_fusedadam_offload-*.whl"))


@pytest.fixture(scope="session")
def installed_tool(wheel, tmp_path_factory):
    """A directory (for PYTHONPATH) holding the package as installed from its wheel: the
    series as package data, no checkout around it."""
    site = tmp_path_factory.mktemp("installed-tool")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


@pytest.fixture(scope="session")
def pristine():
    """The pinned release's transformer_engine/ tree, unpacked (read only by convention)."""
    return upstream.pristine_tree()


@pytest.fixture
def tree(pristine, tmp_path):
    """A writable copy of the pristine release: a directory holding transformer_engine/."""
    root = tmp_path / "site"
    shutil.copytree(pristine / "transformer_engine", root / "transformer_engine")
    return root


def _tool_copy(home, patches_from=REPO / "patches"):
    """The tool and a series in `home` (for PYTHONPATH), without materialized trees."""
    shutil.copytree(
        REPO / "te_fusedadam_offload",
        home / "te_fusedadam_offload",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for name in ("series.toml", "upstream.json"):
        shutil.copyfile(REPO / name, home / name)
    if patches_from is not None:
        shutil.copytree(patches_from, home / "patches")
        shutil.copytree(REPO / "compat", home / "compat")
    return home


@pytest.fixture(scope="session")
def tool_home(tmp_path_factory):
    """The tool and its series without the repository's materialized transformer_engine/."""
    return _tool_copy(tmp_path_factory.mktemp("tool"))


@pytest.fixture
def no_main_tree(monkeypatch):
    """As where neither a TE source nor the archive of the main tree is at hand."""
    monkeypatch.delenv("TE_SOURCE", raising=False)
    monkeypatch.setattr(maintainers, "main_tree", lambda source=None: None)


def _edit(path, after, line):
    """Insert `line` after the line `after` of a file."""
    text = path.read_text(encoding="utf-8")
    assert after in text
    path.write_text(text.replace(after, after + line, 1), encoding="utf-8")


@pytest.fixture(scope="session")
def two_file_patches(pristine, tmp_path_factory):
    """Two patches of a synthetic series, as git diff writes them: the first changes
    fused_adam.py and fused_sgd.py, the second fused_sgd.py again."""
    work = tmp_path_factory.mktemp("two-file-patches")
    for rel in (FUSED_ADAM, FUSED_SGD):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pristine / rel, work / rel)
    git(["init", "-q"], work)
    git(["add", "-A"], work)
    git(["commit", "-qm", "pristine"], work)
    header = "# See LICENSE for license information.\n"
    _edit(work / FUSED_ADAM, header, "# Patched by the first patch.\n")
    _edit(work / FUSED_SGD, header, "# Patched by the first patch.\n")
    first = git(["diff"], work)
    git(["commit", "-qam", "first"], work)
    _edit(work / FUSED_SGD, "# Patched by the first patch.\n", "# And by the second.\n")
    return first, git(["diff"], work)


@pytest.fixture
def series_home(pristine, tmp_path, monkeypatch):
    """A factory: series_home(patch texts) makes a home of the tool (for PYTHONPATH) whose
    series is those patches, one pull request, with their checksums (of the files after the
    patches that apply) and no compat patch, and makes this process's tool use it too."""

    def make(*texts):
        home = _tool_copy(tmp_path / "series-home", patches_from=None)
        pr_dir = home / "patches" / "1-synthetic"
        pr_dir.mkdir(parents=True)
        names = [f"{i:04d}-synthetic.patch" for i in range(1, len(texts) + 1)]
        for name, text in zip(names, texts):
            (pr_dir / name).write_text(text, encoding="utf-8")
        (home / "patches" / "series").write_text("".join(f"1-synthetic/{n}\n" for n in names))
        (home / "compat").mkdir()
        after = tmp_path / "series-after"
        shutil.copytree(pristine / "transformer_engine", after / "transformer_engine")
        list(apply_in_order(after, [pr_dir / n for n in names]))
        checksums = [
            f"{upstream.sha256_of(pristine / rel)} {upstream.sha256_of(after / rel)} {rel}\n"
            for rel in (FUSED_ADAM, FUSED_SGD)
        ]
        (home / "patches" / "checksums").write_text("".join(checksums))
        monkeypatch.setattr(paths, "_REPO", home)
        return home

    return make
