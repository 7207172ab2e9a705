"""The trigger form: a dozen fields generated from the run-config model, the deployment's settings layers under
them (`run`, presets, `box`), and the way back to a validated config."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowFailException, ParamValidationError
from pydantic import ValidationError

from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import (
    BOX_PREFIX,
    FORM_FIELDS,
    NOTES,
    PRESET,
    SETTINGS_ONLY,
    ParamsError,
    box_layer_fields,
    build_params,
    model_leaves,
    params_to_configs,
    required_params,
    run_layer_fields,
    unflatten,
)
from eagle3_airflow.tasks import validate_run
from tests.conftest import RUN

REPO = Path(__file__).resolve().parents[1]

# The form's required fields (paths on the box); the work directory is the deployment's (its settings' run).
GOOD = {
    "target.model_path": "/models/kimi",
    "data.path": "/data/conversations.jsonl",
}
WORKDIR = {"workdir": "/data/eagle3"}
RUN_ID = "manual__2026-11-29T10:00:00+00:00"


def form(under: Deployment | None = None, **overrides) -> ParamsDict:
    """The form's params with a trigger's values applied, validated the way Airflow validates a trigger. Its presets
    are those of the deployment `under`, but not its boxes: what validate refuses by itself is what is tested."""
    params = ParamsDict(copy.deepcopy(build_params(presets=under and under.preset_names())))
    for key, value in {**GOOD, **overrides}.items():
        params[key] = value
    return params


def test_the_form_holds_exactly_its_fields_each_with_its_help_text():
    """A dozen fields a person chooses per run (it had 107: every leaf of the run config and the box settings)."""
    params = build_params()
    assert tuple(params) == FORM_FIELDS and len(params) <= 15
    epochs = params["train.epochs"]
    assert epochs.schema["minimum"] == 1 and epochs.schema["type"] == "integer"
    assert epochs.schema["section"].startswith("recipe:")
    assert params[PRESET].schema["enum"] == ["default"] and params[PRESET].value == "default"
    assert not {"workdir", "box.python", "box.stop_services", "generate.endpoint", "server.extra_args"} & set(params)
    # A required path has no default: the form demands it; the work directory is no longer the form's.
    assert required_params() == ["data.path", "target.model_path"]
    assert not params["target.model_path"].has_value and not params["data.path"].has_value
    # Every field of the form says what it does under its title.
    assert [key for key, param in params.items() if not param.description] == []
    # Every other field of the run config and the box settings is the settings': `run` and presets, `box`, or
    # (keep_versions) its top level. None is lost, none is in two places.
    run, box = run_layer_fields(), [f"{BOX_PREFIX}.{name}" for name in box_layer_fields()]
    places = [set(FORM_FIELDS) - {PRESET, NOTES}, set(run), set(box), set(SETTINGS_ONLY)]
    assert sum(map(len, places)) == len(model_leaves()) and set().union(*places) == set(model_leaves())
    assert {"workdir", "target.dtype", "extract.backend", "server.extra_args", "generate.endpoint"} <= set(run)
    assert {"box.python", "box.stop_services", "box.poll_interval_s"} <= set(box)


def test_settings_file_defaults_override_model_defaults():
    params = build_params({"target.model_path": "/models/kimi", "train.epochs": 3})
    assert params["target.model_path"].value == "/models/kimi" and params["train.epochs"].value == 3
    with pytest.raises(ParamsError, match=r"params: \['train.epoch'\] are not form fields"):
        build_params({"train.epoch": 3})
    # A field that is not the form's is not a form default: the settings' run, a preset or box set it.
    with pytest.raises(ParamsError, match=r"params: \['workdir'\] are not form fields; .* go in the settings' \"run\""):
        build_params({"workdir": "/nfs/eagle3"})
    with pytest.raises(ValidationError, match=r"params: \['box.python', 'workdir'\] are not form fields"):
        Deployment(params={"workdir": "/nfs/eagle3", "box.python": "/opt/eagle3/bin/python"}, run=WORKDIR)
    # The settings' run and box override the models' defaults in every run.
    deployment = Deployment(
        run={**WORKDIR, "train.batch_tokens": 1234, "target.dtype": "float32"}, box={"poll_interval_s": 2.5}
    )
    config, box = deployment.configs(dict(form().validate()), RUN_ID)
    assert config.workdir == "/data/eagle3" and config.train.batch_tokens == 1234 and config.target.dtype == "float32"
    assert box.poll_interval_s == 2.5 and box.conn_ids == ["local"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.epochs", "two"),  # wrong type
        ("train.epochs", 0),  # below minimum
        ("run_name", "x; touch /tmp/pwned"),  # shell metacharacters in a name
        ("run_name", "../../etc"),
        ("box.conn_ids", ["ok", "bad id; rm -rf /"]),
        ("train.learning_rate", float("inf")),
        ("seed", 2**70),
        (PRESET, "no-such-preset"),  # the deployment's presets only
        (NOTES, "x" * 501),
    ],
)
def test_bad_values_are_refused_by_the_form(key, value):
    with pytest.raises(ParamValidationError):
        form(**{key: value}).validate()


@pytest.mark.parametrize(
    "layer, key, value, shown",
    [
        ("run", "vocab.min_coverage", 1.5, "vocab.min_coverage: Input should be less than or equal to 1"),
        ("run", "extract.backend", "vllm", "extract.backend: Input should be 'hf' or 'sglang'"),
        ("run", "workdir", "relative/path", "workdir: 'relative/path' does not match"),  # not absolute
        ("box", "python", "python3 -c 'import os'", "box.python: \"python3 -c 'import os'\" does not match"),
        ("box", "stop_services", ["vllm.service; reboot"], "box.stop_services.0: 'vllm.service; reboot' does not"),
        ("box", "stop_services", ["--all"], "box.stop_services.0: '--all' does not match"),  # a systemctl option
    ],
)
def test_bad_values_in_the_settings_are_refused_when_they_are_read(layer, key, value, shown):
    """The fields the form no longer holds are checked where they are now set: the settings file, when the DAG is
    parsed (an import error naming the field), with the same model's rules."""
    settings = {"run": dict(WORKDIR), "box": {}}
    settings[layer][key] = value
    with pytest.raises(ValidationError) as info:
        Deployment(**settings)
    assert shown in str(info.value)


