"""Miss a DeadlineAlert the way Airflow does, then run its callback the way the triggerer does; prints the events.

Run as a script in a throwaway Airflow home (tests/airflow_env.py), never imported by a test: it opens Airflow's
metadata DB. argv[1]: the DAG's DeadlineAlert callback as JSON ({"path", "kwargs"}), as the settings make it;
argv[2] (default: running): the run's state when the scheduler sees its deadline missed.

Nothing of the context is written here: a DagRun row goes into the DB, Airflow's own Deadline.handle_miss builds
the context and queues the CallbackTrigger, and that trigger, rebuilt from its row as the triggerer rebuilds it,
calls the callback.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime, timedelta

from airflow._shared.module_loading import import_string
from airflow.models.dag import DagModel
from airflow.models.dagbundle import DagBundleModel
from airflow.models.dagrun import DagRun
from airflow.models.deadline import Deadline
from airflow.models.trigger import Trigger
from airflow.sdk import AsyncCallback
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState
from airflow.utils.types import DagRunType

DAG_ID, RUN_ID = "eagle3_drafter", "manual__2026-12-04T10:00:00+00:00"


async def events(trigger) -> list[dict]:
    return [event.payload for event in [e async for e in trigger.run()]]


def main() -> None:
    definition = json.loads(sys.argv[1])
    callback = AsyncCallback(definition["path"], kwargs=definition["kwargs"])
    state = DagRunState(sys.argv[2] if len(sys.argv) > 2 else "running")
    queued = datetime(2026, 12, 4, 10, tzinfo=UTC)
    with create_session() as session:
        session.merge(DagBundleModel(name="dags-folder"))
        session.flush()  # (the DAG row refers to its bundle's)
        session.merge(DagModel(dag_id=DAG_ID, bundle_name="dags-folder"))
        run = DagRun(
            dag_id=DAG_ID, run_id=RUN_ID, run_type=DagRunType.MANUAL, state=state, queued_at=queued, run_after=queued
        )
        session.add(run)
        session.flush()
        deadline = Deadline(
            deadline_time=queued + timedelta(hours=1),
            callback=callback,
            dagrun_id=run.id,
            deadline_alert_id=None,
            dag_id=DAG_ID,
        )
        session.add(deadline)
        session.flush()
        deadline.handle_miss(session)
        session.flush()
        row = session.get(Trigger, deadline.callback.trigger_id)
        classpath, kwargs = row.classpath, row.kwargs
    trigger = import_string(classpath)(**kwargs)
    print(json.dumps(asyncio.run(events(trigger)), default=str))


if __name__ == "__main__":
    main()
