"""Failure and lateness notifications, received by a real SMTP server on loopback (aiosmtpd), sent through the smtp
provider's SmtpNotifier and an Airflow SMTP connection, and by the settings' notify.notifiers: Airflow notifier
classes (here, ones defined in this module) that get the message through markers in their kwargs."""

from __future__ import annotations

import asyncio
import email
import html
import json
import logging
import socket
import subprocess
import sys
from email.message import Message
from types import SimpleNamespace
from typing import ClassVar

import pytest
from airflow.sdk import BaseNotifier

from tests.airflow_env import AIRFLOW, REPO, airflow_env, migrated_airflow_home
from tests.conftest import CONTEXT
from tests.dagruns import WORKER_SECRETS, settings_env


class Inbox:
    """The messages a loopback SMTP server received."""

    def __init__(self):
        self.messages: list[Message] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's handler protocol
        self.messages.append(email.message_from_bytes(envelope.original_content))
        return "250 OK"

    def bodies(self) -> list[str]:
        """Each message's text, as a reader sees it (the mail is HTML: <pre> and escaped characters)."""
        return [
            html.unescape(part.get_payload(decode=True).decode())
            for message in self.messages
            for part in message.walk()
            if part.get_content_type() == "text/html"
        ]


@pytest.fixture
def smtp_server(monkeypatch):
    """(inbox, connection json) of an SMTP server on 127.0.0.1, plain, no login."""
    from aiosmtpd.controller import Controller

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    connection = json.dumps(
        {
            "conn_type": "smtp",
            "host": "127.0.0.1",
            "port": port,
            "extra": {
                "disable_tls": True,
                "disable_ssl": True,
                "from_email": "airflow@example.com",
                "timeout": 10,
                "retry_limit": 1,
            },
        }
    )
    monkeypatch.setenv("AIRFLOW_CONN_SMTP_TEST", connection)
    yield inbox, connection
    controller.stop()


NOTIFY = {"to": ["oncall@example.com"], "smtp_conn_id": "smtp_test"}


@pytest.mark.slow
def test_a_stage_that_failed_for_good_mails_its_run_task_box_log_path_and_last_lines(smtp_server, plan):
    """The remote-job operator's failure (exit code, box, try, job log path, log tail) reaches the on-call person.
    A log line that looks like a Jinja template arrives as written, not evaluated."""
    from types import SimpleNamespace

    from eagle3_airflow.notify import FailureNotifier
    from eagle3_airflow.remote_job import RemoteJobOperator

    inbox, _ = smtp_server
    operator = RemoteJobOperator(task_id="train", stage="train", plan=plan)
    failed = {
        "status": "failed",
        "key": "train",
        "reason": "exited 1",
        "state": {"exit_code": 1, "try": 3, "log": "/data/eagle3/runs/r/jobs/train/log"},
        "log_tail": ["step 812/4000 loss 2.31", "RuntimeError: NCCL timeout {{ 7 * 7 }}"],
    }
    with pytest.raises(Exception) as error:
        operator.execute_complete(CONTEXT, failed)
    # The context Airflow hands an on_failure_callback, with what this message reads of it.
    log_url = "https://airflow.example.com/dags/eagle3_drafter/runs/scheduled__2026-12-01/tasks/train?try_number=3"
    context = {
        "ti": SimpleNamespace(dag_id="eagle3_drafter", task_id="train", map_index=-1, try_number=3, log_url=log_url),
        "task": operator,
        "dag_run": SimpleNamespace(run_id="scheduled__2026-12-01"),
        "exception": error.value,
    }
    FailureNotifier(scope="task", **NOTIFY, from_email=None, notifiers=[]).notify(context)

    (message,) = inbox.messages
    assert message["Subject"] == "[eagle3] eagle3_drafter: train failed in run scheduled__2026-12-01"
    assert message["To"] == "oncall@example.com"
    (body,) = inbox.bodies()
    for expected in (
        "Run:   eagle3_drafter / scheduled__2026-12-01",
        "Task:  train, try 3 (no retries left)",
        "Box:   local",
        f"Log:   {log_url}",
        "job log on the box: /data/eagle3/runs/r/jobs/train/log",
        "step 812/4000 loss 2.31",
        "NCCL timeout {{ 7 * 7 }}",
    ):
        assert expected in body, expected


