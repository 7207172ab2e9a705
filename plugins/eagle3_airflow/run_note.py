"""The DAG run's note: what the run produced, in a few markdown lines, where the user triggered it.

The report task returns the run's summary (figures, promoted or not and why, where the drafter is) as XCom.
When the run ends, a listener in the scheduler (registered by plugins/eagle3_ui.py) turns that summary into the
run's note, which the UI shows on the run's page and the REST API returns with the run. A listener, because
Airflow 3.3's Task SDK gives a running task no call that sets its run's note; the scheduler holds the run in its
own database session when it marks it finished, so the note is written in the same transaction.

A note a person wrote is left alone (ours start with NOTE_TITLE); ours is rewritten each time the run ends again,
after a clear, so it always describes the run's latest outcome.
"""

from __future__ import annotations

import logging

from airflow.listeners import hookimpl

from eagle3_airflow import DAG_ID

log = logging.getLogger(__name__)

NOTE_TITLE = "### EAGLE-3 drafter"
NOTE_LIMIT = 1000  # characters: Airflow's dag_run_note.content column


def note_markdown(summary: dict, failed_tasks: list[str] | None = None, headline: str | None = None) -> str:
    """The report task's summary (eagle3_airflow.tasks.report) as a short markdown note; `failed_tasks` when a
    task after the report failed the run."""
    promotion = summary.get("promotion") or {}
    lines = [f"{NOTE_TITLE}: {headline or verdict(summary)}", ""]
    if failed_tasks:
        lines += [f"the run failed after its report: {', '.join(failed_tasks)}", ""]
    if promotion.get("reason"):
        lines += [promotion["reason"], ""]
    ours = summary.get("measured_accept_length") or {}
    theirs = ((promotion.get("current_before") or {}).get("accept_length")) or {}
    if ours:
        lines += ["| k | acceptance length | current drafter |", "|---|---|---|"]
        lines += [f"| {k} | {value:.3f} | {figure(theirs.get(k))} |" for k, value in ours.items()]
        lines.append("")
    facts = []
    if summary.get("simulated_accept_length") is not None:
        facts.append(f"teacher-forced simulated: {summary['simulated_accept_length']:.3f}")
    states = summary.get("hidden_states")
    if states:
        facts.append(f"hidden states: {states['extracted']} extracted, {states['reused']} reused")
    if facts:
        lines += [" · ".join(facts), ""]
    if summary.get("drafter"):
        lines.append(f"drafter: `{summary['drafter']}`")
    if promotion.get("current"):
        lines.append(f"lineage's current: `{promotion['current']}`")
    lines.append("plots and report: the run's *EAGLE-3 report* tab")
    return _fit(lines)


def failure_markdown(failed_tasks: list[str]) -> str:
    return _fit([f"{NOTE_TITLE}: run failed", "",
                 f"failed: {', '.join(failed_tasks) or 'none (the run was marked failed)'}", "",
                 "Clear a failed task to resume: the stage picks up where it stopped."])


def verdict(summary: dict) -> str:
    """The outcome in three words or so: the note's headline and the report tab's."""
    if summary.get("nothing_changed_since"):
        return f"nothing changed since run {summary['nothing_changed_since']}"
    return "promoted" if (summary.get("promotion") or {}).get("promoted") else "not promoted"


def figure(value) -> str:
    """An acceptance length as both views print it; '-' where there is none (no current drafter yet)."""
    return "-" if value is None else f"{value:.3f}"


def _fit(lines: list[str]) -> str:
    """Drop lines from the end until the note fits the column; paths are long on real boxes."""
    while len(text := "\n".join(lines).strip()) > NOTE_LIMIT and len(lines) > 1:
        lines = lines[:-1]
    return text[:NOTE_LIMIT]


def publish(dag_run) -> None:
    """Write the note of a finished run of this project's DAG, in the session that holds the run."""
    from airflow.models.xcom import XComModel
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    if dag_run.dag_id != DAG_ID:
        return
    session = object_session(dag_run)
    if session is None:  # `airflow dags test` passes a detached run: only a scheduler's run gets a note
        return
    if dag_run.note and not dag_run.note.startswith(NOTE_TITLE):
        log.info("run %s has a note written by a person: not replaced", dag_run.run_id)
        return
    row = session.scalars(select(XComModel).where(
        XComModel.dag_run_id == dag_run.id, XComModel.task_id == "report", XComModel.map_index == -1,
        XComModel.key == "return_value")).first()
    failed = sorted({ti.task_id for ti in dag_run.get_task_instances(state=[TaskInstanceState.FAILED],
                                                                      session=session)})
    if row is not None:
        dag_run.note = note_markdown(XComModel.deserialize_value(row), failed)
    else:
        dag_run.note = failure_markdown(failed)


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    publish(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    publish(dag_run)
