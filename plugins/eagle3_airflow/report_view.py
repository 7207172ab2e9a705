"""The run's report in the Airflow UI: figures, promotion, and the plots, fetched from the box on demand.

A FastAPI app that plugins/eagle3_ui.py mounts in the API server under /eagle3, shown as the *EAGLE-3 report* tab
of a run of this project's DAG (an external view with destination dag_run):

  /eagle3/dags/{dag_id}/runs/{run_id}/                the page: evaluate's report, the plots inline
  /eagle3/dags/{dag_id}/runs/{run_id}/plots/{index}   one plot (PNG), read from the box
  /eagle3/dags/{dag_id}/runs/{run_id}/report.json     evaluate's whole report, read from the box

Access is Airflow's: the caller must be allowed to read the DAG's runs and their XComs (the UI's session cookie or a
bearer token).
What may be read: the run's plan, written by its validate task into XCom, which the USER role may edit, is used only
once its seal holds and the deployment's settings allow it (eagle3_airflow.plan.verified_plan; the key is read
through Airflow's models). Its box and run directory are then the only place read from, through
`python -m eagle3 report` (eagle3/reportfiles.py): `<stage>/*.png` and evaluate/report.json under the real run
directory, regular files only, never through a link, at most 8 MiB each. The figures shown come from that report,
not from the report task's XCom. No path comes from the request or from XCom, so a caller cannot make the API server
read anything else on the box. Files go out with nosniff and a content security policy that runs nothing: a "plot"
that is really HTML is never rendered as a page.
"""

from __future__ import annotations

import html
import json
from typing import Annotated

from airflow.sdk.exceptions import AirflowFailException
from fastapi import Depends, FastAPI, HTTPException, Response
from fastapi.responses import HTMLResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from eagle3_airflow import DAG_ID
from eagle3_airflow.airflow_internals import DagAccessEntity, SessionDep, requires_access_dag
from eagle3_airflow.plan import RunPlan, verified_plan
from eagle3_airflow.results import REPORT, RunFileRefused, list_plots, read_file, run_summary
from eagle3_airflow.run_note import figure, verdict
from eagle3_airflow.seal import SECRET_VARIABLE, Tampered, server_key

app = FastAPI(title="EAGLE-3 run report", docs_url=None, redoc_url=None, openapi_url=None)  # pages, not an API
# The page reads the run's plan from XCom as well as files of the run.
CanReadRuns = [Depends(requires_access_dag("GET", DagAccessEntity.RUN)),
               Depends(requires_access_dag("GET", DagAccessEntity.XCOM))]
# A file of the box is data: never sniffed into HTML, never allowed to run anything.
FILE_HEADERS = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "default-src 'none'; sandbox"}


def _run(session: Session, dag_id: str, run_id: str):
    from eagle3_airflow.airflow_internals import DagRun

    if dag_id != DAG_ID:
        raise HTTPException(404, f"only runs of {DAG_ID} have an EAGLE-3 report")
    dag_run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).first()
    if dag_run is None:
        raise HTTPException(404, f"no run {run_id!r} of {dag_id}")
    return dag_run


def _plan(session: Session, dag_id: str, run_id: str) -> RunPlan:
    """The run's plan, verified; 404 before validate succeeded, 409 when it does not verify (with the reason)."""
    from eagle3_airflow.airflow_internals import XComModel

    dag_run = _run(session, dag_id, run_id)
    row = session.scalars(select(XComModel).where(XComModel.dag_run_id == dag_run.id, XComModel.task_id == "validate",
                                                  XComModel.map_index == -1, XComModel.key == "plan")).first()
    if row is None:
        raise HTTPException(404, "the run has no plan (its validate task did not succeed)")
    return plan_of_run(XComModel.deserialize_value(row), dag_run)


def plan_of_run(plan_value, dag_run) -> RunPlan:
    """A run's plan as read from its XCom, verified with the key the API server reads; 409 with the reason if not."""
    key = server_key()
    if key is None:
        raise HTTPException(409, f"the Airflow Variable {SECRET_VARIABLE}, which run plans are sealed with, is "
                                 "missing: the run's plan cannot be checked, so nothing of it is read")
    try:
        return verified_plan(plan_value, dag_run, key=key)
    except Tampered as err:
        raise HTTPException(409, str(err)) from None
    except AirflowFailException as err:  # the settings file does not load
        raise HTTPException(500, str(err)) from None


def _box_read(read):
    try:
        return read()
    except RunFileRefused as err:
        raise HTTPException(403, f"refused: {err}") from None
    except Exception as err:  # the box unreachable, the command failed: say so, briefly
        raise HTTPException(502, f"reading the run's files on its box failed: {str(err)[-300:]}") from None


