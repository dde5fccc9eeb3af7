"""The command line as users meet it: targets, exit statuses, messages, help, and how much
git work each command does."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from support import (
    FUSED_ADAM,
    REPO,
    drift_context,
    file_state,
    git,
    listing,
    purelib,
    release_patches,
    release_wheel,
    run_tool,
    tool_env,
)

import te_fusedadam_offload
from te_fusedadam_offload import series, target, upstream
from te_fusedadam_offload.errors import NeedsError
from te_fusedadam_offload.maintainers import commands as maintainers, mainline


def _run_cli(args, pythonpath, cwd, tool_home):
    return run_tool(args, cwd, pythonpath=os.pathsep.join([str(pythonpath), str(tool_home)]))


def test_installed_target_inside_an_unrelated_git_repo(tree, tmp_path, tool_home):
    """--installed finds the TE that Python imports; a repository around it is ignored."""
    outer = tmp_path / "project"
    site = outer / ".venv" / "site-packages"
    shutil.move(str(tree / "transformer_engine"), site / "transformer_engine")
    git(["init", "-q"], outer)
    result = _run_cli(["apply", "--installed"], site, outer, tool_home)
    assert result.returncode == 0, result.stderr
    assert f"installed TE at {site}" in result.stdout
    result = _run_cli(["status", "--installed"], site, outer, tool_home)
    assert "installed TE at" in result.stdout and ": applied" in result.stdout
    assert _run_cli(["revert"], site, outer, tool_home).returncode == 0
    assert upstream.sha256_of(site / FUSED_ADAM) == series.load_checksums()[FUSED_ADAM][0]


def _source_install(tree, tmp_path):
    """A TE git checkout (the release's files, and the main files of the series' tests and
    docs where the pinned main tree is at hand) and a venv whose .pth file puts it on sys.path,
    as a source or editable install does; the venv's Python."""
    if mainline.main_tree() is not None:
        for rel in series.main_paths():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(mainline.main_tree() / rel, tree / rel)
    return _checkout_on_path(tree, tmp_path, "main")


def _checkout_on_path(tree, tmp_path, branch):
    """`tree` committed as a git checkout on `branch`, and a venv whose .pth file puts it on
    sys.path; the venv's Python."""
    git(["init", "-q", "-b", branch], tree)
    git(["add", "-A"], tree)
    git(["commit", "-qm", "TE"], tree)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (purelib(venv / "bin" / "python") / "te-source.pth").write_text(f"{tree}\n")
    return venv / "bin" / "python"


def test_te_installed_from_a_git_checkout_is_refused_with_the_command_for_the_checkout(
    tree, tmp_path, tool_home
):
    """apply --installed silently edited the working tree of the TE checkout that a .pth file
    pointed at. Now it (and --dry-run, and revert of commits) refuses and gives the command
    that works on the checkout; status and check say so; the checkout is left as it was. An
    in-place apply that an earlier version made there is reverted from its saved originals."""
    python = _source_install(tree, tmp_path)
    root = tree.resolve()

    def tool(*args):
        return run_tool([*args, "--python", str(python)], cwd=tmp_path, pythonpath=tool_home)

    command = f"te-fusedadam-offload apply {root}"
    for args in (["apply"], ["apply", "--dry-run"]):
        result = tool(*args)
        assert result.returncode == 1 and result.stdout == "", result.stdout
        assert result.stderr.count("\n") == 1, result.stderr
        assert f"its transformer_engine/ is tracked by the git repository {root}" in result.stderr
        assert result.stderr.rstrip().endswith(
            f"as commits (git am; revert removes them): {command}"
        )
    assert git(["status", "--porcelain", "--ignored"], tree) == ""
    result = tool("status")
    assert (
        result.returncode == 1
        and f"note: the TE at {root} is installed from a git" in result.stdout
    )
    result = tool("check")
    assert result.returncode == 1 and result.stdout.rstrip().endswith(command)
    if mainline.main_tree() is not None:  # the command it gives works
        assert run_tool(["apply", str(root)], pythonpath=tool_home).returncode == 0
        assert git(["status", "--porcelain"], tree) == ""
        assert tool("status").returncode == 0 and tool("check").returncode == 0
        result = tool("revert")
        assert result.returncode == 1
        assert result.stderr.rstrip().endswith(f"te-fusedadam-offload revert {root}")
        assert run_tool(["revert", str(root)], pythonpath=tool_home).returncode == 0
        assert git(["log", "--format=%s"], tree) == "TE\n"
    # As an earlier version of the tool left it: applied in place, with the saved originals.
    in_place = tmp_path / "in-place"
    shutil.copytree(tree / "transformer_engine", in_place / "transformer_engine")
    assert run_tool(["apply", str(in_place)], pythonpath=tool_home).returncode == 0
    shutil.rmtree(tree / "transformer_engine")
    shutil.copytree(in_place / "transformer_engine", tree / "transformer_engine")
    assert git(["status", "--porcelain"], tree) != ""
    result = tool("revert")
    assert result.returncode == 0 and "restored the saved original bytes" in result.stdout
    assert git(["status", "--porcelain", "--ignored"], tree) == ""


