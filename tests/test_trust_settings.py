"""Issue 35, items 5 and 6 (the Airflow side): what the deployment's settings decide and no trigger can change.

Written as the attacks a user who may trigger the DAG tried: `evaluate.keep_versions=1` to erase older promoted
drafters, a workdir of their choosing for `runs prune` to clean, and the API key sent to another port of an allowed
host. A trigger now chooses only the form's fields: each of these in its conf is refused by the validate task as
not a trigger parameter, and where the settings file sets it (its `run`, `box`, presets, box_pools), it is checked
against the settings' allow-lists when the file is read, and again by validate.
"""

from __future__ import annotations

import copy
import json

import pytest
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowFailException
from pydantic import ValidationError

from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import ParamsError, build_params
from eagle3_airflow.tasks import validate_run
from tests.conftest import RUN, run_dir_of

GOOD = {"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"}
WORKDIR = {"workdir": "/data/eagle3"}


def trigger(deployment: Deployment, conf: dict | None = None, **overrides) -> dict:
    """validate as a trigger with `overrides` in the form (and `conf` as sent: Airflow merges its keys into the
    params, form fields or not) runs it under `deployment`."""
    params = ParamsDict(copy.deepcopy(deployment.form()))
    for key, value in {**GOOD, **overrides}.items():
        params[key] = value
    sent = {**GOOD, **overrides, **(conf or {})}
    return validate_run({**params.validate(), **sent}, sent, set(build_params()), RUN, deployment)


# -- keep_versions: the settings', never a trigger's -----------------------------------------------------------


def test_a_trigger_cannot_set_keep_versions_and_the_run_gets_the_settings_value():
    deployment = Deployment(run=WORKDIR, keep_versions=5)
    assert "evaluate.keep_versions" not in build_params()  # the form does not offer it
    with pytest.raises(
        AirflowFailException,
        match=r"'evaluate.keep_versions': the deployment decides it \(its "
        r"settings file's 'keep_versions'",
    ):
        trigger(deployment, conf={"evaluate.keep_versions": 1})
    assert trigger(deployment)["plan"]["config"]["evaluate"]["keep_versions"] == 5
    with pytest.raises(ParamsError, match=r"params: \['evaluate.keep_versions'\] are not form fields"):
        build_params({"evaluate.keep_versions": 1})
    # Nor a layer of the settings: the top-level keep_versions is the one place it is set.
    for layer in (
        {"run": {**WORKDIR, "evaluate.keep_versions": 1}},
        {"presets": {"short": {"evaluate.keep_versions": 1}}},
    ):
        with pytest.raises(ValidationError, match=r"\['evaluate.keep_versions'\] are not run-config fields"):
            Deployment(**{"run": WORKDIR, **layer})


# -- the workdirs a run may use ------------------------------------------------------------------------------------


def test_a_trigger_cannot_choose_the_workdir():
    """`runs prune` cleans the run's workdir: a trigger choosing it could point the cleanup at any directory."""
    deployment = Deployment(run=WORKDIR)
    for workdir in ("/home/alice", "/data/eagle3/team-a"):
        with pytest.raises(AirflowFailException, match=r"not trigger parameters: 'workdir' \(the deployment's"):
            trigger(deployment, conf={"workdir": workdir})
    assert trigger(deployment)["plan"]["config"]["workdir"] == "/data/eagle3"