@pytest.mark.slow
def test_a_failed_run_mails_once_for_the_failed_task_and_no_secret(smtp_server, airflow_home, tmp_path, tiny_target):
    """A whole `airflow dags test` run that fails (its validate refuses a mistyped param) sends one mail, the failed
    task's, with the absolute URL of its log on the API server's base URL, through the settings file's SMTP
    connection (the run's own callback stays silent: a task failed it); the worker's secrets are in its environment
    and in no mail. The run's report tab says where it failed, since no report was written."""
    from tests.dagruns import tiny_layers

    _, connection = smtp_server
    inbox = smtp_server[0]
    conf, layers = tiny_layers(tiny_target, tmp_path / "work", run_name="doomed")
    env = {
        **airflow_env(airflow_home),
        **settings_env(tmp_path, notify=NOTIFY, **layers),
        **WORKER_SECRETS,
        "AIRFLOW_CONN_SMTP_TEST": connection,
        "AIRFLOW__API__BASE_URL": "https://airflow.example.com/",
    }
    conf["train.epoch"] = 2  # a typo
    proc = subprocess.run(
        [AIRFLOW, "dags", "test", "eagle3_drafter", "--conf", json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0
    subjects = sorted(message["Subject"] for message in inbox.messages)
    assert len(subjects) == 1, (subjects, proc.stdout[-3000:])
    assert subjects[0].startswith("[eagle3] eagle3_drafter: validate failed in run ")
    bodies = "\n".join(inbox.bodies())
    assert "Log:   https://airflow.example.com/dags/eagle3_drafter/runs/" in bodies
    assert "not trigger parameters: 'train.epoch' (did you mean 'train.epochs'?)" in bodies  # what validate refused
    for name, secret in WORKER_SECRETS.items():
        assert secret not in bodies, name

    # The run's report tab, in the API server's code against the same metadata DB: no report was written, and it
    # says where the run failed; another DAG's run gets no EAGLE-3 report at all.
    run_id = subjects[0].removeprefix("[eagle3] eagle3_drafter: validate failed in run ")
    script = f"""
from airflow.utils.session import create_session
from eagle3_airflow import report_view
with create_session() as session:
    print(report_view.report_page("eagle3_drafter", {run_id!r}, session))
print(report_view.report_page("example_bash_operator", "manual__1", None))
"""
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "The run failed at validate, before its report was written" in proc.stdout
    assert "example_bash_operator is not an EAGLE-3 drafter DAG" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("state", ["running", "queued", "failed", "success"])
def test_a_deadline_warns_of_a_late_run_naming_it_only_while_it_runs(smtp_server, tmp_path, state):
    """notify.late_after_h becomes the DAG's DeadlineAlert (first queued + interval). Missed, Airflow's own
    Deadline.handle_miss builds the callback's context and queues it, and Airflow's CallbackTrigger runs it as the
    triggerer does (tests/deadline_miss.py): the mail names the run (Airflow 3.3 passes its id as `dag_run_id`).
    Airflow misses the deadline of a run that failed too (it drops deadlines only when a run succeeds in time): that
    run, and one that ended since, gets no mail."""
    from datetime import timedelta

    from eagle3_airflow.deployment import Deployment
    from eagle3_airflow.notify import RunFirstQueuedAt, deadline

    inbox, connection = smtp_server
    assert deadline(Deployment()) is None and deadline(Deployment(notify=NOTIFY)) is None
    alert = deadline(Deployment(notify={**NOTIFY, "late_after_h": 30}))
    assert alert.interval == timedelta(hours=30) and alert.callback.path == "eagle3_airflow.notify.late_run"
    assert isinstance(alert.reference, RunFirstQueuedAt)
    callback = json.dumps({"path": alert.callback.path, "kwargs": alert.callback.kwargs})
    env = airflow_env(
        migrated_airflow_home(tmp_path / "home"),
        AIRFLOW_CONN_SMTP_TEST=connection,
        PYTHONPATH=f"{REPO / 'include'}:{REPO / 'plugins'}:{REPO}",
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "deadline_miss.py"), callback, state],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])[-1] == {"state": "success", "body": None}, proc.stdout
    if state in ("failed", "success"):
        assert inbox.messages == [], [message["Subject"] for message in inbox.messages]
        return
    (message,) = inbox.messages
    assert message["Subject"] == "[eagle3] eagle3_drafter: run manual__2026-12-04T10:00:00+00:00 is late"
    assert "still running 1 day, 6:00:00 after it was first queued" in inbox.bodies()[0]