def test_te_installed_from_a_git_checkout_of_a_release_gets_the_series_as_commits(
    tree, pristine, tmp_path, tool_home
):
    """apply --installed sent a TE installed from a checkout of a release to 'apply
    /path/to/checkout', which refused it as drifted from main (the series' tests and docs are
    made against main). The checkout of a release gets the series' changes to
    transformer_engine/ as commits; revert takes them out."""
    (tree / "build_tools").mkdir()
    (tree / "build_tools" / "VERSION.txt").write_text(upstream.load_pin()["version"] + "\n")
    python = _checkout_on_path(tree, tmp_path, "release")
    root = tree.resolve()
    result = run_tool(["apply", "--python", str(python)], pythonpath=tool_home)
    assert result.returncode == 1 and f"te-fusedadam-offload apply {root}" in result.stderr

    result = run_tool(["apply", str(root)], pythonpath=tool_home)
    assert result.returncode == 0, result.stderr
    assert f"applied {len(release_patches())} patches as commits with git am" in result.stdout
    subjects = git(["log", "--format=%s"], tree).splitlines()
    assert (
        len(subjects) == len(release_patches()) + 1 and git(["status", "--porcelain"], tree) == ""
    )
    assert file_state(tree) == "patched"
    changed = git(["diff", "--name-only", "HEAD~" + str(len(release_patches()))], tree).split()
    assert changed == [FUSED_ADAM]
    assert run_tool(["status", "-q", str(root)], pythonpath=tool_home).returncode == 0
    result = run_tool(["apply", str(root)], pythonpath=tool_home)
    assert result.stdout.endswith("already applied; nothing to do\n")
    result = run_tool(["revert", str(root)], pythonpath=tool_home)
    assert result.returncode == 0, result.stderr
    assert git(["log", "--format=%s"], tree) == "TE\n" and file_state(tree) == "pristine"


def test_state_is_found_once(tree, tmp_path):
    """Counted with a git on PATH that logs its calls, against the issue's bounds (apply on a
    fresh TE: 5 git processes at most; status on it, and apply, status and check after the
    apply: 3): on a fresh TE, status and apply try the patches on a scratch copy in one git
    apply (1 process, however many patches change the release's files), and after the apply,
    apply, status and check read the digests that it saved (none)."""
    log, wrapper = tmp_path / "git.log", tmp_path / "bin" / "git"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{shutil.which("git")}" "$@"\n')
    wrapper.chmod(0o755)

    def git_processes(*args, code=0):
        log.write_text("")
        path = f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}"
        pythonpath = os.pathsep.join([str(tree), str(REPO)])
        result = run_tool([*args, "--installed"], tmp_path, pythonpath=pythonpath, PATH=path)
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


