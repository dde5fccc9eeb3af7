"""The plans of apply and revert (plan.py), decided from a State alone: here from stand-ins that
say what a State would have read, with no target on disk (its root does not exist, so a plan
that read or wrote it would fail) and no git (a plan that ran it fails)."""

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from te_fusedadam_offload import plan, preview
from te_fusedadam_offload.errors import ToolError
from te_fusedadam_offload.saved import Backup, sha256
from te_fusedadam_offload.state import APPLIED, DRIFTED, NOT_APPLIED
from te_fusedadam_offload.upstream import load_pin

ROOT = Path("/nonexistent/site")
ADAM = "transformer_engine/pytorch/optimizers/fused_adam.py"
OLD, NEW, OTHER = b"released\n", b"patched\n", b"patched by another version\n"


@pytest.fixture(autouse=True)
def no_git(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError(f"a plan ran {args[0]}")

    monkeypatch.setattr(subprocess, "Popen", refused)


def found(saved=None, **given):
    """A stand-in for the State of a TE tree at ROOT holding fused_adam.py as `given` (by
    default, as released: the series not applied); `saved`: {path: (what it is, original
    bytes, mode)} as apply saved them."""
    target = SimpleNamespace(
        kind="tree",
        leftover=False,
        root=ROOT,
        subtree="transformer_engine",
        args=str(ROOT),
        python=None,
    )
    backup = Backup(target, "apply", read=False)
    if saved:
        backup.state = {rel: {"mode": mode} for rel, (_, _, mode) in saved.items()}
        backup.meta = {"files": backup.state, "patches": [["0001", "0" * 64]]}
        backup._originals = {rel: data for rel, (_, data, _) in saved.items()}
    state = SimpleNamespace(
        target=target,
        backup=backup,
        saved={rel: what for rel, (what, _, _) in saved.items()} if saved else None,
        from_saved=bool(saved),
        this_version=True,
        source_checkout=None,
        overall=NOT_APPLIED,
        rows=[],
        edited=[],
        te_version=load_pin()["version"],
        relevant=["0001", "0002"],
        applied=0,
        files={ADAM: OLD},
        modes={ADAM: 0o640},
        include=["transformer_engine/*"],
    )
    vars(state).update(given)
    state.changes = lambda: ({ADAM: state.files[ADAM]}, {ADAM: NEW})
    state.after_saved = lambda: {ADAM: NEW}
    state.changed_since_apply = lambda: []
    return state


def kinds(steps):
    return [type(step).__name__ for step in steps]


def test_apply_on_released_files_saves_them_then_writes_each_file():
    done = plan.apply_plan(found())
    assert done.refusal is None and kinds(done.steps) == ["Tidy", "Save"]
    save = done.steps[1]
    assert (save.originals, save.write.contents) == ({ADAM: OLD}, {ADAM: NEW})
    assert save.write.modes == {ADAM: 0o640} and save.write.before == {ADAM: sha256(OLD)}
    assert done.message == "applied 2 patch(es) to transformer_engine/"
    assert preview.would_apply(found()).startswith("the series is not in: ")


def test_apply_where_the_series_is_in_does_nothing_but_tidy():
    done = plan.apply_plan(found(overall=APPLIED))
    assert (kinds(done.steps), done.message) == (["Tidy"], "already applied; nothing to do")
    assert preview.would_apply(found(overall=APPLIED)) == "nothing to do, the series is applied"


def test_apply_on_drifted_files_is_refused_and_changes_nothing():
    done = plan.apply_plan(found(overall=DRIFTED))
    assert kinds(done.steps) == ["Tidy"] and isinstance(done.refusal, ToolError)
    assert str(done.refusal).startswith("cannot apply: ")
    with pytest.raises(ToolError, match="cannot apply"):
        preview.dry_run(found(overall=DRIFTED))


def test_apply_after_an_interrupted_apply_writes_only_what_is_left():
    """state.json says fused_sgd.py is still original: only it is written, with its saved
    mode; fused_adam.py, patched already, is left alone."""
    sgd = "transformer_engine/pytorch/optimizers/fused_sgd.py"
    saved = {ADAM: ("patched", OLD, 0o644), sgd: ("original", OLD, 0o600)}
    state = found(saved, files={ADAM: NEW, sgd: OLD})
    state.after_saved = lambda: {ADAM: NEW, sgd: NEW}
    done = plan.apply_plan(state)
    assert kinds(done.steps) == ["Tidy", "Write"]
    assert (done.steps[1].contents, done.steps[1].modes) == ({sgd: NEW}, {sgd: 0o600})
    assert done.message == "completed an interrupted apply (1 file(s) written)"


def test_apply_over_another_version_restores_the_originals_then_applies_this_one():
    state = found({ADAM: ("patched", OLD, 0o644)}, files={ADAM: OTHER}, this_version=False)
    state.saved_results = lambda: [("0001", SimpleNamespace(returncode=0))]
    state.forgetting_saved = lambda written, modes: found(files=written, modes=modes)
    done = plan.apply_plan(state)
    assert kinds(done.steps) == ["Tidy", "Write", "Forget", "Save"]
    restore, save = done.steps[1], done.steps[3]
    assert (restore.contents, restore.action) == ({ADAM: OLD}, "revert")
    assert (save.originals, save.write.contents, save.write.modes) == (
        {ADAM: OLD},
        {ADAM: NEW},
        {ADAM: 0o644},
    )
    assert done.message.startswith("replaced another version of the series (reverted 1 patch")
    assert preview.would_apply(state).startswith("replaces the other version")


def test_revert_writes_the_saved_originals_back_then_forgets_them():
    done = plan.revert_plan(found({ADAM: ("patched", OLD, 0o644)}, files={ADAM: NEW}))
    assert kinds(done.steps) == ["Tidy", "Write", "Forget"] and done.refusal is None
    assert (done.steps[1].contents, done.steps[1].modes) == ({ADAM: OLD}, {ADAM: 0o644})
    assert (
        done.message
        == "reverted 1 patch(es): restored the saved original bytes and modes of 1 file(s)"
    )


def test_what_apply_saved_as_another_user_is_needed_by_revert_and_refused():
    """Saved originals this user cannot read: revert (which writes them back) and an apply
    that would save over them are refused, changing nothing but the tidying; an apply that
    finds the series in does nothing, as before."""
    state = found({ADAM: ("patched", None, 0o644)}, files={ADAM: NEW})
    state.backup.unreadable = PermissionError(13, "Permission denied", "/x/fused_adam.py")
    done = plan.revert_plan(state)
    assert kinds(done.steps) == ["Tidy"] and "cannot read /x/fused_adam.py" in str(done.refusal)
    assert "revert needs it" in str(done.refusal)
    assert plan.apply_plan(state).message == "already applied; nothing to do"
    fresh = found()
    fresh.backup.unreadable = PermissionError(13, "Permission denied", "/x/state.json")
    assert "apply needs it" in str(plan.apply_plan(fresh).refusal)
