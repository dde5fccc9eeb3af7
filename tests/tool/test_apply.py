"""apply, status, check and revert on a directory holding the release (in process and as
commands): the state, the files, other versions and releases."""

import json
import os
import shutil

import pytest
from support import (
    FUSED_ADAM,
    FUSED_SGD,
    REPO,
    added_constant,
    drift_context,
    file_state,
    git,
    listing,
    offset_hunks,
    release_patches,
    run_tool,
    same_tree,
    site_of_release,
)

from te_fusedadam_offload import actions, cli, report, saved, series, state, target, upstream
from te_fusedadam_offload.maintainers import drift
from te_fusedadam_offload.errors import ToolError


def _release_patches(t):
    """The patches of the series that change files of the release's package."""
    return [p for p in series.patch_files() if t.touches(p)]


def test_apply_is_idempotent_and_revert_restores_pristine_bytes(tree, pristine):
    t = target.find_target(tree)
    assert t.kind == "tree"
    assert state.State(t).overall == state.NOT_APPLIED
    assert report.file_report(state.State(t)) == [(FUSED_ADAM, "as released in TE 2.20.2")]
    # The tool's choice is what the patch files say, and what series.toml says of them.
    assert _release_patches(t) == release_patches()
    paths = [series.entry_paths(entry) for entry in series.load_series()["patch"]]
    in_release = [p for p in paths if any(rel.startswith(f"{t.subtree}/") for rel in p)]
    count = len(_release_patches(t))
    assert count == len(in_release) > 0

    assert f"applied {count} patch" in actions.apply(t)
    assert state.State(t).overall == state.APPLIED
    assert report.file_report(state.State(t)) == [
        (FUSED_ADAM, "TE 2.20.2's, patched by this series")
    ]
    assert "state_dict_cpu_offload" in (tree / FUSED_ADAM).read_text(encoding="utf-8")
    assert actions.apply(t) == "already applied; nothing to do"

    assert f"reverted {count} patch" in actions.revert(t)
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")
    assert actions.revert(t) == "not applied; nothing to do"


def _record_saved(tree, key, path, version="earlier"):
    """Set the saved state's digest `key` ("original" or "patched") of fused_adam.py to that
    of the file at `path`, as another version of the tool saves it: an earlier one does not
    record the patches, a later one records its own."""
    state_file = tree / "transformer_engine" / target.BACKUP_DIR / saved.STATE_FILE
    meta = json.loads(state_file.read_text(encoding="utf-8"))
    meta["files"][FUSED_ADAM][key] = upstream.sha256_of(path)
    if version == "earlier":
        meta.pop("patches", None)
    else:
        meta["patches"] = [[label, "0" * 64] for label, _ in meta["patches"]]
    state_file.write_text(json.dumps(meta), encoding="utf-8")


def _as_other_version(tree, pristine, version="earlier"):
    """Make an applied tree look patched by another version of the series: other patched
    bytes (a constant that the series adds, with another value), recorded as such in the
    saved state."""
    path = tree / FUSED_ADAM
    data = path.read_bytes()
    line = added_constant(data, (pristine / FUSED_ADAM).read_bytes())
    name, _, value = line.partition(b" = ")
    path.write_bytes(data.replace(line, name + b" = 2 * (" + value + b")", 1))
    _record_saved(tree, "patched", path, version)


@pytest.mark.parametrize("version", ["earlier", "later"])
def test_apply_replaces_another_version_of_the_series(tree, pristine, version):
    """A TE patched by another version of the series (another release of the tool, whose
    saved originals are there) gets this version from apply; revert then restores it."""
    t = target.find_target(tree)
    actions.apply(t)
    _as_other_version(tree, pristine, version)
    files = dict(report.file_report(state.State(t)))
    assert files[FUSED_ADAM] == "patched by another version of this series; apply replaces it"
    assert state.State(t).other_version
    assert cli.main(["check", str(tree)]) == 1  # not this series: apply replaces it

    message = actions.apply(t)
    assert message.startswith("replaced another version of the series (reverted")
    assert f"applied {len(release_patches())} patch(es)" in message
    assert state.State(t).overall == state.APPLIED
    assert report.file_report(state.State(t)) == [
        (FUSED_ADAM, "TE 2.20.2's, patched by this series")
    ]
    assert actions.apply(t) == "already applied; nothing to do"
    actions.revert(t)
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_other_version_on_other_originals_is_left_unchanged(tree, pristine):
    """If this version does not apply to the originals saved by another version (another TE
    release), apply raises and changes nothing; revert still restores those originals."""
    t = target.find_target(tree)
    actions.apply(t)
    _as_other_version(tree, pristine)
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