def test_good_values_validate_and_become_a_run_config():
    deployment = Deployment(
        run={**WORKDIR, "extract.aux_layers": [1, 5, 9]},
        allowed_boxes=["gpu1", "gpu2"],
        params={"box.conn_ids": ["gpu1"]},
    )
    params = form(**{"train.epochs": 2, "box.conn_ids": ["gpu1", "gpu2"]})
    config, box = deployment.configs(params.validate(), RUN_ID)
    assert config.train.epochs == 2 and config.extract.aux_layers == [1, 5, 9]
    assert config.run_name == "eagle3_drafter.manual__2026-11-29T10-00-00-00-00"  # empty: after its DAG and run
    assert box.conn_ids == ["gpu1", "gpu2"]


# -- presets: named recipes over the settings' run, under the form ---------------------------------------------


def test_a_presets_values_reach_the_config_and_the_forms_values_win():
    deployment = Deployment(
        run={**WORKDIR, "train.batch_tokens": 4096, "data.max_length": 2048},
        presets={"long": {"train.batch_tokens": 32768, "data.max_length": 16384}},
    )
    assert deployment.preset_names() == ["default", "long"]
    assert deployment.form()[PRESET].schema["enum"] == ["default", "long"]
    long, _ = deployment.configs(dict(form(deployment, **{PRESET: "long", "train.epochs": 2}).validate()), RUN_ID)
    assert (long.train.batch_tokens, long.data.max_length, long.train.epochs) == (32768, 16384, 2)
    plain, _ = deployment.configs(dict(form().validate()), RUN_ID)  # default: the settings' run alone
    assert (plain.train.batch_tokens, plain.data.max_length, plain.train.epochs) == (4096, 2048, 1)
    with pytest.raises(
        ParamsError,
        match=r"preset: 'huge' is not one of this deployment's presets "
        r"\['default', 'long'\]",
    ):
        deployment.configs({**GOOD, PRESET: "huge"}, RUN_ID)
    # The layers, a later one winning: the model's defaults < run < the preset < the form.
    config, _ = params_to_configs(
        {**GOOD, "train.epochs": 2, "train.learning_rate": 3e-4},
        RUN_ID,
        run={**WORKDIR, "train.epochs": 5, "train.learning_rate": 1e-3, "seed": 1},
        preset={"train.epochs": 7, "seed": 2},
    )
    assert (config.train.epochs, config.train.learning_rate, config.seed) == (2, 3e-4, 2)
    # A preset named 'default' replaces `run` alone as the default.
    assert (
        Deployment(run=WORKDIR, presets={"default": {"train.batch_tokens": 1024}})
        .configs(dict(form().validate()), RUN_ID)[0]
        .train.batch_tokens
        == 1024
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"run": {**WORKDIR, "train.epochs": 3}},
            r"run: \['train.epochs'\] are the form's \(a trigger sets them\); "
            r"give their defaults in \"params\"",
        ),
        ({"presets": {"long": {"data.path": "/data/long.jsonl"}}}, r"presets.long: \['data.path'\] are the form's"),
        ({"presets": {"long": {"train.epoch": 3}}}, r"presets.long: \['train.epoch'\] are not run-config fields"),
        ({"run": {**WORKDIR, "box.python": "python3"}}, r"run: \['box.python'\] are not run-config fields"),
        ({"run": {**WORKDIR, "evaluate.keep_versions": 1}}, r"run: \['evaluate.keep_versions'\] are not run-config"),
        (
            {"box": {"conn_ids": ["gpu-box-2"]}},
            r"box: \['conn_ids'\] are not box settings .* which boxes a run uses is "
            r"the form's box.conn_ids",
        ),
        (
            {"box_pools": {"gpu-box-1": {"gpus": 8, "run": {"train.ttt_length": 3}}}},
            r"box_pools.gpu-box-1.run: \['train.ttt_length'\] are the form's",
        ),
        (
            {"box_pools": {"gpu-box-1": {"gpus": 8, "box": {"pyhton": "python3"}}}},
            r"box_pools.gpu-box-1.box: \['pyhton'\] are not box settings",
        ),
    ],
)
def test_a_layer_naming_a_field_that_is_not_its_own_is_refused_naming_it(settings, message):
    """A form field in `run` or a preset would be overridden by the form without a word, a typo never read."""
    with pytest.raises(ValidationError, match=message):
        Deployment(**{"run": WORKDIR, **settings})