# -- notify.notifiers: any provider's notifier class ---------------------------------------------------------------


class Recorder(BaseNotifier):
    """A notifier as a provider writes one (its fields templates, for __call__ to render): records what it was made
    with when it is asked to notify."""

    heard: ClassVar[list[dict]] = []
    template_fields = ("title", "text", "blocks")

    def __init__(self, *, text: str, title: str = "", blocks: list | None = None, **kwargs):
        super().__init__(**kwargs)
        self.text, self.title, self.blocks = text, title, blocks

    def notify(self, context):
        Recorder.heard.append({"title": self.title, "text": self.text, "blocks": self.blocks})


class Down(BaseNotifier):
    """A channel that is down; its token must not reach the log."""

    def __init__(self, *, token: str):
        super().__init__()
        self.token = token

    def notify(self, context):
        raise ConnectionError("the channel is down")


RECORDER, DOWN = f"{Recorder.__module__}.Recorder", f"{Down.__module__}.Down"
RECORDED = {
    "class": RECORDER,
    "kwargs": {
        "title": "{subject}",
        "text": "{body}",
        "blocks": [{"type": "section", "html": "{body_html}"}, "{subject}! {run} {{x}}", 7],
    },
}


@pytest.fixture
def heard():
    Recorder.heard.clear()
    yield Recorder.heard
    Recorder.heard.clear()


def failed_task_context(message: str) -> dict:
    return {
        "ti": SimpleNamespace(dag_id="eagle3_drafter", task_id="train", map_index=-1, try_number=2),
        "task": None,
        "dag_run": SimpleNamespace(run_id="manual__r1"),
        "exception": RuntimeError(message),
    }


def test_each_notifier_gets_the_message_through_its_markers_as_written_and_one_down_stops_no_other(
    smtp_server, heard, caplog
):
    """The settings' notifiers are made anew with {subject}, {body} and {body_html} replaced by the message, in one
    plain pass: a Jinja template, a str.format field and a marker inside a log line arrive as written. A notifier
    that fails is logged without its kwargs, and neither the next one nor the mail is stopped."""
    from eagle3_airflow.deployment import Deployment
    from eagle3_airflow.notify import FailureNotifier

    inbox, _ = smtp_server
    settings = Deployment(
        notify={**NOTIFY, "notifiers": [{"class": DOWN, "kwargs": {"token": "xoxb-s3cret"}}, RECORDED]}
    )
    line = "NCCL timeout {{ 7*7 }} {0} {subject} <rank 3>"
    with caplog.at_level(logging.INFO, logger="eagle3_airflow.notify"):
        FailureNotifier(scope="task", **settings.notify.kwargs()).notify(failed_task_context(line))

    subject = "[eagle3] eagle3_drafter: train failed in run manual__r1"
    ((got,),) = [heard]
    assert got["title"] == subject
    assert got["text"].startswith("Run:   eagle3_drafter / manual__r1\nTask:  train, try 2 (no retries left)")
    assert f"RuntimeError: {line}\n" in got["text"] and "49" not in got["text"]
    section, bang, seven = got["blocks"]
    assert section == {"type": "section", "html": f"<pre>{html.escape(got['text'])}</pre>"}
    assert "{{ 7*7 }} {0} {subject} &lt;rank 3&gt;" in section["html"]
    assert (bang, seven) == (subject + "! {run} {{x}}", 7)  # braces not markers: left as they are
    (message,) = inbox.messages  # the mail went too
    assert message["Subject"] == subject and line in inbox.bodies()[0]
    assert f"notifier {DOWN} (notify.notifiers[0]) failed for '{subject}'" in caplog.text
    assert "ConnectionError: the channel is down" in caplog.text
    assert "xoxb-s3cret" not in caplog.text


