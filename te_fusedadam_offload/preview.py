"""apply --dry-run and check: what apply would do to a target, from its plan (plan.py),
shown and not carried out: the diff of the files that it would write, and one line."""

from . import report
from .errors import ToolError
from .plan import GitAm, Save, Tidy, Write, apply_plan
from .state import DRIFTED, INTERRUPTED, NOT_APPLIED
from .target import older_than_supported


def dry_run(state):
    """(what apply would say, the unified diff of what it would change): its plan, shown and
    not carried out."""
    plan = apply_plan(state, dry=True)
    if plan.refusal is not None:
        raise plan.refusal
    contents = {}
    for step in plan.steps:
        if isinstance(step, GitAm) and state.overall == NOT_APPLIED:
            contents.update(state.after)
        step = step.write if isinstance(step, Save) else step
        contents.update(step.contents if isinstance(step, Write) else {})
    return plan.message, report.unified_diff(state.files, contents)


def would_apply(state):
    """What apply would do, in a few words (check's line): its plan's, or why it refuses."""
    try:
        plan = apply_plan(state)
    except ToolError as exc:
        return f"refuses: {str(exc).splitlines()[0]}"
    if plan.refusal is not None:
        if state.source_checkout is None:  # a refusal of the files as they are
            if state.edited:
                return f"refuses: {report.edited_note(state)}"
            if state.overall == NOT_APPLIED and older_than_supported(state.te_version):
                return f"refuses TE {state.te_version}, older than the releases the series supports"
            if state.overall == DRIFTED:
                return "refuses a drifted TE; status says what drifted"
        return f"refuses: {str(plan.refusal).splitlines()[0].removeprefix('cannot apply: ')}"
    writes = [step for step in plan.steps if not isinstance(step, Tidy)]
    command = f"te-fusedadam-offload apply {state.target.args}"
    if not writes:
        return "nothing to do, the series is applied"
    if any(isinstance(step, Write) and step.action == "revert" for step in writes):
        return "replaces the other version of this series that is applied with this one"
    if [type(step) for step in writes] == [Write] or state.applied:  # what is left to write
        return f"completes the series: {command}"
    if isinstance(writes[0], GitAm) and state.overall == INTERRUPTED:
        return f"completes the series: {command}"
    return f"the series is not in: {command} puts it in"