def test_each_preset_must_make_a_valid_run_with_the_settings():
    """A preset is checked over `run` when the settings are read, not when someone picks it: the message names it."""
    with pytest.raises(
        ValidationError,
        match=r"run and box with the preset 'deep' do not make a valid run: .*\n  "
        r"extract.aux_layers: layer 9 out of range for a 8-layer target",
    ):
        Deployment(run={**WORKDIR, "target.num_hidden_layers": 8}, presets={"deep": {"extract.aux_layers": [1, 3, 9]}})


# -- a trigger chooses the form's fields and nothing else -----------------------------------------------------


def test_unknown_conf_keys_are_rejected_by_the_first_task_with_a_hint():
    params = dict(form().validate())
    for typo in ("epochs", "train.epoch"):
        with pytest.raises(
            AirflowFailException,
            match=rf"not trigger parameters: '{typo}' \(did you mean "
            r"'train.epochs'\?\)",
        ):
            validate_run(params, {typo: 2}, set(build_params()), RUN, trusted())


@pytest.mark.parametrize(
    "key, value",
    [
        ("workdir", "/home/alice"),
        ("server.extra_args", ["--enable-custom-all-reduce"]),
        ("generate.endpoint", "https://collector.example/v1"),
        ("generate.api_key_env", "AIRFLOW__CORE__FERNET_KEY"),
        ("extract.aux_layers", [1, 5, 9]),
        ("server.python", "/bin/sh"),
        ("box.python", "/bin/sh"),
        ("box.stop_services", ["sshd.service"]),
    ],
)
def test_a_trigger_cannot_set_what_the_settings_decide(key, value):
    """Airflow merges conf keys that are not params into the params: validate refuses them, saying whose they are."""
    params = {**form().validate(), key: value}  # as Airflow hands them over
    with pytest.raises(
        AirflowFailException,
        match=rf"not trigger parameters: '{key}' \(the deployment's: its "
        r"settings' run, box or a preset\)\. A trigger chooses only the form's fields",
    ):
        validate_run(params, {key: value}, set(build_params()), RUN, trusted())


