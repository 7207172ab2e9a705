"""The trigger form: params generated from the run-config model, and the way back to a validated config."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowFailException, ParamValidationError

from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import ParamsError, build_params, params_to_configs, unflatten
from eagle3_airflow.tasks import validate_run
from tests.conftest import RUN

REPO = Path(__file__).resolve().parents[1]

GOOD = {
    "workdir": "/data/eagle3",
    "target.model_path": "/models/kimi",
    "data.path": "/data/conversations.jsonl",
}


def form(**overrides) -> ParamsDict:
    """The DAG's params with a trigger's conf applied, validated the way Airflow validates a trigger."""
    params = ParamsDict(copy.deepcopy(build_params()))
    for key, value in {**GOOD, **overrides}.items():
        params[key] = value
    return params


def test_every_config_field_is_a_param_with_its_help_text():
    params = build_params()
    expected = {"run_name", "workdir", "target.model_path", "train.epochs", "extract.sglang.tp_size", "box.conn_ids"}
    assert expected <= set(params)
    epochs = params["train.epochs"]
    assert epochs.schema["minimum"] == 1 and epochs.schema["type"] == "integer"
    assert epochs.schema["section"].startswith("train:")
    assert params["extract.backend"].schema["enum"] == ["hf", "sglang"]
    assert "Persistent directory" in params["workdir"].description
    # A required path has no default: the form demands it.
    assert not params["workdir"].has_value
    # Every field of the form says what it does under its title.
    assert [key for key, param in params.items() if not param.description] == []


def test_settings_file_defaults_override_model_defaults():
    params = build_params({"workdir": "/nfs/eagle3", "train.epochs": 3})
    assert params["workdir"].value == "/nfs/eagle3" and params["train.epochs"].value == 3
    with pytest.raises(ParamsError, match=r"unknown key\(s\) \['train.epoch'\]"):
        build_params({"train.epoch": 3})


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.epochs", "two"),  # wrong type
        ("train.epochs", 0),  # below minimum
        ("vocab.min_coverage", 1.5),  # above maximum
        ("extract.backend", "vllm"),  # not in enum
        ("run_name", "x; touch /tmp/pwned"),  # shell metacharacters in a name
        ("run_name", "../../etc"),
        ("workdir", "relative/path"),  # not absolute
        ("box.conn_ids", ["ok", "bad id; rm -rf /"]),
        ("box.python", "python3 -c 'import os'"),
        ("box.stop_services", ["vllm.service; reboot"]),
        ("box.stop_services", ["--all"]),  # would reach systemctl as an option
        ("train.learning_rate", float("inf")),
    ],
)
def test_bad_values_are_refused_by_the_form(key, value):
    with pytest.raises(ParamValidationError):
        form(**{key: value}).validate()


def test_good_values_validate_and_become_a_run_config():
    params = form(**{"train.epochs": 2, "extract.aux_layers": [1, 5, 9], "box.conn_ids": ["gpu1", "gpu2"]})
    resolved = params.validate()
    config, box = params_to_configs(resolved, "manual__2026-11-29T10:00:00+00:00")
    assert config.train.epochs == 2 and config.extract.aux_layers == [1, 5, 9]
    assert config.run_name == "manual__2026-11-29T10-00-00-00-00"  # empty run_name: named after the run id
    assert box.conn_ids == ["gpu1", "gpu2"]


def test_unknown_conf_keys_are_rejected_by_the_first_task_with_a_hint():
    params = dict(form().validate())
    with pytest.raises(AirflowFailException, match=r"'epochs' \(did you mean 'train.epochs'\?\)"):
        validate_run(params, {"epochs": 2}, set(build_params()), RUN)


def test_cross_field_errors_name_the_field():
    params = dict(form(**{"target.num_hidden_layers": 8, "extract.aux_layers": [1, 3, 9]}).validate())
    with pytest.raises(AirflowFailException, match=r"extract.aux_layers: layer 9 out of range for a 8-layer target"):
        validate_run(params, {}, set(build_params()), RUN)


def test_paths_with_shell_syntax_are_valid_data_not_commands():
    """$(...) and backticks are legal in a POSIX path; they travel as data (argv elements, a JSON file)."""
    path = "/data/$(touch /tmp/pwned)/`id`/x.jsonl"
    run = validate_run(dict(form(**{"data.path": path}).validate()), {}, set(build_params()), RUN, trusted())
    assert run["config"]["data"]["path"] == path


def test_unflatten_drops_nulls_so_model_defaults_apply():
    assert unflatten({"a.b": 1, "a.c": None, "d": 2}) == {"a": {"b": 1}, "d": 2}


def test_the_params_reference_in_docs_is_the_forms():
    """docs/params.md is generated from the same params as the form; regenerate it with `make docs`."""
    proc = subprocess.run([sys.executable, "scripts/params_reference.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (REPO / "docs" / "params.md").read_text()
    assert "| `train.epochs` | integer | `1` | >= 1, <= 10000 |" in text and "## server:" in text


def test_an_emptied_run_name_is_allowed_and_names_the_run_after_the_run_id():
    """The web form sends an emptied text field as null and marks any param that cannot be null as required."""
    resolved = form(run_name=None).validate()
    config, _ = params_to_configs(resolved, "scheduled__2026-11-29T00:00:00+00:00")
    assert config.run_name == "scheduled__2026-11-29T00-00-00-00-00"


# -- the deployment decides which boxes, services, hosts and variables a run may use -----------------------


def trusted(**settings) -> Deployment:
    """Settings under which GOOD's workdir is allowed (a trigger may use no workdir the settings do not allow)."""
    return Deployment(**{"allowed_workdirs": ["/data"], **settings})


