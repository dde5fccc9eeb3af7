"""Crash safety of apply and revert on an installed TE or a directory: a killed or failing run
must leave every file as it was or as the series makes it, say truly what it left, and leave
a way out."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support import (
    FUSED_ADAM,
    FUSED_SGD,
    REPO,
    as_main,
    file_state,
    git,
    run_tool,
    same_tree,
    tool_env,
)

from te_fusedadam_offload import cli, report
from te_fusedadam_offload.maintainers import mainline


# The files apply writes: the saved original, the state file, then fused_adam.py; each is
# "write" (half written) then "replace" (written and synced, not yet renamed over).
APPLY_POINTS = [f"{point}#{n}" for n in (1, 2, 3) for point in ("write", "replace")]

# revert writes fused_adam.py back, then removes the saved originals ("unlink").
REVERT_POINTS = ["write#1", "replace#1", "unlink#1"]


def _assert_way_out(tree, pristine, mode):
    """apply then completes the series, and revert gives back every original byte and mode,
    with nothing of the tool left behind."""
    result = run_tool(["apply", str(tree)])
    assert result.returncode == 0, result.stderr
    assert file_state(tree) == "patched" and (tree / FUSED_ADAM).stat().st_mode & 0o7777 == mode
    result = run_tool(["revert", str(tree)])
    assert result.returncode == 0, result.stderr
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")
    assert (tree / FUSED_ADAM).stat().st_mode & 0o7777 == mode


@pytest.mark.parametrize("point", APPLY_POINTS)
def test_apply_killed_at_any_point(tree, pristine, point):
    mode = (tree / FUSED_ADAM).stat().st_mode & 0o7777
    result = run_tool(["apply", str(tree)], fault=f"{point}:kill")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert file_state(tree) in ("pristine", "patched")
    assert (tree / FUSED_ADAM).stat().st_mode & 0o7777 == mode
    status = run_tool(["status", str(tree)])
    assert status.returncode in (0, 1) and "drifted" not in status.stdout
    _assert_way_out(tree, pristine, mode)


@pytest.mark.parametrize("point", REVERT_POINTS)
def test_revert_killed_at_any_point(tree, pristine, point):
    (tree / FUSED_ADAM).chmod(0o640)
    assert run_tool(["apply", str(tree)]).returncode == 0
    result = run_tool(["revert", str(tree)], fault=f"{point}:kill")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert file_state(tree) in ("pristine", "patched")
    _assert_way_out(tree, pristine, 0o640)
    # and revert alone is a way out too
    assert run_tool(["apply", str(tree)]).returncode == 0
    assert run_tool(["revert", str(tree)], fault=f"{point}:kill").returncode == -signal.SIGKILL
    assert run_tool(["revert", str(tree)]).returncode == 0
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


@pytest.mark.parametrize("error", ["enospc", "eio"])
@pytest.mark.parametrize(
    "command,point",
    [("apply", p) for p in APPLY_POINTS] + [("revert", p) for p in REVERT_POINTS],
)
def test_disk_errors_are_reported_truthfully(tree, pristine, command, point, error):
    if command == "revert":
        assert run_tool(["apply", str(tree)]).returncode == 0
    before = file_state(tree)
    result = run_tool([command, str(tree)], fault=f"{point}:{error}")
    assert result.returncode == 1
    assert os.strerror(errno.ENOSPC if error == "enospc" else errno.EIO) in result.stderr
    assert "Traceback" not in result.stderr
    assert file_state(tree) in ("pristine", "patched")
    if "nothing was changed" in result.stderr:
        assert file_state(tree) == before
    _assert_way_out(tree, pristine, 0o644)


@pytest.mark.parametrize("mode", [0o444, 0o600, 0o755])
def test_modes_are_kept(tree, pristine, mode):
    """A read-only (or otherwise moded) file keeps its mode through apply and revert."""
    (tree / FUSED_ADAM).chmod(mode)
    _assert_way_out(tree, pristine, mode)


# The same with a series whose patches change two files of the release (the first patch both,
# the second the second again), so that a run can stop between them.
TWO_FILES = (FUSED_ADAM, FUSED_SGD)


@pytest.fixture
def two_files(series_home, two_file_patches):
    """The tool's home (for PYTHONPATH, and the directory to run it in) with the two-file series
    as its series."""
    return series_home(*two_file_patches)


def _tool(args, home, **env):
    """The command line of the tool in `home`, run there."""
    return run_tool(args, cwd=home, pythonpath=home, **env)


def _two_states(tree, home):
    return [file_state(tree, rel, home / "patches") for rel in TWO_FILES]


def _apply_killed_between_the_files(tree, home):
    """apply writes the two originals, state.json, then fused_adam.py and fused_sgd.py: kill
    it as the second file is half written."""
    result = _tool(["apply", str(tree)], home, fault="write#5:kill")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert _two_states(tree, home) == ["patched", "pristine"]


def test_an_apply_stopped_between_two_files_reads_as_interrupted_and_apply_completes_it(
    tree, pristine, two_files
):
    _apply_killed_between_the_files(tree, two_files)
    result = _tool(["status", str(tree)], two_files)
    assert result.returncode == 1 and f"TE at {tree.resolve()}: interrupted\n" in result.stdout
    assert "  1-synthetic/0002-synthetic.patch: interrupted (an apply or revert" in result.stdout
    assert f"  {FUSED_ADAM}: TE 2.20.2's, patched by this series\n" in result.stdout
    assert f"  {FUSED_SGD}: as released in TE 2.20.2\n" in result.stdout
    assert _tool(["check", str(tree)], two_files).returncode == 1
    result = _tool(["apply", str(tree)], two_files)
    assert result.stdout.endswith("completed an interrupted apply (1 file(s) written)\n")
    assert _two_states(tree, two_files) == ["patched", "patched"]
    assert _tool(["status", str(tree)], two_files).returncode == 0
    result = _tool(["revert", str(tree)], two_files)
    assert "reverted 2 patch(es): restored the saved original bytes and modes of 2 file(s)" in (
        result.stdout
    )
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_revert_of_an_apply_stopped_between_two_files_restores_the_one_written(
    tree, pristine, two_files
):
    _apply_killed_between_the_files(tree, two_files)
    result = _tool(["revert", str(tree)], two_files)
    assert result.returncode == 0, result.stderr
    assert "restored the saved original bytes and modes of 1 file(s)" in result.stdout
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


@pytest.mark.parametrize("command, point", [("apply", "write#5"), ("revert", "write#2")])
def test_a_failure_after_a_file_was_written_says_which(tree, pristine, two_files, command, point):
    """The second file's write fails (a full disk) after the first file was replaced: the
    message says what each file is, read back, and not that nothing was changed."""
    if command == "revert":
        assert _tool(["apply", str(tree)], two_files).returncode == 0
    result = _tool([command, str(tree)], two_files, fault=f"{point}:enospc")
    assert result.returncode == 1
    assert "nothing was changed" not in result.stderr
    assert (
        f"{command} stopped: {os.strerror(errno.ENOSPC)} while writing "
        f"{tree.resolve() / FUSED_SGD}; checked: {FUSED_ADAM}: written, {FUSED_SGD}: as "
        "before; run apply again to complete the series, or revert to undo it\n"
        in result.stderr
    )
    assert _tool(["apply", str(tree)], two_files).returncode == 0
    assert _two_states(tree, two_files) == ["patched", "patched"]
    assert _tool(["revert", str(tree)], two_files).returncode == 0
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_a_failure_before_any_file_was_written_says_nothing_was_changed(tree, two_files):
    result = _tool(["apply", str(tree)], two_files, fault="write#4:eio")
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith(
        f"while writing {tree.resolve() / FUSED_ADAM}; nothing was changed (checked)"
    )
    assert _two_states(tree, two_files) == ["pristine", "pristine"]


# Ctrl-C: SIGINT at the same points (the tool's fault hook sends it to itself), and at instants
# of a real run, sent to its process group as a terminal does (git included).
SCRATCH_POINTS = ["scratch#1"]  # the scratch copy that apply tries the patches on, in $TMPDIR


def _one_interrupted_line(result, command, tree):
    """The command's output after Ctrl-C: nothing on stdout, one line on stderr that says what
    fused_adam.py is, as read back; returns the file's state."""
    assert result.returncode == 130, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"te-fusedadam-offload {command}: "), lines
    found = file_state(tree)
    if "interrupted before it read the TE; nothing was changed" not in lines[0]:
        said = {"pristine": "as released in TE 2.20.2", "patched": "patched by this series"}
        assert f"interrupted; {FUSED_ADAM}: " in lines[0]
        assert said[found] in lines[0], (found, lines[0])
    return found


