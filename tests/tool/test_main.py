"""The series on upstream main: a TE checkout gets it as commits, check-main, the pinned main
tree (from a TE source or the archive) and what materialize makes of it."""

import shutil

import pytest
from support import DOCS_PAGE, FUSED_ADAM, as_main, drift_context, git

from te_fusedadam_offload import actions, patching, series, state, target, upstream
from te_fusedadam_offload.maintainers import commands as maintainers, mainline
from te_fusedadam_offload.errors import ToolError


def test_checkout_gets_the_series_as_commits(tree, monkeypatch):
    expected = as_main(tree, monkeypatch)
    git(["init", "-q", "-b", "main"], tree)
    git(["add", "-A"], tree)
    git(["commit", "-qm", "TE 2.20.2"], tree)
    base = git(["rev-parse", "HEAD"], tree).strip()
    t = target.find_target(tree)
    assert t.kind == "checkout"
    assert "git am" in actions.apply(t)
    subjects = git(["log", "--format=%s", f"-{len(expected)}"], tree).splitlines()[::-1]
    assert subjects == expected
    body = git(["log", "-1", "--format=%B"], tree)
    assert "Signed-off-by: " in body
    assert "state_dict_cpu_offload" in (tree / FUSED_ADAM).read_text(encoding="utf-8")
    assert (tree / DOCS_PAGE).is_file() == (len(expected) == len(series.patch_files()))
    assert state.State(t).overall == state.APPLIED
    assert actions.apply(t) == "already applied; nothing to do"
    actions.revert(t)
    assert git(["rev-parse", "HEAD"], tree).strip() == base
    assert not (tree / DOCS_PAGE).exists()
    assert state.State(t).overall == state.NOT_APPLIED


def _main_repo(tree, monkeypatch):
    """A git repository whose commit stands in for the pinned upstream main commit (its tree
    is exported into a cache of its own)."""
    monkeypatch.setenv("TE_FUSEDADAM_OFFLOAD_CACHE", str(tree.parent / "cache"))
    git(["init", "-q", "-b", "main"], tree)
    git(["add", "-A"], tree)
    git(["commit", "-qm", "main"], tree)
    commit = git(["rev-parse", "HEAD"], tree).strip()
    pin = dict(mainline.load_main_pin(), commit=commit)
    monkeypatch.setattr(mainline, "load_main_pin", lambda: pin)
    return commit


def test_check_main_applies_the_series_in_a_scratch_clone(tree, monkeypatch):
    subjects = as_main(tree, monkeypatch)
    commit = _main_repo(tree, monkeypatch)
    report = mainline.check_main(tree)
    assert f"git am of {len(subjects)} patches" in report and ": applied" in report
    for subject in subjects:
        assert subject in report
    assert git(["rev-parse", "HEAD"], tree).strip() == commit
    assert not git(["status", "--porcelain"], tree).strip()


def test_check_main_reports_a_conflict_and_a_missing_commit(tree, monkeypatch, tmp_path):
    drift_context(tree)
    _main_repo(tree, monkeypatch)
    with pytest.raises(ToolError, match="git am of 1-export onto main .* failed and was aborted"):
        mainline.check_main(tree)
    assert not git(["status", "--porcelain"], tree).strip()
    monkeypatch.setattr(mainline, "load_main_pin", lambda: dict(upstream.load_pin()["main"]))
    with pytest.raises(ToolError, match="does not hold the pinned main commit"):
        mainline.check_main(tree)
    with pytest.raises(ToolError, match="not a git repository"):
        mainline.check_main(tmp_path)


@pytest.mark.skipif(mainline.main_tree() is None, reason=mainline.NO_MAIN_TREE)
def test_series_applies_to_the_pinned_main_commit():
    """The pull request's base: the whole series git-am's onto the pinned main commit."""
    assert ": applied" in mainline.check_main()


# Only this test needs the archive itself; the pinned main tree may be at hand without it.
NO_MAIN_ARCHIVE = (
    "no archive of the pinned main tree (upstream.json's main.archive, at "
    f"${mainline.ARCHIVE_ENV} or ../shared/upstream/ beside the checkout): this test of the "
    "archive is skipped even where the tree itself is found (the cache, TE_SOURCE)"
)


@pytest.mark.skipif(mainline.main_archive() is None, reason=NO_MAIN_ARCHIVE)
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


@pytest.mark.skipif(mainline.main_tree() is None, reason=mainline.NO_MAIN_TREE)
def test_materialize_writes_the_stages_of_main_files_changed_several_times(tmp_path):
    """Several patches extend test_fused_optimizer.py: .stages/NNNN/ holds it as the first
    patch that changes it leaves it (NNNN: that patch's number), the pinned main file with that
    patch applied."""
    rel = "tests/pytorch/test_fused_optimizer.py"
    entries = series.load_series()["patch"]
    first = next(i for i, entry in enumerate(entries) if rel in series.entry_paths(entry))
    assert rel in series.staged_paths()[first]
    maintainers.materialize(tmp_path / "m")
    scratch = tmp_path / "main"
    (scratch / rel).parent.mkdir(parents=True)
    shutil.copyfile(mainline.main_tree() / rel, scratch / rel)
    patch = series.patch_files()[first]
    patching.git(["apply", f"--include={rel}", str(patch)], scratch)
    stage = tmp_path / "m" / series.stage_dir(first) / rel
    assert stage.read_bytes() == (scratch / rel).read_bytes()


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
