"""The run's report in the Airflow UI: figures, promotion, and the plots, fetched from the box on demand.

A FastAPI app that plugins/eagle3_ui.py mounts in the API server under /eagle3, shown as the *EAGLE-3 report* tab
of a run of this project's DAG (an external view with destination dag_run):

  /eagle3/dags/{dag_id}/runs/{run_id}/                the page: the report task's summary, the plots inline
  /eagle3/dags/{dag_id}/runs/{run_id}/plots/{index}   one plot (PNG), read from the box
  /eagle3/dags/{dag_id}/runs/{run_id}/report.json     evaluate's whole report, read from the box

Access is Airflow's: the caller must be allowed to read the DAG's runs and their XComs (the UI's session cookie or a
bearer token).
What may be read is what the run's own XCom names: the plots the report task listed and the report it wrote,
under the run directory the validate task planned, on the run's box, through the transport every task uses.
No path comes from the request, so a caller cannot make the API server read anything else on the box.
"""

from __future__ import annotations

import base64
import html
import json
from typing import Annotated

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Response
from fastapi.responses import HTMLResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from eagle3_airflow import DAG_ID
from eagle3_airflow.plan import RunPlan
from eagle3_airflow.run_note import figure, verdict

app = FastAPI(title="EAGLE-3 run report", docs_url=None, redoc_url=None, openapi_url=None)  # pages, not an API
# The page shows the run's XCom (the report task's summary, the plan's paths) as well as files of the run.
CanReadRuns = [Depends(requires_access_dag("GET", DagAccessEntity.RUN)),
               Depends(requires_access_dag("GET", DagAccessEntity.XCOM))]
BOX_READ_TIMEOUT_S = 60


def _xcom(session: Session, dag_id: str, run_id: str, task_id: str, key: str):
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel

    if dag_id != DAG_ID:
        raise HTTPException(404, f"only runs of {DAG_ID} have an EAGLE-3 report")
    run_pk = session.scalar(select(DagRun.id).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if run_pk is None:
        raise HTTPException(404, f"no run {run_id!r} of {dag_id}")
    row = session.scalars(select(XComModel).where(XComModel.dag_run_id == run_pk, XComModel.task_id == task_id,
                                                  XComModel.map_index == -1, XComModel.key == key)).first()
    return None if row is None else XComModel.deserialize_value(row)


def _read_from_box(session: Session, dag_id: str, run_id: str, path: str) -> bytes:
    """One file of the run directory, as bytes (base64 on the box: the transport carries text)."""
    plan_dict = _xcom(session, dag_id, run_id, "validate", "plan")
    if plan_dict is None:
        raise HTTPException(404, "the run has no plan (its validate task did not succeed)")
    plan = RunPlan.from_xcom(plan_dict)
    if not path.startswith(plan.run_dir.rstrip("/") + "/"):
        raise HTTPException(404, "not a file of this run")
    result = plan.box().run(["base64", "-w", "0", path], timeout=BOX_READ_TIMEOUT_S)
    if result.returncode != 0:
        raise HTTPException(502, f"reading {path} on the box failed: {result.stderr.strip()[-300:]}")
    return base64.b64decode(result.stdout)


def _summary(session: Session, dag_id: str, run_id: str) -> dict | None:
    return _xcom(session, dag_id, run_id, "report", "return_value")


# The page's URL ends with a slash, so that its relative links (plots/0, report.json) stay under the run.
@app.get("/dags/{dag_id}/runs/{run_id}/", response_class=HTMLResponse, dependencies=CanReadRuns)
def report_page(dag_id: str, run_id: str, session: SessionDep) -> str:
    summary = _summary(session, dag_id, run_id)
    if summary is None:
        return _page(run_id, "<p>No report yet: the run's <code>report</code> task has not succeeded.</p>")
    return _page(run_id, _summary_html(summary))


@app.get("/dags/{dag_id}/runs/{run_id}/plots/{index}", dependencies=CanReadRuns)
def plot(dag_id: str, run_id: str, index: int, session: SessionDep) -> Response:
    plots = (_summary(session, dag_id, run_id) or {}).get("plots") or []
    if not 0 <= index < len(plots):
        raise HTTPException(404, f"the run's report lists {len(plots)} plots")
    return Response(_read_from_box(session, dag_id, run_id, plots[index]), media_type="image/png",
                    headers={"Cache-Control": "private, max-age=3600"})  # a finished run's plots do not change


@app.get("/dags/{dag_id}/runs/{run_id}/report.json", dependencies=CanReadRuns)
def report_json(dag_id: str, run_id: str, session: SessionDep) -> Response:
    report = (_summary(session, dag_id, run_id) or {}).get("report")
    if not report:
        raise HTTPException(404, "the run wrote no evaluation report")
    return Response(_read_from_box(session, dag_id, run_id, report), media_type="application/json")


# -- HTML ------------------------------------------------------------------------------------------------------

Escaped = Annotated[str, "html-escaped"]


def _summary_html(summary: dict) -> Escaped:
    e = html.escape
    promotion = summary.get("promotion") or {}
    parts = [f"<h2 id='verdict'>{e(verdict(summary))}</h2>"]
    if promotion.get("reason"):
        parts.append(f"<p id='reason'>{e(promotion['reason'])}</p>")
    ours = summary.get("measured_accept_length") or {}
    theirs = (promotion.get("current_before") or {}).get("accept_length") or {}
    if ours:
        rows = "".join(f"<tr><td>{e(k)}</td><td>{figure(value)}</td><td>{figure(theirs.get(k))}</td></tr>"
                       for k, value in ours.items())
        parts.append("<table id='acceptance'><tr><th>draft length k</th><th>acceptance length</th>"
                     f"<th>current drafter</th></tr>{rows}</table>")
    states = summary.get("hidden_states")
    simulated = summary.get("simulated_accept_length")
    facts = {
        "teacher-forced simulated acceptance": None if simulated is None else f"{simulated:.3f}",
        "val accuracy per position": summary.get("val_acc_per_position"),
        "hidden states": states and (f"{states['samples']} samples: {states['extracted']} extracted by this run, "
                                     f"{states['reused']} reused from the store {states['store']}"),
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
