"""Tests of te-fusedadam-offload on the real pinned TE release (downloaded) and on drifted copies.

CPU only. The pinned wheel is fetched once per cache (TE_FUSEDADAM_OFFLOAD_CACHE).
"""

import ast
import email.header
import errno
import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import te_fusedadam_offload
from te_fusedadam_offload import (
    actions,
    cli,
    drift,
    generate,
    mainline,
    maintainers,
    patching,
    saved,
    series,
    state,
    target,
    upstream,
)
from te_fusedadam_offload.errors import ToolError

REPO = Path(__file__).resolve().parents[2]
FUSED_ADAM = "transformer_engine/pytorch/optimizers/fused_adam.py"
DOCS_PAGE = "docs/features/other_optimizations/fused_adam_state_dict_offload.rst"


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


def _same_tree(a, b):
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


def _drift_context(root):
    """Change a context line of the series' first hunk, so that the patch no longer applies."""
    path = root / FUSED_ADAM
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("from itertools import chain", "from itertools import chain  # x"))


def _offset(root):
    """Insert lines between two hunks: the series still applies, with an offset."""
    path = root / FUSED_ADAM
    text = path.read_text(encoding="utf-8")
    marker = "    This version of fused Adam implements 2 fusions.\n"
    assert marker in text
    path.write_text(text.replace(marker, marker + "\n    (A local note.)\n", 1))


def test_pin_matches_the_downloaded_release(pristine):
    pin = upstream.load_pin()
    wheel = upstream.fetch_pinned()
    assert wheel.name == pin["artifact"]
    assert upstream.sha256_of(wheel) == pin["sha256"]
    assert (pristine / FUSED_ADAM).is_file()
    before, _ = series.load_checksums()[FUSED_ADAM]
    assert upstream.sha256_of(pristine / FUSED_ADAM) == before


def test_wrong_hash_is_refused(tmp_path):
    wheel = upstream.fetch_pinned()
    bad = tmp_path / wheel.name
    shutil.copyfile(wheel, bad)
    with open(bad, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ToolError, match="does not match the pinned"):
        upstream.fetch_pinned(bad)
    with pytest.raises(ToolError, match="does not exist"):
        upstream.fetch_pinned(tmp_path / "missing.whl")


def _release_patches(t):
    """The patches of the series that change files of the release's package."""
    return [p for p in series.patch_files() if t.touches(p)]


def test_apply_is_idempotent_and_revert_restores_pristine_bytes(tree, pristine):
    t = target.find_target(tree)
    assert t.kind == "tree"
    assert state.status(t)[1] == state.NOT_APPLIED
    assert state.file_report(state.State(t)) == [(FUSED_ADAM, "as released in TE 2.20.2")]
    count = len(_release_patches(t))
    assert count == 3  # the export, the load, the docstring fix

    assert f"applied {count} patch" in actions.apply(t)
    assert state.status(t)[1] == state.APPLIED
    assert state.file_report(state.State(t)) == [
        (FUSED_ADAM, "TE 2.20.2's, patched by this series")
    ]
    assert "state_dict_cpu_offload" in (tree / FUSED_ADAM).read_text(encoding="utf-8")
    assert actions.apply(t) == "already applied; nothing to do"

    assert f"reverted {count} patch" in actions.revert(t)
    assert _same_tree(tree / "transformer_engine", pristine / "transformer_engine")
    assert actions.revert(t) == "not applied; nothing to do"


def _record_saved(tree, key, path):
    """Set the saved state's digest `key` ("original" or "patched") of fused_adam.py to that
    of the file at `path`."""
    state_file = tree / "transformer_engine" / target.BACKUP_DIR / saved.STATE_FILE
    meta = json.loads(state_file.read_text(encoding="utf-8"))
    meta["files"][FUSED_ADAM][key] = upstream.sha256_of(path)
    meta.pop("patches", None)  # as an earlier version of the tool writes it
    state_file.write_text(json.dumps(meta), encoding="utf-8")


def _as_other_version(tree, old, new):
    """Make an applied tree look patched by another version of the series: other patched
    bytes (`old` replaced by `new`), recorded as such in the saved state."""
    path = tree / FUSED_ADAM
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new))
    _record_saved(tree, "patched", path)


def test_apply_replaces_another_version_of_the_series(tree, pristine):
    """A TE patched by another version of the series (an earlier release of the tool, whose
    saved originals are there) gets this version from apply; revert then restores it."""
    t = target.find_target(tree)
    actions.apply(t)
    _as_other_version(tree, b"_OFFLOAD_MAX_BUFFERS = 16", b"_OFFLOAD_MAX_BUFFERS = 8")
    report = dict(state.file_report(state.State(t)))
    assert report[FUSED_ADAM] == "patched by another version of this series; apply replaces it"
    assert state.State(t).other_version
    assert cli.main(["check", str(tree)]) == 0

    message = actions.apply(t)
    assert message.startswith("replaced another version of the series (reverted")
    assert "applied 3 patch(es)" in message
    assert state.status(t)[1] == state.APPLIED
    assert state.file_report(state.State(t)) == [
        (FUSED_ADAM, "TE 2.20.2's, patched by this series")
    ]
    assert actions.apply(t) == "already applied; nothing to do"
    actions.revert(t)
    assert _same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_other_version_on_other_originals_is_left_unchanged(tree):
    """If this version does not apply to the originals saved by another version (another TE
    release), apply raises and changes nothing; revert still restores those originals."""
    t = target.find_target(tree)
    actions.apply(t)
    _as_other_version(tree, b"_OFFLOAD_MAX_BUFFERS = 16", b"_OFFLOAD_MAX_BUFFERS = 8")
    backup = tree / "transformer_engine" / target.BACKUP_DIR
    original = backup / "original" / FUSED_ADAM
    drifted = original.read_bytes().replace(
        b"from itertools import chain", b"from itertools import chain  # x"
    )
    original.write_bytes(drifted)
    _record_saved(tree, "original", original)
    before = {p: p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}

    assert not state.State(t).other_version
    assert cli.main(["check", str(tree)]) == 1
    with pytest.raises(ToolError, match="another version of this series.*nothing was changed"):
        actions.apply(t)
    assert {p: p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()} == before
    assert "restored the saved original bytes" in actions.revert(t)
    assert (tree / FUSED_ADAM).read_bytes() == drifted


