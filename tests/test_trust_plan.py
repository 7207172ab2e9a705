"""Issue 35, item 1: the run plan, the run config inside it, is taken from XCom only as validate sealed it.

Written as the attack: a USER-role user PATCHes the `plan` XCom of a running run after validate (its config
included). Each task that reads it (here called directly, as the DAG's @task wrappers call them) fails before it
touches a box, with a message that names what was edited and says to trigger a new run; a retry of the same plan, a
cleared validate, and a plan from newer code still work. Issue 43: one plan, validated once: no config beside it in
XCom, and no task reads the settings again, so a run keeps the settings it was validated with.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from eagle3_airflow import plan as plan_module
from eagle3_airflow import promotion, tasks
from eagle3_airflow.jobs import RemoteJobOperator
from eagle3_airflow.seal import NoSealingKey, Tampered, task_key
from eagle3_airflow.sensors import GpuIdleSensor
from tests.airflow_env import AIRFLOW, PLAN_SECRET_ENV, airflow_env, migrated_airflow_home
from tests.conftest import CONTEXT, RUN, sealed

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
    assert (run["plan"]["workdir"], run["plan"]["python"]) == (str(tmp_path / "work"), sys.executable)
    assert run["plan"]["config"]["data"]["path"] == "/data/conversations.jsonl" and "config_sha256" not in run["plan"]
    return run


def test_a_plan_edited_to_use_another_connection_fails_sync_code_before_any_login(run, no_box):
    """The issue's attack: conn_ids edited to a connection the settings do not allow (`prod-db`)."""
    edited = {**run["plan"], "conn_ids": ["prod-db"]}
    with pytest.raises(Tampered, match=rf"the run plan in XCom \(task `validate`, key `plan`\) {EDITED}") as refused:
        tasks.sync_code(edited, dag_run=RUN)
    assert TRIGGER_AGAIN in str(refused.value)


def test_an_edited_plan_never_reaches_systemctl_through_the_gpu_sensor(run, no_box):
    """... and the GPU sensor would have run `systemctl stop -- sshd.service` there."""
    edited = {**run["plan"], "conn_ids": ["prod-db"], "stop_services": ["sshd.service"]}
    with pytest.raises(Tampered, match=EDITED):
        GpuIdleSensor(task_id="gpus_idle", plan=edited).poke(CONTEXT)


@pytest.mark.parametrize("field, value", [
    ("python", "/tmp/evil/python"), ("run_dir", "/"), ("workdir", "/"), ("code_digest", "0123456789abcdef"),
    ("box_env", ["AIRFLOW__CORE__FERNET_KEY"]), ("num_shards", 64), ("config", {}), ("reports_url", "/tmp/mine"),
    ("keep_runs", 1), ("keep_proposals_h", 999)])
def test_any_edited_field_fails_every_kind_of_task(run, no_box, field, value):
    edited = {**run["plan"], field: value}
    for call in (lambda: tasks.write_config(edited, dag_run=RUN),
                 lambda: tasks.sync_code(edited, dag_run=RUN),
                 lambda: tasks.inputs_changed(edited, dag_run=RUN),
                 lambda: tasks.report(edited, dag_run=RUN),
                 lambda: promotion.propose_promotion(edited, "eagle3_drafter.proposals", outlet_events={}, dag_run=RUN),
                 lambda: tasks.prune_runs(edited, dag_run=RUN),
                 lambda: tasks.shard_list(edited, dag_run=RUN),
                 lambda: RemoteJobOperator(task_id="train", stage="train", plan=edited).execute(CONTEXT)):
        with pytest.raises(Tampered, match=EDITED):
            call()


def test_an_edited_config_in_the_plan_fails_write_config_and_sync_code(run, no_box):
    """The plan's config is what `write_config` writes to the box as the run's config: a changed data path, endpoint
    or keep_versions would reach every stage. The seal covers it with the rest of the plan."""
    config = run["plan"]["config"]
    for edit in ({"data": {**config["data"], "path": "/home/alice/.ssh/id_ed25519"}},
                 {"evaluate": {**config["evaluate"], "keep_versions": 1}}):
        edited = {**run["plan"], "config": {**config, **edit}}
        for call in (tasks.write_config, tasks.sync_code):
            with pytest.raises(Tampered, match=rf"the run plan in XCom \(task `validate`, key `plan`\) {EDITED}") \
                    as refused:
                call(edited, dag_run=RUN)
            assert TRIGGER_AGAIN in str(refused.value)


def test_a_plan_sealed_by_the_previous_code_fails_where_it_needs_the_config(run, no_box, caplog):
    """A run in flight when this code was deployed: its plan, sealed by the previous validate, has the digest of a
    config kept beside it (config_sha256) and no config. Tasks that need no config go on; sync_code and write_config
    fail without a retry, saying to trigger again, never with a KeyError."""
    body = {key: value for key, value in run["plan"].items() if key not in ("seal", "config", "reports_url",
                                                                           "reports_conn_id", "keep_runs",
                                                                           "keep_proposals_h")}
    previous = sealed_as_is({**body, "config_sha256": "0" * 64})
    with caplog.at_level("WARNING", logger="eagle3_airflow.plan"):
        assert tasks.shard_list(previous, dag_run=RUN) == [0]
    assert "does not know" not in caplog.text  # a retired key, not one of newer code
    for call in (tasks.write_config, tasks.sync_code):
        with pytest.raises(AirflowFailException, match=r"carries no run config: validate planned this run with "
                                                       r"older code(?s:.*)Trigger a new run"):
            call(previous, dag_run=RUN)


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
    through this code's RunPlan, which would drop a key it does not know and refuse one missing)."""
    from eagle3_airflow.seal import RunRef, seal

    return {**body, "seal": seal("plan", body, RunRef.of(RUN), task_key())}