@pytest.mark.parametrize(
    "command,point",
    [("apply", p) for p in SCRATCH_POINTS + APPLY_POINTS] + [("revert", p) for p in REVERT_POINTS],
)
def test_ctrl_c_at_any_point_says_what_the_files_are_and_leaves_no_scratch(
    tree, pristine, tmp_path, command, point
):
    if command == "revert":
        assert run_tool(["apply", str(tree)]).returncode == 0
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    result = run_tool([command, str(tree)], fault=f"{point}:int", TMPDIR=str(scratch))
    assert "Traceback" not in result.stderr
    assert _one_interrupted_line(result, command, tree) in ("pristine", "patched")
    assert not list(scratch.iterdir())
    _assert_way_out(tree, pristine, 0o644)


# The instants of a run at which a Ctrl-C is sent, in order, and what the files then are: the
# target found and its lock not yet taken (no other run holds it), git trying the patches on a
# scratch copy (git gets the Ctrl-C too), each file written and before it replaces the old one,
# the saved originals about to be removed, the work done and read back before the success line.
INSTANTS = {
    "apply": [
        ("lock#1", "pristine"),
        ("scratch#1", "pristine"),
        ("git#1", "pristine"),
        *[(point, "pristine") for point in APPLY_POINTS],
        ("done#1", "patched"),
    ],
    "revert": [
        ("lock#1", "patched"),
        ("write#1", "patched"),
        ("replace#1", "patched"),
        ("unlink#1", "pristine"),
        ("done#1", "pristine"),
    ],
}
BEFORE_THE_LOCK = "interrupted before it read the TE; nothing was changed"