def test_revert_of_a_drifted_target_that_apply_never_patched_says_it_changes_nothing(tree):
    """A user's edit of a TE the tool never patched: revert has nothing to write back, and
    says so before the way to the released files (which would discard the edit)."""
    drift_context(tree)
    before = (tree / FUSED_ADAM).read_bytes()
    result = run_tool(["revert", str(tree)])
    assert result.returncode == 1, result.stderr
    assert "it saved none of these files: it did not patch them, and nothing was changed" in (
        result.stderr
    )
    assert "(which discards what was changed in them): put the files of a supported TE" in (
        result.stderr
    )
    assert result.stderr.endswith("or point at such a tree.\n"), result.stderr
    assert (tree / FUSED_ADAM).read_bytes() == before


def test_revert_where_apply_saved_originals_keeps_the_advice_to_restore_a_release(tree):
    """Revert's 'it did not patch them' is for a TE without saved originals only."""
    drift_context(tree)
    t = target.find_target(tree)
    rows = state.State(t).rows
    saved = report.drift_message(t, rows, "revert", saved=True)
    assert "did not patch" not in saved and saved.endswith("and run revert again.")
    assert "it did not patch them" in report.drift_message(t, rows, "revert", saved=False)


def test_drifted_target_is_reported_and_left_unchanged(tree):
    drift_context(tree)
    before = (tree / FUSED_ADAM).read_bytes()
    t = target.find_target(tree)
    found = state.State(t)
    rows, overall = found.rows, found.overall
    assert overall == state.DRIFTED
    detail = [d for _, s, d in rows if s == state.DRIFTED][0]
    first_hunk = next(iter(series.hunk_headers(series.patch_files()[0]).values()))
    assert FUSED_ADAM in detail and first_hunk in detail
    assert report.file_report(state.State(t)) == [
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


def test_a_file_edited_before_apply_is_not_called_released_and_its_edit_is_kept(tree):
    """A line appended to the release's fused_adam.py, where the series still applies: status
    said "not patched", as of the released file. Now it says the file is not as released; apply
    keeps the edit, and revert gives the edited bytes back."""
    edited = (tree / FUSED_ADAM).read_bytes() + b"# a local edit\n"
    (tree / FUSED_ADAM).write_bytes(edited)
    t = target.find_target(tree)
    assert state.State(t).overall == state.NOT_APPLIED
    assert report.file_report(state.State(t)) == [
        (FUSED_ADAM, f"not as released in TE 2.20.2: {report.NOT_PRISTINE}")
    ]
    actions.apply(t)
    assert (tree / FUSED_ADAM).read_bytes().endswith(b"# a local edit\n")
    assert report.file_report(state.State(t)) == [  # not "TE of another version's"
        (
            FUSED_ADAM,
            (
                "patched by this series over a file that was not as released in TE 2.20.2 (revert "
                "gives that file back)"
            ),
        )
    ]
    actions.revert(t)
    assert (tree / FUSED_ADAM).read_bytes() == edited


def test_a_file_edited_after_apply_is_drifted_and_revert_keeps_it_unless_told(tree, pristine):
    """A line appended to the patched fused_adam.py: status said "applied" (exit 0), check
    exit 0, and revert said "reverted" but kept the edit and deleted the saved originals. Now
    status and check say drifted (exit 1), apply and revert refuse and change nothing, and
    revert --discard-edits writes the saved original back and names the file."""
    assert run_tool(["apply", str(tree)]).returncode == 0
    with open(tree / FUSED_ADAM, "a", encoding="utf-8") as f:
        f.write("# a local edit\n")
    edited = (tree / FUSED_ADAM).read_bytes()
    saved_dir = tree / "transformer_engine" / target.BACKUP_DIR
    result = run_tool(["status", str(tree)])
    assert result.returncode == 1 and ": drifted\n" in result.stdout
    assert f"drifted ({FUSED_ADAM}: changed after apply)" in result.stdout
    assert f"  {FUSED_ADAM}: {report.EDITED} (the saved originals are kept)\n" in result.stdout
    found = json.loads(run_tool(["status", "--json", str(tree)]).stdout)
    assert found["status"] == "drifted" and found["files"][0]["state"].startswith(report.EDITED)
    assert run_tool(["check", str(tree)]).returncode == 1
    advice = f"What to do: 'te-fusedadam-offload revert --discard-edits {tree.resolve()}' writes"
    for command in ("apply", "revert"):
        result = run_tool([command, str(tree)])
        assert result.returncode == 1
        assert f"cannot {command}: {FUSED_ADAM} {report.EDITED}\n" in result.stderr
        assert advice in result.stderr
        assert (tree / FUSED_ADAM).read_bytes() == edited and saved_dir.is_dir()
    result = run_tool(["revert", "--discard-edits", str(tree)])
    assert result.returncode == 0, result.stderr
    assert (
        "restored the saved original bytes and modes of 1 file(s); discarded what was changed "
        f"after apply in {FUSED_ADAM}\n"
        in result.stdout
    )
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def _without_git(args, tree):
    """The command line with no git on PATH (the TE named by its path, or installed: the
    release copy first on this Python's path)."""
    pythonpath = os.pathsep.join([str(tree), str(REPO)])
    return run_tool(args, pythonpath=pythonpath, PATH=str(tree / "no-bin-here"))


@pytest.mark.parametrize("case", ["this version", "an earlier version", "edited", "installed"])
def test_revert_works_without_git(tree, pristine, case):
    """revert writes the saved originals back, which needs no git: as this version saved
    them, as an earlier version did (no patches recorded), and with --discard-edits; for an
    edited file without it, exit 4 says why git is needed and what else to do."""
    assert run_tool(["apply", str(tree)]).returncode == 0
    args = ["revert", "--installed" if case == "installed" else str(tree)]
    if case == "an earlier version":
        _record_saved(tree, "patched", tree / FUSED_ADAM)  # the same digests, no patches
    if case == "edited":
        with open(tree / FUSED_ADAM, "a", encoding="utf-8") as f:
            f.write("# a local edit\n")
        result = _without_git(args, tree)
        assert result.returncode == 4 and result.stderr.count("\n") == 1, result.stderr
        assert (
            "telling an edit from a reinstall of TE needs git (git is needed but" in result.stderr
        )
        assert "or 'te-fusedadam-offload revert --discard-edits " in result.stderr
        args.append("--discard-edits")
    result = _without_git(args, tree)
    assert result.returncode == 0, result.stderr
    count = "the series" if case == "an earlier version" else f"{len(release_patches())} patch(es)"
    assert f"reverted {count}: restored the saved original bytes and modes of 1 file(s)" in (
        result.stdout
    )
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")
    result = _without_git(["status", str(tree)], tree)
    assert result.returncode == 4 and "git is needed but was not found" in result.stderr


def test_one_of_two_files_edited_after_apply(tree, pristine, series_home, two_file_patches):
    """A series that changes two files, one edited after apply: drifted; --discard-edits
    restores both (the other as any revert does)."""
    home = series_home(*two_file_patches)
    tool = lambda *args: run_tool([*args, str(tree)], cwd=home, pythonpath=home)
    assert tool("apply").returncode == 0
    with open(tree / FUSED_SGD, "a", encoding="utf-8") as f:
        f.write("# a local edit\n")
    result = tool("status")
    assert result.returncode == 1 and f"  {FUSED_SGD}: {report.EDITED}" in result.stdout
    assert f"  {FUSED_ADAM}: TE 2.20.2's, patched by this series\n" in result.stdout, result.stdout
    assert tool("revert").returncode == 1
    result = tool("revert", "--discard-edits")
    assert "of 2 file(s); discarded what was changed after apply in " + FUSED_SGD in result.stdout
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_failed_apply_changes_nothing(tree, series_home, two_file_patches):
    """A series whose second patch does not apply (to the second file that the first patch
    changes) leaves every file as it was, and status says that the first applies and where
    the second stops (one git apply of both leaves the first applied: the patches are then
    tried in turn on a fresh copy)."""
    first, second = two_file_patches
    series_home(first, second.replace(" # Patched by the first patch.", " # Patched otherwise."))
    snapshot = {p: p.read_bytes() for p in (tree / "transformer_engine").rglob("*.py")}
    found = state.State(target.find_target(tree))
    assert found.overall == state.DRIFTED
    assert [row[1] for row in found.rows] == [state.NOT_APPLIED, state.DRIFTED]
    assert f"{FUSED_SGD}: hunk @@" in found.rows[1][2]
    with pytest.raises(ToolError, match="drifted"):
        actions.apply(target.find_target(tree))
    assert {p: p.read_bytes() for p in (tree / "transformer_engine").rglob("*.py")} == snapshot


def test_offset_applies_and_reverts_exactly(tree):
    offset_hunks(tree)
    original = (tree / FUSED_ADAM).read_bytes()
    rows = drift.check_tree(tree)
    assert rows[0][1] == drift.OFFSET and "offset 2 lines" in rows[0][2]
    t = target.find_target(tree)
    actions.apply(t)
    assert state.State(t).overall == state.APPLIED
    actions.revert(t)
    assert (tree / FUSED_ADAM).read_bytes() == original


@pytest.mark.parametrize("way_out", ["apply", "revert"])
def test_partly_applied_target_is_completed_or_reverted(tree, pristine, way_out):
    """Only the first of the patches that change fused_adam.py applied (as an interrupted
    earlier version of the tool left it): reported as interrupted, with the patch that is in;
    apply completes the series, revert takes the first patch out."""
    t = target.find_target(tree)
    first, second = state.State(t).relevant[:2]
    t.patch([first])
    found = state.State(t)
    rows, overall = found.rows, found.overall
    assert overall == state.INTERRUPTED
    states = {label: what for label, what, _ in rows}
    assert states[series.patch_label(first)] == state.APPLIED
    assert states[series.patch_label(second)] == state.NOT_APPLIED
    assert cli.main(["check", str(tree)]) == 1
    if way_out == "apply":
        assert "the first 1 were applied already" in actions.apply(t)
        assert report.file_report(state.State(t)) == [
            (FUSED_ADAM, "TE 2.20.2's, patched by this series")
        ]
    actions.revert(t)
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_status_json(tree):
    assert run_tool(["apply", str(tree)]).returncode == 0
    result = run_tool(["status", "--json", str(tree)])
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert report["status"] == "applied" and report["kind"] == "tree"
    assert report["target"] == str(tree.resolve())
    assert report["series_for"] == upstream.load_pin()["version"]
    states = {row["patch"]: row["state"] for row in report["patches"]}
    assert list(states.values()).count("applied") == len(release_patches())
    assert report["files"] == [{"path": FUSED_ADAM, "state": "TE 2.20.2's, patched by this series"}]
    assert report["notes"] == []


def test_apply_dry_run_shows_the_diff_and_changes_nothing(tree, tmp_path):
    before = listing(tree), (tree / FUSED_ADAM).read_bytes()
    result = run_tool(["apply", "--dry-run", str(tree)])
    assert result.returncode == 0, result.stderr
    assert (listing(tree), (tree / FUSED_ADAM).read_bytes()) == before
    diff, _, summary = result.stdout.rpartition("dry run: ")
    count = len(release_patches())
    assert summary.startswith(
        f"tree TE at {tree.resolve()}: apply would say: applied {count} patch(es)"
    )
    assert summary.rstrip().endswith("; nothing was changed")
    # The diff is what apply writes: applied to a copy, it gives the same bytes.
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy)
    (tmp_path / "dry.diff").write_text(diff)
    git(["apply", str(tmp_path / "dry.diff")], copy)
    assert run_tool(["apply", str(tree)]).returncode == 0
    assert (copy / FUSED_ADAM).read_bytes() == (tree / FUSED_ADAM).read_bytes()
    result = run_tool(["apply", "--dry-run", str(tree)])
    assert (
        result.stdout
        == f"dry run: tree TE at {tree.resolve()}: apply would say: already applied; "
        "nothing to do; nothing was changed\n"
    )


