"""Telling someone: one mail per failure (a task that failed for good, or a run failed otherwise: timed out,
marked failed), and one when a run is late.

Configured in the settings file's `notify` (eagle3_airflow/deployment.py; docs/deployment.md), never by a trigger.
Airflow calls these as the DAG's on_failure_callback, every task's on_failure_callback (no retry left; retries go
by silently) and, with `notify.late_after_h`, a DeadlineAlert on the run (RunFirstQueuedAt: that long after it was
first queued). A message names the run, the task and its try, the box, the task log's URL (on [api] base_url), and
the error (a remote stage's names the job log on the box and its last lines); nothing else (no params, no
environment).

A mail goes through SmtpNotifier and the deployment's SMTP connection to `notify.to`; each other channel is an
Airflow notifier class in `notify.notifiers`, with its keyword arguments, e.g.

    {"class": "airflow.providers.slack.notifications.slack.SlackNotifier",
     "kwargs": {"slack_conn_id": "slack_api_default", "channel": "#eagle3", "text": "*{subject}*\\n```{body}```"}}

`{subject}`, `{body}` and `{body_html}` (escaped, in <pre>) in the strings among the kwargs, nested ones too, are
replaced in one plain pass, never by str.format or Jinja, and notifiers are called through notify(), not __call__:
no template in a log line is evaluated. The settings check each class and its kwargs when read. One channel that
fails is logged (its class and the subject, never its kwargs); the others still go.
"""

from __future__ import annotations

import asyncio
import html
import logging
import re
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseNotifier

if TYPE_CHECKING:
    # airflow.sdk exports these, but its stub (airflow/sdk/__init__.pyi, Task SDK 1.3.2) leaves them out: the type
    # checker reads them from the modules airflow.sdk imports them from.
    from airflow.sdk import Context
    from airflow.sdk.definitions.callback import AsyncCallback
    from airflow.sdk.definitions.deadline import BaseDeadlineReference, DeadlineAlert
    from jinja2 import Environment
    from sqlalchemy.orm import Session

    from eagle3_airflow.deployment import Deployment
else:
    from airflow.sdk import AsyncCallback, BaseDeadlineReference, DeadlineAlert

log = logging.getLogger(__name__)

MAX_BODY_LINES = 60
MARKERS = re.compile(r"\{(subject|body|body_html)\}")


def _describe_exception(context: Context) -> str:
    error = context.get("exception")
    if error is None:
        return "(no error message)"
    lines = f"{type(error).__name__}: {error}".splitlines()
    return "\n".join(lines[-MAX_BODY_LINES:])


def task_failure_message(context: Context) -> tuple[str, str]:
    ti = context["ti"]
    task = context.get("task")
    run_id = getattr(context.get("dag_run"), "run_id", None) or context.get("run_id")
    task_name = ti.task_id if getattr(ti, "map_index", -1) in (-1, None) else f"{ti.task_id}[{ti.map_index}]"
    try:
        box = getattr(task, "conn_id", None)  # the remote stages know their box
    except Exception:  # noqa: BLE001 - a plan that did not render: the box is unknown, the mail still goes
        box = None
    subject = f"[eagle3] {ti.dag_id}: {task_name} failed in run {run_id}"
    log_url = getattr(ti, "log_url", None)  # absolute: the Task SDK builds it on [api] base_url
    body = "\n".join(
        [
            f"Run:   {ti.dag_id} / {run_id}",
            f"Task:  {task_name}, try {ti.try_number} (no retries left)",
            f"Box:   {box or '(not a box task)'}",
            *([f"Log:   {log_url}"] if isinstance(log_url, str) else []),
            "",
            _describe_exception(context),
            "",
            "Clear the task in the Airflow UI to resume the stage where it stopped.",
        ]
    )
    return subject, body


def run_failure_message(context: Context) -> tuple[str, str]:
    dag_run = context.get("dag_run")
    dag_id = getattr(context.get("dag"), "dag_id", None) or getattr(dag_run, "dag_id", "?")
    run_id = getattr(dag_run, "run_id", None) or context.get("run_id")
    subject = f"[eagle3] {dag_id}: run {run_id} failed"
    body = "\n".join(
        [
            f"Run:    {dag_id} / {run_id}",
            f"Reason: {context.get('reason') or 'a task failed'}",
            "",
            "Clear the failed task in the Airflow UI to resume the run where it stopped.",
        ]
    )
    return subject, body


