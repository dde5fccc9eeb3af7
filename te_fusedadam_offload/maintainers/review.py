"""The stack of pull requests as TE's reviewers and CI meet it: TE's lint job on each prefix of
the stack, and the patches signed off by the person who submits them."""

import email.header
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from ..errors import ToolError
from .mainline import load_main_pin
from ..patching import apply_all, git, touched
from ..series import PLACEHOLDER_IDENTITY, patches_dir, pr_patch_files

# What TE's CI runs (qa/L0_pytorch_lint/test.sh, .pre-commit-config.yaml at the pinned main).
PYLINT_VERSION = "3.3.1"
PYLINT_ARGS = ["--recursive=y", "transformer_engine/common", "transformer_engine/pytorch"]
PYLINT_ARGS += ["transformer_engine/debug"]
BLACK_VERSION = "24.4.2"
BLACK_ARGS = ["--check", "--line-length=100", "--preview"]
BLACK_ARGS += ["--enable-unstable-feature=string_processing"]
VERMIN_ARGS = ["-t=3.10-", "--violations", "--no-tips"]


def _require(package, version=None):
    try:
        found = metadata.version(package)
    except metadata.PackageNotFoundError:
        found = None
    if found is None or (version and found != version):
        wanted = f"{package}=={version}" if version else package
        raise ToolError(f"TE's lint job needs {wanted} (found {found or 'none'}): pip install it")


def _run(args, cwd):
    """Run a tool of this Python environment (pylint, black, vermin) in `cwd`."""
    module, *rest = args
    code = f"import sys; from {module} import main; sys.argv[0] = '{module}'; sys.exit(main())"
    if module != "vermin":
        code = f"import runpy; runpy.run_module('{module}', run_name='__main__', alter_sys=True)"
    result = subprocess.run(
        [sys.executable, "-c", code, *rest], cwd=cwd, capture_output=True, text=True, check=False
    )
    return result.returncode, (result.stdout + result.stderr).strip()


def lint(main_root):
    """TE's lint job on the pinned main tree `main_root` with each prefix of the stack applied:
    pylint (TE's version, TE's pylintrc, TE's packages), black (TE's version and arguments)
    and vermin (TE's target) on the Python files the stack changes. Returns (ok, report)."""
    _require("pylint", PYLINT_VERSION)
    _require("black", BLACK_VERSION)
    _require("vermin")
    lines, ok, changed, stack = [], True, set(), "main"
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "te"
        shutil.copytree(main_root, tree, ignore=shutil.ignore_patterns(".commit"))
        for pr_dir, patches in pr_patch_files():  # each pull request on top of those before
            stack += f" + {pr_dir.name}"
            apply_all(tree, patches)
            changed.update(
                rel for patch in patches for rel in touched(patch) if rel.endswith(".py")
            )
            checks = [
                ("pylint " + " ".join(PYLINT_ARGS), ["pylint", *PYLINT_ARGS]),
                ("black " + " ".join(BLACK_ARGS[1:]), ["black", *BLACK_ARGS, *sorted(changed)]),
                ("vermin " + " ".join(VERMIN_ARGS[:2]), ["vermin", *VERMIN_ARGS, *sorted(changed)]),
            ]
            for title, args in checks:
                code, output = _run(args, tree)
                ok = ok and code == 0
                state = "clean" if code == 0 else f"FAILED (exit {code})"
                lines.append(f"{stack}: {title}: {state}")
                if code != 0:
                    lines += [f"  {line}" for line in output.splitlines() if line.strip()]
    return ok, "\n".join(lines)


def git_identity(identity=None):
    """(name, email) of `identity` ("Name <email>"), or of the user's git identity."""
    if identity is None:
        # useConfigOnly: an identity that git would guess from the host is no sign-off.
        result = git(
            ["-c", "user.useConfigOnly=true", "var", "GIT_AUTHOR_IDENT"], Path.cwd(), check=False
        )
        if result.returncode != 0:
            raise ToolError(
                "no git identity to sign off with: set it (git config --global user.name "
                "'Your Name'; git config --global user.email you@example.org) or pass --identity"
            )
        identity = result.stdout.rsplit(">", 1)[0] + ">"
    m = re.fullmatch(r"\s*([^<>]*?)\s*<([^<>\s]+@[^<>\s]+)>\s*", identity)
    if not m or not m.group(1):
        raise ToolError(f"expected an identity 'Name <email>', got {identity!r}")
    if (m.group(1), m.group(2)) == PLACEHOLDER_IDENTITY:
        raise ToolError("that is the placeholder identity; sign off with your own")
    return m.group(1), m.group(2)


def signed_off(out_dir, identity=None):
    """Write the stack to `out_dir` (its pull request directories and series file) with the
    placeholder identity replaced by the submitter's in every From: and Signed-off-by: line.
    Returns a report."""
    name, address = git_identity(identity)
    placeholder = f"{PLACEHOLDER_IDENTITY[0]} <{PLACEHOLDER_IDENTITY[1]}>"
    try:
        name.encode("ascii")
        header_name = name
    except UnicodeEncodeError:
        header_name = email.header.Header(name, "utf-8").encode()
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ToolError(f"{out_dir} is not empty; give a new directory")
    count, stack = 0, pr_patch_files()
    for pr_dir, patches in stack:
        (out_dir / pr_dir.name).mkdir(parents=True, exist_ok=True)
        for patch in [pr_dir / "0000-cover-letter.patch", *patches]:
            text = patch.read_text(encoding="utf-8")
            if f"From: {placeholder}\n" not in text:
                raise ToolError(f"{patch} does not carry the placeholder identity {placeholder}")
            text = text.replace(f"From: {placeholder}\n", f"From: {header_name} <{address}>\n", 1)
            if patch in patches:
                if text.count(f"\nSigned-off-by: {placeholder}\n") != 1:
                    raise ToolError(f"{patch} has no placeholder sign-off to replace")
                text = text.replace(
                    f"\nSigned-off-by: {placeholder}\n", f"\nSigned-off-by: {name} <{address}>\n"
                )
                count += 1
            (out_dir / pr_dir.name / patch.name).write_text(text, encoding="utf-8")
    shutil.copyfile(patches_dir() / "series", out_dir / "series")
    main = load_main_pin()
    return (
        f"wrote {count} patches in {len(stack)} pull requests to {out_dir}, signed off"
        f" by {name} <{address}>.\nOn {main['repository']} at {main['commit'][:12]}: git am"
        f" --keep-non-patch $(sed 's|^|{out_dir}/|' {out_dir}/series) makes the stack, a pull"
        " request after another; each 0000-cover-letter.patch is a pull request's description."
    )
