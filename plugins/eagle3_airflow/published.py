"""A run's report, published through Airflow object storage, where the report tab reads it: the API server never
logs in to a box.

The report task (on a worker, which holds the box's key) reads the run's report files from its box through
eagle3_airflow.results (only the run's own regular files of the expected names, at most 8 MiB each) and publishes
them with the run's summary under the `reports_url` its plan carries (the settings' when validate planned the run):

    {reports_url}/{dag_id}/{run_id}/report.json        evaluate's report
                                    benchmark.json     the benchmark's, when the run benchmarked
                                    plots/000.png ...  each stage's plots
                                    summary.json       written last: what the tab shows, and which files are whole

`reports_url` is an ObjectStoragePath: a local directory by default ($AIRFLOW_HOME/eagle3-reports, which every
Airflow process of a deployment must share: a volume; under an executor whose workers share no disk the DAG file
refuses a local folder unless the settings say `reports_shared_disk`), or s3://, gs://, ... with `reports_conn_id`
(the store's provider installed in the image). The report tab reads under the settings' store as they are now: move
the store, and the runs published before stay where they were. Each file is written under a temporary name and
renamed into place, and summary.json names only files already in place, so a reader never takes a half-written
publication for a whole one; a report task cleared and run again replaces the publication file by file, its summary
last.

dag_id and run_id become one path component each, percent-encoded, dots included: no id can name '..' or a
folder of another run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from eagle3.disk.layout import BENCHMARK_REPORT, REPORT
from eagle3_airflow.results import read_files

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from eagle3_airflow.deployment import Deployment
    from eagle3_airflow.plan import RunPlan

    Store = Deployment | RunPlan  # what names a reports store: reports_url and reports_conn_id

SUMMARY = "summary.json"
# A publication keeps the reports' own file names (report.json, benchmark.json) and numbers the plots.
PUBLISHED_REPORT, PUBLISHED_BENCHMARK = PurePosixPath(REPORT).name, PurePosixPath(BENCHMARK_REPORT).name
FORMAT = 1  # of summary.json; a reader refuses another
# The only names a publication has: a summary.json that names another path (edited in the store) names nothing.
PUBLISHED_NAME = re.compile(
    rf"^({re.escape(PUBLISHED_REPORT)}|{re.escape(PUBLISHED_BENCHMARK)}|plots/[0-9]{{3,6}}\.png)$"
)


class NotPublished(Exception):
    """The run has no (whole) publication: its report task has not run yet."""


def component(value: str) -> str:
    """An id as one path component that names nothing but itself: percent-encoded, '.' too (no '..')."""
    return quote(value, safe="-_~").replace(".", "%2E") or "%00"


def reports_root(settings: Store) -> ObjectStoragePath:
    """The object-storage folder runs' reports are published under: the reports_url of the settings (the report tab),
    or of a run's plan (the report task, which publishes where the settings said when the run was validated)."""
    from airflow.sdk import ObjectStoragePath  # fsspec and friends: only when a report is published or read

    url = settings.reports_url or str(Path(os.environ.get("AIRFLOW_HOME", "~/airflow")).expanduser() / "eagle3-reports")
    return ObjectStoragePath(url, conn_id=settings.reports_conn_id)


def run_folder(settings: Store, dag_id: str, run_id: str) -> ObjectStoragePath:
    """Where the run's publication lives in the store of `settings` (the settings, or a run's plan)."""
    return reports_root(settings) / component(dag_id) / component(run_id)


def _put(path: ObjectStoragePath, data: bytes) -> None:
    """Write under a temporary name, then rename: a reader sees the old file or the new one, never a part."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    temporary.write_bytes(data)
    temporary.rename(path)


def publish(
    plan: RunPlan, summary: dict[str, Any], folder: ObjectStoragePath, log: logging.Logger | None = None
) -> dict[str, Any]:
    """Copy the run's report, benchmark and plots (those `summary` lists) from its box into `folder`, then its summary;
    return summary.json's content. Files the summary does not name (no report: nothing changed) are not read."""
    folder.mkdir(parents=True, exist_ok=True)
    reports = (
        [(REPORT, PUBLISHED_REPORT), *(((BENCHMARK_REPORT, PUBLISHED_BENCHMARK),) if summary.get("benchmark") else ())]
        if summary.get("report")
        else []
    )
    # The plots the summary listed on the box a moment ago (results.summarize: run_dir/<stage>/<name>.png).
    names = [path.removeprefix(f"{plan.run_dir}/") for path in summary.get("plots") or []]
    wanted = [name for name, _ in reports] + names
    data = read_files(plan, wanted)[0] if wanted else {}  # one manifest, one SFTP session
    files: dict[str, str] = {}
    for name, published in reports:
        content = data[name]
        if content is not None:
            _put(folder / published, content)
            files[published] = name
    plots: list[dict[str, str]] = []
    for index, name in enumerate(names):
        content = data[name]
        if content is None:  # removed since it was listed (a retention run): leave it out
            continue
        published = f"plots/{index:03d}.png"
        (folder / "plots").mkdir(parents=True, exist_ok=True)
        _put(folder / published, content)
        plots.append({"file": published, "name": name})
    manifest: dict[str, Any] = {"format": FORMAT, "summary": summary, "files": files, "plots": plots}
    _put(folder / SUMMARY, json.dumps(manifest, indent=1).encode())
    if log is not None:
        log.info("published the report: %s (%d plots, %s)", folder, len(plots), ", ".join(files) or "no report files")
    return manifest


def read_manifest(folder: ObjectStoragePath) -> dict[str, Any]:
    """summary.json of a publication; NotPublished when there is none (or it is not ours)."""
    path = folder / SUMMARY
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise NotPublished(f"nothing published in {folder}: the run's report task has not run yet") from None
    except ValueError:
        raise NotPublished(f"{path} is not JSON: run the report task again (clear it)") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("summary"), dict)
    ):
        raise NotPublished(f"{path} is not a publication this version reads: run the report task again (clear it)")
    return manifest


def read_published(folder: ObjectStoragePath, manifest: dict[str, Any], file: str) -> bytes | None:
    """A file the manifest names, of a publication's names (never another), or None when it names none such or it is
    gone."""
    if not PUBLISHED_NAME.match(file):
        return None
    named = set(manifest.get("files") or {}) | {
        plot.get("file") for plot in manifest.get("plots") or [] if isinstance(plot, dict)
    }
    if file not in named:
        return None
    try:
        return (folder / file).read_bytes()
    except FileNotFoundError:
        return None
