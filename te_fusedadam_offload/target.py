"""The TE that a command works on: where it is (an installed TE, found by asking its Python; a
TE checkout; a directory), what kind of target it is and which files of the series it takes,
which TE release it holds, and the releases the series supports."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from functools import cached_property
from pathlib import Path

from .errors import NeedsError, NoTargetError
from .patching import apply_all, git, touched
from .upstream import load_pin

BACKUP_DIR = ".te_fusedadam_offload"  # in <root>/<subtree>/: the saved originals (saved.py)


class Target:
    """A directory holding `transformer_engine/` and how to patch it.

    kind "installed" or "tree": the upstream files of the series are patched in place with
    `git apply` (tests and docs are not part of an installed package). kind "checkout": a
    git checkout of TE, which gets the whole series as commits with `git am`.
    """

    def __init__(self, root, kind, python=None):
        self.root = Path(root).resolve()
        self.kind = kind
        self.python = python  # the interpreter whose installed TE this is (kind "installed")
        self.subtree = load_pin()["subtree"]
        if not (self.root / self.subtree).is_dir():
            hint = ""
            if self.root.name == self.subtree:
                hint = f"; pass the directory that holds it, {self.root.parent}"
            raise NoTargetError(f"{self.root} holds no {self.subtree}/ directory{hint}")
        package = self.root / self.subtree
        # What `pip uninstall` leaves of a patched TE: the saved originals, which pip does
        # not know about, and nothing else of TE.
        self.leftover = not (package / "__init__.py").exists() and (package / BACKUP_DIR).is_dir()

    def __str__(self):
        return f"{self.kind} TE at {self.root}"

    @cached_property
    def source_checkout(self):
        """For an installed TE: the top of the git work tree that tracks its files (a source
        or editable install from a TE checkout: a .pth file or a finder pointing at it), or
        None (installed from a wheel, also into a venv inside a repository; or no git here)."""
        if self.kind != "installed" or not shutil.which("git"):
            return None
        args = ["ls-files", "--error-unmatch", f"{self.subtree}/__init__.py"]
        if git(args, self.root, check=False).returncode != 0:
            return None
        return Path(git(["rev-parse", "--show-toplevel"], self.root).stdout.strip()).resolve()

    @property
    def args(self):
        """How to name this target on the command line."""
        if self.kind != "installed":
            return str(self.root)
        return "--installed" if self.python == sys.executable else f"--python {self.python}"

    def refuse_leftover(self):
        """Raise NoTargetError if TE was uninstalled from here and only the saved originals
        are left."""
        if self.leftover:
            raise NoTargetError(
                f"no TE at {self.root}: {self.subtree}/ holds only {BACKUP_DIR}/, the original "
                "files that apply saved, left behind when TE was uninstalled (pip removes only "
                "the files it installed); 'revert' removes it, or: rm -r "
                f"{self.root / self.subtree / BACKUP_DIR}"
            )

    @cached_property
    def release_checkout(self):
        """Whether this is a git checkout of a TE release (its build_tools/VERSION.txt says
        2.20.2, where main's says 2.21.0.dev0): the series' tests and docs are made against
        main, so it gets the series' changes to transformer_engine/ only, as commits."""
        version = te_version(self) if self.kind == "checkout" else None
        return version is not None and re.fullmatch(r"\d+\.\d+\.\d+", version) is not None

    @property
    def whole_series(self):
        """Whether this target takes every file of the series (a checkout of main)."""
        return self.kind == "checkout" and not self.release_checkout

    @property
    def include(self):
        """The paths of a patch that this target holds (git apply --include patterns)."""
        return [] if self.whole_series else [f"{self.subtree}/*"]

    def touches(self, patch):
        """The files of this target that a patch changes (all of them in a checkout of main)."""
        files = touched(patch)
        if self.whole_series:
            return files
        return [rel for rel in files if rel.startswith(self.subtree + "/")]

    def patch(self, patches):
        """git apply the patches that change this target's files, in turn, in place: for
        scratch copies that the tool makes itself (materialize), not for a user's TE. Returns
        how many applied; raises ToolError at the first that does not."""
        return apply_all(self.root, [p for p in patches if self.touches(p)], self.include)


def te_version(target):
    """The TE version of a target, or None if it does not say: the package metadata beside an
    installed TE, or build_tools/VERSION.txt (TE's own) of a source checkout."""
    for meta in sorted(target.root.glob(f"{target.subtree}-*.dist-info/METADATA")):
        found = re.search(r"^Version: *(\S+)", meta.read_text(encoding="utf-8"), re.MULTILINE)
        if found:
            return found.group(1)
    version_file = target.root / "build_tools" / "VERSION.txt"
    if version_file.is_file():
        return version_file.read_text(encoding="utf-8").strip()
    return None


def version_key(version):
    """(major, minor, patch) of a release string such as '2.16.1' or '2.20.0.dev0'."""
    numbers = [int(n) for n in re.findall(r"\d+", version)[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def supported_range():
    """(oldest, pinned): the releases from `oldest` on are supported; `pinned` is the one the
    series is made and tested for."""
    pin = load_pin()
    return pin.get("supported", {}).get("oldest", pin["version"]), pin["version"]


def older_than_supported(version):
    """Whether a TE version is older than the oldest release the series supports."""
    return version is not None and version_key(version) < version_key(supported_range()[0])


# Where the TE that a Python imports lives; run from "/", so that the current directory
# (a checkout with transformer_engine/ in it) does not decide it. Nothing is imported. The
# answer is a JSON object with a key of this tool's, so that a program that is no Python
# interpreter (/bin/true, /bin/echo) is told from one.
_FIND_TE = (
    "import importlib.util, json; s = importlib.util.find_spec('transformer_engine'); "
    "print(json.dumps({'te_fusedadam_offload': list(s.submodule_search_locations or []) "
    "if s else []}))"
)


PROBE_TIMEOUT = 60  # seconds that the Python of --python has to answer where its TE is


def _not_python(python, why):
    return NeedsError(f"--python {python}: not a Python interpreter that can be used: {why}")


def _installed_location(python):
    """The directory holding the transformer_engine/ that `python` imports, or None. Raises
    NeedsError, one line, if `python` cannot be run or does not answer as a Python does."""
    if Path(python).is_dir():
        inside = next((p for p in ("bin/python", "bin/python3") if (Path(python) / p).is_file()), 0)
        hint = f" (the Python of this environment is {Path(python) / inside})" if inside else ""
        raise _not_python(python, f"it is a directory{hint}")
    try:
        result = _probe(python)
    except OSError as exc:
        raise _not_python(python, f"cannot run it: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise _not_python(python, f"it did not answer within {PROBE_TIMEOUT} s") from exc
    lines = result.stdout.strip().splitlines()
    try:
        locations = json.loads(lines[-1])["te_fusedadam_offload"] if lines else None
    except (ValueError, TypeError, KeyError):
        locations = None
    if result.returncode != 0 or not isinstance(locations, list):
        said = result.stderr.strip().splitlines()[-1:]
        if not said:
            said = " and printed nothing on stderr"
        elif "find_spec" in said[0]:  # it echoes the query: it takes -c CODE for something else
            said = " (it does not take -c CODE)"
        else:
            said = f": {said[0][:200]}"
        what = f"exited with status {result.returncode}" if result.returncode else "ran"
        raise _not_python(python, f"{what} without answering as a Python does{said}")
    return Path(locations[0]).parent if locations else None


def _probe(python):
    """Run the query of _FIND_TE in `python`, in a session of its own: after PROBE_TIMEOUT
    seconds, it and whatever it started (which may hold its output open) are killed."""
    with subprocess.Popen(
        [python, "-c", _FIND_TE],
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=PROBE_TIMEOUT)
        except BaseException:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def find_target(path=None, installed=False, python=None):
    """The target named by a path, or the TE that this Python (or `python`) imports."""
    if installed or python is not None or path is None:
        given = python = python or sys.executable
        if os.sep in python:  # a path (venv/bin/python): from here, not from where it is run
            python = os.path.abspath(python)
        else:  # a name (python3): looked up on PATH, as a shell does
            python = shutil.which(python) or python
        root = _installed_location(python)
        if root is None:
            where = "this Python environment" if python == sys.executable else python
            if given not in (python, sys.executable):
                where += f" (--python {given})"
            raise NoTargetError(
                f"transformer_engine is not installed in {where} "
                "(pass the path of a TE tree instead)"
            )
        return Target(root, "installed", python)
    root = Path(path)
    if not root.exists():
        raise NoTargetError(f"{root} does not exist")
    if not root.is_dir():
        raise NoTargetError(f"{root} is not a directory")
    kind = "checkout" if (root / ".git").exists() else "tree"
    return Target(root, kind)