def validate_under(deployment, **overrides) -> dict:
    return validate_run(dict(form(**overrides).validate()), {}, set(build_params()), RUN, deployment)


def test_a_trigger_cannot_send_the_run_to_another_stored_connection():
    """Any Airflow connection id is a valid name (a database bastion's, say); only the deployment's boxes pass."""
    deployment = trusted(allowed_boxes=["gpu-box-1", "gpu-box-2"], params={"box.conn_ids": ["gpu-box-1"]})
    assert validate_under(deployment, **{"box.conn_ids": ["gpu-box-2"]})["plan"]["conn_ids"] == ["gpu-box-2"]
    with pytest.raises(AirflowFailException, match=r"box.conn_ids: \['db_bastion'\] not allowed here; this "
                       r"deployment allows \['gpu-box-1', 'gpu-box-2'\]"):
        validate_under(deployment, **{"box.conn_ids": ["gpu-box-1", "db_bastion"]})
    # With no list in the settings file, only the default box is allowed.
    with pytest.raises(AirflowFailException, match=r"allows \['local'\]"):
        validate_under(trusted(), **{"box.conn_ids": ["db_bastion"]})


def test_the_form_offers_only_the_deployments_boxes_and_services():
    deployment = Deployment(allowed_boxes=["gpu-box-1"], params={"box.conn_ids": ["gpu-box-1"]})
    params = ParamsDict(copy.deepcopy(build_params(deployment.params, deployment.form_choices())))
    for key, value in GOOD.items():
        params[key] = value
    with pytest.raises(ParamValidationError, match="'db_bastion' is not one of \\['gpu-box-1'\\]"):
        params["box.conn_ids"] = ["db_bastion"]
    with pytest.raises(ParamValidationError):  # no service may be stopped unless the deployment lists one
        params["box.stop_services"] = ["sshd.service"]
    params["box.conn_ids"] = ["gpu-box-1"]
    assert params.validate()["box.conn_ids"] == ["gpu-box-1"]


def test_a_trigger_cannot_stop_a_service_the_deployment_did_not_list():
    deployment = trusted(allowed_services=["vllm.service"])
    assert validate_under(deployment, **{"box.stop_services": ["vllm.service"]})["plan"]["stop_services"] == [
        "vllm.service"]
    with pytest.raises(AirflowFailException, match=r"box.stop_services: \['sshd.service'\] not allowed here"):
        validate_under(deployment, **{"box.stop_services": ["sshd.service"]})


def test_generate_talks_only_to_the_deployments_endpoint_hosts():
    """The endpoint receives every conversation (and the API key): a trigger cannot point it at its own host."""
    on = {"generate.enabled": True}
    assert validate_under(trusted(), **on, **{"generate.endpoint": "http://localhost:30000/v1"})
    with pytest.raises(AirflowFailException, match=r"generate.endpoint: collector.example:443 not allowed here"):
        validate_under(trusted(), **on, **{"generate.endpoint": "https://collector.example/v1"})
    allowed = trusted(allowed_endpoint_hosts=["sglang.internal"])
    assert validate_under(allowed, **on, **{"generate.endpoint": "http://sglang.internal:30000/v1"})


