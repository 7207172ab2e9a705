"""The Airflow plugin of eagle3-airflow: the run's note, its report tab and the lateness deadline's reference.

- listeners: eagle3_airflow.run_note, which writes each finished run's summary as the run's note;
- deadline_references: eagle3_airflow.notify.RunFirstQueuedAt, the lateness alert's reference (notify.late_after_h),
  which the scheduler and the API server look up here when they create a run;
- fastapi_apps + external_views: eagle3_airflow.report_view under /eagle3, shown as the *EAGLE-3 report* tab of
  every run (Airflow 3.3's external views cannot be limited to some DAGs: another DAG's run says it has no EAGLE-3
  report, and a drafter run that failed before its report says at which task).

Airflow imports every file of the plugins folder; plugins/.airflowignore keeps it out of eagle3_airflow/, which
the DAG imports as a package.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from eagle3_airflow import run_note
from eagle3_airflow.notify import RunFirstQueuedAt


class Eagle3Plugin(AirflowPlugin):
    name = "eagle3"
    listeners = [run_note]
    deadline_references = [RunFirstQueuedAt]

    @property
    def fastapi_apps(self):  # imported by the API server only: the scheduler and workers never serve it
        from eagle3_airflow.report_view import app

        return [{"app": app, "url_prefix": "/eagle3", "name": "EAGLE-3 run report"}]

    external_views = [
        {
            "name": "EAGLE-3 report",
            "href": "/eagle3/dags/{DAG_ID}/runs/{RUN_ID}/",
            "destination": "dag_run",
            "url_route": "eagle3_report",
        }
    ]
