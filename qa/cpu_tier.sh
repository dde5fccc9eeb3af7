#!/usr/bin/env bash
# The CPU tier, what CI runs (.ci/run): no GPU needed, network to the package index needed.
#   bash qa/cpu_tier.sh
# Creates .venv (reused when present) with requirements-ci.txt and this package, then checks:
# the series against every supported TE release and the newest, patches/ not stale, the tool's tests,
# the patched fused_adam.py of the release (compile, black, pylint with TE's settings), and the
# docs build. With the pinned upstream main tree also: the stack git-am'ed onto it pull request
# by pull request, TE's lint job (pylint 3.3.1 with TE's pylintrc over TE's packages, black
# 24.4.2, vermin) on main with each prefix of the stack, patches/ regenerated in full (without
# it, the diffs of upstream main files are not, and it says so), and TE's own docs of the
# patched main tree built with -W (their toolchain goes into .venv-te-docs). That tree comes
# from the cache, from TE_SOURCE=<a TE git clone holding the pinned main commit>, else from the
# archive of it that upstream.json pins (TE_MAIN_ARCHIVE, by default ../shared/upstream/ beside
# the checkout, as CI has it), else, where upstream's git is reachable, from a shallow fetch of
# that commit; only without any of them are those checks SKIPPED, with the reason.
# It never installs into the virtualenv that is active when it is called (a training venv
# would lose its torch): it uses the repository's .venv (CPU_TIER_VENV), whatever is active.
# TE's lint job and TE's docs build run in the background beside the other steps (CI has two
# CPUs); their output is shown whole at the end.
# --setup-only: set up that venv, print its Python, and stop.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${CPU_TIER_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    # Not from an active venv's python: the new venv must not depend on that one.
    base=$(python3 -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
    "$base" -m venv "$VENV" || exit 1
fi
deactivate 2>/dev/null || true
unset PYTHONHOME PIP_USER PIP_TARGET PIP_PREFIX
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -r requirements-ci.txt || exit 1
python -m pip install -q --no-build-isolation . || exit 1
if [ "${1:-}" = --setup-only ]; then
    command -v python
    exit 0
fi

FAILED=()
step() {
    local name=$1; shift
    echo "=== $name"
    if "$@"; then echo "--- ok: $name"; else echo "--- FAILED: $name"; FAILED+=("$name"); fi
}
BLACK=(black --check --line-length=100 --preview --enable-unstable-feature=string_processing)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# TE's docs toolchain (.venv-te-docs) installs in the background from here on (network and
# disk bound), for the docs build of the patched main tree at the end.
te_docs_venv() {  # its exit status goes to te-docs-venv.rc, for te_docs (no child of it)
    [ -x .venv-te-docs/bin/sphinx-build ] ||
        { python3 -m venv .venv-te-docs && .venv-te-docs/bin/pip install -q -r qa/te_docs/requirements.txt; }
    echo $? > "$WORK/te-docs-venv.rc"
}
te_docs_venv > "$WORK/te-docs-venv.log" 2>&1 &
TE_DOCS_VENV_PID=$!

main_tree() {  # the pinned main tree (exported into the cache the first time), or nothing
    python -c 'from te_fusedadam_offload.maintainers.mainline import main_tree
print(main_tree() or "")'
}
no_main_tree() {  # a step that failed: the checks that need the tree say so
    echo "--- FAILED: the pinned main tree"; FAILED+=("the pinned main tree")
    MAIN_TREE= NO_MAIN="the pinned main tree could not be made (see above)"
}
if ! MAIN_TREE=$(main_tree); then
    no_main_tree
elif [ -z "$MAIN_TREE" ]; then
    read -r MAIN_REPO MAIN_COMMIT < <(python -c 'from te_fusedadam_offload.maintainers.mainline import load_main_pin
m = load_main_pin(); print(m["repository"], m["commit"])')
    echo "=== no TE source, no archive of the pinned main tree: a shallow fetch of $MAIN_COMMIT"
    if git init -q "$WORK/te-source" && GIT_TERMINAL_PROMPT=0 timeout 300 \
        git -C "$WORK/te-source" fetch -q --depth 1 "$MAIN_REPO" "$MAIN_COMMIT"; then
        export TE_SOURCE="$WORK/te-source"
        MAIN_TREE=$(main_tree) || no_main_tree
    else
        NO_MAIN="$(python -c 'from te_fusedadam_offload.maintainers.mainline import NO_MAIN_TREE
print(NO_MAIN_TREE)'); and $MAIN_REPO is not reachable from here"
    fi
fi
[ -n "$MAIN_TREE" ] && echo "=== the pinned upstream main tree: $MAIN_TREE"

# The two longest checks need the pinned main tree and nothing that the steps below make but
# materialize's te-main/: TE's lint job (pylint over TE's packages with each prefix of the
# stack) runs in the background from here, TE's docs build from materialize on, each with its
# output in a file, shown whole at the end; on two CPUs they run beside the other steps.
background() {  # NAME FILE CMD...: a step whose output goes to FILE, its status to FILE.rc
    local name=$1 out=$2; shift 2
    step "$name" "$@" > "$out" 2>&1
    [ ${#FAILED[@]} -eq 0 ]; echo $? > "$out.rc"
}
te_docs() {  # after the docs toolchain (te_docs_venv, no child of this shell: polled)
    while [ ! -s "$WORK/te-docs-venv.rc" ] && kill -0 "$TE_DOCS_VENV_PID" 2>/dev/null; do sleep 1; done
    if [ "$(cat "$WORK/te-docs-venv.rc" 2>/dev/null)" != 0 ]; then
        cat "$WORK/te-docs-venv.log"
        echo "--- FAILED: TE's docs toolchain (.venv-te-docs)"; echo 1 > "$WORK/te-docs.log.rc"
        return
    fi
    local pandoc_dir
    pandoc_dir=$(.venv-te-docs/bin/python -c "import os, pypandoc; print(os.path.dirname(pypandoc.get_pandoc_path()))")
    FAILED=()
    step "TE's docs of the patched main tree build with -W (TE's toolchain, qa/te_docs)" \
        env PATH="$pandoc_dir:$PATH" TE_DOCS="$WORK/te-main/docs" .venv-te-docs/bin/sphinx-build \
        -W -q -b html -c qa/te_docs "$WORK/te-main/docs" "$WORK/te-docs-html"
    [ ${#FAILED[@]} -eq 0 ]; echo $? > "$WORK/te-docs.log.rc"
}
if [ -n "$MAIN_TREE" ]; then
    echo "=== TE's lint job: started in the background"
    (FAILED=(); background "TE's lint job on upstream main with each prefix of the stack of pull requests" \
        "$WORK/lint.log" python -m te_fusedadam_offload lint) &
    LINT_PID=$!
fi

step "patches/ is regenerated byte for byte from the pinned release and this tree" \
    python -m te_fusedadam_offload refresh --check
step "the series against every supported release and the newest" \
    python -m te_fusedadam_offload drift
if [ -n "$MAIN_TREE" ]; then
    step "each pull request git-am's onto the pinned upstream main commit's tree, in turn" \
        python -m te_fusedadam_offload check-main
else
    echo "=== SKIPPED: the stack git-am'ed onto the pinned upstream main commit: ${NO_MAIN:-}"
fi
step "materialize pristine TE + the series" python -m te_fusedadam_offload materialize --dest "$WORK"
if [ -n "$MAIN_TREE" ] && [ -d "$WORK/te-main" ]; then
    echo "=== TE's docs of the patched main tree: started in the background"
    te_docs > "$WORK/te-docs.log" 2>&1 &
    DOCS_PID=$!
elif [ -n "$MAIN_TREE" ]; then
    NO_DOCS="materialize made no te-main/ (see above)"
fi
FA="$WORK/transformer_engine/pytorch/optimizers/fused_adam.py"
step "patched fused_adam.py compiles" python -m py_compile "$FA"
step "black (TE settings)" "${BLACK[@]}" "$FA" te_fusedadam_offload benchmarks tests setup.py docs/conf.py qa/te_docs
step "pylint (TE settings) on the patched fused_adam.py and the tool" \
    pylint --rcfile=.pylintrc "$FA" te_fusedadam_offload
step "installed command works on the materialized tree" te-fusedadam-offload status "$WORK"
step "docs build without warnings" sphinx-build -W -q -b html docs "$WORK/docs-html"
step "tests: the tool's own (none collected fails)" python -m pytest -rs -q tests/tool
wait "$TE_DOCS_VENV_PID"
show() {  # NAME PID FILE: wait for a background step, show its output, count its failure
    wait "$2"
    cat "$3"
    [ "$(cat "$3.rc" 2>/dev/null)" = 0 ] || FAILED+=("$1")
}
if [ -n "${LINT_PID:-}" ]; then
    show "TE's lint job" "$LINT_PID" "$WORK/lint.log"
else
    echo "=== SKIPPED: TE's lint job on main with each prefix of the stack: ${NO_MAIN:-}"
fi
if [ -n "${DOCS_PID:-}" ]; then
    show "TE's docs of the patched main tree" "$DOCS_PID" "$WORK/te-docs.log"
else
    echo "=== SKIPPED: TE's docs of the patched main tree: ${NO_DOCS:-${NO_MAIN:-}}"
fi

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
echo "CPU tier passed"
