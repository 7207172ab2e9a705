"""The DAG run's note: what the run produced, in a few markdown lines, where the user triggered it.

The report task returns the run's summary (figures, promoted or not and why, where the drafter is) as XCom.
When the run ends, a listener in the scheduler (registered by plugins/eagle3_ui.py) turns that summary into the
run's note, which the UI shows on the run's page and the REST API returns with the run. A listener, because
Airflow 3.3's Task SDK gives a running task no call that sets its run's note; the scheduler holds the run in its
own database session when it marks it finished, so the note is written in the same transaction.

A note a person wrote is left alone (ours start with NOTE_TITLE); ours is rewritten each time the run ends again,
after a clear, so it always describes the run's latest outcome.

Every value in a note (and in the approval's body, which is made here too) came from a trigger, a file on the box or
XCom, so it is escaped: text with `text()`, paths as code spans with `code()`, numbers only as numbers. A workdir
with a backtick, or a reason reading `**Security review: passed, approve**` or `![x](https://...)`, shows as the
characters it is, never as bold text, a link or an image. (The note is no trust anchor either way: the USER role may
edit a run's note. The report tab, the approval and the Asset event read the box, never this XCom.)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from airflow.listeners import hookimpl

if TYPE_CHECKING:
    from eagle3_airflow.airflow_internals import DagRun

log = logging.getLogger(__name__)

NOTE_TITLE = "### EAGLE-3 drafter"
NOTE_LIMIT = 1000  # characters: Airflow's dag_run_note.content column
NOTES_SHOWN = 200  # characters of the form's notes the note shows


# Markdown's inline markup (CommonMark and GitHub's tables and strikethrough): emphasis, code, links and images,
# raw HTML and autolinks, table cells, escapes themselves. '(' and ')' need no escape once '[' and '!' have one.
MARKUP = re.compile(r"([\\`*_\[\]<>!|~#{}])")
# What starts a block at the beginning of a line: a list item ("- ", "+ ", "1. ", "1) "), a setext underline.
BLOCK_START = re.compile(r"^(\s*)([-+=]|\d+(?=[.)]))")


def text(value: object) -> str:
    """Any value as markdown that renders as exactly its characters, on one line."""
    flat = " ".join(str(value).split())  # newlines would start new blocks: a heading, a list, a table row
    return BLOCK_START.sub(
        lambda m: m.group(1) + "\\" + m.group(2) if not m.group(2)[0].isdigit() else m.group(1) + m.group(2) + "\\",
        MARKUP.sub(r"\\\1", flat),
    )


def code(value: object) -> str:
    """A value (a path) as a code span: literal whatever it holds, backticks included, on one line."""
    flat = " ".join(str(value).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def number(value: object, spec: str = ".3f") -> str:
    """A figure; anything that is not a number (a forged XCom) is shown as escaped text instead."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return text(value)


