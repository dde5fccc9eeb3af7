"""Regenerating the series (`refresh`): the patches made with git from the edited files, and
their comparison with patches/."""

import filecmp
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import ToolError
from ..patching import git
from ..series import (
    entry_paths,
    identity_env,
    load_series,
    main_paths,
    pr_dir_name,
    stage_dir,
    staged_paths,
)
from ..upstream import load_pin, pristine_tree, sha256_of

PLACEHOLDER_SUBJECT = "*** SUBJECT HERE ***"
PLACEHOLDER_BLURB = "*** BLURB HERE ***"


def _message(entry, author):
    body = entry.get("body", "").strip()
    sign_off = f"Signed-off-by: {author['name']} <{author['email']}>"
    return (
        f"{entry['subject']}\n\n{body}\n\n{sign_off}\n"
        if body
        else f"{entry['subject']}\n\n{sign_off}\n"
    )


def generate(source_root, out_dir, wheel=None, main=None):
    """Write the series made from the files under `source_root` into `out_dir` (created).

    `source_root` holds the edited `transformer_engine/` tree, the repository's own new files
    and the edited upstream main files, at the paths series.toml names, and, for a file that
    several patches change, its content after each but the last of them under `.stages/`.
    Commits are made on top of the pristine release plus, from `main` (the pristine tree of
    the pinned main commit), the main files the series changes, with fixed identity and dates,
    so the output depends only on the files and series.toml. Without `main`, each main file
    is a stand-in: the output then differs from the series only in the diffs of the main
    files and the diffstats (see `compare_dirs`).
    """
    series = load_series()
    changed_main = main_paths(series)
    staged = staged_paths(series)
    author = series["author"]
    env = identity_env(author)
    source_root = Path(source_root)
    pristine = pristine_tree(wheel)
    pin = load_pin()
    with tempfile.TemporaryDirectory() as work:
        repo = Path(work) / "te"
        shutil.copytree(pristine, repo)
        for rel in changed_main if main is not None else ():
            if not (Path(main) / rel).is_file():
                raise ToolError(f"{rel} (a main_paths entry) is not a file of upstream main")
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(main) / rel, repo / rel)
        git(["init", "-q", "-b", "base"], repo, env)
        git(["add", "-A"], repo, env)
        git(
            ["commit", "-q", "-m", f"{pin['package']} {pin['version']} (pristine)"],
            repo,
            env,
        )
        bases = {1: git(["rev-parse", "HEAD"], repo, env).stdout.strip()}
        for index, entry in enumerate(series["patch"]):
            if entry["pr"] not in bases:
                bases[entry["pr"]] = git(["rev-parse", "HEAD"], repo, env).stdout.strip()
            for rel in entry_paths(entry):
                if main is None and rel in changed_main:
                    # A stand-in, so that the patch and its message are made as with main.
                    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                    stand_in = f"not regenerated: no upstream main tree (patch {index + 1})\n"
                    (repo / rel).write_text(stand_in)
                    git(["add", rel], repo, env)
                    continue
                if (
                    main is not None
                    and rel not in changed_main
                    and not rel.startswith(pin["subtree"] + "/")
                    and (Path(main) / rel).exists()
                ):
                    raise ToolError(f"{rel} exists upstream: name it in main_paths, not paths")
                src = source_root / rel
                if rel in staged.get(index, ()):
                    src = source_root / stage_dir(index) / rel
                if not src.is_file():
                    raise ToolError(f"{src} does not exist (named by '{entry['subject']}')")
                dst = repo / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                git(["add", rel], repo, env)
            if not git(["diff", "--cached", "--quiet"], repo, env, check=False).returncode:
                raise ToolError(f"'{entry['subject']}' changes nothing")
            git(["commit", "-q", "-F", "-"], repo, env, input_text=_message(entry, author))
        bases[len(series["pr"]) + 1] = git(["rev-parse", "HEAD"], repo, env).stdout.strip()
        out_dir = Path(out_dir)
        listed = []
        for number, pr in enumerate(series["pr"], 1):
            pr_dir = out_dir / pr_dir_name(number, pr)
            pr_dir.mkdir(parents=True, exist_ok=True)
            git(
                [
                    "-c",
                    "core.abbrev=12",
                    "-c",
                    "diff.noprefix=false",
                    "format-patch",
                    "-q",
                    "--cover-letter",
                    "--no-signature",
                    "--zero-commit",
                    "--no-binary",
                    "--stat=80",
                    "-o",
                    str(pr_dir),
                    f"{bases[number]}..{bases[number + 1]}",
                ],
                repo,
                env,
            )
            _write_cover(pr_dir, series, number, pin)
            names = sorted(p.name for p in pr_dir.glob("[0-9][0-9][0-9][0-9]-*.patch"))
            listed += [f"{pr_dir.name}/{n}" for n in names if not n.startswith("0000-")]
    (out_dir / "series").write_text("".join(f"{n}\n" for n in listed), encoding="utf-8")
    _write_checksums(pristine, out_dir, source_root, series, pin["subtree"])
    return out_dir


