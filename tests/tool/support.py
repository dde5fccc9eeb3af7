"""What the tool's tests share beside their fixtures (conftest.py): the files they look at, the
command line in a subprocess, git, and changes to a TE tree."""

import filecmp
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from te_fusedadam_offload import errors, series, state, upstream
from te_fusedadam_offload.maintainers import mainline

REPO = Path(__file__).resolve().parents[2]
FUSED_ADAM = "transformer_engine/pytorch/optimizers/fused_adam.py"
FUSED_SGD = "transformer_engine/pytorch/optimizers/fused_sgd.py"
DOCS_PAGE = "docs/features/other_optimizations/fused_adam_state_dict_offload.rst"

# The last line of a script that a test runs in a process of its own on a gloo group, after
# dist.destroy_process_group(): the process ends without finalizing the interpreter. Gloo's
# worker threads outlive destroy_process_group() and may drop a collective's last tensor while
# the interpreter finalizes; taking the GIL then aborts the process ("terminate called without
# an active exception", exit -6: once in CI, after README.md:96's dcp.save; see
# pytorch/pytorch#179291). What the script did has run; the stager's exit hook is tested with
# scripts that end without a process group (test_staging.py).
EXIT_WITHOUT_FINALIZING = "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)"


def release_patches(patches=None):
    """The patches (default: those that patches/series lists) that change files under the
    release's package, transformer_engine/, read from the patch files themselves: the
    patches that apply writes to an installed TE."""
    subtree = re.escape(upstream.load_pin()["subtree"])
    return [
        patch
        for patch in (series.patch_files() if patches is None else patches)
        if re.search(rf"^diff --git a/{subtree}/", patch.read_text(encoding="utf-8"), re.M)
    ]


def added_constant(patched, released):
    """A module-level constant that the series adds to a file: the first line `_NAME = value`
    of `patched` (the file's bytes as the series makes it) that `released` lacks."""
    pattern = rb"^_[A-Z][A-Z0-9_]* = .+$"
    before = set(re.findall(pattern, released, re.M))
    added = [line for line in re.findall(pattern, patched, re.M) if line not in before]
    assert added, "the series adds no module-level constant (_NAME = value) to the file"
    return added[0]


def same_tree(a, b):
    """Whether two directories hold the same files with the same bytes."""
    cmp = filecmp.dircmp(a, b)
    stack = [cmp]
    while stack:
        c = stack.pop()
        if c.left_only or c.right_only or c.diff_files or c.funny_files:
            return False
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        if mismatch or errors:
            return False
        stack.extend(c.subdirs.values())
    return True


def listing(root):
    """Every path under `root`, sorted."""
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


def drift_context(root):
    """Change a context line of the series' first hunk, so that the patch no longer applies."""
    path = root / FUSED_ADAM
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("from itertools import chain", "from itertools import chain  # x"))


def offset_hunks(root):
    """Insert lines between two hunks: the series still applies, with an offset."""
    path = root / FUSED_ADAM
    text = path.read_text(encoding="utf-8")
    marker = "    This version of fused Adam implements 2 fusions.\n"
    assert marker in text
    path.write_text(text.replace(marker, marker + "\n    (A local note.)\n", 1))


def file_state(tree, rel=FUSED_ADAM, directory=None):
    """ "pristine" or "patched" (by sha256 against the series' checksums), else "other"."""
    before, after = series.load_checksums(directory)[rel]
    digest = upstream.sha256_of(tree / rel)
    return {before: "pristine", after: "patched"}.get(digest, "other")


def git(args, cwd):
    """Run git with a fixed identity; its stdout."""
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com")
    env.update(GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def tool_env(pythonpath=REPO, fault=None, **extra):
    """The environment of the command line in a subprocess, with a fault injected or none."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath), **extra)
    env.pop(errors.FAULT_ENV, None)
    if fault:
        env[errors.FAULT_ENV] = fault
    return env


def run_tool(args, cwd=None, script=None, **env):
    """Run `python -m te_fusedadam_offload ARGS` in a subprocess (see tool_env for `env`), or
    `python -c SCRIPT ARGS` for a script that runs the command with something injected."""
    program = ["-c", script] if script else ["-m", "te_fusedadam_offload"]
    return subprocess.run(
        [sys.executable, *program, *args],
        cwd=cwd,
        env=tool_env(**env),
        capture_output=True,
        text=True,
        check=False,
    )


def purelib(python):
    """The site-packages directory of the environment of `python`."""
    return Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )


def release_wheel(version):
    """The release wheel of TE `version` (downloaded once into the cache)."""
    return upstream.download_wheel("transformer_engine", version, upstream.cache_dir() / "wheels")


def site_of_release(version, tmp_path):
    """A site directory with the real TE `version` wheel unpacked, package metadata included."""
    site = tmp_path / f"site-{version}"
    with zipfile.ZipFile(release_wheel(version)) as zf:
        zf.extractall(site)
    return site


def as_main(tree, monkeypatch):
    """Make the release tree stand in for a checkout of main: with the pinned main tree at
    hand, add the main files the series changes; without it, only the patches that need none
    of them make the series. Returns the series' subjects."""
    main = mainline.main_tree()
    entries = series.load_series()["patch"]
    if main is not None:
        for rel in series.main_paths():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(main / rel, tree / rel)
        return [e["subject"] for e in entries]
    # Without main, the patches that change main files are left out, and so are those that
    # change files that a left-out patch makes (the docs page).
    left_out = set(series.main_paths())
    needs_main = []
    for entry in entries:
        needs_main.append(bool(left_out & set(series.entry_paths(entry))))
        if needs_main[-1]:
            left_out.update(series.entry_paths(entry))
    kept = [p for p, needs in zip(series.patch_files(), needs_main) if not needs]
    for module in (state, mainline):
        monkeypatch.setattr(module, "patch_files", lambda: kept)
    stack = [(d, [p for p in ps if p in kept]) for d, ps in series.pr_patch_files()]
    monkeypatch.setattr(mainline, "pr_patch_files", lambda: [(d, ps) for d, ps in stack if ps])
    return [e["subject"] for e, needs in zip(entries, needs_main) if not needs]