# The run-failure reason Airflow gives when a task failed the run: that task's own mail (box, log, last lines) has
# gone already, so the run's would be a second mail about one failure.
TASK_FAILURE = "task_failure"


class FailureNotifier(BaseNotifier):
    """Builds the failure message of a task or a run and sends it through every configured channel."""

    template_fields = ()

    def __init__(
        self,
        *,
        scope: str,
        smtp_conn_id: str | None,
        to: list[str],
        from_email: str | None,
        notifiers: list[dict[str, Any]],
    ):
        super().__init__()
        self.scope = scope  # "task" or "run"
        self.smtp_conn_id = smtp_conn_id
        self.to = list(to)
        self.from_email = from_email
        self.notifiers = list(notifiers)

    def render_template_fields(self, context: Context, jinja_env: Environment | None = None) -> None:
        """Nothing here is a template. (BaseNotifier's own asks the DAG for a Jinja environment, which a DAG-level
        callback's serialized DAG lacks in Airflow 3.3: the run-failure mail was never sent.)"""

    def notify(self, context: Context) -> None:
        if self.scope == "run" and context.get("reason") == TASK_FAILURE:
            log.info("run failed by a task: that task's failure mail was the one sent")
            return
        subject, body = (task_failure_message if self.scope == "task" else run_failure_message)(context)
        send(subject, body, context, self.smtp_conn_id, self.to, self.from_email, self.notifiers)


def fill(value: Any, message: dict[str, str]) -> Any:  # any JSON value
    """A notifier's kwarg from the settings with each marker in its strings replaced by the message's text, in one
    pass (a `{body}` in the subject stays as written)."""
    if isinstance(value, str):
        return MARKERS.sub(lambda found: message[found.group(1)], value)
    if isinstance(value, list):
        return [fill(item, message) for item in value]
    if isinstance(value, dict):
        return {key: fill(item, message) for key, item in value.items()}
    return value


def send(
    subject: str,
    body: str,
    context: Any,
    smtp_conn_id: str | None,
    to: list[str],
    from_email: str | None,
    notifiers: list[dict[str, Any]],
) -> None:
    """Every channel gets the message: a mail to `to`, and each of the settings' `notify.notifiers` ({"class": dotted
    path, "kwargs": {...}}, NotifySettings.kwargs()). One that fails is logged and does not stop the others.
    `context`: Airflow's, handed on to each notifier: a task's or a run's Context, or late_run's dict."""
    html_body = f"<pre>{html.escape(body)}</pre>"
    if to:
        from airflow.providers.smtp.notifications.smtp import SmtpNotifier

        # Every field given: SmtpNotifier renders the ones left None (from_email included) as templates, asking the
        # DAG for a Jinja environment that a DAG-level callback's serialized DAG does not have.
        mail = SmtpNotifier(
            to=to,
            from_email=from_email or _connection_sender(smtp_conn_id),
            subject=subject,
            smtp_conn_id=smtp_conn_id,
            html_content=html_body,
        )
        try:
            mail.notify(context)  # not mail(context): that would render subject and body as Jinja first
            log.info("sent '%s' to %s", subject, to)
        except Exception:
            log.exception("could not send '%s' by SMTP (connection %s)", subject, smtp_conn_id)
    if not notifiers:
        return
    from airflow.sdk.module_loading import import_string

    message = {"subject": subject, "body": body, "body_html": html_body}
    for index, entry in enumerate(notifiers):
        path = entry["class"]
        try:
            notifier = import_string(path)(**fill(entry.get("kwargs") or {}, message))
            notifier.notify(context)  # not notifier(context): that would render its fields as Jinja first
            log.info("sent '%s' through %s", subject, path)
        except Exception:  # its kwargs are not logged: a token or a webhook URL may be among them
            log.exception("notifier %s (notify.notifiers[%d]) failed for '%s'", path, index, subject)


def _connection_sender(smtp_conn_id: str | None) -> str:
    """The SMTP connection's from_email, else eagle3-airflow@<this host>."""
    import socket

    from airflow.sdk import BaseHook

    try:
        sender = BaseHook.get_connection(smtp_conn_id or "smtp_default").extra_dejson.get("from_email")
    except Exception:  # noqa: BLE001 - no such connection: the send below says so
        sender = None
    return sender or f"eagle3-airflow@{socket.getfqdn()}"


