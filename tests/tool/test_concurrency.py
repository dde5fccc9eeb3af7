"""apply and revert run at the same time on one TE, as when every rank of a node runs
`apply --installed` in its start-up script: one does the work, the others wait for it and find
it done; a killed run never blocks the next."""

import fcntl
import os
import signal
import subprocess
import sys

import pytest
from support import file_state, same_tree, tool_env

RUNS = 8


def _start(args):
    return subprocess.Popen(
        [sys.executable, "-m", "te_fusedadam_offload", *args],
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _all_at_once(commands, tree):
    """Run the commands (apply, revert) on `tree` at once; [(command, exit status, stdout,
    stderr)]."""
    procs = [(command, _start([command, str(tree)])) for command in commands]
    return [(command, p.wait(120), p.stdout.read(), p.stderr.read()) for command, p in procs]


def _assert_clean(results):
    for command, code, out, err in results:
        assert code == 0, f"{command} exited {code}:\n{out}\n{err}"
        assert "Traceback" not in out + err, err


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_concurrent_runs_of_one_command_do_it_once(tree, pristine, command):
    if command == "revert":
        assert _start(["apply", str(tree)]).wait(120) == 0
    results = _all_at_once([command] * RUNS, tree)
    _assert_clean(results)
    done = [out for _, _, out, _ in results if "nothing to do" not in out]
    assert len(done) == 1, [out for _, _, out, _ in results]
    if command == "apply":
        assert file_state(tree) == "patched"
        assert _start(["status", "-q", str(tree)]).wait(120) == 0
    else:
        assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_concurrent_applies_and_reverts_leave_the_state_of_the_last(tree, pristine):
    results = _all_at_once(["apply", "revert"] * (RUNS // 2), tree)
    _assert_clean(results)
    assert file_state(tree) in ("pristine", "patched")
    status = _start(["status", str(tree)])
    code, out = status.wait(120), status.stdout.read()
    assert code in (0, 1) and ("applied" in out.splitlines()[0]), out
    assert _start(["revert", str(tree)]).wait(120) == 0
    assert same_tree(tree / "transformer_engine", pristine / "transformer_engine")


def test_a_killed_holder_of_the_lock_does_not_block_the_next_run(tree, tmp_path):
    # A process holds the lock as apply does, then is killed.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)"
            ),
            str(tree / "transformer_engine"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "locked\n"
    waiting = _start(["apply", str(tree)])
    assert "waiting for another" in waiting.stderr.readline()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert waiting.wait(120) == 0, waiting.stderr.read()
    assert file_state(tree) == "patched"
    assert not list((tree / "transformer_engine").glob(".*lock*"))  # nothing left behind


def test_a_ctrl_c_while_waiting_changes_nothing(tree):
    fd = os.open(tree / "transformer_engine", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        waiting = _start(["apply", str(tree)])
        assert "waiting for another" in waiting.stderr.readline()
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(120) == 130
        err = waiting.stderr.read()
        assert "while it waited for another run" in err and "Traceback" not in err, err
        assert file_state(tree) == "pristine"
    finally:
        os.close(fd)