def test_status_and_check_exit_codes(tree):
    assert run_tool(["status", str(tree)]).returncode == 1  # not applied
    assert "'te-fusedadam-offload check && train'" in run_tool(["--help"]).stdout
    result = run_tool(["check", str(tree)])  # not in: a CI line must not go on
    assert result.returncode == 1
    assert result.stdout.endswith(f"te-fusedadam-offload apply {tree.resolve()} puts it in\n")
    assert run_tool(["apply", str(tree)]).returncode == 0
    assert run_tool(["status", str(tree)]).returncode == 0  # applied
    assert run_tool(["check", str(tree)]).returncode == 0
    assert run_tool(["revert", str(tree)]).returncode == 0
    drift_context(tree)
    assert run_tool(["status", str(tree)]).returncode == 1
    assert run_tool(["check", str(tree)]).returncode == 1  # drifted
    assert run_tool(["status", "--bogus"]).returncode == 2


def test_check_says_in_one_line_what_apply_would_do_in_every_state(tree, pristine):
    """check printed no line on what apply would do where the series is applied (README
    promises one). Now its last line, and only that one, says it in every state."""

    def said():
        result = run_tool(["check", str(tree)])
        lines = [line for line in result.stdout.splitlines() if line.startswith("  apply: ")]
        assert lines == result.stdout.splitlines()[-1:], result.stdout
        return result.returncode, lines[0][len("  apply: ") :]

    root = tree.resolve()
    assert said() == (1, f"the series is not in: te-fusedadam-offload apply {root} puts it in")
    assert run_tool(["apply", str(tree)]).returncode == 0
    assert said() == (0, "nothing to do, the series is applied")
    with open(tree / FUSED_ADAM, "a", encoding="utf-8") as f:
        f.write("# a local edit\n")
    code, line = said()
    assert code == 1 and line.startswith(f"refuses: {FUSED_ADAM} changed after apply patched it")
    assert run_tool(["revert", "--discard-edits", str(tree)]).returncode == 0
    assert run_tool(["apply", "--upto", "1", str(tree)]).returncode == 0
    assert said() == (1, "replaces the other version of this series that is applied with this one")
    assert run_tool(["revert", str(tree)]).returncode == 0
    first = target.Target(tree, "tree").patch(release_patches()[:1])
    assert first == 1 and said() == (
        1,
        f"completes the series: te-fusedadam-offload apply {root}",
    )
    shutil.rmtree(tree / "transformer_engine")
    shutil.copytree(pristine / "transformer_engine", tree / "transformer_engine")
    drift_context(tree)
    assert said() == (1, "refuses a drifted TE; status says what drifted")


def test_missing_git_is_one_line(tree):
    result = run_tool(["status", str(tree)], PATH="/nonexistent")
    assert result.returncode == 4
    assert result.stderr.strip().splitlines() == [
        "te-fusedadam-offload status: error: git is needed but was not found on PATH; install git"
    ]


