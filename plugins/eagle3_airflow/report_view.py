"""The run's report in the Airflow UI: figures, promotion, and the plots, as the run's report task published them.

A FastAPI app that plugins/eagle3_ui.py mounts in the API server under /eagle3, shown as the *EAGLE-3 report* tab
of a run (an external view with destination dag_run):

  /eagle3/dags/{dag_id}/runs/{run_id}/                the page: the run's summary, the plots inline
  /eagle3/dags/{dag_id}/runs/{run_id}/plots/{index}   one plot (PNG)
  /eagle3/dags/{dag_id}/runs/{run_id}/report.json     evaluate's whole report

Everything comes from the run's publication in Airflow object storage (eagle3_airflow.published: the settings'
reports_url), which the report task wrote from the box's files. The API server holds no box key and opens no SSH
session: a box that is down, or a deployment whose API server cannot reach it, changes nothing here.
Access is Airflow's: the caller must be allowed to read the DAG's runs (the UI's session cookie or a bearer token),
and the run must exist. No path comes from the request: the run's folder is derived from its ids (each one
percent-encoded path component), and a file is served only if the run's summary.json names it. Files go out with
nosniff and a content security policy that runs nothing: a "plot" that is really HTML is never rendered as a page.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Response
from fastapi.responses import HTMLResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from eagle3_airflow.airflow_internals import DagAccessEntity, SessionDep, requires_access_dag
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import ParamsError
from eagle3_airflow.pools import is_drafter_dag
from eagle3_airflow.published import PUBLISHED_REPORT, NotPublished, read_manifest, read_published, run_folder
from eagle3_airflow.run_note import (
    BESIDE_MEASURED,
    PUBLIC_SET_COLUMNS,
    beside_measured,
    figure,
    public_set_rows,
    verdict,
)

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

app = FastAPI(title="EAGLE-3 run report", docs_url=None, redoc_url=None, openapi_url=None)  # pages, not an API
CanReadRuns = [Depends(requires_access_dag("GET", DagAccessEntity.RUN))]
# A published file is data: never sniffed into HTML, never allowed to run anything.
FILE_HEADERS = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "default-src 'none'; sandbox"}


def _check_run_exists(session: Session, dag_id: str, run_id: str) -> None:
    from eagle3_airflow.airflow_internals import DagRun

    if session.scalars(select(DagRun.id).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).first() is None:
        raise HTTPException(404, f"no run {run_id!r} of {dag_id}")


def _failed_tasks(session: Session, dag_id: str, run_id: str) -> list[str]:
    """The run's failed tasks (`extract[2]` for a mapped one), in task order."""
    from airflow.sdk import TaskInstanceState

    from eagle3_airflow.airflow_internals import DagRun

    dag_run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).first()
    if dag_run is None:
        return []
    # airflow.sdk's TaskInstanceState, the public one: another str enum than the ORM's that get_task_instances names,
    # of the same values, which the query compares as strings.
    tis = dag_run.get_task_instances(state=[TaskInstanceState.FAILED], session=session)  # type: ignore[list-item]
    return sorted(ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]" for ti in tis)


def _unpublished_html(session: Session | None, dag_id: str, run_id: str, why: str) -> Escaped:
    """What the tab says of a run with no report: another DAG's run (Airflow shows the tab on every run), one that
    failed before its report (where), or one whose report task has not run yet (`why`)."""
    e = html.escape
    if not is_drafter_dag(dag_id):
        return (
            f"<p id='unpublished'>{e(dag_id)} is not an EAGLE-3 drafter DAG: its runs have no EAGLE-3 report "
            "(Airflow shows this tab on every DAG's runs).</p>"
        )
    failed = _failed_tasks(session, dag_id, run_id) if session is not None else []
    if failed:
        return (
            f"<p id='failed'>The run failed at {e(', '.join(failed))}, before its report was written. The task's "
            "log says why; clear the failed task to resume the stage where it stopped.</p>"
        )
    return f"<p id='unpublished'>{e(why)}.</p>"


def publication(session: Session | None, dag_id: str, run_id: str) -> tuple[ObjectStoragePath, dict[str, Any]]:
    """(folder, manifest) of a run's publication; 404 with the reason when there is none, 500 when the settings
    file does not load, 502 when the store cannot be read."""
    if session is not None:
        _check_run_exists(session, dag_id, run_id)
    try:
        folder = run_folder(Deployment.from_env(), dag_id, run_id)
    except ParamsError as err:
        raise HTTPException(500, str(err)) from None
    try:
        return folder, read_manifest(folder)
    except NotPublished as err:
        raise HTTPException(404, str(err)) from None
    except OSError as err:  # the store unreachable, permissions: say so, briefly
        raise HTTPException(502, f"reading the run's report from {folder} failed: {str(err)[-300:]}") from None


def _read(folder: ObjectStoragePath, manifest: dict[str, Any], file: str | None, missing: str) -> bytes:
    try:
        data = read_published(folder, manifest, file) if file else None
    except OSError as err:
        raise HTTPException(502, f"reading {file} from {folder} failed: {str(err)[-300:]}") from None
    if data is None:
        raise HTTPException(404, missing)
    return data


