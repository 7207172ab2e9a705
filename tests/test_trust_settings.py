"""Issue 35, items 5 and 6 (the Airflow side): what the deployment's settings decide and no trigger can change.

Written as the attacks a user who may trigger the DAG tried: `evaluate.keep_versions=1` to erase older promoted
drafters, a workdir of their choosing for `runs prune` to clean, and the API key sent to another port of an allowed
host. Each is refused by the validate task, naming the field and the settings key.
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
from tests.conftest import RUN

GOOD = {"workdir": "/data/eagle3", "target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"}


def trigger(deployment: Deployment, conf: dict | None = None, **overrides) -> dict:
    """validate as a trigger with `overrides` in the form (and `conf` as sent) runs it under `deployment`."""
    params = ParamsDict(copy.deepcopy(build_params(deployment.params, deployment.form_choices())))
    for key, value in {**GOOD, **overrides}.items():
        params[key] = value
    return validate_run(dict(params.validate()), {**GOOD, **overrides, **(conf or {})}, set(build_params()), RUN,
                        deployment)


# -- keep_versions: the settings', never a trigger's -----------------------------------------------------------


def test_a_trigger_cannot_set_keep_versions_and_the_run_gets_the_settings_value():
    deployment = Deployment(params={"workdir": "/data/eagle3"}, keep_versions=5)
    assert "evaluate.keep_versions" not in build_params()  # the form no longer offers it
    with pytest.raises(AirflowFailException, match=r"'evaluate.keep_versions': the deployment decides it \(its "
                                                   r"settings file's 'keep_versions'"):
        trigger(deployment, conf={"evaluate.keep_versions": 1})
    assert trigger(deployment)["config"]["evaluate"]["keep_versions"] == 5
    with pytest.raises(ParamsError, match=r"set \['keep_versions'\] at the top level of the settings file"):
        build_params({"evaluate.keep_versions": 1})


# -- the workdirs a run may use ------------------------------------------------------------------------------------


def test_by_default_only_the_forms_default_workdir_is_allowed():
    """`runs prune` cleans the run's workdir: a trigger choosing it could point the cleanup at any directory."""
    deployment = Deployment(params={"workdir": "/data/eagle3"})
    assert trigger(deployment, workdir="/data/eagle3/")["plan"]["workdir"] == "/data/eagle3"  # spelled one way
    assert trigger(deployment, workdir="/data/eagle3/team-a")["plan"]["run_dir"].startswith("/data/eagle3/team-a/")
    for elsewhere in ("/home/alice", "/data/eagle3-other", "/data"):
        with pytest.raises(AirflowFailException, match=rf"workdir: '{elsewhere}' is not under a directory this "
                                                       r"deployment allows; it allows \['/data/eagle3'\]"):
            trigger(deployment, workdir=elsewhere)
    with pytest.raises(AirflowFailException, match=r"workdir: '/data/eagle3/\.\./\.\./home/alice' has a '\.\.' "
                                                   "component"):
        trigger(deployment, workdir="/data/eagle3/../../home/alice")
    # A ':' would split the stages' PYTHONPATH={workdir}/code/<digest>: its first part would be searched for an
    # `eagle3` package, not the synced code.
    with pytest.raises(AirflowFailException, match=r"workdir: '/data/eagle3/x:/tmp/mine' has a ':'"):
        trigger(deployment, workdir="/data/eagle3/x:/tmp/mine")
    with pytest.raises(AirflowFailException, match=r"it allows \[\]"):  # no default workdir: none allowed
        trigger(Deployment(), workdir="/data/eagle3")


def test_allowed_workdirs_in_the_settings_replace_the_default():
    deployment = Deployment(allowed_workdirs=["/scratch/eagle3/", "/nfs/./team"])
    assert deployment.workdirs() == ["/scratch/eagle3", "/nfs/team"]
    assert trigger(deployment, workdir="/nfs/team/run-a")
    with pytest.raises(AirflowFailException, match="not under a directory this deployment allows"):
        trigger(deployment, workdir="/data/eagle3")
    with pytest.raises(ValidationError, match=r"'\.\.' component"):
        Deployment(allowed_workdirs=["/scratch/../etc"])


# -- the API key goes only to the endpoint the settings name for it --------------------------------------------


KEYED = {"generate.enabled": True, "generate.api_key_env": "SGLANG_API_KEY"}