def test_apply_upto_applies_the_first_pull_requests(tree, pristine, tmp_path):
    """apply --upto 1 (a maintainers' option, for the GPU runner's STACK_PREFIX=1): the first
    pull request alone, as its patches make the file; the whole stack then reads as
    interrupted, and apply without it applies the whole stack."""
    stack = series.pr_patch_files()
    first = len(release_patches(stack[0][1]))
    result = run_tool(["apply", "--upto", "1", str(tree)])
    assert result.returncode == 0, result.stderr
    assert f"applied {first} patch(es)" in result.stdout
    expected = tmp_path / "pr1"
    shutil.copytree(pristine / "transformer_engine", expected / "transformer_engine")
    assert target.Target(expected, "tree").patch(stack[0][1]) == first
    assert (tree / FUSED_ADAM).read_bytes() == (expected / FUSED_ADAM).read_bytes()
    result = run_tool(["apply", "--upto", "1", str(tree)])
    assert result.stdout.endswith("already applied; nothing to do\n"), result.stdout
    result = run_tool(["status", str(tree)])
    assert result.returncode == 1 and ": interrupted\n" in result.stdout
    result = run_tool(["apply", str(tree)])
    count = len(release_patches())
    assert result.returncode == 0 and f"applied {count} patch(es)" in result.stdout, result.stderr
    assert file_state(tree) == "patched"
    assert run_tool(["revert", str(tree)]).returncode == 0
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")
    result = run_tool(["apply", "--upto", str(len(stack) + 1), str(tree)])
    assert result.returncode == 2 and f"give --upto 1 to {len(stack)}" in result.stderr