def _module_imports(path):
    """The modules that a Python file imports at module scope."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_series_adds_no_torch_import_at_module_scope(tree, pristine):
    """`import transformer_engine.pytorch` must not depend on a private torch module: the
    series imports only standard-library modules at module scope of fused_adam.py."""
    actions.apply(target.find_target(tree))
    added = _module_imports(tree / FUSED_ADAM) - _module_imports(pristine / FUSED_ADAM)
    assert added == {"collections", "concurrent.futures", "functools", "os"}
    assert all(name.split(".")[0] in sys.stdlib_module_names for name in added)


def test_drifted_target_is_reported_and_left_unchanged(tree):
    _drift_context(tree)
    before = (tree / FUSED_ADAM).read_bytes()
    t = target.find_target(tree)
    rows, overall = state.status(t)
    assert overall == state.DRIFTED
    detail = [d for _, s, d in rows if s == state.DRIFTED][0]
    first_hunk = next(iter(series.hunk_headers(series.patch_files()[0]).values()))
    assert FUSED_ADAM in detail and first_hunk in detail
    assert state.file_report(state.State(t)) == [
        (
            FUSED_ADAM,
            (
                "neither as released in TE 2.20.2 nor as this series patches that: edited, patched "
                "by something else, or of a release that the series does not apply to"
            ),
        )
    ]
    with pytest.raises(ToolError, match="drifted"):
        actions.apply(t)
    with pytest.raises(ToolError, match="drifted"):
        actions.revert(t)
    assert (tree / FUSED_ADAM).read_bytes() == before
    assert cli.main(["check", str(tree)]) == 1


def test_failed_apply_changes_nothing(tree, monkeypatch, tmp_path):
    """A series whose second patch does not apply leaves every file as it was."""
    good = series.patch_files()[0]
    bad = tmp_path / "0002-bad.patch"
    bad.write_text(
        good.read_text(encoding="utf-8").replace(
            "from itertools import chain\n", "from itertools import product\n"
        ),
        encoding="utf-8",
    )
    other = tree / "transformer_engine" / "pytorch" / "optimizers" / "fused_sgd.py"
    text = bad.read_text(encoding="utf-8").replace(FUSED_ADAM, str(other.relative_to(tree)))
    bad.write_text(text, encoding="utf-8")
    for module in (state, saved):
        monkeypatch.setattr(module, "patch_files", lambda: [good, bad])
    snapshot = {p: p.read_bytes() for p in (tree / "transformer_engine").rglob("*.py")}
    t = target.find_target(tree)
    with pytest.raises(ToolError):
        actions.apply(t)
    assert {p: p.read_bytes() for p in (tree / "transformer_engine").rglob("*.py")} == snapshot


def test_offset_applies_and_reverts_exactly(tree):
    _offset(tree)
    original = (tree / FUSED_ADAM).read_bytes()
    rows = drift.check_tree(tree)
    assert rows[0][1] == drift.OFFSET and "offset 2 lines" in rows[0][2]
    t = target.find_target(tree)
    actions.apply(t)
    assert state.status(t)[1] == state.APPLIED
    actions.revert(t)
    assert (tree / FUSED_ADAM).read_bytes() == original


def test_drift_report_on_pristine_and_drifted_trees(tree, pristine):
    assert [r[1] for r in drift.check_tree(pristine)] == [drift.CLEAN] * 3
    _drift_context(tree)
    assert [r[1] for r in drift.check_tree(tree)] == [drift.CONFLICT] + [state.NOT_CHECKED] * 2


def _git(args, cwd):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com")
    env.update(GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def _as_main(tree, monkeypatch):
    """Make the release tree stand in for a checkout of main: with the pinned main tree at
    hand (cached, or TE_SOURCE), add the main files the series changes; without it, only the
    patches that need none of them make the series. Returns the series' subjects."""
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
    for module in (state, saved, actions, mainline):
        monkeypatch.setattr(module, "patch_files", lambda: kept)
    stack = [(d, [p for p in ps if p in kept]) for d, ps in series.pr_patch_files()]
    monkeypatch.setattr(mainline, "pr_patch_files", lambda: [(d, ps) for d, ps in stack if ps])
    return [e["subject"] for e, needs in zip(entries, needs_main) if not needs]


def test_checkout_gets_the_series_as_commits(tree, monkeypatch):
    expected = _as_main(tree, monkeypatch)
    _git(["init", "-q", "-b", "main"], tree)
    _git(["add", "-A"], tree)
    _git(["commit", "-qm", "TE 2.20.2"], tree)
    base = _git(["rev-parse", "HEAD"], tree).strip()
    t = target.find_target(tree)
    assert t.kind == "checkout"
    assert "git am" in actions.apply(t)
    subjects = _git(["log", "--format=%s", f"-{len(expected)}"], tree).splitlines()[::-1]
    assert subjects == expected
    body = _git(["log", "-1", "--format=%B"], tree)
    assert "Signed-off-by: " in body
    assert "state_dict_cpu_offload" in (tree / FUSED_ADAM).read_text(encoding="utf-8")
    assert (tree / DOCS_PAGE).is_file() == (len(expected) == len(series.patch_files()))
    assert state.status(t)[1] == state.APPLIED
    assert actions.apply(t) == "already applied; nothing to do"
    actions.revert(t)
    assert _git(["rev-parse", "HEAD"], tree).strip() == base
    assert not (tree / DOCS_PAGE).exists()
    assert state.status(t)[1] == state.NOT_APPLIED