# The page's URL ends with a slash, so that its relative links (plots/0, report.json) stay under the run.
@app.get("/dags/{dag_id}/runs/{run_id}/", response_class=HTMLResponse, dependencies=CanReadRuns)
def report_page(dag_id: str, run_id: str, session: SessionDep) -> str:
    plan = _plan(session, dag_id, run_id)
    summary = _box_read(lambda: run_summary(plan))
    if summary is None:
        return _page(run_id, f"<p>No evaluation report in <code>{html.escape(plan.run_dir)}</code>: evaluate did not "
                             "run (nothing changed since the lineage's current drafter, or the run has not got that "
                             "far). The run's <code>report</code> task says which.</p>")
    return _page(run_id, _summary_html(summary))


@app.get("/dags/{dag_id}/runs/{run_id}/plots/{index}", dependencies=CanReadRuns)
def plot(dag_id: str, run_id: str, index: int, session: SessionDep) -> Response:
    plan = _plan(session, dag_id, run_id)
    plots = _box_read(lambda: list_plots(plan))
    if not 0 <= index < len(plots):
        raise HTTPException(404, f"the run has {len(plots)} plots")
    data = _box_read(lambda: read_file(plan, plots[index]))
    if data is None:
        raise HTTPException(404, f"{plots[index]} is gone from the run directory")
    return Response(data, media_type="image/png", headers={**FILE_HEADERS, "Cache-Control": "private, max-age=3600"})


@app.get("/dags/{dag_id}/runs/{run_id}/report.json", dependencies=CanReadRuns)
def report_json(dag_id: str, run_id: str, session: SessionDep) -> Response:
    plan = _plan(session, dag_id, run_id)
    data = _box_read(lambda: read_file(plan, REPORT))
    if data is None:
        raise HTTPException(404, "the run wrote no evaluation report")
    return Response(data, media_type="application/json", headers=FILE_HEADERS)


# -- HTML ------------------------------------------------------------------------------------------------------

Escaped = Annotated[str, "html-escaped"]


def _summary_html(summary: dict) -> Escaped:
    e = html.escape
    promotion = summary.get("promotion") if isinstance(summary.get("promotion"), dict) else {}
    parts = [f"<h2 id='verdict'>{e(verdict(summary))}</h2>"]
    if promotion.get("reason"):
        parts.append(f"<p id='reason'>{e(promotion['reason'])}</p>")
    ours = summary.get("measured_accept_length") or {}
    theirs = (promotion.get("current_before") or {}).get("accept_length") or {}
    if ours:
        rows = "".join(f"<tr><td>{e(k)}</td><td>{e(figure(value))}</td><td>{e(figure(theirs.get(k)))}</td></tr>"
                       for k, value in ours.items())
        parts.append("<table id='acceptance'><tr><th>draft length k</th><th>acceptance length</th>"
                     f"<th>current drafter</th></tr>{rows}</table>")
    states = summary.get("hidden_states") if isinstance(summary.get("hidden_states"), dict) else None
    simulated = summary.get("simulated_accept_length")
    facts = {
        "teacher-forced simulated acceptance": None if simulated is None else figure(simulated),
        "val accuracy per position": summary.get("val_acc_per_position"),
        "hidden states": states and (f"{states.get('samples')} samples: {states.get('extracted')} extracted by this "
                                     f"run, {states.get('reused')} reused from the store {states.get('store')}"),
        "drafter": summary.get("drafter"),
        "lineage's current drafter": promotion.get("current"),
        "run directory": summary.get("run_dir"),
    }
    parts.append("<dl>" + "".join(f"<dt>{e(name)}</dt><dd>{e(_text(value))}</dd>"
                                  for name, value in facts.items() if value is not None) + "</dl>")
    if summary.get("report"):
        parts.append(f"<p><a href='report.json' target='_blank'>evaluation report (JSON)</a> "
                     f"<code>{e(summary['report'])}</code></p>")
    for index, path in enumerate(summary.get("plots") or []):
        parts.append(f"<figure><img src='plots/{index}' alt='{e(path)}'><figcaption>{e(path)}</figcaption></figure>")
    return "\n".join(parts)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _page(run_id: str, body: Escaped) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>EAGLE-3 report: {html.escape(run_id)}</title>"
            "<style>body{font-family:sans-serif;margin:1.5em}img{max-width:100%}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .6em}</style></head>"
            f"<body><h1>EAGLE-3 report: {html.escape(run_id)}</h1>\n{body}\n</body></html>")