def test_the_notifiers_still_hear_when_the_mail_cannot_go(monkeypatch, heard, caplog):
    """SMTP down (nothing listens on its port): logged, and the notifiers get the message anyway."""
    from eagle3_airflow.notify import send

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: connecting is refused
    monkeypatch.setenv(
        "AIRFLOW_CONN_SMTP_DOWN",
        json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": port,
                "extra": {"disable_tls": True, "disable_ssl": True, "timeout": 5, "retry_limit": 0},
            }
        ),
    )
    send("the subject", "the body", {}, "smtp_down", ["oncall@example.com"], "airflow@example.com", [RECORDED])
    assert "could not send 'the subject' by SMTP (connection smtp_down)" in caplog.text
    assert [(got["title"], got["text"]) for got in heard] == [("the subject", "the body")]


def test_a_late_run_reaches_the_notifiers_through_the_deadline_kwargs(heard):
    """The DeadlineAlert's kwargs (stored by Airflow: plain JSON) carry the notifiers to late_run in the triggerer;
    a deadline stored before notify.notifiers (with `callables`) still sends its mail, without them."""
    from eagle3_airflow.deployment import Deployment
    from eagle3_airflow.notify import deadline, late_run

    alert = deadline(Deployment(notify={"notifiers": [RECORDED], "late_after_h": 2}))
    kwargs = json.loads(json.dumps(alert.callback.kwargs))
    run = {"dag_run": {"dag_run_id": "manual__r2", "dag_id": "eagle3_drafter"}}
    asyncio.run(late_run(**kwargs, context=run))
    ((got,),) = [heard]
    assert got["title"] == "[eagle3] eagle3_drafter: run manual__r2 is late"
    assert "still running 2:00:00 after it was first queued" in got["text"]
    asyncio.run(
        late_run(
            smtp_conn_id="smtp_default", to=[], from_email=None, callables=["old:channel"], late_after_h=2, context=run
        )
    )
    assert len(heard) == 1


@pytest.mark.parametrize(
    ("notify", "expected"),
    [
        (
            {"notifiers": [RECORDED, {"class": "json.JSONDecoder"}]},
            "notify.notifiers.1.class: 'json.JSONDecoder' is not an Airflow notifier (a subclass of "
            "airflow.sdk.BaseNotifier)",
        ),
        (
            {"notifiers": [{"class": "eagle3_no_such_provider.notifications.Pager"}]},
            "notify.notifiers.0.class: cannot import 'eagle3_no_such_provider.notifications.Pager' "
            "(ModuleNotFoundError: No module named 'eagle3_no_such_provider'); install the provider",
        ),
        (
            {"notifiers": [{"class": "eagle3_airflow.notify:late_run"}]},
            "notify.notifiers.0.class: 'eagle3_airflow.notify:",
        ),
        (
            {"notifiers": [{"class": RECORDER, "kwargs": {"txt": "{body}"}}]},
            f"notify.notifiers.0.kwargs: {RECORDER} cannot be made with these arguments (missing a required argument: "
            "'text'); it takes ['text', 'title', 'blocks']",
        ),
        (
            {"notifiers": [{"class": RECORDER, "kwargs": ["{body}"]}]},
            "notify.notifiers.0.kwargs: Input should be a valid",
        ),
        ({"notifiers": [{"class": RECORDER, "text": "{body}"}]}, "notify.notifiers.0.text: unknown key"),
        (
            {"to": ["oncall@example.com"], "callables": ["mymodule:page"]},
            "notify: `callables` (module:function channels) is no longer read: each channel is now an Airflow notifier "
            'class in `notifiers`, e.g. "notifiers": [{"class": '
            '"airflow.providers.slack.notifications.slack.SlackNotifier"',
        ),
    ],
    ids=[
        "not-a-notifier",
        "unimportable",
        "a-function",
        "wrong-kwargs",
        "kwargs-not-an-object",
        "unknown-key",
        "old-callables",
    ],
)
def test_the_settings_file_refuses_a_notifier_it_could_not_make_naming_the_field(
    tmp_path, monkeypatch, notify, expected
):
    """Checked when the settings file is read (the DAG file's parse: an import error), not at the first failure."""
    from eagle3_airflow.deployment import SETTINGS_ENV, Deployment
    from eagle3_airflow.params import ParamsError

    path = tmp_path / "eagle3_settings.json"
    path.write_text(json.dumps({"notify": notify}))
    monkeypatch.setenv(SETTINGS_ENV, str(path))
    with pytest.raises(ParamsError) as refused:
        Deployment.from_env(tmp_path)
    assert f"the settings file {path}" in str(refused.value)
    assert expected in str(refused.value), str(refused.value)