@pytest.fixture(scope="session")
def tool_home(tmp_path_factory):
    """The tool and its series without the repository's materialized transformer_engine/."""
    home = tmp_path_factory.mktemp("tool")
    for name in ("te_fusedadam_offload", "patches", "compat"):
        shutil.copytree(REPO / name, home / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("series.toml", "upstream.json"):
        shutil.copyfile(REPO / name, home / name)
    return home


def _cli_env(pythonpath=REPO, fault=None, **extra):
    """The environment of the command line in a subprocess, with a fault injected or none."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath), **extra)
    env.pop(saved.FAULT_ENV, None)
    if fault:
        env[saved.FAULT_ENV] = fault
    return env


def _cli(args, cwd=None, **env):
    """Run `python -m te_fusedadam_offload ARGS` in a subprocess (see _cli_env for `env`)."""
    return subprocess.run(
        [sys.executable, "-m", "te_fusedadam_offload", *args],
        cwd=cwd,
        env=_cli_env(**env),
        capture_output=True,
        text=True,
        check=False,
    )


def _run_cli(args, pythonpath, cwd, tool_home):
    return _cli(args, cwd, pythonpath=os.pathsep.join([str(pythonpath), str(tool_home)]))


def test_installed_target_inside_an_unrelated_git_repo(tree, tmp_path, tool_home):
    """--installed finds the TE that Python imports; a repository around it is ignored."""
    outer = tmp_path / "project"
    site = outer / ".venv" / "site-packages"
    shutil.move(str(tree / "transformer_engine"), site / "transformer_engine")
    _git(["init", "-q"], outer)
    result = _run_cli(["apply", "--installed"], site, outer, tool_home)
    assert result.returncode == 0, result.stderr
    assert f"installed TE at {site}" in result.stdout
    result = _run_cli(["status", "--installed"], site, outer, tool_home)
    assert "installed TE at" in result.stdout and ": applied" in result.stdout
    assert _run_cli(["revert"], site, outer, tool_home).returncode == 0
    assert upstream.sha256_of(site / FUSED_ADAM) == series.load_checksums()[FUSED_ADAM][0]


def test_state_is_found_once(tree, tmp_path):
    """Counted with a git on PATH that logs its calls: apply on a fresh TE applies each patch
    once to a scratch copy (3 patches: 3 git processes), and after it, apply, status and check
    read the digests that apply saved (none)."""
    log, wrapper = tmp_path / "git.log", tmp_path / "bin" / "git"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{shutil.which("git")}" "$@"\n')
    wrapper.chmod(0o755)

    def git_processes(*args, code=0):
        log.write_text("")
        path = f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}"
        pythonpath = os.pathsep.join([str(tree), str(REPO)])
        result = _cli([*args, "--installed"], tmp_path, pythonpath=pythonpath, PATH=path)
        assert result.returncode == code, result.stderr
        return len(log.read_text().splitlines())

    counts = {"status (fresh)": git_processes("status", code=1)}
    counts["apply"] = git_processes("apply")
    for command in ("apply", "status", "check"):
        counts[f"{command} (applied)"] = git_processes(command)
    assert counts["status (fresh)"] <= 3 and counts["apply"] <= 5, counts
    assert max(counts[f"{c} (applied)"] for c in ("apply", "status", "check")) <= 3, counts


def test_no_installed_te_is_a_clear_error(tmp_path, tool_home):
    result = _run_cli(["status", "--installed"], tmp_path, tmp_path, tool_home)
    assert result.returncode == 3
    assert "transformer_engine is not installed" in result.stderr


def test_materialize_gives_pristine_plus_series(tmp_path):
    message = maintainers.materialize(tmp_path)
    assert "2.20.2 + series" in message
    _, after = series.load_checksums()[FUSED_ADAM]
    assert upstream.sha256_of(tmp_path / FUSED_ADAM) == after
    with pytest.raises(ToolError, match="already exists"):
        maintainers.materialize(tmp_path)


@pytest.mark.parametrize("way_out", ["apply", "revert"])
def test_partly_applied_target_is_completed_or_reverted(tree, pristine, way_out):
    """Only the first of the two patches that change fused_adam.py applied (as an interrupted
    earlier version of the tool left it): reported as interrupted, with the patch that is in;
    apply completes the series, revert takes the first patch out."""
    t = target.find_target(tree)
    first, second = state.State(t).relevant[:2]
    t.patch([first])
    rows, overall = state.status(t)
    assert overall == state.INTERRUPTED
    states = {label: what for label, what, _ in rows}
    assert states[series.patch_label(first)] == state.APPLIED
    assert states[series.patch_label(second)] == state.NOT_APPLIED
    assert cli.main(["check", str(tree)]) == 0
    if way_out == "apply":
        assert "the first 1 were applied already" in actions.apply(t)
        assert state.file_report(state.State(t)) == [
            (FUSED_ADAM, "TE 2.20.2's, patched by this series")
        ]
    actions.revert(t)
    assert _same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_materialize_writes_the_stages_of_a_file_changed_twice(tmp_path, tree):
    """fused_adam.py is changed by patches 1, 3 and 5 (the export, the docstring fix, the
    load): .stages/0001/ and .stages/0003/ hold it after patches 1 and 3."""
    staged = series.staged_paths()
    assert [i for i, paths in staged.items() if FUSED_ADAM in paths] == [0, 2]
    maintainers.materialize(tmp_path / "m")
    stages = []
    for index, patch in enumerate(series.patch_files()[:3]):
        target.find_target(tree).patch([patch])
        if FUSED_ADAM in staged.get(index, ()):
            stage = tmp_path / "m" / ".stages" / f"{index + 1:04d}" / FUSED_ADAM
            assert stage.read_bytes() == (tree / FUSED_ADAM).read_bytes()
            stages.append(stage.read_bytes())
    assert len({*stages, (tmp_path / "m" / FUSED_ADAM).read_bytes()}) == 3
    with pytest.raises(ToolError, match="already exists"):
        maintainers.materialize(tmp_path / "m")


@pytest.mark.skipif(mainline.main_tree() is None, reason=mainline.NO_MAIN_TREE)
def test_materialize_writes_the_stages_of_main_files_changed_twice(tmp_path):
    """Both pull requests extend test_fused_optimizer.py: .stages/0002/ holds it as the first
    pull request leaves it, the pinned main file with patch 2 applied."""
    rel = "tests/pytorch/test_fused_optimizer.py"
    assert rel in series.staged_paths()[1]
    maintainers.materialize(tmp_path / "m")
    scratch = tmp_path / "main"
    (scratch / rel).parent.mkdir(parents=True)
    shutil.copyfile(mainline.main_tree() / rel, scratch / rel)
    patch = series.patch_files()[1]
    patching.git(["apply", f"--include={rel}", str(patch)], scratch)
    assert (tmp_path / "m" / ".stages" / "0002" / rel).read_bytes() == (scratch / rel).read_bytes()


def test_patches_are_up_to_date():
    """The CI check: the series regenerates itself byte for byte from the repository."""
    assert cli.main(["refresh", "--check"]) == 0


@pytest.fixture
def no_main_tree(monkeypatch):
    """As in CI: no TE source given and no main tree cached."""
    monkeypatch.delenv("TE_SOURCE", raising=False)
    monkeypatch.setattr(maintainers, "main_tree", lambda source=None: None)


def test_refresh_check_without_main_checks_all_but_the_main_diffs(no_main_tree, capsys):
    """Without the pinned main tree, the check regenerates the series with stand-ins for the
    main files: every message and every other diff must match, and it says what it skipped."""
    assert cli.main(["refresh", "--check"]) == 0
    out = capsys.readouterr().out
    assert "patches/ is up to date" in out
    assert out.rstrip().endswith(
        "their commit messages and every other diff were regenerated and match"
    )
    assert "SKIPPED: the diffs of" in out and "tests/pytorch/test_fused_optimizer.py" in out


def test_refresh_check_without_main_finds_a_stale_message(no_main_tree, monkeypatch):
    changed = series.load_series()
    entry = next(e for e in changed["patch"] if e.get("main_paths"))
    entry["body"] = entry["body"] + "\nOne more line.\n"
    monkeypatch.setattr(generate, "load_series", lambda: changed)
    assert cli.main(["refresh", "--check"]) == 1


def test_refresh_without_main_refuses_to_write(no_main_tree, capsys):
    assert cli.main(["refresh"]) == 1
    assert "pass --source or set TE_SOURCE" in capsys.readouterr().err


def test_materialize_without_main_says_what_it_skipped(no_main_tree, tmp_path):
    message = maintainers.materialize(tmp_path)
    assert "SKIPPED: " in message and "te-main" in message
    assert not (tmp_path / "te-main").exists()


def test_main_sections_are_left_out_of_the_comparison():
    text = (
        "Subject: [PATCH 1/1] x\n---\n a/b.py          | 2 +-\n tests/t.py | 10 ++++\n"
        " 2 files changed, 11 insertions(+), 1 deletion(-)\n create mode 100644 tests/t.py\n\n"
        "diff --git a/a/b.py b/a/b.py\n-old\n+new\n"
        "diff --git a/tests/t.py b/tests/t.py\n+stand-in\n-- \n"
    )
    kept = generate.without_paths(text, ["tests/t.py"])
    assert kept == "Subject: [PATCH 1/1] x\n---\n\ndiff --git a/a/b.py b/a/b.py\n-old\n+new\n-- \n"


@pytest.mark.skipif(mainline.main_tree() is None, reason=mainline.NO_MAIN_TREE)
def test_materialize_makes_the_patched_main_tree(tmp_path):
    """te-main/: the pinned main tree with the whole series, as the pull request makes it."""
    message = maintainers.materialize(tmp_path)
    assert "te-main: upstream main" in message
    main = tmp_path / "te-main"
    assert (main / DOCS_PAGE).is_file()
    for rel in series.main_paths():
        assert (main / rel).read_bytes() != (mainline.main_tree() / rel).read_bytes(), rel
    assert "state_dict_cpu_offload" in (main / "tests/pytorch/test_fused_optimizer.py").read_text()


def test_series_is_a_stack_of_pull_requests_with_cover_letters():
    """patches/<n>-<name>/: format-patch output per pull request, numbered from 1 in each, with
    a cover letter in TE's template; every patch signed off by the placeholder identity."""
    stack = series.pr_patch_files()
    assert [d.name for d, _ in stack] == ["1-export", "2-bounded-load"]
    placeholder = "{} <{}>".format(*series.PLACEHOLDER_IDENTITY)
    for number, (pr_dir, patches) in enumerate(stack, 1):
        names = [p.name for p in patches]
        assert names == sorted(names) and names[0].startswith("0001-")
        cover = (pr_dir / "0000-cover-letter.patch").read_text(encoding="utf-8")
        assert "*** SUBJECT HERE ***" not in cover and "*** BLURB HERE ***" not in cover
        assert f"[PATCH 0/{len(patches)}]" in cover
        assert "sha256 " + upstream.load_pin()["sha256"] in cover
        assert "## Type of change" in cover and "- [x] New feature" in cover
        assert "- [ ]" not in cover.split("# Checklist:")[1].split("\n\n")[1]
        assert ("Fixes #3668" in cover) == (number == 1)
        assert (',\non top of "[PyTorch]' in cover) == (number > 1)
        for patch in patches:
            text = patch.read_text(encoding="utf-8")
            assert text.startswith("From 0000000000000000000000000000000000000000 ")
            assert f"\nFrom: {placeholder}\n" in text
            assert f"\nSigned-off-by: {placeholder}\n" in text


def test_first_pull_request_adds_at_most_200_lines_under_transformer_engine():
    """The export pull request stays small: what it adds under transformer_engine/."""
    added = 0
    for patch in series.pr_patch_files()[0][1]:
        path = None
        for line in patch.read_text(encoding="utf-8").splitlines():
            if line.startswith("+++ "):
                path = line[len("+++ b/") :]
            elif line.startswith("+") and path and path.startswith("transformer_engine/"):
                added += 1
    assert 0 < added <= 200


def _signed_off_stack(tmp_path, *args, env=None):
    out = tmp_path / "signed"
    result = subprocess.run(
        [sys.executable, "-m", "te_fusedadam_offload", "pr", "--signoff", "--out", str(out), *args],
        cwd=tmp_path,
        env=_cli_env(**(env or {})),
        capture_output=True,
        text=True,
        check=False,
    )
    return result, out


def test_pr_signoff_writes_the_stack_signed_off_by_the_submitter(tmp_path, tree, monkeypatch):
    """pr --signoff: every From: and Signed-off-by: of the stack names the submitter; git am of
    the written stack makes commits authored and signed off by them."""
    result, out = _signed_off_stack(tmp_path, "--identity", "Jane Doe <jane@example.org>")
    assert result.returncode == 0, result.stderr
    assert "signed off by Jane Doe <jane@example.org>" in result.stdout
    written = [out / line for line in (out / "series").read_text().split()]
    assert [p.relative_to(out) for p in written] == [
        p.relative_to(series.patches_dir()) for p in series.patch_files()
    ]
    for patch in [*written, *out.glob("*/0000-cover-letter.patch")]:
        text = patch.read_text(encoding="utf-8")
        assert "you@example.com" not in text and "\nFrom: Jane Doe <jane@example.org>\n" in text
    assert all("\nSigned-off-by: Jane Doe <jane@example.org>\n" in p.read_text() for p in written)
    subjects = _as_main(tree, monkeypatch)
    kept = {series.patch_label(p) for p in state.patch_files()}
    _git(["init", "-q", "-b", "main"], tree)
    _git(["add", "-A"], tree)
    _git(["commit", "-qm", "TE"], tree)
    _git(
        ["am", "--keep-non-patch", *(str(p) for p in written if series.patch_label(p) in kept)],
        tree,
    )
    log = _git(["log", f"-{len(subjects)}", "--format=%an <%ae>|%(trailers:valueonly)"], tree)
    assert set(log.split()) >= {"Doe", "<jane@example.org>|Jane"} and "Your Name" not in log
    assert _git(["log", f"-{len(subjects)}", "--format=%s"], tree).split("\n")[::-1][1:] == subjects


def test_pr_signoff_takes_the_git_identity(tmp_path):
    """Without --identity, the user's git identity (here from the environment), a non-ASCII
    name encoded in the From: header as mail wants it."""
    env = {"GIT_AUTHOR_NAME": "Ana Núñez", "GIT_AUTHOR_EMAIL": "ana@example.org"}
    result, out = _signed_off_stack(tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    text = next(out.glob("1-*/0001-*.patch")).read_text(encoding="utf-8")
    header = re.search(r"^From: (.*)$", text, re.MULTILINE).group(1)
    assert (
        str(email.header.make_header(email.header.decode_header(header)))
        == "Ana Núñez <ana@example.org>"
    )
    assert "\nSigned-off-by: Ana Núñez <ana@example.org>\n" in text


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {"HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}, "no git identity"),
        (["--identity", "Your Name <you@example.com>"], {}, "placeholder identity"),
        (["--identity", "jane@example.org"], {}, "expected an identity"),
    ],
)
def test_pr_signoff_refuses_without_a_real_identity(tmp_path, args, env, message):
    result, out = _signed_off_stack(tmp_path, *args, env=env)
    assert result.returncode == 1 and message in result.stderr
    assert not out.exists()


def test_wheel_carries_the_series(tmp_path):
    """pip install . ships the series and the pin as package data of te_fusedadam_offload."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("te_fusedadam_offload-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "te_fusedadam_offload/cli.py" in names
    assert "te_fusedadam_offload/_data/upstream.json" in names
    assert "te_fusedadam_offload/_data/patches/series" in names
    assert "te_fusedadam_offload/_data/compat/te-2.14.0-2.16.1.patch" in names
    assert "te_fusedadam_offload/staging.py" in names
    assert not any(n.startswith("build_tools/") for n in names)
    entry = [n for n in names if n.endswith("entry_points.txt")][0]
    assert (
        "te-fusedadam-offload = te_fusedadam_offload.cli:main"
        in zipfile.ZipFile(wheel).read(entry).decode()
    )
    pinned = json.loads(zipfile.ZipFile(wheel).read("te_fusedadam_offload/_data/upstream.json"))
    assert pinned == upstream.load_pin()


def _main_repo(tree, monkeypatch):
    """A git repository whose commit stands in for the pinned upstream main commit (its tree
    is exported into a cache of its own)."""
    monkeypatch.setenv("TE_FUSEDADAM_OFFLOAD_CACHE", str(tree.parent / "cache"))
    _git(["init", "-q", "-b", "main"], tree)
    _git(["add", "-A"], tree)
    _git(["commit", "-qm", "main"], tree)
    commit = _git(["rev-parse", "HEAD"], tree).strip()
    pin = dict(mainline.load_main_pin(), commit=commit)
    monkeypatch.setattr(mainline, "load_main_pin", lambda: pin)
    return commit


def test_check_main_applies_the_series_in_a_scratch_clone(tree, monkeypatch):
    subjects = _as_main(tree, monkeypatch)
    commit = _main_repo(tree, monkeypatch)
    report = mainline.check_main(tree)
    assert f"git am of {len(subjects)} patches" in report and ": applied" in report
    for subject in subjects:
        assert subject in report
    assert _git(["rev-parse", "HEAD"], tree).strip() == commit
    assert not _git(["status", "--porcelain"], tree).strip()


def test_check_main_reports_a_conflict_and_a_missing_commit(tree, monkeypatch, tmp_path):
    _drift_context(tree)
    _main_repo(tree, monkeypatch)
    with pytest.raises(ToolError, match="git am of 1-export onto main .* failed and was aborted"):
        mainline.check_main(tree)
    assert not _git(["status", "--porcelain"], tree).strip()
    monkeypatch.setattr(mainline, "load_main_pin", lambda: dict(upstream.load_pin()["main"]))
    with pytest.raises(ToolError, match="does not hold the pinned main commit"):
        mainline.check_main(tree)
    with pytest.raises(ToolError, match="not a git repository"):
        mainline.check_main(tmp_path)


@pytest.mark.skipif(mainline.main_tree() is None, reason=mainline.NO_MAIN_TREE)
def test_series_applies_to_the_pinned_main_commit():
    """The pull request's base: the whole series git-am's onto the pinned main commit."""
    assert ": applied" in mainline.check_main()


@pytest.mark.skipif(mainline.main_archive() is None, reason=mainline.NO_MAIN_TREE)
def test_the_main_tree_comes_from_the_pinned_archive(tmp_path, monkeypatch):
    """Without a TE source (as in CI), the pinned main tree is the archive's, checked by its
    sha256; TE_MAIN_ARCHIVE names another place for it."""
    archive = mainline.main_archive()
    monkeypatch.delenv("TE_SOURCE", raising=False)
    monkeypatch.setenv("TE_FUSEDADAM_OFFLOAD_CACHE", str(tmp_path / "cache"))
    tree = mainline.main_tree()
    assert (tree / ".commit").read_text().strip() == mainline.load_main_pin()["commit"]
    for rel in series.main_paths():
        assert (tree / rel).is_file(), rel
    assert ": applied" in mainline.check_main()
    monkeypatch.setenv("TE_FUSEDADAM_OFFLOAD_CACHE", str(tmp_path / "another-cache"))
    changed = tmp_path / archive.name
    changed.write_bytes(archive.read_bytes() + b"\0")
    monkeypatch.setenv(mainline.ARCHIVE_ENV, str(changed))
    with pytest.raises(ToolError, match="does not match the pinned"):
        mainline.main_tree()
    monkeypatch.setenv(mainline.ARCHIVE_ENV, str(tmp_path / "missing.tar.gz"))
    with pytest.raises(ToolError, match="no such file"):
        mainline.main_tree()


# Crash safety of apply and revert on an installed TE or a directory (issue: a killed or
# failing run must leave every file as it was or as the series makes it, and a way out).

# The files apply writes: the saved original, the state file, then fused_adam.py; each is
# "write" (half written) then "replace" (written and synced, not yet renamed over).
APPLY_POINTS = [f"{point}#{n}" for n in (1, 2, 3) for point in ("write", "replace")]
# revert writes fused_adam.py back, then removes the saved originals ("unlink").
REVERT_POINTS = ["write#1", "replace#1", "unlink#1"]


def _file_state(tree):
    """ "pristine" or "patched" (by sha256 against patches/checksums), else "other"."""
    before, after = series.load_checksums()[FUSED_ADAM]
    digest = upstream.sha256_of(tree / FUSED_ADAM)
    return {before: "pristine", after: "patched"}.get(digest, "other")


def _assert_way_out(tree, pristine, mode):
    """apply then completes the series, and revert gives back every original byte and mode,
    with nothing of the tool left behind."""
    result = _cli(["apply", str(tree)])
    assert result.returncode == 0, result.stderr
    assert _file_state(tree) == "patched" and (tree / FUSED_ADAM).stat().st_mode & 0o7777 == mode
    result = _cli(["revert", str(tree)])
    assert result.returncode == 0, result.stderr
    assert _same_tree(tree / "transformer_engine", pristine / "transformer_engine")
    assert (tree / FUSED_ADAM).stat().st_mode & 0o7777 == mode


@pytest.mark.parametrize("point", APPLY_POINTS)
def test_apply_killed_at_any_point(tree, pristine, point):
    mode = (tree / FUSED_ADAM).stat().st_mode & 0o7777
    result = _cli(["apply", str(tree)], fault=f"{point}:kill")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert _file_state(tree) in ("pristine", "patched")
    assert (tree / FUSED_ADAM).stat().st_mode & 0o7777 == mode
    status = _cli(["status", str(tree)])
    assert status.returncode in (0, 1) and "drifted" not in status.stdout
    _assert_way_out(tree, pristine, mode)


@pytest.mark.parametrize("point", REVERT_POINTS)
def test_revert_killed_at_any_point(tree, pristine, point):
    (tree / FUSED_ADAM).chmod(0o640)
    assert _cli(["apply", str(tree)]).returncode == 0
    result = _cli(["revert", str(tree)], fault=f"{point}:kill")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert _file_state(tree) in ("pristine", "patched")
    _assert_way_out(tree, pristine, 0o640)
    # and revert alone is a way out too
    assert _cli(["apply", str(tree)]).returncode == 0
    assert _cli(["revert", str(tree)], fault=f"{point}:kill").returncode == -signal.SIGKILL
    assert _cli(["revert", str(tree)]).returncode == 0
    assert _same_tree(tree / "transformer_engine", pristine / "transformer_engine")


@pytest.mark.parametrize("error", ["enospc", "eio"])
@pytest.mark.parametrize(
    "command,point",
    [("apply", p) for p in APPLY_POINTS] + [("revert", p) for p in REVERT_POINTS],
)
def test_disk_errors_are_reported_truthfully(tree, pristine, command, point, error):
    if command == "revert":
        assert _cli(["apply", str(tree)]).returncode == 0
    before = _file_state(tree)
    result = _cli([command, str(tree)], fault=f"{point}:{error}")
    assert result.returncode == 1
    assert os.strerror(errno.ENOSPC if error == "enospc" else errno.EIO) in result.stderr
    assert "Traceback" not in result.stderr
    assert _file_state(tree) in ("pristine", "patched")
    if "nothing was changed" in result.stderr:
        assert _file_state(tree) == before
    _assert_way_out(tree, pristine, 0o644)


@pytest.mark.parametrize("mode", [0o444, 0o600, 0o755])
def test_modes_are_kept(tree, pristine, mode):
    """A read-only (or otherwise moded) file keeps its mode through apply and revert."""
    (tree / FUSED_ADAM).chmod(mode)
    _assert_way_out(tree, pristine, mode)


def _site_of_release(version, tmp_path):
    """A site directory with the real TE `version` wheel unpacked, package metadata included."""
    wheel = upstream.download_wheel("transformer_engine", version, upstream.cache_dir() / "wheels")
    site = tmp_path / f"site-{version}"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def test_release_older_than_supported_is_refused_with_the_range(tmp_path):
    site = _site_of_release("2.13.0", tmp_path)
    before = (site / FUSED_ADAM).read_bytes()
    pin = upstream.load_pin()["version"]
    for command in ("apply", "status", "check"):
        result = _cli([command, str(site)])
        assert result.returncode == 1, command
    result = _cli(["apply", str(site)])
    assert (
        f"found TE 2.13.0 at {site}; this series supports TE 2.14.0 to {pin} (made and tested "
        f"for {pin}): the FusedAdam code it builds on differs in older releases"
        in result.stderr
    )
    assert f"{FUSED_ADAM}: hunk" in result.stderr
    assert "What to do: put the files of a supported TE (TE 2.14.0 to" in result.stderr
    assert (site / FUSED_ADAM).read_bytes() == before


def test_other_te_version_that_applies_gets_a_note(tmp_path):
    site = _site_of_release("2.19.0", tmp_path)
    before = (site / FUSED_ADAM).read_bytes()
    result = _cli(["apply", str(site)])
    assert result.returncode == 0, result.stderr
    assert "note: found TE 2.19.0; the series is made and tested for" in result.stdout
    # status agrees with apply: this series, on 2.19.0's file (not "another version").
    result = _cli(["status", str(site)])
    assert result.returncode == 0
    assert f"  {FUSED_ADAM}: TE 2.19.0's, patched by this series\n" in result.stdout
    assert "another version" not in result.stdout
    assert _cli(["apply", str(site)]).stdout.endswith("already applied; nothing to do\n")
    assert _cli(["revert", str(site)]).returncode == 0
    assert (site / FUSED_ADAM).read_bytes() == before


def test_apply_upto_applies_the_first_pull_requests(tree, pristine, tmp_path):
    """apply --upto 1 (a maintainers' option, for the GPU runner's STACK_PREFIX=1): the first
    pull request alone, as its patches make the file; the whole stack then reads as
    interrupted, and apply without it applies the whole stack."""
    result = _cli(["apply", "--upto", "1", str(tree)])
    assert result.returncode == 0, result.stderr
    assert "applied 2 patch(es)" in result.stdout
    expected = tmp_path / "pr1"
    shutil.copytree(pristine / "transformer_engine", expected / "transformer_engine")
    assert target.Target(expected, "tree").patch(series.pr_patch_files()[0][1]) == 2
    assert (tree / FUSED_ADAM).read_bytes() == (expected / FUSED_ADAM).read_bytes()
    result = _cli(["apply", "--upto", "1", str(tree)])
    assert result.stdout.endswith("already applied; nothing to do\n"), result.stdout
    result = _cli(["status", str(tree)])
    assert result.returncode == 1 and ": interrupted\n" in result.stdout
    result = _cli(["apply", str(tree)])
    assert result.returncode == 0 and "applied 3 patch(es)" in result.stdout, result.stderr
    assert _file_state(tree) == "patched"
    assert _cli(["revert", str(tree)]).returncode == 0
    assert _same_tree(tree / "transformer_engine", pristine / "transformer_engine")
    result = _cli(["apply", "--upto", "3", str(tree)])
    assert result.returncode == 2 and "give --upto 1 to 2" in result.stderr


def test_status_and_check_exit_codes(tree):
    assert _cli(["status", str(tree)]).returncode == 1  # not applied
    assert _cli(["check", str(tree)]).returncode == 0  # applies
    assert _cli(["apply", str(tree)]).returncode == 0
    assert _cli(["status", str(tree)]).returncode == 0  # applied
    assert _cli(["check", str(tree)]).returncode == 0
    assert _cli(["revert", str(tree)]).returncode == 0
    _drift_context(tree)
    assert _cli(["status", str(tree)]).returncode == 1
    assert _cli(["check", str(tree)]).returncode == 1  # drifted
    assert _cli(["status", "--bogus"]).returncode == 2


def test_missing_git_is_one_line(tree):
    result = _cli(["status", str(tree)], PATH="/nonexistent")
    assert result.returncode == 4
    assert result.stderr.strip().splitlines() == [
        "te-fusedadam-offload status: error: git is needed but was not found on PATH; install git"
    ]


def test_closed_pipe_ends_quietly(tree):
    with subprocess.Popen(
        [sys.executable, "-m", "te_fusedadam_offload", "status", str(tree)],
        env=_cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        proc.stdout.close()  # as `| head -0` does, before anything is printed
        stderr = proc.stderr.read().decode()
        assert proc.wait() == 128 + signal.SIGPIPE
    assert stderr == ""


def test_the_module_runs_from_a_te_checkout(tmp_path):
    """A TE checkout has a build_tools/ package of its own: it does not shadow the tool."""
    (tmp_path / "build_tools").mkdir()
    (tmp_path / "build_tools" / "__init__.py").write_text("")
    result = _cli(["--version"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == te_fusedadam_offload.__version__


def test_the_package_directory_itself_gets_a_hint(tree):
    result = _cli(["status", str(tree / "transformer_engine")])
    assert result.returncode == 3
    assert f"pass the directory that holds it, {tree}" in result.stderr


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the tool's tests run outside a venv")
def test_cpu_tier_leaves_the_active_venv_untouched(tmp_path):
    """With a user's virtualenv active, the CPU tier sets up and uses its own venv (here the
    one these tests run in, as from .ci/run) and installs nothing into the active one."""
    active = tmp_path / "training-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(active)], check=True)
    before = _listing(active)
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
    assert _listing(active) == before


def test_exit_status_tells_no_target_from_no(tree, tmp_path):
    """3: nothing to work on where named; 4: something the tool needs is missing; 1: the
    answer is no (not applied, drifted)."""
    (tmp_path / "file").write_text("")
    for args in (
        ["status", str(tmp_path / "missing")],
        ["apply", str(tmp_path / "file")],
        ["check", str(tmp_path)],  # no transformer_engine/ in it
    ):
        result = _cli(args)
        assert result.returncode == 3, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    result = _cli(["status", "--python", str(tmp_path / "no-python")])
    assert result.returncode == 4 and "cannot run the Python" in result.stderr
    assert _cli(["status", str(tree)]).returncode == 1
    _drift_context(tree)
    assert _cli(["apply", str(tree)]).returncode == 1


def test_help_lists_the_user_commands_first():
    out = _cli(["--help"]).stdout
    listed = re.findall(r"^    (\S+)", out, re.MULTILINE)
    assert listed[:4] == ["apply", "status", "check", "revert"]
    for name in ("fetch", "materialize", "refresh", "drift", "check-main", "lint", "pr"):
        assert re.search(rf"^    {name}\s+\[maintainers\]", out, re.MULTILINE), name
    assert "exit status:" in out and "  3  no TE where named" in out


def test_drift_message_keeps_its_parentheses_and_fits_a_directory(tree):
    _drift_context(tree)
    message = _cli(["apply", str(tree)]).stderr
    assert ": not checked (an earlier patch does not apply)" in message
    assert ": not for this target (tests and docs go to source checkouts only)" in message
    assert "pip install" not in message  # a directory, not an installed TE
    assert "What to do: put the files of a supported TE" in message


def test_status_json(tree):
    assert _cli(["apply", str(tree)]).returncode == 0
    result = _cli(["status", "--json", str(tree)])
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert report["status"] == "applied" and report["kind"] == "tree"
    assert report["target"] == str(tree.resolve())
    assert report["series_for"] == upstream.load_pin()["version"]
    states = {row["patch"]: row["state"] for row in report["patches"]}
    assert list(states.values()).count("applied") == 3
    assert report["files"] == [{"path": FUSED_ADAM, "state": "TE 2.20.2's, patched by this series"}]
    assert report["notes"] == []


def test_apply_dry_run_shows_the_diff_and_changes_nothing(tree, tmp_path):
    before = _listing(tree), (tree / FUSED_ADAM).read_bytes()
    result = _cli(["apply", "--dry-run", str(tree)])
    assert result.returncode == 0, result.stderr
    assert (_listing(tree), (tree / FUSED_ADAM).read_bytes()) == before
    diff, _, summary = result.stdout.rpartition("dry run: ")
    assert summary.startswith(f"tree TE at {tree.resolve()}: applied 3 patch(es)")
    assert summary.rstrip().endswith("; nothing was changed")
    # The diff is what apply writes: applied to a copy, it gives the same bytes.
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy)
    (tmp_path / "dry.diff").write_text(diff)
    _git(["apply", str(tmp_path / "dry.diff")], copy)
    assert _cli(["apply", str(tree)]).returncode == 0
    assert (copy / FUSED_ADAM).read_bytes() == (tree / FUSED_ADAM).read_bytes()
    result = _cli(["apply", "--dry-run", str(tree)])
    assert (
        result.stdout
        == f"dry run: tree TE at {tree.resolve()}: already applied; nothing "
        "to do; nothing was changed\n"
    )


@pytest.mark.parametrize("version", ["2.14.0", "2.16.1"])
def test_releases_before_2_17_get_the_compat_patch_first(tmp_path, version):
    """TE 2.14.0 to 2.16.1 (the ends of the range; drift covers each release): the compat
    patch, then the series; revert gives back the release's exact bytes."""
    site = _site_of_release(version, tmp_path)
    before = (site / FUSED_ADAM).read_bytes()
    t = target.find_target(site)
    assert [series.patch_label(p) for p in state.State(t).relevant][0].startswith("compat/")
    assert "applied 4 patch(es)" in actions.apply(t)
    rows, overall = state.status(t)
    assert overall == state.APPLIED and rows[0][:2] == ("compat/te-2.14.0-2.16.1.patch", "applied")
    patched = (site / FUSED_ADAM).read_text(encoding="utf-8")
    compile(patched, FUSED_ADAM, "exec")
    assert "from ..constants import DType, TE_DType_To_Torch\n" in patched
    assert state.file_report(state.State(t), overall) == [
        (FUSED_ADAM, f"TE {version}'s, patched by this series")
    ]
    actions.revert(t)
    assert (site / FUSED_ADAM).read_bytes() == before


