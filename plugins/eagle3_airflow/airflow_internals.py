"""Airflow's internals this project uses, in one place, each with why no public interface serves.

Everything else comes from Airflow's public interface: airflow.sdk (operators, sensors, Params, notifiers, XCom and
Variables inside a task, DeadlineAlert, TaskInstanceState), airflow.sdk.exceptions, and the extension points its
"Public Interface" pages list (airflow.triggers.base, airflow.listeners, airflow.plugins_manager). What is imported
here runs outside any task (the API server's report tab, the scheduler's listener), where the Task SDK's XCom and
Variable accessors do not work, and no public server-side API exists in Airflow 3.3.

Import these names from this module only, never from airflow.models or airflow.api_fastapi directly, and import this
module where the name is needed (it loads Airflow's ORM and API server packages: never at the top of a module a
task imports). tests/test_airflow_internals.py checks every name and the attributes and signatures used of each, so
an Airflow upgrade that moves or changes one fails that test, not a page or a listener in production.
"""

from __future__ import annotations

# The report tab checks the caller's right to read the DAG's runs as Airflow's own REST routes do, so that
# the auth manager (simple, or FAB roles) decides who sees a report: Airflow's FastAPI security dependencies, for
# which a plugin's fastapi_apps have no public counterpart.
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity

# The report tab's metadata-DB session for one request (a FastAPI dependency), as Airflow's own routes get theirs.
from airflow.api_fastapi.common.db.common import SessionDep

# (DagAccessEntity's companion: the dependency that checks it.)
from airflow.api_fastapi.core_api.security import requires_access_dag

# Whether a run exists, asked of the metadata DB by the report tab (a request, not a task); when a run was queued,
# asked by the lateness deadline's reference (notify.RunFirstQueuedAt, in the scheduler or API server creating the
# run: Airflow hands a custom reference a session and ids, no run). The listener gets its run from Airflow.
from airflow.models.dagrun import DagRun

# The report task's XCom, read by the listener that writes a finished run's note (in the scheduler, within the
# run's session): the Task SDK's XCom access needs a running task instance.
from airflow.models.xcom import XComModel

__all__ = ["DagAccessEntity", "DagRun", "SessionDep", "XComModel", "requires_access_dag"]
