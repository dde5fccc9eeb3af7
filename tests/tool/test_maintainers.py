"""The maintainers' commands on the release: materialize, refresh, drift and pr --signoff."""

import email.header
import re
import subprocess
import sys

import pytest
from support import FUSED_ADAM, as_main, drift_context, git, release_patches, tool_env

from te_fusedadam_offload import cli, patching, series, state, target, upstream
from te_fusedadam_offload.maintainers import commands as maintainers, drift, generate
from te_fusedadam_offload.errors import ToolError


def test_materialize_gives_pristine_plus_series(tmp_path):
    message = maintainers.materialize(tmp_path)
    assert "2.20.2 + series" in message
    _, after = series.load_checksums()[FUSED_ADAM]
    assert upstream.sha256_of(tmp_path / FUSED_ADAM) == after
    with pytest.raises(ToolError, match="already exists"):
        maintainers.materialize(tmp_path)


def test_materialize_writes_the_stages_of_a_file_changed_several_times(tmp_path, tree):
    """Several patches change fused_adam.py (those whose diffs name it): .stages/NNNN/ holds
    it after each of them but the last (NNNN: that patch's number), and the materialized file
    is it after the last; each of them differs."""
    patches = series.patch_files()
    changing = [i for i, patch in enumerate(patches) if FUSED_ADAM in patching.touched(patch)]
    assert len(changing) > 1, "the series no longer changes fused_adam.py several times"
    staged = series.staged_paths()
    assert [i for i, paths in staged.items() if FUSED_ADAM in paths] == changing[:-1]
    maintainers.materialize(tmp_path / "m")
    stages = []
    for index, patch in enumerate(patches[: changing[-1]]):
        target.find_target(tree).patch([patch])
        if index in changing:
            stage = tmp_path / "m" / ".stages" / f"{index + 1:04d}" / FUSED_ADAM
            assert stage.read_bytes() == (tree / FUSED_ADAM).read_bytes()
            stages.append(stage.read_bytes())
    target.find_target(tree).patch([patches[changing[-1]]])
    assert (tmp_path / "m" / FUSED_ADAM).read_bytes() == (tree / FUSED_ADAM).read_bytes()
    assert len({*stages, (tmp_path / "m" / FUSED_ADAM).read_bytes()}) == len(changing)
    with pytest.raises(ToolError, match="already exists"):
        maintainers.materialize(tmp_path / "m")


def test_patches_are_up_to_date():
    """The CI check: the series regenerates itself byte for byte from the repository."""
    assert cli.main(["refresh", "--check"]) == 0


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


def test_drift_report_on_pristine_and_drifted_trees(tree, pristine):
    """A row for each patch that changes the release's files; on a tree where the first does
    not apply, the later ones are not checked."""
    count = len(release_patches())
    assert [r[1] for r in drift.check_tree(pristine)] == [drift.CLEAN] * count
    drift_context(tree)
    rows = [r[1] for r in drift.check_tree(tree)]
    assert rows == [drift.CONFLICT] + [state.NOT_CHECKED] * (count - 1)


@pytest.mark.network
def test_drift_goes_on_past_a_release_it_cannot_download(capsys):
    code = cli.main(["drift", "0.0.1", "2.16.1", "2.13.0"])
    out = capsys.readouterr().out
    assert code == 1  # 2.13.0 conflicts
    assert "transformer_engine 0.0.1:\n  download: not checked (could not download" in out
    assert "  compat/te-2.14.0-2.16.1.patch: applies cleanly" in out
    assert "2.13.0" in out and "note: older than the releases the series supports" in out
    assert cli.main(["drift", "0.0.1", "2.16.1"]) == 4


def _signed_off_stack(tmp_path, *args, env=None):
    out = tmp_path / "signed"
    result = subprocess.run(
        [sys.executable, "-m", "te_fusedadam_offload", "pr", "--signoff", "--out", str(out), *args],
        cwd=tmp_path,
        env=tool_env(**(env or {})),
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
    subjects = as_main(tree, monkeypatch)
    kept = {series.patch_label(p) for p in state.patch_files()}
    git(["init", "-q", "-b", "main"], tree)
    git(["add", "-A"], tree)
    git(["commit", "-qm", "TE"], tree)
    git(
        ["am", "--keep-non-patch", *(str(p) for p in written if series.patch_label(p) in kept)],
        tree,
    )
    log = git(["log", f"-{len(subjects)}", "--format=%an <%ae>|%(trailers:valueonly)"], tree)
    assert set(log.split()) >= {"Doe", "<jane@example.org>|Jane"} and "Your Name" not in log
    assert git(["log", f"-{len(subjects)}", "--format=%s"], tree).split("\n")[::-1][1:] == subjects


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