def test_an_api_key_variable_must_be_one_the_deployment_passes():
    """Else a trigger could name any variable of the box (AIRFLOW__CORE__FERNET_KEY on a local box) and have it
    sent to the endpoint as a bearer token."""
    with pytest.raises(AirflowFailException, match=r"generate.api_key_env: 'AIRFLOW__CORE__FERNET_KEY' is not a "
                       r"variable this deployment passes"):
        validate_under(trusted(), **{"generate.api_key_env": "AIRFLOW__CORE__FERNET_KEY"})
    run = validate_under(trusted(box_env=["SGLANG_API_KEY"]), **{"generate.api_key_env": "SGLANG_API_KEY"})
    assert run["plan"]["box_env"] == ["SGLANG_API_KEY"]


def test_a_settings_file_with_a_typo_or_a_default_it_does_not_allow_is_refused(tmp_path, monkeypatch):
    settings = tmp_path / "dag-settings.json"
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))
    settings.write_text(json.dumps({"allowed_box": ["gpu-box-1"]}))
    with pytest.raises(ParamsError, match="allowed_box: unknown key"):
        Deployment.from_env()
    settings.write_text(json.dumps({"allowed_boxes": ["gpu-box-1"]}))  # the default box, 'local', is not in it
    with pytest.raises(ParamsError, match=r"box.conn_ids: \['local'\] not allowed here"):
        Deployment.from_env()
    settings.write_text(json.dumps({"allowed_boxes": ["gpu-box-1"], "params": {"box.conn_ids": ["gpu-box-1"]}}))
    assert Deployment.from_env().boxes() == ["gpu-box-1"]


def test_a_schedule_needs_a_default_for_every_required_param_and_a_valid_run(tmp_path, monkeypatch):
    """Scheduled runs take the form's defaults: without a default for target.model_path the scheduler used to fail
    'creating DagRun' on every loop while the UI showed nothing. Refused where the DAG is parsed instead."""
    settings = tmp_path / "dag-settings.json"
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))
    settings.write_text(json.dumps({"schedule": "@weekly", "params": {"data.path": "/data/conversations.jsonl"}}))
    deployment = Deployment.from_env()
    with pytest.raises(ParamsError, match=rf"the settings file {settings} \(EAGLE3_DAG_SETTINGS\): schedule '@weekly' "
                       r"starts runs .* required params have none: \['target.model_path', 'workdir'\]"):
        deployment.check_schedulable(build_params(deployment.params, deployment.form_choices()))

    settings.write_text(json.dumps({"schedule": "@weekly", "params": {**GOOD, "train.learning_rate": -1.0}}))
    deployment = Deployment.from_env()
    with pytest.raises(ParamsError, match=r"(?s)do not make a valid run: .*train.learning_rate: Input should be"):
        deployment.check_schedulable(build_params(deployment.params, deployment.form_choices()))

    settings.write_text(json.dumps({"schedule": "@weekly", "params": GOOD}))
    deployment = Deployment.from_env()
    deployment.check_schedulable(build_params(deployment.params, deployment.form_choices()))
    Deployment().check_schedulable(build_params())  # unscheduled: triggers fill the form in


def test_create_pool_makes_the_settings_pool_and_counts_deferred_tasks(airflow_home, tmp_path):
    """The remote stages defer within seconds and wait in the triggerer: a pool that leaves deferred tasks out
    bounds nothing. make demo, make airflow and the compose init create it with this command."""
    from tests.airflow_env import AIRFLOW, airflow_env

    settings = tmp_path / "dag-settings.json"
    settings.write_text(json.dumps({"pool": "gpu-box-pool", "pool_slots": 3}))
    env = airflow_env(airflow_home, EAGLE3_DAG_SETTINGS=str(settings))
    subprocess.run([sys.executable, "-m", "eagle3_airflow.deployment", "create-pool", "--airflow", AIRFLOW],
                   env=env, check=True, capture_output=True, timeout=120)
    shown = subprocess.run([AIRFLOW, "pools", "get", "gpu-box-pool", "-o", "json"], env=env, check=True,
                           capture_output=True, text=True, timeout=120)
    (pool,) = json.loads(shown.stdout)
    assert pool["slots"] in (3, "3") and str(pool["include_deferred"]).lower() == "true"