def _in_a_session(args, **env):
    """The command line in a session of its own: the fault hook's Ctrl-C goes to its process
    group, as a terminal's does (git included)."""
    with subprocess.Popen(
        [sys.executable, "-m", "te_fusedadam_offload", *args],
        env=tool_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_ctrl_c_at_several_instants_of_a_run(tree, pristine, tmp_path, command):
    """Ctrl-C at each instant of INSTANTS in turn (sent there by the fault hook, so that where it
    lands is chosen, not timed): exit 130 and one line saying what the files are, as they are;
    before the lock, that nothing was read or changed (not that it waited for another run:
    none held the lock); never a traceback, nothing left in $TMPDIR or beside the files."""
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    other = "revert" if command == "apply" else "apply"
    for instant, files in INSTANTS[command]:
        assert run_tool([other, str(tree)]).returncode == 0
        result = _in_a_session([command, str(tree)], fault=f"{instant}:int", TMPDIR=str(scratch))
        assert "Traceback" not in result.stderr, (instant, result.stderr)
        assert _one_interrupted_line(result, command, tree) == files, instant
        said = result.stderr.split(": ", 1)[1].rstrip("\n")
        assert (said == BEFORE_THE_LOCK) == instant.startswith("lock"), (instant, said)
        assert not list(scratch.iterdir()), instant
        assert not list((tree / FUSED_ADAM).parent.glob(".*.tmp")), instant
    _assert_way_out(tree, pristine, 0o644)


# The same with Ctrl-C sent at timed instants from 0 to 0.4 s into a run: where each lands
# depends on the machine's speed and load, and whatever it is, what the run says must be true.
_CONSOLE_SCRIPT = """import sys
import te_fusedadam_offload.__main__ as command
quiet = command.quiet_lost_interrupts
def ready():
    print('ready', file=sys.stderr, flush=True)
    return quiet()
command.quiet_lost_interrupts = ready
sys.exit(command.main())
"""


def _ctrl_c_after(args, delay, scratch):
    with subprocess.Popen(
        [sys.executable, "-c", _CONSOLE_SCRIPT, *args],
        env=tool_env(TMPDIR=str(scratch)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    ) as proc:
        assert proc.stderr.readline() == "ready\n"
        time.sleep(delay)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass  # done already
        stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_ctrl_c_at_timed_instants_of_a_run_says_the_truth(tree, pristine, tmp_path, command):
    """Ctrl-C from 0 to 0.4 s into a run (after the command's main() has begun; the instants
    are the machine's, so this asserts only what holds at any of them): it either completes
    (exit 0, its line) or stops with exit 130 and one line saying what the files are; never a
    traceback, never a success line before an interrupt, nothing left in $TMPDIR or beside the
    files."""
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    for delay in (0, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.3, 0.4):
        other = "revert" if command == "apply" else "apply"
        assert run_tool([other, str(tree)]).returncode == 0
        result = _ctrl_c_after([command, str(tree)], delay, scratch)
        assert "Traceback" not in result.stderr, (delay, result.stderr)
        if result.returncode == 0:
            assert result.stderr == "" and result.stdout.count("\n") >= 1
            assert file_state(tree) == ("patched" if command == "apply" else "pristine")
        else:
            assert _one_interrupted_line(result, command, tree) in ("pristine", "patched")
        assert not list(scratch.iterdir()), delay
        assert not list((tree / FUSED_ADAM).parent.glob(".*.tmp")), delay
    _assert_way_out(tree, pristine, 0o644)


# Python 3.11 and older raise a Ctrl-C that lands in a class's __set_name__ (while the standard
# library's ipaddress is imported, say) as a RuntimeError caused by it (CI saw it once in the test
# above). Here the import of the tool's command line raises it.
_WRAPPED_AT_IMPORT = """import os, sys
import te_fusedadam_offload.__main__ as command
class Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "te_fusedadam_offload.cli":
            cause = KeyboardInterrupt() if os.environ["CAUSE"] == "interrupt" else ValueError("other")
            raise RuntimeError("Error calling __set_name__") from cause
sys.meta_path.insert(0, Finder)
sys.exit(command.main())
"""


@pytest.mark.parametrize("cause", ["interrupt", "other"])
def test_a_ctrl_c_that_python_raises_as_a_runtime_error_is_a_ctrl_c(tree, cause):
    result = run_tool(["apply", str(tree)], script=_WRAPPED_AT_IMPORT, CAUSE=cause)
    if cause == "interrupt":
        assert (result.returncode, result.stderr) == (
            130,
            "te-fusedadam-offload apply: interrupted before it read the TE; nothing was changed\n",
        )
    else:  # any other RuntimeError is not taken for one
        assert result.returncode == 1 and "ValueError: other" in result.stderr
    assert file_state(tree) == "pristine"


def test_a_ctrl_c_raised_as_a_runtime_error_during_a_run_is_one_line(tree, monkeypatch, capsys):
    def wrapped(state):
        raise RuntimeError("Error calling __set_name__") from KeyboardInterrupt()

    monkeypatch.setattr(cli, "_print_status", wrapped)  # once status has found its TE
    assert cli.main(["status", str(tree)]) == 130
    assert (
        capsys.readouterr().err
        == "te-fusedadam-offload status: interrupted; nothing was changed (status only reads)\n"
    )


@pytest.mark.parametrize("during", [KeyboardInterrupt, ValueError])
def test_an_os_error_while_a_ctrl_c_is_handled_is_one_line(tree, monkeypatch, capsys, during):
    """Ctrl-C inside shutil.rmtree of a TemporaryDirectory made it fail with EBADF (seen): the
    OSError raised while the KeyboardInterrupt is handled is the Ctrl-C; one without is not."""

    def wrapped(state):
        try:
            raise during()
        except during:  # the OSError's __context__, as in the traceback seen
            raise OSError(errno.EBADF, "Bad file descriptor")  # pylint: disable=raise-missing-from

    monkeypatch.setattr(cli, "_print_status", wrapped)
    if during is KeyboardInterrupt:
        assert cli.main(["status", str(tree)]) == 130
        assert (
            capsys.readouterr().err
            == "te-fusedadam-offload status: interrupted; nothing was changed (status only reads)\n"
        )
    else:
        with pytest.raises(OSError):
            cli.main(["status", str(tree)])


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_ctrl_c_after_the_success_line_is_ignored(tree, monkeypatch, capsys, command):
    """Once apply or revert has said it succeeded, a Ctrl-C does not turn that into exit 130
    (here sent from the print of its first line)."""
    if command == "revert":
        assert cli.main(["apply", str(tree)]) == 0
        capsys.readouterr()

    def print_then_ctrl_c(*args, **kwargs):
        print(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cli, "print", print_then_ctrl_c, raising=False)
    assert cli.main([command, str(tree)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith(f"tree TE at {tree}: ")
    assert file_state(tree) == ("patched" if command == "apply" else "pristine")


def test_a_ctrl_c_while_revert_reads_the_files_back_prints_no_success_line(
    tree, monkeypatch, capsys
):
    assert cli.main(["apply", str(tree)]) == 0
    capsys.readouterr()

    calls = []

    def interrupted_once(*args):
        calls.append(args)
        if len(calls) == 1:  # revert's read-back; the interrupted line's own read is real
            raise KeyboardInterrupt
        return report.file_report(*args)

    monkeypatch.setattr(cli, "file_report", interrupted_once)
    assert cli.main(["revert", str(tree)]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("te-fusedadam-offload revert: interrupted; ")
    assert file_state(tree) == "pristine"


# A Ctrl-C that comes after the import of the tool's modules but before cli.main has its
# handler in place (here sent from that very point, the first call of cli.main).
_CTRL_C_BEFORE_THE_HANDLER = """import os, signal, sys
import te_fusedadam_offload.__main__ as command
from te_fusedadam_offload import cli
quiet = cli.quiet_lost_interrupts
def ctrl_c_then_quiet():
    os.kill(os.getpid(), signal.SIGINT)
    return quiet()
cli.quiet_lost_interrupts = ctrl_c_then_quiet
sys.exit(command.main())
"""


def test_a_ctrl_c_between_the_import_and_the_handler_is_one_line(tree, tmp_path):
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    result = run_tool(["apply", str(tree)], script=_CTRL_C_BEFORE_THE_HANDLER, TMPDIR=str(scratch))
    assert (result.returncode, result.stdout, result.stderr) == (
        130,
        "",
        "te-fusedadam-offload apply: interrupted before it read the TE; nothing was changed\n",
    )
    assert file_state(tree) == "pristine" and not list(scratch.iterdir())


# Python started with a script's path (as the installed command is run) checks whether that
# path is an import path entry, through sys.path_hooks; a Ctrl-C there is printed by Python
# ("Failed checking if argv[0] is an import path entry" and its traceback), and the script runs
# all the same. Here a path hook that sitecustomize puts first raises it for the script's path.
_SITECUSTOMIZE = """import os, sys
def interrupted(path):
    if path == os.environ.get("INTERRUPT_AT"):
        raise KeyboardInterrupt
    raise ImportError
sys.path_hooks.insert(0, interrupted)
"""
_PIP_SCRIPT = """import re
import sys
from te_fusedadam_offload.__main__ import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""


def test_a_ctrl_c_that_python_printed_at_its_start_stops_the_command(tree, tmp_path):
    """Seen once in 48 Ctrl-Cs at 0.02 s under load: Python's traceback, then the command ran
    on, applied the series and exited 0. Now it stops before it reads the TE, with its one line
    after Python's traceback (exit 130)."""
    hook, script = tmp_path / "hook", tmp_path / "bin" / "te-fusedadam-offload"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    script.parent.mkdir()
    script.write_text(_PIP_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), "apply", str(tree)],
        env=tool_env(pythonpath=f"{hook}{os.pathsep}{REPO}", INTERRUPT_AT=str(script)),
        capture_output=True,
        text=True,
        check=False,
    )
    assert "Failed checking if argv[0] is an import path entry" in result.stderr, result.stderr
    assert (result.returncode, result.stdout) == (130, ""), result.stderr
    assert (
        result.stderr.splitlines()[-1]
        == "te-fusedadam-offload apply: interrupted before it read the TE; nothing was changed"
    )
    assert file_state(tree) == "pristine"


def _te_checkout(tree, monkeypatch):
    """`tree` as a git checkout of the pinned main (one commit); that commit."""
    if mainline.main_tree() is None:
        pytest.skip("the pinned main tree is not at hand (the series' test files need it)")
    as_main(tree, monkeypatch)
    git(["init", "-q", "-b", "main"], tree)
    git(["add", "-A"], tree)
    git(["commit", "-qm", "TE"], tree)
    return git(["rev-parse", "HEAD"], tree)


def _applied_checkout(tree, monkeypatch):
    """`tree` as a git checkout of the pinned main with the series applied as commits; the
    commit before them."""
    base = _te_checkout(tree, monkeypatch)
    assert run_tool(["apply", str(tree)]).returncode == 0
    return base


def _ctrl_c_once(args, marker, env, wait_s, poll_s):
    """Run the tool with `args` in a session of its own, send its process group a SIGINT (as
    Ctrl-C at a terminal does) once `marker` exists (within `wait_s`); (exit status, stdout,
    stderr)."""
    with subprocess.Popen(
        [sys.executable, "-m", "te_fusedadam_offload", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        deadline = time.monotonic() + wait_s
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(poll_s)
        assert marker.exists(), proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate()
    return proc.returncode, stdout, stderr


def test_ctrl_c_during_git_am_of_a_checkout_aborts_it(tree, tmp_path, monkeypatch):
    """A TE checkout gets the series with git am; Ctrl-C after its first commit (a hook of git
    am waits there) stops git am, and the tool aborts it: the checkout is as before."""
    base = _te_checkout(tree, monkeypatch)
    marker = tmp_path / "first-patch-applied"
    hook = tree / ".git" / "hooks" / "post-applypatch"
    hook.write_text(f'#!/bin/sh\ntouch "{marker}"\nsleep 60\n')
    hook.chmod(0o755)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    returncode, stdout, stderr = _ctrl_c_once(
        ["apply", str(tree)], marker, tool_env(TMPDIR=str(scratch)), wait_s=120, poll_s=0.05
    )
    assert returncode == 130 and stdout == "", stderr
    assert stderr.count("\n") == 1 and "(status: not applied)" in stderr, stderr
    assert git(["rev-parse", "HEAD"], tree) == base
    assert not (tree / ".git" / "rebase-apply").exists()
    assert git(["status", "--porcelain", "--untracked-files=no"], tree) == ""
    assert not list(scratch.iterdir())


def test_ctrl_c_during_the_git_reset_of_a_checkout_revert_lets_it_finish(
    tree, tmp_path, monkeypatch
):
    """Ctrl-C at the terminal (the process group) while revert's git reset runs: the reset is
    not stopped halfway (files reset, HEAD not), it finishes, and the one line says so."""
    base = _applied_checkout(tree, monkeypatch)
    marker, bin_dir = tmp_path / "reset-started", tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "git"  # a git that waits before it resets, for the Ctrl-C to land
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$1" = reset ]; then touch "{marker}"; sleep 1; fi\n'
        f'exec "{shutil.which("git")}" "$@"\n'
    )
    wrapper.chmod(0o755)
    env = tool_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    returncode, stdout, stderr = _ctrl_c_once(
        ["revert", str(tree)], marker, env, wait_s=60, poll_s=0.02
    )
    assert returncode == 130 and stdout == "", stderr
    assert stderr.count("\n") == 1 and "(status: not applied)" in stderr, stderr
    assert git(["rev-parse", "HEAD"], tree) == base
    assert git(["status", "--porcelain", "--untracked-files=no"], tree) == ""


def test_revert_of_a_checkout_with_uncommitted_changes_to_its_files_is_refused(tree, monkeypatch):
    base = _applied_checkout(tree, monkeypatch)
    edited = tree / FUSED_ADAM
    edited.write_text(edited.read_text(encoding="utf-8") + "# mine\n", encoding="utf-8")
    result = run_tool(["revert", str(tree)])
    assert result.returncode == 1, result.stderr
    assert f"has uncommitted changes to files of the series ({FUSED_ADAM})" in result.stderr
    assert "# mine" in edited.read_text(encoding="utf-8")
    assert git(["rev-parse", "HEAD"], tree) != base  # the series is still applied


def test_revert_of_a_checkout_keeps_uncommitted_changes_to_other_files(tree, monkeypatch):
    """As git reset --keep does: only changes to the series' files stop it."""
    base = _applied_checkout(tree, monkeypatch)
    other = tree / FUSED_SGD
    other.write_text(other.read_text(encoding="utf-8") + "# mine\n", encoding="utf-8")
    result = run_tool(["revert", str(tree)])
    assert result.returncode == 0, result.stderr
    assert git(["rev-parse", "HEAD"], tree) == base
    assert "# mine" in other.read_text(encoding="utf-8")