# A summary is JSON from XCom (the report task's, or a forged one): dict[str, Any], every value checked where read.
def note_markdown(summary: dict[str, Any], failed_tasks: list[str] | None = None, headline: str | None = None) -> str:
    """The report task's summary (eagle3_airflow.tasks.report) as a short markdown note; `failed_tasks` when a
    task after the report failed the run. Every value is escaped (see the module docstring)."""
    promotion = _mapping(summary.get("promotion"))
    lines = [f"{NOTE_TITLE}: {text(headline or verdict(summary))}", ""]
    if failed_tasks:
        lines += [f"the run failed after its report: {text(', '.join(failed_tasks))}", ""]
    notes = summary.get("notes")
    if isinstance(notes, str) and notes:  # the form's: why this run (its start: the figures must fit too)
        lines += [f"notes: {text(notes[:NOTES_SHOWN])}" + ("…" if len(notes) > NOTES_SHOWN else ""), ""]
    if promotion.get("reason"):
        lines += [text(promotion["reason"]), ""]
    ours = _mapping(summary.get("measured_accept_length"))
    theirs = _mapping(_mapping(promotion.get("current_before")).get("accept_length"))
    if ours:
        lines += [
            "| k | acceptance length | current drafter | " + " | ".join(BESIDE_MEASURED) + " |",
            "|---|---|---|" + "---|" * len(BESIDE_MEASURED),
        ]
        for k, value in ours.items():
            cells = [text(k), number(value), figure(theirs.get(k)), *beside_measured(summary, k)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    public = public_set_rows(summary)
    if public:
        lines += ["| public set | " + " | ".join(PUBLIC_SET_COLUMNS) + " |", "|---|" + "---|" * len(PUBLIC_SET_COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in public_set_rows(summary, escape=text)]
        lines.append("")
    facts = []
    states = _mapping(summary.get("hidden_states"))
    if states:
        facts.append(
            f"hidden states: {number(states.get('extracted'), 'd')} extracted, "
            f"{number(states.get('reused'), 'd')} reused"
        )
    if facts:
        lines += [" · ".join(facts), ""]
    if summary.get("drafter"):
        lines.append(f"drafter: {code(summary['drafter'])}")
    if promotion.get("current"):
        lines.append(f"lineage's current: {code(promotion['current'])}")
    lines.append("plots and report: the run's *EAGLE-3 report* tab")
    return _fit(lines)


def failure_markdown(failed_tasks: list[str]) -> str:
    return _fit(
        [
            f"{NOTE_TITLE}: run failed",
            "",
            f"failed: {text(', '.join(failed_tasks) or 'none (the run was marked failed)')}",
            "",
            "Clear a failed task to resume: the stage picks up where it stopped.",
        ]
    )


def verdict(summary: dict[str, Any]) -> str:
    """The outcome in three words or so: the note's headline and the report tab's (plain text: each escapes it)."""
    if summary.get("nothing_changed_since"):
        return f"nothing changed since run {summary['nothing_changed_since']}"
    promotion = _mapping(summary.get("promotion"))
    if promotion.get("promoted") is True:
        return "promoted"
    # approve_promotion: the run ended with its proposal; the promotion DAG asks a person
    return "proposed, awaiting approval" if promotion.get("pending_approval") is True else "not promoted"


BESIDE_MEASURED = ("95% interval over prompts", "ceiling (share reached)", "offline (validation split)")


def beside_measured(summary: dict[str, Any], k: str) -> list[str]:
    """What puts the measured acceptance length at k in proportion (BESIDE_MEASURED): its noise over prompts, what a
    drafter that always agrees with the target would reach, and what training predicted offline."""
    measured: Any = _mapping(summary.get("measured_accept_length")).get(k)  # JSON: `numeric` checks both
    interval = _mapping(summary.get("accept_length_interval95")).get(k)
    ceiling: Any = _mapping(summary.get("ceiling_accept_length")).get(k)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (measured, ceiling))
    return [
        f"{number(interval[0])}-{number(interval[1])}" if isinstance(interval, list) and len(interval) == 2 else "-",
        f"{number(ceiling)} ({measured / ceiling:.0%})" if numeric and ceiling > 0 else figure(ceiling),
        figure(_mapping(summary.get("offline_accept_length")).get(k)),
    ]


# k=3 and k=7 are the published configurations: 3 steps / topk 1 / 4 draft tokens, and 7 / 1 / 8
PUBLIC_SET_COLUMNS = ("prompts", "k=3 (95% interval)", "k=7 (95% interval)", "published at k=3")


def public_set_rows(summary: dict[str, Any], escape: Callable[[object], str] = str) -> list[list[str]]:
    """One row per public set of evaluate.benchmarks (PUBLIC_SET_COLUMNS after the set's title). Names from the
    report go through `escape` (the note's `text`; the report tab escapes whole cells as HTML); figures are
    number()'s, which shows anything that is not a number as escaped text."""
    rows = []
    for name, figures in _mapping(summary.get("public_sets")).items():
        figures = _mapping(figures)
        measured, intervals = _mapping(figures.get("accept_length")), _mapping(figures.get("interval95"))
        at = {k: figure(measured.get(k)) + _spread(intervals.get(k)) for k in ("3", "7")}
        cut = figures.get("answers_cut")
        prompts = number(figures.get("prompts"), "d") + (f", {number(cut, 'd')} cut at max tokens" if cut else "")
        published = (
            ", ".join(
                f"{escape(who)} {number(value, '.2f')}" for who, value in _mapping(figures.get("published_k3")).items()
            )
            or "-"
        )
        rows.append([escape(figures.get("title") or name), prompts, at["3"], at["7"], published])
    return rows


def _spread(interval: object) -> str:
    """(low-high), or nothing where the report has no interval."""
    if isinstance(interval, list) and len(interval) == 2:
        return f" ({number(interval[0])}-{number(interval[1])})"
    return ""


def figure(value: object) -> str:
    """An acceptance length as both views print it; '-' where there is none (no current drafter yet)."""
    return "-" if value is None else number(value)


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _fit(lines: list[str]) -> str:
    """Drop lines from the end until the note fits the column; paths are long on real boxes."""
    while len(text := "\n".join(lines).strip()) > NOTE_LIMIT and len(lines) > 1:
        lines = lines[:-1]
    return text[:NOTE_LIMIT]


def publish(dag_run: DagRun) -> None:
    """Write the note of a finished run of this project's DAG, in the session that holds the run."""
    from airflow.sdk import TaskInstanceState
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    from eagle3_airflow.airflow_internals import XComModel
    from eagle3_airflow.pools import is_drafter_dag

    if not is_drafter_dag(dag_run.dag_id):  # eagle3_drafter, or a box's eagle3_drafter__<box>
        return
    session = object_session(dag_run)
    if session is None:  # `airflow dags test` passes a detached run: only a scheduler's run gets a note
        return
    if dag_run.note and not dag_run.note.startswith(NOTE_TITLE):
        log.info("run %s has a note written by a person: not replaced", dag_run.run_id)
        return
    row = session.scalars(
        select(XComModel).where(
            XComModel.dag_run_id == dag_run.id,
            XComModel.task_id == "report",
            XComModel.map_index == -1,
            XComModel.key == "return_value",
        )
    ).first()
    # airflow.sdk's TaskInstanceState, the public one: another str enum than the ORM's that get_task_instances names,
    # of the same values, which the query compares as strings.
    states = [TaskInstanceState.FAILED]
    failed = sorted({ti.task_id for ti in dag_run.get_task_instances(state=states, session=session)})  # type: ignore[arg-type]
    if row is not None:
        dag_run.note = note_markdown(XComModel.deserialize_value(row), failed)
    else:
        dag_run.note = failure_markdown(failed)


@hookimpl
def on_dag_run_success(dag_run: DagRun, msg: str) -> None:
    publish(dag_run)


@hookimpl
def on_dag_run_failed(dag_run: DagRun, msg: str) -> None:
    publish(dag_run)