def test_closed_pipe_ends_quietly(tree):
    with subprocess.Popen(
        [sys.executable, "-m", "te_fusedadam_offload", "status", str(tree)],
        env=tool_env(),
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
    result = run_tool(["--version"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"te-fusedadam-offload {te_fusedadam_offload.__version__} ")


def test_version_names_the_tool_and_the_release_of_the_series(tmp_path):
    """--version printed a bare 0.1.0."""
    pin = upstream.load_pin()
    result = run_tool(["--version"], cwd=tmp_path)
    assert (
        result.stdout
        == f"te-fusedadam-offload {te_fusedadam_offload.__version__} (the series for TE "
        f"{pin['version']}, made against TE main {pin['main']['commit'][:9]})\n"
    )


def test_status_prints_no_line_for_the_patches_that_are_not_for_the_target(tree):
    """status printed four 'not for this target (tests and docs go to source checkouts only)'
    lines on every run; --json still lists every patch."""
    result = run_tool(["status", str(tree)])
    assert "not for this target" not in result.stdout
    assert len(result.stdout.splitlines()) == 1 + len(release_patches()) + 2  # + fused_adam.py
    # One line says why the patch lines are fewer than the series' patches.
    total, ours = len(series.patch_files()), len(release_patches())
    assert (
        f"  ({ours} of the series' {total} patches change transformer_engine/; the others are "
        "TE's tests and docs)"
        in result.stdout.splitlines()
    )
    found = json.loads(run_tool(["status", "--json", str(tree)]).stdout)
    assert len(found["patches"]) == len(series.patch_files())


def test_the_package_directory_itself_gets_a_hint(tree):
    result = run_tool(["status", str(tree / "transformer_engine")])
    assert result.returncode == 3
    assert f"pass the directory that holds it, {tree}" in result.stderr


def test_exit_status_tells_no_target_from_no(tree, tmp_path):
    """3: nothing to work on where named; 4: something the tool needs is missing; 1: the
    answer is no (not applied, drifted)."""
    (tmp_path / "file").write_text("")
    for args in (
        ["status", str(tmp_path / "missing")],
        ["apply", str(tmp_path / "file")],
        ["check", str(tmp_path)],  # no transformer_engine/ in it
    ):
        result = run_tool(args)
        assert result.returncode == 3, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    result = run_tool(["status", "--python", str(tmp_path / "no-python")])
    assert result.returncode == 4 and "cannot run it: No such file or directory" in result.stderr
    assert run_tool(["status", str(tree)]).returncode == 1
    drift_context(tree)
    assert run_tool(["apply", str(tree)]).returncode == 1


def _fake_pythons(tmp_path):
    """Programs given as --python that are no Python interpreter, with what the reason says."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    not_executable = tmp_path / "python-text"
    not_executable.write_text("print(1)\n")
    broken = tmp_path / "broken-python"
    broken.write_text(
        "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
        "echo 'ModuleNotFoundError: No module named encodings' >&2\nexit 1\n"
    )
    broken.chmod(0o755)
    return {
        "/bin/true": "ran without answering as a Python does and printed nothing on stderr",
        "/bin/echo": "ran without answering as a Python does",
        "/bin/false": "exited with status 1 without answering as a Python does",
        shutil.which("ls"): "without answering as a Python does (it does not take -c CODE)",
        str(tmp_path / "missing"): "cannot run it: No such file or directory",
        str(not_executable): "cannot run it: Permission denied",
        str(venv): f"it is a directory (the Python of this environment is {venv}/bin/python)",
        str(broken): (
            "exited with status 1 without answering as a Python does: "
            "ModuleNotFoundError: No module named encodings"
        ),
    }


def test_python_that_is_not_one_exits_4_with_a_one_line_reason(tmp_path):
    """--python /bin/true crashed with IndexError, /bin/echo with JSONDecodeError, /bin/false
    said 'failed: ' with no reason and ls echoed the tool's query: each is exit 4 and one line
    that says why."""
    for python, reason in _fake_pythons(tmp_path).items():
        result = run_tool(["status", "--python", python])
        assert result.returncode == 4, (python, result.stderr)
        lines = result.stderr.splitlines()
        lead = f"te-fusedadam-offload status: error: --python {python}: not a Python interpreter"
        assert len(lines) == 1 and lines[0].startswith(lead), (python, lines)
        assert reason in lines[0], (python, lines[0])
        assert "find_spec" not in lines[0] and result.stdout == ""


def test_python_given_by_a_relative_path_is_found_from_the_current_directory(tree, tmp_path):
    """--python venv2/bin/python said "cannot run it: No such file or directory": the
    interpreter was run from "/". The path is taken from the current directory, as a shell
    takes it."""
    python = tmp_path / "venv2" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tree} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    result = run_tool(["status", "--python", "venv2/bin/python"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr  # found, not applied
    assert result.stdout.startswith(f"installed TE at {tree.resolve()}: not applied\n")
    result = run_tool(["apply", "--python", "venv2/bin/python"], cwd=tmp_path)
    assert result.returncode == 0 and file_state(tree) == "patched", result.stderr


USER_COMMANDS = ["apply", "status", "check", "revert"]


def test_help_lists_the_user_commands_first_and_the_exit_statuses_once():
    """In a checkout: the users' commands, then the maintainers'; the exit-status table is in
    --help, and each command's help points at it in one line (it was repeated in each)."""
    out = run_tool(["--help"]).stdout
    listed = re.findall(r"^    (\S+)", out, re.MULTILINE)
    assert listed[:4] == USER_COMMANDS
    for name in maintainers.MAINTAINERS_COMMANDS:
        assert re.search(rf"^    {name}\s+\[maintainers\]", out, re.MULTILINE), name
    assert out.count("exit status:") == 1 and "  3  no TE where named" in out
    for name in USER_COMMANDS + list(maintainers.MAINTAINERS_COMMANDS):
        out = run_tool([name, "--help"]).stdout
        assert out.rstrip().endswith(
            "exit status: 0 success; the others are listed by te-fusedadam-offload --help"
        ), name
        assert "no TE where named" not in out, name


def test_installed_tool_has_only_the_users_commands(installed_tool, tmp_path):
    """Installed (no checkout around it), --help lists the users' commands only, and a
    maintainers' command is a usage error (2, one line) instead of exit 1."""
    out = run_tool(["--help"], cwd=tmp_path, pythonpath=installed_tool).stdout
    assert re.findall(r"^    (\S+)", out, re.MULTILINE) == USER_COMMANDS
    assert "[maintainers]" not in out and out.count("exit status:") == 1
    for name in maintainers.MAINTAINERS_COMMANDS:
        result = run_tool([name], cwd=tmp_path, pythonpath=installed_tool)
        assert result.returncode == 2 and result.stdout == "", name
        assert result.stderr.splitlines() == [
            f"te-fusedadam-offload: error: {name} is a command for the maintainers of the "
            "series; it works in a checkout of the patch set's repository (python -m "
            f"te_fusedadam_offload {name} there)"
        ]


def test_quiet_prints_nothing_and_keeps_the_exit_status(tree):
    """-q: nothing on stdout (check is used for its exit status); errors still on stderr."""
    for args, code in (
        (["check"], 1),
        (["status"], 1),
        (["apply"], 0),
        (["status"], 0),
        (["status", "--json"], 0),
        (["revert"], 0),
    ):
        result = run_tool([*args, "-q", str(tree)])
        assert (result.returncode, result.stdout, result.stderr) == (code, "", ""), args
    drift_context(tree)
    result = run_tool(["check", "-q", str(tree)])
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "")
    result = run_tool(["-q", "check", str(tree)])  # -q before the command was refused
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "")
    result = run_tool(["apply", "-q", str(tree)])
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("te-fusedadam-offload apply: error: cannot apply:")