def _write_cover(pr_dir, series, number, pin):
    """Fill in the cover letter of pull request `number`: its subject, its description, and
    what it is made against (upstream main, and the pull requests before it)."""
    pr = series["pr"][number - 1]
    cover = pr_dir / "0000-cover-letter.patch"
    text = cover.read_text(encoding="utf-8")
    text = text.replace(PLACEHOLDER_SUBJECT, pr["subject"], 1)
    main_pin = pin["main"]
    base_line = (
        f"Made against {main_pin['branch']} of {main_pin['repository']} at "
        f"{main_pin['commit']}\n({main_pin['date']}, {main_pin['version']})"
    )
    if pr.get("independent"):  # a carried upstream pull request: it needs none before it
        base_line += ",\nalone: it depends on none of the pull requests before it in this stack"
    elif number > 1:
        before = ", ".join(
            f'"{p["subject"]}" ({pr_dir_name(n, p)})'
            for n, p in enumerate(series["pr"][: number - 1], 1)
        )
        base_line += f",\non top of {before}"
    base_line += (
        f". Its changes to {pin['subtree']}/ are generated from\n"
        f"{pin['package']} {pin['version']} ({pin['artifact']},\n"
        f"sha256 {pin['sha256']}),\nto which they apply as well."
    )
    text = text.replace(PLACEHOLDER_BLURB, pr["body"].strip() + "\n\n" + base_line, 1)
    cover.write_text(text, encoding="utf-8")


def _write_checksums(pristine, out_dir, source_root, series, subtree):
    """patches/checksums: sha256 of each upstream file the series changes, before and after."""
    lines = []
    paths = dict.fromkeys(rel for entry in series["patch"] for rel in entry_paths(entry))
    for rel in paths:
        before = pristine / rel
        if rel.startswith(subtree + "/") and before.is_file():
            after = source_root / rel
            lines.append(f"{sha256_of(before)} {sha256_of(after)} {rel}\n")
    (out_dir / "checksums").write_text("".join(lines), encoding="utf-8")


def compare_dirs(expected, actual, main_paths_aside=()):
    """Names of files that differ between two series directories (missing counts). With
    `main_paths_aside` (`actual` was generated without those upstream main files), their diffs
    and the diffstats are left out of the comparison."""
    expected, actual = Path(expected), Path(actual)

    def files(root):
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    names = files(expected) | files(actual)

    def same(n):
        if not main_paths_aside:
            return filecmp.cmp(expected / n, actual / n, shallow=False)
        return without_paths((expected / n).read_text(encoding="utf-8"), main_paths_aside) == (
            without_paths((actual / n).read_text(encoding="utf-8"), main_paths_aside)
        )

    return sorted(
        n
        for n in names
        if not (expected / n).is_file() or not (actual / n).is_file() or not same(n)
    )


_DIFFSTAT = re.compile(r"^ (\S.* \| +(\d+ ?[-+]*|Bin .*)|\d+ files? changed.*)$")


def without_paths(text, paths):
    """A patch's text less its diffstat lines and its sections (`diff --git` and the summary's
    `create mode` lines) of `paths`."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if line.startswith("diff --git "):
            skipping = any(bare.endswith(f" b/{rel}") for rel in paths)
        elif skipping and (line == "-- \n" or line.startswith("From ")):
            skipping = False
        if skipping or _DIFFSTAT.match(bare):
            continue
        if bare.startswith(" create mode ") and bare.split(" ", 4)[-1] in paths:
            continue
        out.append(line)
    return "".join(out)