def test_by_default_only_the_settings_workdir_is_allowed():
    assert Deployment(run={"workdir": "/data/eagle3/"}).allowed.workdirs() == ["/data/eagle3"]
    spelled = trigger(Deployment(run={"workdir": "/data/eagle3/"}))["plan"]["config"]["workdir"]
    assert spelled == "/data/eagle3"  # one spelling
    team = Deployment(run={"workdir": "/data/eagle3/team-a"}, allowed_workdirs=["/data/eagle3"])
    assert str(run_dir_of(trigger(team)["plan"])).startswith("/data/eagle3/team-a/")
    for elsewhere in ("/home/alice", "/data/eagle3-other", "/data"):
        with pytest.raises(
            ValidationError,
            match=rf"workdir: '{elsewhere}' is not under a directory this "
            r"deployment allows; it allows \['/data/eagle3'\]",
        ):
            Deployment(run={"workdir": elsewhere}, allowed_workdirs=["/data/eagle3"])
        # each box's own workdir too
        with pytest.raises(
            ValidationError,
            match=rf"box_pools.gpu-box-1 \(over run and box\) reaches past what "
            rf"this deployment allows:\n  workdir: '{elsewhere}' is not under",
        ):
            Deployment(
                run=WORKDIR,
                allowed_workdirs=["/data/eagle3"],
                box_pools={"gpu-box-1": {"gpus": 8, "run": {"workdir": elsewhere}}},
            )
    with pytest.raises(
        ValidationError,
        match=r"workdir: '/data/eagle3/\.\./\.\./home/alice' has a '\.\.' "
        "component",
    ):
        Deployment(run={"workdir": "/data/eagle3/../../home/alice"}, allowed_workdirs=["/data/eagle3"])
    # A ':' would split the stages' PYTHONPATH={workdir}/code/<digest>: its first part would be searched for an
    # `eagle3` package, not the synced code.
    with pytest.raises(ValidationError, match=r"workdir: '/data/eagle3/x:/tmp/mine' has a ':'"):
        Deployment(run={"workdir": "/data/eagle3/x:/tmp/mine"}, allowed_workdirs=["/data/eagle3"])
    # No workdir in the settings: none is allowed, and a run says where to set one.
    assert Deployment().allowed.workdirs() == []
    with pytest.raises(AirflowFailException, match=r"workdir: .* name no work directory on the box; set \"run\""):
        trigger(Deployment())


def test_a_workdir_the_settings_no_longer_allow_is_refused_by_validate():
    """Every task checks against the settings as they are now: tightened after the DAG was parsed, they refuse a
    workdir they allowed then."""
    deployment = Deployment(run={"workdir": "/data/eagle3/team-a"}, allowed_workdirs=["/data/eagle3"])
    assert trigger(deployment)["plan"]["config"]["workdir"] == "/data/eagle3/team-a"
    tightened = deployment.model_copy(update={"allowed_workdirs": ["/data/eagle3/team-b"]})
    with pytest.raises(
        AirflowFailException,
        match=r"workdir: '/data/eagle3/team-a' is not under a directory this "
        r"deployment allows; it allows \['/data/eagle3/team-b'\]",
    ):
        trigger(tightened)


def test_allowed_workdirs_in_the_settings_replace_the_default():
    deployment = Deployment(run={"workdir": "/nfs/team/run-a"}, allowed_workdirs=["/scratch/eagle3/", "/nfs/./team"])
    assert deployment.allowed.workdirs() == ["/scratch/eagle3", "/nfs/team"]
    assert trigger(deployment)["plan"]["config"]["workdir"] == "/nfs/team/run-a"
    with pytest.raises(ValidationError, match="not under a directory this deployment allows"):
        Deployment(run=WORKDIR, allowed_workdirs=["/scratch/eagle3/", "/nfs/./team"])
    with pytest.raises(ValidationError, match=r"'\.\.' component"):
        Deployment(allowed_workdirs=["/scratch/../etc"])


# -- the API key goes only to the endpoint the settings name for it --------------------------------------------


KEYED = {**WORKDIR, "generate.enabled": True, "generate.api_key_env": "SGLANG_API_KEY"}


def test_the_api_key_is_sent_only_to_the_endpoint_the_settings_allow_for_that_variable():
    allowed = {
        "allowed_endpoint_hosts": ["sglang.internal"],
        "box_env": ["SGLANG_API_KEY"],
        "api_key_endpoints": {"SGLANG_API_KEY": ["http://sglang.internal:30000/v1"]},
    }
    assert trigger(Deployment(run={**KEYED, "generate.endpoint": "http://SGLANG.internal:30000/v1/"}, **allowed))
    for other in (
        "http://sglang.internal:8000/v1",
        "https://sglang.internal:30000/v1",
        "http://sglang.internal:30000/collect",
    ):
        with pytest.raises(
            ValidationError,
            match=r"generate.api_key_env: the key in SGLANG_API_KEY may be sent "
            r"only to \['http://sglang.internal:30000/v1'\], not to "
            "generate.endpoint",
        ):
            Deployment(run={**KEYED, "generate.endpoint": other}, **allowed)
    # A trigger can point neither the endpoint nor the key elsewhere.
    deployment = Deployment(run={**KEYED, "generate.endpoint": "http://sglang.internal:30000/v1"}, **allowed)
    for key, value in (("generate.endpoint", "http://sglang.internal:8000/v1"), ("generate.api_key_env", "OTHER")):
        with pytest.raises(AirflowFailException, match=rf"not trigger parameters: '{key}' \(the deployment's"):
            trigger(deployment, conf={key: value})
    # No endpoint listed for the variable: the key goes nowhere but to a server the stage starts itself.
    unlisted = {"allowed_endpoint_hosts": ["sglang.internal"], "box_env": ["SGLANG_API_KEY"]}
    with pytest.raises(ValidationError, match=r"may be sent to no endpoint \(api_key_endpoints lists none"):
        Deployment(run={**KEYED, "generate.endpoint": "http://sglang.internal:30000/v1"}, **unlisted)
    assert trigger(Deployment(run={**KEYED, "generate.launch_server": True}, **unlisted))