# The page's URL ends with a slash, so that its relative links (plots/0, report.json) stay under the run.
@app.get("/dags/{dag_id}/runs/{run_id}/", response_class=HTMLResponse, dependencies=CanReadRuns)
def report_page(dag_id: str, run_id: str, session: SessionDep) -> str:
    try:
        _, manifest = publication(session, dag_id, run_id)
    except HTTPException as err:
        if err.status_code != 404:
            raise
        return _page(run_id, _unpublished_html(session, dag_id, run_id, err.detail))
    return _page(run_id, _summary_html(manifest["summary"], manifest))


@app.get("/dags/{dag_id}/runs/{run_id}/plots/{index}", dependencies=CanReadRuns)
def plot(dag_id: str, run_id: str, index: int, session: SessionDep) -> Response:
    folder, manifest = publication(session, dag_id, run_id)
    plots = manifest.get("plots") or []
    file = plots[index].get("file") if 0 <= index < len(plots) and isinstance(plots[index], dict) else None
    data = _read(folder, manifest, file, f"the run published {len(plots)} plots, no plot {index}")
    return Response(data, media_type="image/png", headers={**FILE_HEADERS, "Cache-Control": "private, max-age=3600"})


@app.get("/dags/{dag_id}/runs/{run_id}/report.json", dependencies=CanReadRuns)
def report_json(dag_id: str, run_id: str, session: SessionDep) -> Response:
    folder, manifest = publication(session, dag_id, run_id)
    data = _read(folder, manifest, PUBLISHED_REPORT, "the run published no evaluation report")
    return Response(data, media_type="application/json", headers=FILE_HEADERS)


# -- HTML ------------------------------------------------------------------------------------------------------

Escaped = Annotated[str, "html-escaped"]


# summary.json's (eagle3_airflow.published): JSON, each value checked or escaped where it is shown.
def _summary_html(summary: dict[str, Any], manifest: dict[str, Any]) -> Escaped:
    e = html.escape
    promotion: dict[str, Any] = summary["promotion"] if isinstance(summary.get("promotion"), dict) else {}
    parts = [f"<h2 id='verdict'>{e(verdict(summary))}</h2>"]
    if promotion.get("reason"):
        parts.append(f"<p id='reason'>{e(promotion['reason'])}</p>")
    ours = summary.get("measured_accept_length") or {}
    theirs = (promotion.get("current_before") or {}).get("accept_length") or {}
    if ours:
        rows = "".join(
            f"<tr><td>{e(k)}</td><td>{e(figure(value))}</td><td>{e(figure(theirs.get(k)))}</td>"
            + "".join(f"<td>{e(cell)}</td>" for cell in beside_measured(summary, k))
            + "</tr>"
            for k, value in ours.items()
        )
        parts.append(
            "<table id='acceptance'><tr><th>draft length k</th><th>acceptance length</th>"
            "<th>current drafter</th>"
            + "".join(f"<th>{e(name)}</th>" for name in BESIDE_MEASURED)
            + f"</tr>{rows}</table>"
        )
    public = public_set_rows(summary)
    if public:
        rows = "".join("<tr>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>" for row in public)
        parts.append(
            "<table id='public-sets'><tr><th>public set</th>"
            + "".join(f"<th>{e(name)}</th>" for name in PUBLIC_SET_COLUMNS)
            + f"</tr>{rows}</table>"
        )
    states = summary["hidden_states"] if isinstance(summary.get("hidden_states"), dict) else None
    facts = {
        "val accuracy per position": summary.get("val_acc_per_position"),
        "hidden states": states
        and (
            f"{states.get('samples')} samples: {states.get('extracted')} extracted by this "
            f"run, {states.get('reused')} reused from the store {states.get('store')}"
        ),
        "drafter": summary.get("drafter"),
        "lineage's current drafter": promotion.get("current"),
        "run directory": summary.get("run_dir"),
    }
    parts.append(
        "<dl>"
        + "".join(f"<dt>{e(name)}</dt><dd>{e(_text(value))}</dd>" for name, value in facts.items() if value is not None)
        + "</dl>"
    )
    if PUBLISHED_REPORT in (manifest.get("files") or {}):
        parts.append(
            f"<p><a href='report.json' target='_blank'>evaluation report (JSON)</a> "
            f"<code>{e(summary['report'])}</code></p>"
        )
    for index, published in enumerate(manifest.get("plots") or []):
        name = _text(published.get("name") if isinstance(published, dict) else published)
        parts.append(f"<figure><img src='plots/{index}' alt='{e(name)}'><figcaption>{e(name)}</figcaption></figure>")
    return "\n".join(parts)


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _page(run_id: str, body: Escaped) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>EAGLE-3 report: {html.escape(run_id)}</title>"
        "<style>body{font-family:sans-serif;margin:1.5em}img{max-width:100%}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .6em}</style></head>"
        f"<body><h1>EAGLE-3 report: {html.escape(run_id)}</h1>\n{body}\n</body></html>"
    )