def test_drift_message_keeps_its_parentheses_and_fits_a_directory(tree):
    drift_context(tree)
    message = run_tool(["apply", str(tree)]).stderr
    assert ": not checked (an earlier patch does not apply)" in message
    assert ": not for this target" not in message
    assert "pip install" not in message  # a directory, not an installed TE
    assert "What to do: put the files of a supported TE" in message


def _venv_with_te(root, version):
    """A real virtualenv (with pip) where TE `version` is installed from its release wheel."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    _pip(root, "install", "--no-deps", "--no-index", str(release_wheel(version)))
    return root / "bin" / "python"


def _pip(venv, *args):
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "-q", *args],
        check=True,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )


@pytest.mark.network
def test_pip_uninstall_reinstall_and_upgrade_of_a_patched_te(tmp_path, tool_home):
    """--python names another environment's TE. pip uninstall leaves only the saved originals:
    a clear error (3), and revert removes them; reinstalled, apply applies (nothing was
    interrupted); upgraded over an apply, status says so and apply applies again."""
    venv = tmp_path / "venv"
    python = _venv_with_te(venv, "2.20.2")
    site = purelib(python)

    def tool(*args):
        return run_tool([*args, "--python", str(python)], cwd=tmp_path, pythonpath=tool_home)

    count = len(release_patches())
    result = tool("apply")
    assert result.returncode == 0 and f"installed TE at {site}: applied {count}" in result.stdout
    _pip(venv, "uninstall", "-y", "transformer_engine")
    assert listing(site / "transformer_engine")[0] == target.BACKUP_DIR
    result = tool("status")
    assert result.returncode == 3
    assert "left behind when TE was uninstalled" in result.stderr
    result = tool("revert")
    assert (
        result.returncode == 0
        and "removed the original files that apply had saved" in result.stdout
    )
    assert not (site / "transformer_engine").exists()

    _pip(venv, "install", "--no-deps", "--no-index", str(release_wheel("2.20.2")))
    result = tool("apply")
    assert result.returncode == 0 and f": applied {count} patch(es)" in result.stdout, result.stdout
    _pip(venv, "install", "--no-deps", "--no-index", str(release_wheel("2.19.0")))
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
    with zipfile.ZipFile(release_wheel("2.19.0")) as zf:
        assert (site / FUSED_ADAM).read_bytes() == zf.read(FUSED_ADAM)
    assert not (site / "transformer_engine" / target.BACKUP_DIR).exists()


def test_a_ctrl_c_that_python_cannot_raise_prints_no_traceback():
    """A Ctrl-C that lands in a weakref callback of the import system (CI saw it, 0.02 s into
    an apply) is lost, and Python printed "Exception ignored in ... Traceback ...
    KeyboardInterrupt". With the tool's hook it prints nothing; other errors there still do."""
    code = (
        "import weakref\n"
        "from te_fusedadam_offload.errors import quiet_lost_interrupts\n"
        "quiet_lost_interrupts()\n"
        "class A: pass\n"
        "def interrupt(_): raise KeyboardInterrupt\n"
        "def fail(_): raise RuntimeError('another error')\n"
        "a, b = A(), A()\n"
        "refs = weakref.ref(a, interrupt), weakref.ref(b, fail)\n"
        "del a, b\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=tool_env(), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    assert "KeyboardInterrupt" not in result.stderr
    assert "RuntimeError: another error" in result.stderr


def test_python_that_never_answers_is_given_up_after_the_probe_timeout(tmp_path, monkeypatch):
    """--python a program that never answers hung: one whose child kept its output open
    outlived the timeout. The probe's whole session is killed after PROBE_TIMEOUT (exit 4)."""
    pid_file = tmp_path / "child.pid"
    silent = tmp_path / "silent-python"
    silent.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    silent.chmod(0o755)
    monkeypatch.setattr(target, "PROBE_TIMEOUT", 1)
    started = time.monotonic()
    with pytest.raises(NeedsError) as caught:
        target.find_target(python=str(silent))
    assert time.monotonic() - started < 30
    assert caught.value.code == 4 and "did not answer within 1 s" in str(caught.value)
    child = pid_file.read_text().strip()
    for _ in range(100):  # killed with it (reaped by init, or a zombie until then)
        try:
            if Path(f"/proc/{child}/stat").read_text().split(") ")[-1].startswith("Z"):
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the probe's child {child} is still running")


def test_python_given_by_name_is_found_on_path_and_named_by_its_path(tmp_path):
    """--python NAME is looked up on PATH, and "transformer_engine is not installed in NAME"
    did not say which interpreter that was: the error names the path it found."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "teless-python"
    python.write_text(f'#!/bin/sh\nexec env -u PYTHONPATH {sys.executable} "$@"\n')
    python.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    result = run_tool(["status", "--python", "teless-python"], cwd=tmp_path, PATH=path)
    assert result.returncode == 3, result.stderr
    assert (
        f"transformer_engine is not installed in {python} (--python teless-python)" in result.stderr
    )


def test_status_json_says_an_error_as_json_with_the_exit_status(tmp_path):
    """status --json /nonexistent printed nothing on standard output (exit 3)."""
    result = run_tool(["status", "--json", str(tmp_path / "nonexistent")])
    assert result.returncode == 3
    found = json.loads(result.stdout)
    assert found == {"error": f"{tmp_path / 'nonexistent'} does not exist", "exit_status": 3}
    assert "does not exist" in result.stderr