async def late_run(
    smtp_conn_id: str | None,
    to: list[str],
    from_email: str | None,
    late_after_h: float,
    notifiers: list[dict[str, Any]] | None = None,
    context: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """The DeadlineAlert's callback (it runs in the triggerer): the run is late, if it is still running. Airflow
    misses a deadline whatever the run's state (it drops a deadline only when its run succeeds in time), so a run that
    failed, or ended after the deadline but before the scheduler noticed, is not mailed as late. (A deadline stored
    before `notify.notifiers` carries `callables` instead, which is ignored: its mail still goes.)

    Airflow 3.3's Deadline.handle_miss hands it {"dag_run": <the run as the REST API returns it>, "deadline": ...}:
    a dict, whose run id is `dag_run_id` (DAGRunResponse's name for it), not `run_id`, and whose `state` is the run's
    when the scheduler saw the deadline missed."""
    context = context or {}
    dag_run = context.get("dag_run") or {}
    if isinstance(dag_run, dict):
        run_id, dag_id, state = (
            dag_run.get("dag_run_id") or dag_run.get("run_id"),
            dag_run.get("dag_id"),
            dag_run.get("state"),
        )
    else:  # (a DagRun, should a later Airflow pass the full context)
        run_id, dag_id, state = (
            getattr(dag_run, "run_id", None),
            getattr(dag_run, "dag_id", None),
            getattr(dag_run, "state", None),
        )
    if state in ENDED_RUN_STATES:
        log.info("run %s / %s is %s, not late: no lateness message", dag_id, run_id, state)
        return
    subject = f"[eagle3] {dag_id or 'eagle3_drafter'}: run {run_id} is late"
    body = (
        f"Run {dag_id} / {run_id} is still running {timedelta(hours=late_after_h)} after it was first queued "
        "(notify.late_after_h in the DAG settings). It may be waiting for a box, GPUs or disk, or a stage is slow."
    )
    await asyncio.to_thread(send, subject, body, context, smtp_conn_id, to, from_email, notifiers or [])


ENDED_RUN_STATES = ("success", "failed")


class RunFirstQueuedAt(BaseDeadlineReference):
    """When the run was first queued: the lateness deadline's reference. Airflow's own DAGRUN_QUEUED_AT moves with
    every clear, and in Airflow 3.3 that move fails the clear itself (HTTP 500 inside the deadline:
    apache/airflow#70368, docs/deployment.md); Airflow moves no custom reference. Registered by the plugin
    (plugins/eagle3_ui.py); a run created running (`airflow dags test`) is never queued and has no deadline."""

    required_kwargs = {"dag_id", "run_id"}

    def _evaluate_with(self, *, session: Session, dag_id: str, run_id: str, **_: Any) -> datetime | None:
        from sqlalchemy import select

        from eagle3_airflow.airflow_internals import DagRun

        return session.scalar(select(DagRun.queued_at).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))


# -- what the DAG file hands Airflow, from the settings' `notify` --------------------------------------------------
def run_failure_callbacks(settings: Deployment) -> list[FailureNotifier]:
    """The DAG's on_failure_callback: the run failed."""
    if settings.notify is None:
        return []
    return [FailureNotifier(scope="run", **settings.notify.kwargs())]


def task_failure_callbacks(settings: Deployment) -> list[FailureNotifier]:
    """Every task's on_failure_callback: it failed with no retry left (a retry itself is silent)."""
    if settings.notify is None:
        return []
    return [FailureNotifier(scope="task", **settings.notify.kwargs())]


def deadline(settings: Deployment) -> DeadlineAlert | None:
    """A DeadlineAlert that warns when a run is still running `notify.late_after_h` after it was first queued, or
    None."""
    if settings.notify is None or settings.notify.late_after_h is None:
        return None
    return DeadlineAlert(
        reference=RunFirstQueuedAt(),
        interval=timedelta(hours=settings.notify.late_after_h),
        callback=AsyncCallback(
            "eagle3_airflow.notify.late_run",
            kwargs={**settings.notify.kwargs(), "late_after_h": settings.notify.late_after_h},
        ),
    )