def test_the_api_key_is_sent_only_to_the_endpoint_the_settings_allow_for_that_variable():
    deployment = Deployment(params={"workdir": "/data/eagle3"}, allowed_endpoint_hosts=["sglang.internal"],
                            box_env=["SGLANG_API_KEY"],
                            api_key_endpoints={"SGLANG_API_KEY": ["http://sglang.internal:30000/v1"]})
    assert trigger(deployment, **KEYED, **{"generate.endpoint": "http://SGLANG.internal:30000/v1/"})
    for other in ("http://sglang.internal:8000/v1", "https://sglang.internal:30000/v1",
                  "http://sglang.internal:30000/collect"):
        with pytest.raises(AirflowFailException, match=r"generate.api_key_env: the key in SGLANG_API_KEY may be "
                                                       r"sent only to \['http://sglang.internal:30000/v1'\], not to "
                                                       "generate.endpoint"):
            trigger(deployment, **KEYED, **{"generate.endpoint": other})
    # No endpoint listed for the variable: the key goes nowhere but to a server the stage starts itself.
    unlisted = Deployment(params={"workdir": "/data/eagle3"}, allowed_endpoint_hosts=["sglang.internal"],
                          box_env=["SGLANG_API_KEY"])
    with pytest.raises(AirflowFailException, match=r"may be sent to no endpoint \(api_key_endpoints lists none"):
        trigger(unlisted, **KEYED, **{"generate.endpoint": "http://sglang.internal:30000/v1"})
    assert trigger(unlisted, **KEYED, **{"generate.launch_server": True})


def test_a_host_port_entry_allows_that_port_only():
    deployment = Deployment(params={"workdir": "/data/eagle3"}, allowed_endpoint_hosts=["sglang.internal:30000"])
    on = {"generate.enabled": True}
    assert trigger(deployment, **on, **{"generate.endpoint": "http://sglang.internal:30000/v1"})
    with pytest.raises(AirflowFailException, match=r"generate.endpoint: sglang.internal:22 not allowed here; this "
                                                   r"deployment allows \['sglang.internal:30000'\]"):
        trigger(deployment, **on, **{"generate.endpoint": "http://sglang.internal:22/v1"})


def test_a_key_mapping_for_a_variable_no_stage_gets_is_refused():
    with pytest.raises(ValidationError, match=r"api_key_endpoints: \['OTHER_KEY'\] not in box_env"):
        Deployment(api_key_endpoints={"OTHER_KEY": ["http://127.0.0.1:30000/v1"]})


# -- approvals ---------------------------------------------------------------------------------------------------


def test_approve_promotion_without_approvers_is_an_import_error_naming_the_key(tmp_path, monkeypatch):
    settings = tmp_path / "dag-settings.json"
    settings.write_text(json.dumps({"approve_promotion": True}))
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))
    with pytest.raises(ParamsError, match=rf"{settings} \(EAGLE3_DAG_SETTINGS\):\n  approvers: approve_promotion "
                                          r"is on, but no one may approve"):
        Deployment.from_env()  # what the DAG file calls when it is parsed
    settings.write_text(json.dumps({"approve_promotion": True, "approvers": ["bob", {"id": "7", "name": "carol"}]}))
    assert [a.hitl_user() for a in Deployment.from_env().approvers] == [{"id": "bob", "name": "bob"},
                                                                       {"id": "7", "name": "carol"}]


# -- the interpreters a run may start on the box ----------------------------------------------------------------


def test_a_trigger_names_only_the_interpreters_the_settings_allow():
    """box.python runs every stage and server.python the serving engine: a trigger naming any executable on the box
    would run it with the stage's arguments."""
    deployment = Deployment(params={"workdir": "/data/eagle3", "box.python": "/opt/eagle3/bin/python"})
    assert trigger(deployment)["plan"]["python"] == "/opt/eagle3/bin/python"  # the form's default is allowed
    with pytest.raises(AirflowFailException, match=r"box.python: \['/bin/sh'\] not allowed here; this deployment "
                                                   r"allows \['/opt/eagle3/bin/python'\]"):
        trigger(deployment, **{"box.python": "/bin/sh"})
    with pytest.raises(AirflowFailException, match=r"server.python: \['/home/alice/venv/bin/python'\] not allowed"):
        trigger(deployment, **{"server.python": "/home/alice/venv/bin/python"})
    vllm = Deployment(params={"workdir": "/data/eagle3"}, allowed_pythons=["python3", "/opt/vllm/bin/python"])
    assert trigger(vllm, **{"server.engine": "vllm", "server.python": "/opt/vllm/bin/python"})["config"]["server"][
        "python"] == "/opt/vllm/bin/python"
    with pytest.raises(ValidationError, match="allowed_pythons"):
        Deployment(allowed_pythons=["python3; rm -rf /"])
