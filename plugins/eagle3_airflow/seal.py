"""Seals on what tasks hand each other through XCom: the run plan (with its config's digest) and the approval.

XCom is not the DAG's own memory: whoever may trigger the DAG (the USER role of Airflow's auth managers) may also
PATCH any XCom of its runs. So the validate task seals what it planned, HMAC-SHA256 over the canonical JSON of the
plan and the run it belongs to (DAG id and run id), and every task checks the seal before it uses the plan. An edit
after validate, or another run's sealed plan pasted in, fails the next task with a message that says so. The
approval task seals who approved which proposal the same way, for the promote task.

The key is a deployment secret: the Airflow Variable SECRET_VARIABLE ("eagle3_plan_secret"; the name has "secret" in
it, so Airflow masks its value in task logs and in the UI). Only the OP and ADMIN roles may read Variables; USER may
not. Tasks read it through the Task SDK (so a secrets backend, or AIRFLOW_VAR_EAGLE3_PLAN_SECRET in the environment,
may supply it instead); the API server's report tab through Airflow's models. The first validate task of a
deployment that has none makes one (32 random bytes) and stores it; deleting the Variable invalidates the seal of
every run in flight (their next task fails and says to trigger a new run), which is how the key is rotated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from airflow.sdk.exceptions import AirflowFailException

SECRET_VARIABLE = "eagle3_plan_secret"
TRIGGER_AGAIN = ("Nothing was run on the box. Trigger a new run (or clear this run's `validate` task with its "
                 "downstream tasks: validate plans the run again from its trigger parameters, which XCom edits "
                 "cannot reach).")


class Tampered(AirflowFailException):
    """Something read from XCom is not what this run's own task wrote there: the task fails without a retry."""


@dataclass(frozen=True)
class RunRef:
    """The run a seal belongs to."""

    dag_id: str
    run_id: str

    @classmethod
    def of(cls, dag_run) -> RunRef:
        """From a context's dag_run (the Task SDK's) or a DagRun row (the API server's)."""
        if dag_run is None:
            raise Tampered("no DAG run in the task's context to check the run plan's seal against")
        return cls(str(dag_run.dag_id), str(dag_run.run_id))


def canonical(value) -> bytes:
    """One byte string per JSON value: sorted keys, no spaces, no NaN (XCom stores JSON, so what comes back
    serializes the same)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def digest(value) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def seal(kind: str, body: dict, run: RunRef, key: bytes) -> str:
    """`kind` keeps a plan's seal from passing for an approval's, and the run keeps one run's from passing for
    another's."""
    message = canonical({"kind": kind, "dag_id": run.dag_id, "run_id": run.run_id, "body": body})
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def is_sealed(kind: str, body: dict, run: RunRef, key: bytes, claimed) -> bool:
    if not isinstance(claimed, str):
        return False
    try:
        expected = seal(kind, body, run, key)
    except (TypeError, ValueError):  # not JSON (a NaN, an object): nothing validate wrote
        return False
    return hmac.compare_digest(expected, claimed)


def task_key(create: bool = False) -> bytes:
    """The sealing key, read by a task through the Task SDK; `create` (the validate task): make and store one if
    the deployment has none yet."""
    from airflow.sdk import Variable

    value = Variable.get(SECRET_VARIABLE, default=None)
    if not value and create:
        Variable.set(SECRET_VARIABLE, secrets.token_urlsafe(32),
                     description="eagle3-airflow: the key run plans and approvals are sealed with "
                     "(eagle3_airflow/seal.py). Deleting it fails every run in flight at its next task.")
        value = Variable.get(SECRET_VARIABLE, default=None)  # another validate may have stored its own first
    if not value:
        raise Tampered(f"the Airflow Variable {SECRET_VARIABLE}, which run plans are sealed with, is missing (deleted "
                       "since this run was validated?), so the plan cannot be checked. " + TRIGGER_AGAIN)
    return value.encode()
