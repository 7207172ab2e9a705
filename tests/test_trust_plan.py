"""Issue 35, item 1: the run plan, the run config inside it, is taken from XCom only as validate sealed it.

Written as the attack: a USER-role user PATCHes the `plan` XCom of a running run after validate (its config
included). Each task that reads it (here called directly, as the DAG's @task wrappers call them) fails before it
touches a box, with a message that names what was edited and says to trigger a new run; a retry of the same plan and a
cleared validate still work, and a plan of another protocol (a deploy since the run was validated) is refused with
what to do. Issue 43: one plan, validated once: no config beside it in XCom, and no task reads the settings again, so
a run keeps the settings it was validated with.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from eagle3_airflow import approvals, tasks
from eagle3_airflow import plan as plan_module
from eagle3_airflow.remote_job import RemoteJobOperator
from eagle3_airflow.seal import NoSealingKey, Tampered, task_key
from eagle3_airflow.sensors import GpuIdleSensor
from tests.airflow_env import AIRFLOW, PLAN_SECRET_ENV, airflow_env, migrated_airflow_home
from tests.conftest import CONTEXT, RUN, edited, sealed

EDITED = "does not match its seal: it was edited after validate planned this run"
TRIGGER_AGAIN = "Trigger a new run"


@pytest.fixture
def no_box(monkeypatch):
    """Fails the test if anything asks for a box: a refused plan must stop before any command."""

    def box_for(conn_id):
        raise AssertionError(f"a box command was about to run on {conn_id!r}")

    monkeypatch.setattr(plan_module, "box_for", box_for)


@pytest.fixture
def run(trust_settings, tmp_path) -> dict:
    """What validate hands to XCom for a run on this machine (its workdir and python the settings'): the sealed plan,
    the config inside it."""
    from eagle3_airflow.deployment import Deployment

    deployment = Deployment.from_env()
    params = {name: param.value for name, param in deployment.form().items() if param.has_value}
    params.update({"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"})
    run = tasks.validate_run(params, {}, set(deployment.form()), RUN, deployment)
    assert set(run) == {"plan"}  # no second copy of the config, and no digest of one
    assert (run["plan"]["config"]["workdir"], run["plan"]["box"]["python"]) == (str(tmp_path / "work"), sys.executable)
    assert run["plan"]["config"]["data"]["path"] == "/data/conversations.jsonl"
    return run


def test_a_plan_edited_to_use_another_connection_fails_sync_code_before_any_login(run, no_box):
    """The issue's attack: conn_ids edited to a connection the settings do not allow (`prod-db`)."""
    with pytest.raises(Tampered, match=rf"the run plan in XCom \(task `validate`, key `plan`\) {EDITED}") as refused:
        tasks.sync_code(edited(run["plan"], {"box.conn_ids": ["prod-db"]}), dag_run=RUN)
    assert TRIGGER_AGAIN in str(refused.value)


def test_an_edited_plan_never_reaches_systemctl_through_the_gpu_sensor(run, no_box):
    """... and the GPU sensor would have run `systemctl stop -- sshd.service` there."""
    plan = edited(run["plan"], {"box.conn_ids": ["prod-db"], "box.stop_services": ["sshd.service"]})
    with pytest.raises(Tampered, match=EDITED):
        GpuIdleSensor(task_id="gpus_idle", plan=plan).poke(CONTEXT)


@pytest.mark.parametrize(
    "field, value",
    [
        ("box.python", "/tmp/evil/python"),
        ("config.run_name", "other"),
        ("config.workdir", "/"),
        ("code_digest", "0123456789abcdef"),
        ("box_env", ["AIRFLOW__CORE__FERNET_KEY"]),
        ("config.extract.num_shards", 64),
        ("config", {}),
        ("reports_url", "/tmp/mine"),
        ("keep_runs", 1),
        ("keep_proposals_h", 999),
        ("protocol", 0),
    ],
)
def test_any_edited_field_fails_every_kind_of_task(run, no_box, field, value):
    plan = edited(run["plan"], {field: value})
    for call in (
        lambda: tasks.write_config(plan, dag_run=RUN),
        lambda: tasks.sync_code(plan, dag_run=RUN),
        lambda: tasks.inputs_changed(plan, dag_run=RUN),
        lambda: tasks.report(plan, dag_run=RUN),
        lambda: approvals.propose_promotion(plan, "eagle3_drafter.proposals", outlet_events={}, dag_run=RUN),
        lambda: tasks.prune_runs(plan, dag_run=RUN),
        lambda: tasks.shard_list(plan, dag_run=RUN),
        lambda: RemoteJobOperator(task_id="train", stage="train", plan=plan).execute(CONTEXT),
    ):
        with pytest.raises(Tampered, match=EDITED):
            call()


def test_an_edited_config_in_the_plan_fails_write_config_and_sync_code(run, no_box):
    """The plan's config is what `write_config` writes to the box as the run's config: a changed data path, endpoint
    or keep_versions would reach every stage. The seal covers it with the rest of the plan."""
    for field, value in (("config.data.path", "/home/alice/.ssh/id_ed25519"), ("config.evaluate.keep_versions", 1)):
        for call in (tasks.write_config, tasks.sync_code):
            with pytest.raises(
                Tampered, match=rf"the run plan in XCom \(task `validate`, key `plan`\) {EDITED}"
            ) as refused:
                call(edited(run["plan"], {field: value}), dag_run=RUN)
            assert TRIGGER_AGAIN in str(refused.value)


def test_a_plan_without_its_seal_or_another_runs_sealed_plan_is_refused(run, no_box):
    unsealed = {key: value for key, value in run["plan"].items() if key != "seal"}
    with pytest.raises(Tampered, match="carries no seal"):
        tasks.inputs_changed(unsealed, dag_run=RUN)
    other_run = SimpleNamespace(dag_id=RUN.dag_id, run_id="manual__2026-12-01T00:00:00+00:00")
    with pytest.raises(Tampered, match="or it is another run's plan"):
        tasks.inputs_changed(sealed(run["plan"], other_run), dag_run=RUN)  # replayed from another run
    with pytest.raises(Tampered, match="no DAG run"):
        tasks.inputs_changed(run["plan"], dag_run=None)


def sealed_as_is(body: dict) -> dict:
    """`body` sealed for RUN exactly as it is, as validate of other code would seal it (conftest's `sealed` goes
    through this code's RunPlan, which refuses a key it does not know and one missing)."""
    from eagle3_airflow.seal import RunRef, seal

    return {**body, "seal": seal("plan", body, RunRef.of(RUN), task_key())}


def test_a_retry_and_a_cleared_validate_verify(run):
    """A retry reads the same sealed plan: it verifies again, through XCom's JSON round trip. Clearing validate seals
    the plan again for the same run."""
    verified = plan_module.verified_plan(run["plan"], RUN)
    assert plan_module.verified_plan(json.loads(json.dumps(run["plan"])), RUN) == verified
    assert verified.config.model_dump(mode="json") == run["plan"]["config"]
    assert plan_module.verified_plan(sealed(verified), RUN) == verified


def test_a_plan_of_another_protocol_is_refused_saying_to_clear_validate(run, no_box):
    """A run validated before a deploy that changed the plan or the box commands (eagle3.contracts.PROTOCOL): its
    sealed plan holds, but this worker cannot drive the run's pinned code. Every task refuses it before any box
    command, saying what to clear; a plan of this protocol with another layout (the protocol not bumped) is refused
    naming the fields."""
    body = {key: value for key, value in run["plan"].items() if key != "seal"}
    other = sealed_as_is({**body, "protocol": 0, "gpu_numa_policy": "interleave"})
    for call in (tasks.shard_list, tasks.sync_code, tasks.write_config, tasks.inputs_changed):
        with pytest.raises(
            AirflowFailException,
            match=r"whose plan and box commands are protocol 0; this worker's "
            r"code speaks protocol 1\. Clear the run's validate task with "
            r"its downstream tasks",
        ) as refused:
            call(other, dag_run=RUN)
        assert not isinstance(refused.value, Tampered)
    for layout in (
        {**body, "gpu_numa_policy": "interleave"},
        {key: value for key, value in body.items() if key != "box"},
    ):
        with pytest.raises(AirflowFailException, match=r"is not a plan this code reads \((box|gpu_numa_policy)"):
            plan_module.verified_plan(sealed_as_is(layout), RUN)


@pytest.mark.slow
def test_sync_code_refuses_a_box_whose_code_speaks_another_protocol(run, monkeypatch):
    """Real: the local box, the run's code synced and its `box info` run. The box reports the protocol its code speaks
    (eagle3.contracts); where this worker expects another, sync_code fails before any stage, saying what to do."""
    monkeypatch.setattr(tasks, "PROTOCOL", 2)  # a worker of the next protocol, against the run's code on the box
    with pytest.raises(
        AirflowFailException,
        match=r"box local: this run's code there \(.*/code/\w+\) speaks protocol "
        r"1, this worker's 2(?s:.*)Clear the run's validate task with its "
        r"downstream tasks",
    ):
        tasks.sync_code(run["plan"], dag_run=RUN)
    monkeypatch.setattr(tasks, "PROTOCOL", 1)
    assert tasks.sync_code(run["plan"], dag_run=RUN)["local"]["protocol"] == 1


def test_a_run_in_flight_keeps_the_settings_it_was_validated_with(run, trust_settings, monkeypatch):
    """Validate checked the run against the settings and sealed what later tasks need of them into the plan: the
    settings file changed (tightened, or broken) since, or read by a worker that parsed another version of it, changes
    nothing for this run, and no task reads it. (To stop a run in flight: mark it failed.)"""
    from eagle3_airflow.deployment import Deployment

    settings = json.loads(trust_settings.read_text())
    trust_settings.write_text(
        json.dumps({**settings, "allowed_boxes": ["gpu_box"], "keep_runs": 1, "params": {"box.conn_ids": ["gpu_box"]}})
    )

    def read(*args, **kwargs):
        raise AssertionError("a task read the settings file")

    monkeypatch.setattr(Deployment, "from_env", read)
    plan = plan_module.verified_plan(run["plan"], RUN)
    assert (plan.box.conn_ids, plan.keep_runs) == (["local"], None)
    assert tasks.shard_list(run["plan"], dag_run=RUN) == [0]
    with pytest.raises(AirflowSkipException, match="keep_runs was not set in the settings this run was validated"):
        tasks.prune_runs(run["plan"], dag_run=RUN)


SET_THE_KEY = (
    r"no key to seal run plans with: set the Airflow Variable eagle3_plan_secret in the deployment, as "
    r"AIRFLOW_VAR_EAGLE3_PLAN_SECRET in the Airflow workers' environment \(docker-compose: in \.env"
)


def test_without_the_sealing_key_nothing_verifies_and_nothing_is_planned(run, monkeypatch, no_box):
    """The deployment sets the key; a task that finds none fails closed, saying how to set it, and validate makes
    none (it used to store one where the OP role may write it)."""
    monkeypatch.delenv("AIRFLOW_VAR_EAGLE3_PLAN_SECRET")
    with pytest.raises(NoSealingKey, match=SET_THE_KEY):
        tasks.inputs_changed(run["plan"], dag_run=RUN)
    with pytest.raises(NoSealingKey, match=SET_THE_KEY):
        task_key()  # what validate seals with (eagle3_airflow/tasks.py): it makes none


def test_a_short_key_is_refused(run, monkeypatch, no_box):
    monkeypatch.setenv("AIRFLOW_VAR_EAGLE3_PLAN_SECRET", "hunter2")
    with pytest.raises(NoSealingKey, match=r"eagle3_plan_secret .* has 7 characters; .* at least 32 random"):
        tasks.inputs_changed(run["plan"], dag_run=RUN)


@pytest.mark.slow
def test_a_key_written_as_a_variable_in_airflows_database_is_never_used(trust_settings, tmp_path):
    """The issue's attack: the OP role writes Variables (eagle3_plan_secret is redacted when read, not when
    written), so a key taken from the metadata DB is one OP chose and can seal a forged approval with. A real
    `airflow dags test` (its tasks read Variables through the Task SDK, the database included) with the key only in
    the DB: validate fails closed, naming the environment variable, and plans nothing."""
    home = migrated_airflow_home(tmp_path / "airflow-home")
    env = {name: value for name, value in airflow_env(home).items() if name != PLAN_SECRET_ENV}
    subprocess.run(
        [AIRFLOW, "variables", "set", "eagle3_plan_secret", "chosen-by-op-" + "x" * 40],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    conf = {"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"}
    # Every task but validate is marked successful without running: the run stops or goes on at validate alone.
    proc = subprocess.run(
        [
            AIRFLOW,
            "dags",
            "test",
            "eagle3_drafter",
            "--conf",
            json.dumps(conf),
            "--mark-success-pattern",
            "(?!validate$).*",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-6000:]
    assert re.search(SET_THE_KEY, output), output[-6000:]
    assert "chosen-by-op" not in output


def test_a_mapped_shard_the_plan_does_not_have_is_refused(run, no_box):
    """The `shards` XCom decides how many extract tasks there are and which shard each runs."""
    with pytest.raises(
        AirflowFailException,
        match=r"shard 7 \(from the `shards` task's XCom\) is not a shard of "
        r"this run, which has 1",
    ):
        RemoteJobOperator(task_id="extract", stage="extract", plan=run["plan"], shard=7).execute(CONTEXT)


def test_retention_prunes_only_in_the_verified_plans_workdir(run, no_box):
    """`runs prune` runs in the plan's workdir: an edit that points it at another directory is refused first."""
    with pytest.raises(Tampered, match=EDITED):
        tasks.prune_runs(edited(run["plan"], {"config.workdir": "/srv/other-team"}), dag_run=RUN)


def test_the_report_publishes_to_the_store_the_run_was_validated_with(trust_settings, tmp_path, monkeypatch):
    """The reports store is the settings' as validate planned the run, carried by the sealed plan: a store moved
    since (or a worker that parsed another version of the settings) does not scatter one run's publications."""
    from eagle3_airflow import published
    from eagle3_airflow.deployment import Deployment

    settings = json.loads(trust_settings.read_text())
    trust_settings.write_text(json.dumps({**settings, "reports_url": str(tmp_path / "reports-then")}))
    deployment = Deployment.from_env()
    params = {name: param.value for name, param in deployment.form().items() if param.has_value}
    params.update({"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"})
    plan = tasks.validate_run(params, {}, set(deployment.form()), RUN, deployment)["plan"]
    trust_settings.write_text(json.dumps({**settings, "reports_url": str(tmp_path / "reports-now")}))
    folders = []
    monkeypatch.setattr(tasks, "report_summary", lambda plan: {"run_dir": plan.run_dir})
    monkeypatch.setattr(published, "publish", lambda plan, summary, folder, log=None: folders.append(str(folder)))
    tasks.report(plan, dag_run=RUN)
    assert folders == [
        str(published.run_folder(Deployment(reports_url=str(tmp_path / "reports-then")), RUN.dag_id, RUN.run_id))
    ]
    assert folders[0].startswith(str(tmp_path / "reports-then"))