def test_cross_field_errors_name_the_field():
    deployment = trusted(run={**WORKDIR, "target.num_hidden_layers": 8, "extract.aux_layers": [1, 3, 7]})
    assert validate_run(dict(form().validate()), {}, set(build_params()), RUN, deployment)
    with pytest.raises(ValidationError, match=r"extract.aux_layers: layer 9 out of range for a 8-layer target"):
        trusted(run={**WORKDIR, "target.num_hidden_layers": 8, "extract.aux_layers": [1, 3, 9]})


def test_paths_with_shell_syntax_are_valid_data_not_commands():
    """$(...) and backticks are legal in a POSIX path; they travel as data (argv elements, a JSON file)."""
    path = "/data/$(touch /tmp/pwned)/`id`/x.jsonl"
    run = validate_run(dict(form(**{"data.path": path}).validate()), {}, set(build_params()), RUN, trusted())
    assert run["plan"]["config"]["data"]["path"] == path


def test_a_run_needs_a_work_directory_from_the_settings():
    with pytest.raises(
        AirflowFailException,
        match=r"workdir: the built-in settings .* name no work directory on "
        r"the box; set \"run\": \{\"workdir\": \"/data/eagle3\"\}",
    ):
        validate_run(dict(form().validate()), {}, set(build_params()), RUN, Deployment())


def test_the_notes_and_the_preset_reach_the_plan_not_the_config():
    deployment = trusted(presets={"long": {"train.batch_tokens": 32768}})
    run = validate_under(deployment, **{PRESET: "long", NOTES: "new data from the support queue"})
    assert run["plan"]["notes"] == "new data from the support queue"
    assert run["plan"]["config"]["train"]["batch_tokens"] == 32768
    assert not {PRESET, NOTES} & set(run["plan"]["config"])


def test_unflatten_drops_nulls_so_model_defaults_apply():
    assert unflatten({"a.b": 1, "a.c": None, "d": 2}) == {"a": {"b": 1}, "d": 2}


