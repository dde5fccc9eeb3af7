"""The series: its metadata (series.toml) and its patches (patches/, compat/)."""

import os
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .errors import ToolError, UsageError
from .paths import data_file

# A file that several patches change: its content after each patch but the last that changes
# it lives in <tree>/.stages/NNNN/<path> (NNNN: that patch's number), beside the final file.
STAGES_DIR = ".stages"
COMPAT_DIR = "compat"


# The identity that the committed series carries, to be replaced by the submitter's own
# (`pr --signoff`): a sign-off certifies the Developer Certificate of Origin for a person.
PLACEHOLDER_IDENTITY = ("Your Name", "you@example.com")


def load_series():
    """series.toml as a dict: author, pr (list: the stack of pull requests, each with its
    name, subject and body), patch (list, each naming its pull request by number)."""
    with open(data_file("series.toml"), "rb") as f:
        series = tomllib.load(f)
    if not series.get("patch") or not series.get("pr"):
        raise ToolError("series.toml lists no [[pr]] or no [[patch]]")
    numbers = [entry.get("pr") for entry in series["patch"]]
    if numbers != sorted(numbers) or set(numbers) != set(range(1, len(series["pr"]) + 1)):
        raise ToolError(
            "series.toml: each [[patch]] names its pull request (pr = 1, 2, ...), in order, "
            "and each [[pr]] has patches"
        )
    return series


def pr_dir_name(number, pr):
    """The directory of pull request `number` (1-based) under patches/: '1-export'."""
    return f"{number}-{pr['name']}"


def patch_label(patch):
    """How a patch is named in reports: its pull request's directory and its file name."""
    patch = Path(patch)
    if re.match(r"\d+-", patch.parent.name) or patch.parent.name == COMPAT_DIR:
        return f"{patch.parent.name}/{patch.name}"
    return patch.name


def compat_patches():
    """The compat patches (compat/*.patch, in name order): each is applied before the series
    to the older releases whose context lines differ from the pinned release's in a way that
    the patch mends (see its header), and never on its own."""
    return sorted(data_file(COMPAT_DIR).glob("*.patch"))


def stage_dir(index):
    """The directory, relative to a tree, of the files as they are after patch `index` (0-based)."""
    return Path(STAGES_DIR) / f"{index + 1:04d}"


def entry_paths(entry):
    """All files a [[patch]] entry changes: `paths` (files of the release's package, and new
    files that this repository holds) and `main_paths` (existing files of upstream main)."""
    return [*entry.get("paths", []), *entry.get("main_paths", [])]


def main_paths(series=None):
    """The existing upstream main files that the series changes, in series order."""
    entries = (series or load_series())["patch"]
    return list(dict.fromkeys(rel for entry in entries for rel in entry.get("main_paths", [])))


def staged_paths(series=None):
    """{patch index: [paths]}: the files that a later patch of the series changes again."""
    entries = (series or load_series())["patch"]
    staged = {}
    for i, entry in enumerate(entries):
        for rel in entry_paths(entry):
            if any(rel in entry_paths(later) for later in entries[i + 1 :]):
                staged.setdefault(i, []).append(rel)
    return staged


def patches_dir():
    """The directory of the generated series."""
    return data_file("patches")


def patch_files(directory=None):
    """The patches of the series, in order, as listed by patches/series (no cover letters):
    those of the first pull request, then those of the second, ..."""
    directory = Path(directory) if directory is not None else patches_dir()
    series_file = directory / "series"
    if not series_file.is_file():
        raise ToolError(f"{series_file} is missing; run 'refresh'")
    names = [
        line.strip()
        for line in series_file.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise ToolError(f"{directory} lacks {', '.join(missing)} named in its series file")
    return [directory / n for n in names]


def identity_env(author):
    """Environment for git with the series' fixed author, committer, dates and no user config."""
    name, email, date = author["name"], author["email"], author["date"]
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": date,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "TZ": "UTC",
    }


def pr_patch_files(directory=None):
    """[(pull request directory, [its patches])] of the series, in order."""
    groups = {}
    for patch in patch_files(directory):
        groups.setdefault(patch.parent, []).append(patch)
    return list(groups.items())


def stack_prefix(upto=None):
    """The patches of the first `upto` pull requests of the stack (all without `upto`)."""
    if upto is None:
        return patch_files()
    stack = pr_patch_files()
    if not 1 <= upto <= len(stack):
        raise UsageError(f"the stack has {len(stack)} pull requests: give --upto 1 to {len(stack)}")
    return [patch for _, patches in stack[:upto] for patch in patches]


def load_checksums(directory=None):
    """{path: (pristine sha256, patched sha256)} for the upstream files the series changes."""
    directory = Path(directory) if directory is not None else patches_dir()
    table = {}
    path = directory / "checksums"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            before, after, rel = line.split(" ", 2)
            table[rel] = (before, after)
    return table


def hunk_headers(patch_file):
    """{(path, old start line): hunk header} of a patch file."""
    headers = {}
    path = None
    for line in Path(patch_file).read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ "):
            path = line[4:].split("b/", 1)[-1]
        m = re.match(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", line)
        if m and path:
            headers[(path, int(m.group(1)))] = line
    return headers


def commit_subject(patch):
    """The commit title that `git am --keep-non-patch` makes of a patch."""
    lines = Path(patch).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Subject: "):
            subject = line[len("Subject: ") :]
            for more in lines[i + 1 :]:  # folded header lines
                if not more.startswith((" ", "\t")):
                    break
                subject += more
            return re.sub(r"^\[PATCH[^\]]*\] ", "", subject)
    return ""