@pytest.mark.network
def test_release_older_than_supported_is_refused_with_the_range(tmp_path):
    site = site_of_release("2.13.0", tmp_path)
    before = (site / FUSED_ADAM).read_bytes()
    pin = upstream.load_pin()["version"]
    for command in ("apply", "status", "check"):
        result = run_tool([command, str(site)])
        assert result.returncode == 1, command
    # Not "drifted" (the word for local edits): not applied, and why apply refuses it.
    result = run_tool(["status", str(site)])
    assert result.stdout.startswith(f"tree TE at {site}: not applied\n")
    assert "drifted" not in result.stdout
    assert (
        f"not applied (TE 2.13.0 is older than the releases the series supports, 2.14.0 to {pin}"
        in result.stdout
    )
    assert "not for this target" not in result.stdout
    result = run_tool(["revert", str(site)])  # nothing to take out
    assert result.returncode == 0 and "not applied; nothing to do" in result.stdout
    result = run_tool(["apply", str(site)])
    assert (
        f"found TE 2.13.0 at {site}; this series supports TE 2.14.0 to {pin} (made and tested "
        f"for {pin}): the FusedAdam code it builds on differs in older releases"
        in result.stderr
    )
    assert f"{FUSED_ADAM}: hunk" in result.stderr
    assert "What to do: put the files of a supported TE (TE 2.14.0 to" in result.stderr
    assert (site / FUSED_ADAM).read_bytes() == before