@pytest.mark.slow
def test_the_params_reference_in_docs_is_the_forms():
    """docs/params.md is generated from the same params as the form; regenerate it with `make docs`."""
    proc = subprocess.run(
        [sys.executable, "scripts/params_reference.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = (REPO / "docs" / "params.md").read_text()
    assert "| `train.epochs` | integer | `1` | >= 1, <= 10000 |" in text
    assert "## Settings `run` and presets, server:" in text


def test_an_emptied_run_name_is_allowed_and_names_the_run_after_its_dag_and_run_id():
    """The web form sends an emptied text field as null and marks any param that cannot be null as required. The
    name carries the DAG id too: two boxes' DAGs share run ids (scheduled__<date>), never a run directory."""
    resolved = form(run_name=None).validate()
    config, _ = Deployment(run=WORKDIR).configs(resolved, "scheduled__2026-11-29T00:00:00+00:00")
    assert config.run_name == "eagle3_drafter.scheduled__2026-11-29T00-00-00-00-00"


# -- the deployment decides which boxes, services, hosts and variables a run may use -----------------------


def trusted(**settings) -> Deployment:
    """Settings with a work directory (every run needs one) that they allow: the settings' run names it."""
    return Deployment(**{"allowed_workdirs": ["/data"], **settings, "run": {**WORKDIR, **settings.get("run", {})}})


def validate_under(deployment, **overrides) -> dict:
    return validate_run(dict(form(deployment, **overrides).validate()), {}, set(build_params()), RUN, deployment)


def test_a_trigger_cannot_send_the_run_to_another_stored_connection():
    """Any Airflow connection id is a valid name (a database bastion's, say); only the deployment's boxes pass."""
    deployment = trusted(allowed_boxes=["gpu-box-1", "gpu-box-2"], params={"box.conn_ids": ["gpu-box-1"]})
    assert validate_under(deployment, **{"box.conn_ids": ["gpu-box-2"]})["plan"]["box"]["conn_ids"] == ["gpu-box-2"]
    with pytest.raises(
        AirflowFailException,
        match=r"box.conn_ids: \['db_bastion'\] not allowed here; this "
        r"deployment allows \['gpu-box-1', 'gpu-box-2'\]",
    ):
        validate_under(deployment, **{"box.conn_ids": ["gpu-box-1", "db_bastion"]})
    # With no list in the settings file, only the default box is allowed.
    with pytest.raises(AirflowFailException, match=r"allows \['local'\]"):
        validate_under(trusted(), **{"box.conn_ids": ["db_bastion"]})


def test_the_form_offers_only_the_deployments_boxes_and_presets():
    deployment = Deployment(
        allowed_boxes=["gpu-box-1"],
        params={"box.conn_ids": ["gpu-box-1"]},
        run=WORKDIR,
        presets={"long": {"train.batch_tokens": 32768}},
    )
    params = ParamsDict(copy.deepcopy(deployment.form()))
    for key, value in GOOD.items():
        params[key] = value
    with pytest.raises(ParamValidationError, match="'db_bastion' is not one of \\['gpu-box-1'\\]"):
        params["box.conn_ids"] = ["db_bastion"]
    with pytest.raises(ParamValidationError, match="'huge' is not one of \\['default', 'long'\\]"):
        params[PRESET] = "huge"
    assert "box.stop_services" not in params  # which services a run stops is the settings' box, never the form's
    params["box.conn_ids"] = ["gpu-box-1"]
    params[PRESET] = "long"
    assert params.validate()["box.conn_ids"] == ["gpu-box-1"] and params.validate()[PRESET] == "long"


def test_the_services_a_run_stops_are_the_settings_and_allowed():
    deployment = trusted(allowed_services=["vllm.service"], box={"stop_services": ["vllm.service"]})
    assert validate_under(deployment)["plan"]["box"]["stop_services"] == ["vllm.service"]
    # default: what box names
    assert trusted(box={"stop_services": ["vllm.service"]}).allowed.services() == ["vllm.service"]
    assert validate_under(trusted())["plan"]["box"]["stop_services"] == []  # none unless the settings name some
    with pytest.raises(ValidationError, match=r"box.stop_services: \['sshd.service'\] not allowed here"):
        trusted(allowed_services=["vllm.service"], box={"stop_services": ["sshd.service"]})
    with pytest.raises(
        ValidationError,
        match=r"box_pools.gpu-box-1 \(over run and box\) reaches past what this "
        r"deployment allows:\n  box.stop_services: \['sshd.service'\] not allowed here",
    ):
        trusted(
            allowed_services=["vllm.service"],
            box_pools={"gpu-box-1": {"gpus": 8, "box": {"stop_services": ["sshd.service"]}}},
        )


def test_generate_talks_only_to_the_deployments_endpoint_hosts():
    """The endpoint receives every conversation (and the API key): the settings name it, among the allowed hosts."""
    on = {"generate.enabled": True}
    assert validate_under(trusted(run={**on, "generate.endpoint": "http://localhost:30000/v1"}))
    with pytest.raises(ValidationError, match=r"generate.endpoint: collector.example:443 not allowed here"):
        trusted(
            allowed_endpoint_hosts=["sglang.internal"], run={**on, "generate.endpoint": "https://collector.example/v1"}
        )
    allowed = trusted(
        allowed_endpoint_hosts=["sglang.internal"], run={**on, "generate.endpoint": "http://sglang.internal:30000/v1"}
    )
    assert validate_under(allowed)["plan"]["config"]["generate"]["endpoint"] == "http://sglang.internal:30000/v1"
    # Without the list: the loopback and the host the settings' own endpoint names.
    assert trusted(run={"generate.endpoint": "http://sglang.internal:30000/v1"}).allowed.endpoint_hosts() == [
        "127.0.0.1",
        "localhost",
        "sglang.internal",
    ]


def test_an_api_key_variable_must_be_one_the_deployment_passes():
    """Else the settings could name any variable of the box (AIRFLOW__CORE__FERNET_KEY on a local box) and have it
    sent to the endpoint as a bearer token."""
    with pytest.raises(
        ValidationError,
        match=r"generate.api_key_env: 'AIRFLOW__CORE__FERNET_KEY' is not a "
        r"variable this deployment passes",
    ):
        trusted(run={"generate.api_key_env": "AIRFLOW__CORE__FERNET_KEY"})
    run = validate_under(trusted(box_env=["SGLANG_API_KEY"], run={"generate.api_key_env": "SGLANG_API_KEY"}))
    assert run["plan"]["box_env"] == ["SGLANG_API_KEY"]


def test_a_presets_values_are_checked_against_the_allow_lists_when_a_run_uses_it():
    """A preset sets the same run-config fields as `run`: a run with it is checked like any other, by validate (if
    the settings are not refused when they are read already)."""
    refused = r"workdir: '/home/alice' is not under a directory this deployment allows; it allows \['/data/eagle3'\]"
    try:
        deployment = trusted(allowed_workdirs=["/data/eagle3"], presets={"elsewhere": {"workdir": "/home/alice"}})
    except ValidationError as err:
        assert re.search(refused, str(err)), err
        return
    with pytest.raises(AirflowFailException, match=refused):
        validate_under(deployment, **{PRESET: "elsewhere"})


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
    assert Deployment.from_env().allowed.boxes() == ["gpu-box-1"]
    # A file written for the 107-field form: its workdir is the settings' run now, and the message says so.
    settings.write_text(json.dumps({"params": {"workdir": "/data/eagle3"}}))
    with pytest.raises(
        ParamsError,
        match=rf"{settings} \(EAGLE3_DAG_SETTINGS\):\n  params: \['workdir'\] are not "
        r"form fields .* put run-config fields in \"run\"",
    ):
        Deployment.from_env()
    settings.write_text(json.dumps({"run": {"workdir": "/data/eagle3"}, "allowed_workdirs": ["/scratch"]}))
    with pytest.raises(ParamsError, match=r"workdir: '/data/eagle3' is not under a directory this deployment allows"):
        Deployment.from_env()


def test_a_schedule_needs_a_default_for_every_required_param_and_a_valid_run(tmp_path, monkeypatch):
    """Scheduled runs take the form's defaults: without a default for target.model_path the scheduler used to fail
    'creating DagRun' on every loop while the UI showed nothing. Refused where the DAG is parsed instead."""
    settings = tmp_path / "dag-settings.json"
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))
    settings.write_text(json.dumps({"schedule": "@weekly", "run": WORKDIR}))
    deployment = Deployment.from_env()
    with pytest.raises(
        ParamsError,
        match=rf"the settings file {settings} \(EAGLE3_DAG_SETTINGS\): schedule '@weekly' "
        r"starts runs .* required params have none: \['data.path', 'target.model_path'\]",
    ):
        deployment.check_schedulable(deployment.form())

    settings.write_text(
        json.dumps({"schedule": "@weekly", "run": WORKDIR, "params": {**GOOD, "train.learning_rate": -1.0}})
    )
    deployment = Deployment.from_env()
    with pytest.raises(ParamsError, match=r"(?s)do not make a valid run: .*train.learning_rate: Input should be"):
        deployment.check_schedulable(deployment.form())

    settings.write_text(json.dumps({"schedule": "@weekly", "params": GOOD}))  # no work directory in the settings
    deployment = Deployment.from_env()
    with pytest.raises(ParamsError, match=r"do not make a valid run: workdir: .* name no work directory"):
        deployment.check_schedulable(deployment.form())

    settings.write_text(json.dumps({"schedule": "@weekly", "params": GOOD, "run": WORKDIR}))
    deployment = Deployment.from_env()
    deployment.check_schedulable(deployment.form())
    Deployment().check_schedulable(build_params())  # unscheduled: triggers fill the form in


@pytest.mark.slow
def test_create_pool_makes_the_settings_pool_and_counts_deferred_tasks(airflow_home, tmp_path):
    """The remote stages defer within seconds and wait in the triggerer: a pool that leaves deferred tasks out
    bounds nothing. make demo, make airflow and the compose init create it with this command."""
    from tests.airflow_env import AIRFLOW, airflow_env

    settings = tmp_path / "dag-settings.json"
    settings.write_text(json.dumps({"pool": "gpu-box-pool", "pool_slots": 3}))
    env = airflow_env(airflow_home, EAGLE3_DAG_SETTINGS=str(settings))
    subprocess.run(
        [sys.executable, "-m", "eagle3_airflow.deployment", "create-pool", "--airflow", AIRFLOW],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    shown = subprocess.run(
        [AIRFLOW, "pools", "get", "gpu-box-pool", "-o", "json"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (pool,) = json.loads(shown.stdout)
    assert pool["slots"] in (3, "3") and str(pool["include_deferred"]).lower() == "true"