def test_a_retry_a_cleared_validate_and_a_newer_codes_plan_verify(run, caplog):
    """A retry reads the same sealed plan: it verifies again. Clearing validate seals the plan again for the same
    run. A key this code does not know, in a plan sealed by newer code (the DAG code rolled back during a run), is
    logged and ignored; the same key added by an XCom edit breaks the seal, which covers the whole dict."""
    verified = plan_module.verified_plan(run["plan"], RUN)
    assert plan_module.verified_plan(json.loads(json.dumps(run["plan"])), RUN) == verified  # XCom's JSON round trip
    assert verified.run_config() == run["plan"]["config"]
    assert plan_module.verified_plan(sealed(verified), RUN) == verified  # validate cleared and run again
    body = {key: value for key, value in run["plan"].items() if key != "seal"}
    newer = sealed_as_is({**body, "gpu_numa_policy": "interleave"})
    with caplog.at_level("WARNING", logger="eagle3_airflow.plan"):
        assert plan_module.verified_plan(newer, RUN) == verified
    assert "keys this code does not know (planned by newer code?): ['gpu_numa_policy']; ignored" in caplog.text
    with pytest.raises(Tampered, match=EDITED):
        plan_module.verified_plan({**newer, "gpu_numa_policy": "first-touch"}, RUN)
    with pytest.raises(Tampered, match=EDITED):
        plan_module.verified_plan({**run["plan"], "gpu_numa_policy": "interleave"}, RUN)


def test_a_plan_of_older_code_that_lacks_a_field_fails_naming_it(run):
    """Sealed, but planned by code that had no `num_shards` yet: refused, naming what is missing, before any use."""
    body = {key: value for key, value in run["plan"].items() if key not in ("seal", "num_shards", "conn_ids")}
    with pytest.raises(Tampered, match=r"lacks conn_ids, num_shards, which this code needs \(planned by older "
                                       r"code\?\)\. Nothing was run on the box"):
        plan_module.verified_plan(sealed_as_is(body), RUN)


def test_a_run_in_flight_keeps_the_settings_it_was_validated_with(run, trust_settings, monkeypatch):
    """Validate checked the run against the settings and sealed what later tasks need of them into the plan: the
    settings file changed (tightened, or broken) since, or read by a worker that parsed another version of it, changes
    nothing for this run, and no task reads it. (To stop a run in flight: mark it failed.)"""
    from eagle3_airflow.deployment import Deployment

    settings = json.loads(trust_settings.read_text())
    trust_settings.write_text(json.dumps({**settings, "allowed_boxes": ["gpu_box"], "keep_runs": 1,
                                          "params": {"box.conn_ids": ["gpu_box"]}}))

    def read(*args, **kwargs):
        raise AssertionError("a task read the settings file")

    monkeypatch.setattr(Deployment, "from_env", read)
    plan = plan_module.verified_plan(run["plan"], RUN)
    assert (plan.conn_ids, plan.keep_runs) == (["local"], None)
    assert tasks.shard_list(run["plan"], dag_run=RUN) == [0]
    with pytest.raises(AirflowSkipException, match="keep_runs was not set in the settings this run was validated"):
        tasks.prune_runs(run["plan"], dag_run=RUN)


SET_THE_KEY = (r"no key to seal run plans with: set the Airflow Variable eagle3_plan_secret in the deployment, as "
               r"AIRFLOW_VAR_EAGLE3_PLAN_SECRET in the Airflow workers' environment \(docker-compose: in \.env")


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
    subprocess.run([AIRFLOW, "variables", "set", "eagle3_plan_secret", "chosen-by-op-" + "x" * 40], env=env,
                   check=True, capture_output=True, timeout=300)
    conf = {"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"}
    # Every task but validate is marked successful without running: the run stops or goes on at validate alone.
    proc = subprocess.run([AIRFLOW, "dags", "test", "eagle3_drafter", "--conf", json.dumps(conf),
                           "--mark-success-pattern", "(?!validate$).*"],
                          env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-6000:]
    assert re.search(SET_THE_KEY, output), output[-6000:]
    assert "chosen-by-op" not in output


def test_a_mapped_shard_the_plan_does_not_have_is_refused(run, no_box):
    """The `shards` XCom decides how many extract tasks there are and which shard each runs."""
    with pytest.raises(AirflowFailException, match=r"shard 7 \(from the `shards` task's XCom\) is not a shard of "
                                                   r"this run, which has 1"):
        RemoteJobOperator(task_id="extract", stage="extract", plan=run["plan"], shard=7).execute(CONTEXT)


def test_retention_prunes_only_in_the_verified_plans_workdir(run, no_box):
    """`runs prune` runs in plan.workdir: an edit that points it at another directory is refused first."""
    with pytest.raises(Tampered, match=EDITED):
        tasks.prune_runs({**run["plan"], "workdir": "/srv/other-team"}, dag_run=RUN)


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
    assert folders == [str(published.run_folder(Deployment(reports_url=str(tmp_path / "reports-then")),
                                                 RUN.dag_id, RUN.run_id))]
    assert folders[0].startswith(str(tmp_path / "reports-then"))