@pytest.mark.network
def test_other_te_version_that_applies_gets_a_note(tmp_path):
    site = site_of_release("2.19.0", tmp_path)
    before = (site / FUSED_ADAM).read_bytes()
    result = run_tool(["apply", str(site)])
    assert result.returncode == 0, result.stderr
    assert "note: found TE 2.19.0; the series is made and tested for" in result.stdout
    # status agrees with apply: this series, on 2.19.0's file (not "another version").
    result = run_tool(["status", str(site)])
    assert result.returncode == 0
    assert f"  {FUSED_ADAM}: TE 2.19.0's, patched by this series\n" in result.stdout
    assert "another version" not in result.stdout
    assert run_tool(["apply", str(site)]).stdout.endswith("already applied; nothing to do\n")
    assert run_tool(["revert", str(site)]).returncode == 0
    assert (site / FUSED_ADAM).read_bytes() == before


@pytest.mark.network
@pytest.mark.parametrize("version", ["2.14.0", "2.16.1"])
def test_releases_before_2_17_get_the_compat_patch_first(tmp_path, version):
    """TE 2.14.0 to 2.16.1 (the ends of the range; drift covers each release): the compat
    patch, then the series; revert gives back the release's exact bytes."""
    site = site_of_release(version, tmp_path)
    before = (site / FUSED_ADAM).read_bytes()
    t = target.find_target(site)
    assert [series.patch_label(p) for p in state.State(t).relevant][0].startswith("compat/")
    assert f"applied {len(release_patches()) + 1} patch(es)" in actions.apply(t)  # + compat
    found = state.State(t)
    rows, overall = found.rows, found.overall
    assert overall == state.APPLIED and rows[0][:2] == ("compat/te-2.14.0-2.16.1.patch", "applied")
    patched = (site / FUSED_ADAM).read_text(encoding="utf-8")
    compile(patched, FUSED_ADAM, "exec")
    assert "from ..constants import DType, TE_DType_To_Torch\n" in patched
    assert report.file_report(state.State(t), overall) == [
        (FUSED_ADAM, f"TE {version}'s, patched by this series")
    ]
    actions.revert(t)
    assert (site / FUSED_ADAM).read_bytes() == before
