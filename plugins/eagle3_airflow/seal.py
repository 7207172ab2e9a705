"""Seals on what tasks hand each other through XCom: the run plan (the run config inside it) and the approval.

XCom is not the DAG's own memory: whoever may trigger the DAG (the USER role of Airflow's auth managers) may also
PATCH any XCom of its runs. So the validate task seals what it planned, HMAC-SHA256 over the canonical JSON of the
plan and the run it belongs to (DAG id and run id), and every task checks the seal before it uses the plan. An edit
after validate, or another run's sealed plan pasted in, fails the next task with a message that says so. The
approval task seals who approved which proposal the same way, for the promote task.

The key is a deployment secret, set when the deployment is made and never by a task: the Airflow Variable
SECRET_VARIABLE ("eagle3_plan_secret") as the environment variable KEY_ENV (docker-compose.yaml hands .env's to the
Celery worker only), or in the secrets backend the deployment configures. Tasks read it from those two sources alone
(deployment_key), never from Airflow's metadata database: there the OP role may write Variables, and whoever writes
the key can seal an edited plan or a forged approval. Without a key every task fails closed, naming the variable and
how to set it. Changing the key rotates it: every run in flight fails at its next task (its seals no longer hold)
and says to trigger a new run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any, Protocol

from airflow.sdk.exceptions import AirflowFailException

SECRET_VARIABLE = "eagle3_plan_secret"
KEY_ENV = "AIRFLOW_VAR_EAGLE3_PLAN_SECRET"  # the Variable in the environment, where Airflow's secrets backends look
MIN_KEY_CHARS = 32  # what `secrets.token_urlsafe(32)` makes has 43
# Where the key may come from, besides the secrets backend the deployment configures ([secrets] backend, or [workers]
# secrets_backend on a worker), which Airflow puts before these. An allowlist: Airflow's own search path would go on
# to the metadata database (through the Execution API on a worker), which the OP role writes.
KEY_SOURCES = ["airflow.secrets.environment_variables.EnvironmentVariablesBackend"]
MAKE_A_KEY = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
TRIGGER_AGAIN = (
    "Nothing was run on the box. Trigger a new run (or clear this run's `validate` task with its "
    "downstream tasks: validate plans the run again from its trigger parameters, which XCom edits "
    "cannot reach)."
)


class Tampered(AirflowFailException):
    """Something read from XCom is not what this run's own task wrote there: the task fails without a retry."""


class NoSealingKey(AirflowFailException):
    """The deployment sets no usable key: no task can seal or check anything, and retrying cannot change that."""


class RunIds(Protocol):
    """What names a run: a context's dag_run (the Task SDK's), a DagRun row (the API server's), a RunRef."""

    @property
    def dag_id(self) -> str: ...

    @property
    def run_id(self) -> str: ...


@dataclass(frozen=True)
class RunRef:
    """The run a seal belongs to."""

    dag_id: str
    run_id: str

    @classmethod
    def of(cls, dag_run: RunIds | None) -> RunRef:
        """From a context's dag_run (the Task SDK's) or a DagRun row (the API server's)."""
        if dag_run is None:
            raise Tampered("no DAG run in the task's context to check the run plan's seal against")
        return cls(str(dag_run.dag_id), str(dag_run.run_id))


def canonical(value: Any) -> bytes:  # any JSON value
    """One byte string per JSON value: sorted keys, no spaces, no NaN (XCom stores JSON, so what comes back
    serializes the same)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def seal(kind: str, body: dict[str, Any], run: RunRef, key: bytes) -> str:
    """`kind` keeps a plan's seal from passing for an approval's, and the run keeps one run's from passing for
    another's."""
    message = canonical({"kind": kind, "dag_id": run.dag_id, "run_id": run.run_id, "body": body})
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def is_sealed(kind: str, body: dict[str, Any], run: RunRef, key: bytes, claimed: object) -> bool:
    if not isinstance(claimed, str):
        return False
    try:
        expected = seal(kind, body, run, key)
    except (TypeError, ValueError):  # not JSON (a NaN, an object): nothing validate wrote
        return False
    return hmac.compare_digest(expected, claimed)


def deployment_key() -> str | None:
    """The key as the deployment set it: from its secrets backend, else from KEY_ENV; None when neither has one.
    Airflow's own loader builds the backends (the configured one first), so a Vault or AWS Secrets Manager backend
    works as it does for connections; a backend that cannot be reached raises, and the task retries."""
    from airflow.sdk.configuration import ensure_secrets_loaded

    for backend in ensure_secrets_loaded(default_backends=KEY_SOURCES):
        value: str | None = backend.get_variable(key=SECRET_VARIABLE)
        if value:
            return value
    return None


def task_key() -> bytes:
    """The sealing key, read by a task (deployment_key); fails the task, naming how to set the key, when the
    deployment has none or a short one. No task ever makes one: it could only store it where the OP role may write
    it too."""
    from airflow.sdk.log import mask_secret

    value = deployment_key()
    if not value:
        raise NoSealingKey(
            f"no key to seal run plans with: set the Airflow Variable {SECRET_VARIABLE} in the deployment, as "
            f"{KEY_ENV} in the Airflow workers' environment (docker-compose: in .env, then `docker-compose up -d`) "
            f"or in its secrets backend; make one with {MAKE_A_KEY}. A Variable stored in Airflow's database is not "
            "read: the OP role may write those. Nothing was run on the box; trigger the run again once it is set."
        )
    mask_secret(value, SECRET_VARIABLE)  # a log line that quotes it shows ***, as for any Variable read
    if len(value) < MIN_KEY_CHARS:
        raise NoSealingKey(
            f"the Airflow Variable {SECRET_VARIABLE} (the key run plans are sealed with; {KEY_ENV}, or the secrets "
            f"backend) has {len(value)} characters; a guessable key lets anyone seal an edited plan. Set one of at "
            f"least {MIN_KEY_CHARS} random characters: {MAKE_A_KEY}. Nothing was run on the box."
        )
    return value.encode()