def test_a_host_port_entry_allows_that_port_only():
    allowed = {"allowed_endpoint_hosts": ["sglang.internal:30000"]}
    on = {**WORKDIR, "generate.enabled": True}
    assert trigger(Deployment(run={**on, "generate.endpoint": "http://sglang.internal:30000/v1"}, **allowed))
    with pytest.raises(
        ValidationError,
        match=r"generate.endpoint: sglang.internal:22 not allowed here; this "
        r"deployment allows \['sglang.internal:30000'\]",
    ):
        Deployment(run={**on, "generate.endpoint": "http://sglang.internal:22/v1"}, **allowed)


def test_a_key_mapping_for_a_variable_no_stage_gets_is_refused():
    with pytest.raises(ValidationError, match=r"api_key_endpoints: \['OTHER_KEY'\] not in box_env"):
        Deployment(api_key_endpoints={"OTHER_KEY": ["http://127.0.0.1:30000/v1"]})


# -- approvals ---------------------------------------------------------------------------------------------------


def test_approve_promotion_without_approvers_is_an_import_error_naming_the_key(tmp_path, monkeypatch):
    settings = tmp_path / "dag-settings.json"
    settings.write_text(json.dumps({"approve_promotion": True}))
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))
    with pytest.raises(
        ParamsError,
        match=rf"{settings} \(EAGLE3_DAG_SETTINGS\):\n  approvers: approve_promotion "
        r"is on, but no one may approve",
    ):
        Deployment.from_env()  # what the DAG file calls when it is parsed
    settings.write_text(json.dumps({"approve_promotion": True, "approvers": ["bob", {"id": "7", "name": "carol"}]}))
    assert [a.hitl_user() for a in Deployment.from_env().approvers] == [
        {"id": "bob", "name": "bob"},
        {"id": "7", "name": "carol"},
    ]


# -- the interpreters a run may start on the box ----------------------------------------------------------------


def test_the_settings_name_only_the_interpreters_they_allow():
    """box.python runs every stage and server.python the serving engine: a trigger naming any executable on the box
    would run it with the stage's arguments. Both are the settings' now, checked against allowed_pythons."""
    deployment = Deployment(run=WORKDIR, box={"python": "/opt/eagle3/bin/python"})
    assert deployment.allowed.pythons() == ["/opt/eagle3/bin/python"]  # default: the interpreter the settings name
    assert trigger(deployment)["plan"]["box"]["python"] == "/opt/eagle3/bin/python"
    for key, value in (("box.python", "/bin/sh"), ("server.python", "/home/alice/venv/bin/python")):
        with pytest.raises(AirflowFailException, match=rf"not trigger parameters: '{key}' \(the deployment's"):
            trigger(deployment, conf={key: value})
    with pytest.raises(
        ValidationError,
        match=r"box.python: \['/bin/sh'\] not allowed here; this deployment "
        r"allows \['/opt/eagle3/bin/python'\]",
    ):
        Deployment(run=WORKDIR, box={"python": "/bin/sh"}, allowed_pythons=["/opt/eagle3/bin/python"])
    with pytest.raises(ValidationError, match=r"server.python: \['/home/alice/venv/bin/python'\] not allowed"):
        Deployment(run={**WORKDIR, "server.python": "/home/alice/venv/bin/python"}, box={"python": "python3"})
    with pytest.raises(
        ValidationError,
        match=r"box_pools.gpu-box-1 \(over run and box\) reaches past .*\n  "
        r"box.python: \['/bin/sh'\] not allowed here",
    ):
        Deployment(
            run=WORKDIR, allowed_pythons=["python3"], box_pools={"gpu-box-1": {"gpus": 8, "box": {"python": "/bin/sh"}}}
        )
    vllm = Deployment(
        run={**WORKDIR, "server.engine": "vllm", "server.python": "/opt/vllm/bin/python"},
        allowed_pythons=["python3", "/opt/vllm/bin/python"],
    )
    assert trigger(vllm)["plan"]["config"]["server"]["python"] == "/opt/vllm/bin/python"
    with pytest.raises(ValidationError, match="allowed_pythons"):
        Deployment(allowed_pythons=["python3; rm -rf /"])