def test_drift_goes_on_past_a_release_it_cannot_download(capsys):
    code = cli.main(["drift", "0.0.1", "2.16.1", "2.13.0"])
    out = capsys.readouterr().out
    assert code == 1  # 2.13.0 conflicts
    assert "transformer_engine 0.0.1:\n  download: not checked (could not download" in out
    assert "  compat/te-2.14.0-2.16.1.patch: applies cleanly" in out
    assert "2.13.0" in out and "note: older than the releases the series supports" in out
    assert cli.main(["drift", "0.0.1", "2.16.1"]) == 4


def _venv_with_te(root, version):
    """A real virtualenv (with pip) where TE `version` is installed from its release wheel."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    _pip(root, "install", "--no-deps", "--no-index", str(_wheel(version)))
    return root / "bin" / "python"


def _wheel(version):
    return upstream.download_wheel("transformer_engine", version, upstream.cache_dir() / "wheels")


def _pip(venv, *args):
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "-q", *args],
        check=True,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )


def test_pip_uninstall_reinstall_and_upgrade_of_a_patched_te(tmp_path, tool_home):
    """--python names another environment's TE. pip uninstall leaves only the saved originals:
    a clear error (3), and revert removes them; reinstalled, apply applies (nothing was
    interrupted); upgraded over an apply, status says so and apply applies again."""
    venv = tmp_path / "venv"
    python = _venv_with_te(venv, "2.20.2")
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )

    def tool(*args):
        return _cli([*args, "--python", str(python)], cwd=tmp_path, pythonpath=tool_home)

    result = tool("apply")
    assert result.returncode == 0 and f"installed TE at {site}: applied 3" in result.stdout
    _pip(venv, "uninstall", "-y", "transformer_engine")
    assert _listing(site / "transformer_engine")[0] == target.BACKUP_DIR
    result = tool("status")
    assert result.returncode == 3
    assert "left behind when TE was uninstalled" in result.stderr
    result = tool("revert")
    assert (
        result.returncode == 0
        and "removed the original files that apply had saved" in result.stdout
    )
    assert not (site / "transformer_engine").exists()

    _pip(venv, "install", "--no-deps", "--no-index", str(_wheel("2.20.2")))
    result = tool("apply")
    assert result.returncode == 0 and ": applied 3 patch(es)" in result.stdout, result.stdout
    _pip(venv, "install", "--no-deps", "--no-index", str(_wheel("2.19.0")))
    result = tool("status")
    assert result.returncode == 1
    assert ": not applied\n" in result.stdout
    assert (
        "note: the series was applied here and is not now (TE 2.20.2 then, TE 2.19.0 now)"
        in result.stdout
    )
    result = tool("apply")
    assert "TE was reinstalled or upgraded since the last apply" in result.stdout
    assert tool("status").returncode == 0
    assert tool("revert").returncode == 0
    with zipfile.ZipFile(_wheel("2.19.0")) as zf:
        assert (site / FUSED_ADAM).read_bytes() == zf.read(FUSED_ADAM)
    assert not (site / "transformer_engine" / target.BACKUP_DIR).exists()