# -- the settings file: in the DAG bundle, read when the DAG file is parsed (issue 43) ----------------------------


def test_the_settings_are_the_file_beside_the_dag_file_or_the_one_eagle3_dag_settings_names(tmp_path, monkeypatch):
    """eagle3_settings.json beside the DAG file (in its bundle, deployed and versioned with it); EAGLE3_DAG_SETTINGS
    names another, a relative path against the DAG file's folder (wherever the bundle is checked out); neither: the
    built-in settings."""
    from eagle3_airflow.deployment import SETTINGS_FILE, settings_path

    bundle = tmp_path / "dags"
    (bundle / "settings").mkdir(parents=True)
    monkeypatch.delenv("EAGLE3_DAG_SETTINGS", raising=False)
    assert settings_path(bundle) == (None, "")
    assert Deployment.from_env(bundle).allowed.boxes() == ["local"]  # built-in
    (bundle / SETTINGS_FILE).write_text(
        json.dumps({"allowed_boxes": ["gpu_box"], "params": {"box.conn_ids": ["gpu_box"]}})
    )
    assert Deployment.from_env(bundle).allowed.boxes() == ["gpu_box"]
    (bundle / "settings" / "other.json").write_text(json.dumps({"approve_promotion": True}))
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", "settings/other.json")
    with pytest.raises(
        ParamsError,
        match=rf"{bundle}/settings/other.json \(EAGLE3_DAG_SETTINGS, in the DAG folder "
        rf"{bundle}\):\n  approvers: approve_promotion is on",
    ):
        Deployment.from_env(bundle)
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(bundle / "settings" / "other.json"))  # absolute: as it says
    assert settings_path(tmp_path / "elsewhere") == (bundle / "settings" / "other.json", "EAGLE3_DAG_SETTINGS")
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", "settings/missing.json")
    with pytest.raises(ParamsError, match=r"EAGLE3_DAG_SETTINGS, in the DAG folder .*: cannot read .*missing.json"):
        Deployment.from_env(bundle)


@pytest.mark.parametrize(
    "executor, names",
    [
        ("LocalExecutor", ["LocalExecutor"]),
        ("CeleryExecutor,KubernetesExecutor", ["CeleryExecutor", "KubernetesExecutor"]),
        ("airflow.providers.edge3.executors.EdgeExecutor", ["EdgeExecutor"]),
        ("fast:my.module.MyExecutor, LocalExecutor", ["MyExecutor", "LocalExecutor"]),
        ("LocalExecutor;team1=CeleryExecutor", ["LocalExecutor", "CeleryExecutor"]),
    ],
)
def test_the_executors_are_read_as_airflow_names_them(executor, names):
    from eagle3_airflow.deployment import executor_names

    assert executor_names(executor) == names


def test_a_local_reports_folder_is_refused_under_workers_that_share_no_disk_unless_the_settings_say_they_do():
    """Issue 43: the default reports_url is a folder on the worker's disk; under Celery (or Kubernetes, Edge, ...)
    the report task publishes on one worker and the report tab, in the API server, never sees it. Refused when the
    DAG file is parsed, naming the executor and the two fixes."""
    for local in (None, "/srv/eagle3-reports", "file:///srv/eagle3-reports"):
        settings = Deployment(reports_url=local)
        settings.check_reports_store("LocalExecutor")  # one machine: fine
        for executor, named in (
            ("CeleryExecutor", "CeleryExecutor"),
            ("LocalExecutor,KubernetesExecutor", "KubernetesExecutor"),
        ):
            with pytest.raises(
                ParamsError,
                match=rf"reports_url \(.*\) is a folder on each machine's own disk, but "
                rf"the executor {named} \(\[core\] executor\) runs tasks on workers "
                r"(?s:.*)object store(?s:.*)\"reports_shared_disk\": true",
            ):
                settings.check_reports_store(executor)
        Deployment(reports_url=local, reports_shared_disk=True).check_reports_store("CeleryExecutor")
    with pytest.raises(ParamsError, match=r"the default, \$AIRFLOW_HOME/eagle3-reports"):
        Deployment().check_reports_store("EdgeExecutor")
    Deployment(reports_url="s3://bucket/eagle3", reports_conn_id="aws_reports").check_reports_store("CeleryExecutor")
