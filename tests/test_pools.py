"""Issue 36 item 3: a box is a resource. One pool per box, whose slots are its GPUs; one DAG per box, so two boxes
run two runs at once; each task holds the GPUs it uses in its own box's pool; a run cannot use more than its DAG
holds, nor another box. Issue 43 item 4: adding a box renames no DAG, and one schedule tick makes one run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from airflow.sdk.exceptions import AirflowFailException, ParamValidationError
from pydantic import ValidationError

from eagle3_airflow.deployment import Deployment, create_pool_argvs
from eagle3_airflow.params import build_params
from eagle3_airflow.pools import box_params, is_drafter_dag
from eagle3_airflow.tasks import validate_run
from tests.airflow_env import AIRFLOW, REPO, airflow_env
from tests.conftest import RUN
from tests.test_trust_settings import GOOD, trigger

TWO_BOXES = {
    "box_pools": {"box-a": {"gpus": 4}, "box-b": {"gpus": 8, "shard_gpus": 2}},
    "run": {"workdir": "/data/eagle3"},
    "presets": {"wide": {"train.gpus": list(range(8))}},
}


def box_settings(conn_id: str, settings: dict = TWO_BOXES) -> Deployment:
    deployment = Deployment.model_validate(settings)
    (resource,) = [r for r in deployment.resources() if r.conn_id == conn_id]
    return deployment.for_box(resource)


# -- the settings -----------------------------------------------------------------------------------------------


def test_each_box_gets_a_dag_and_a_pool_whose_slots_are_its_gpus():
    deployment = Deployment.model_validate(TWO_BOXES)
    assert [(r.dag_id, r.pool, r.gpus) for r in deployment.resources()] == [
        ("eagle3_drafter", "eagle3_box_box-a", 4),
        ("eagle3_drafter__box-b", "eagle3_box_box-b", 8),
    ]
    assert deployment.allowed.boxes() == ["box-a", "box-b"]  # box_pools alone allows its boxes
    argvs = create_pool_argvs(deployment, "airflow")
    assert [argv[3:5] for argv in argvs] == [["eagle3_box_box-a", "4"], ["eagle3_box_box-b", "8"]]
    assert all(argv[-1] == "--include-deferred" for argv in argvs)
    assert all(is_drafter_dag(r.dag_id) for r in deployment.resources()) and not is_drafter_dag("eagle3_drafterx")


def test_settings_without_box_pools_make_one_dag_named_eagle3_drafter_in_their_pool():
    for settings, pool, gpus in (({}, "eagle3_box", 8), ({"pool": "gpu_box", "pool_slots": 3}, "gpu_box", 3)):
        (resource,) = Deployment.model_validate(settings).resources()
        assert (resource.dag_id, resource.conn_id, resource.pool, resource.gpus) == ("eagle3_drafter", None, pool, gpus)
    (one,) = Deployment.model_validate({"box_pools": {"gpu-1": {"gpus": 8, "pool": "p1"}}}).resources()
    assert (one.dag_id, one.pool) == ("eagle3_drafter", "p1")  # one box: the usual id


def test_adding_a_box_renames_no_dag_the_default_box_keeps_eagle3_drafter():
    """Issue 43 item 4: a deployment's DAG id is its runs' history, its FAB permissions and its runs in flight. One
    box, or none listed, is eagle3_drafter; a box added beside it gets a DAG of its own and the first keeps its id,
    whichever order box_pools lists them in when the form's default box names it."""

    def dag_ids(settings: dict) -> dict:
        return {r.conn_id: r.dag_id for r in Deployment.model_validate(settings).resources()}

    one = {"box_pools": {"gpu-1": {"gpus": 8}}, "params": {"box.conn_ids": ["gpu-1"]}}
    assert dag_ids(one) == {"gpu-1": "eagle3_drafter"}
    two = {**one, "box_pools": {"gpu-2": {"gpus": 8}, **one["box_pools"]}}  # added first in the file, even
    assert dag_ids(two) == {"gpu-1": "eagle3_drafter", "gpu-2": "eagle3_drafter__gpu-2"}
    assert dag_ids({"box_pools": {"gpu-1": {"gpus": 8}, "gpu-2": {"gpus": 8}}}) == {  # no default box: the first
        "gpu-1": "eagle3_drafter",
        "gpu-2": "eagle3_drafter__gpu-2",
    }
    assert dag_ids({}) == {None: "eagle3_drafter"}  # before box_pools: the one DAG, the same id


def test_one_schedule_tick_makes_one_run_only_the_default_boxs_dag_is_scheduled():
    """Issue 43 item 4: with every box's DAG on the settings' schedule, one tick started a run per box (and all of
    them in one run directory). Only the default box's DAG keeps the schedule and the Asset schedule; the others are
    triggered only, and their defaults need not make a schedulable run."""
    settings = {
        **TWO_BOXES,
        "schedule": "@weekly",
        "schedule_assets": ["eagle3_prompts"],
        "params": {**GOOD, "box.conn_ids": ["box-b"]},
    }
    deployment = Deployment.model_validate(settings)
    scheduled = {
        r.dag_id: (deployment.for_box(r).schedule, deployment.for_box(r).schedule_assets)
        for r in deployment.resources()
    }
    assert scheduled == {"eagle3_drafter__box-a": (None, []), "eagle3_drafter": ("@weekly", ["eagle3_prompts"])}
    assert [r.scheduled for r in deployment.resources()] == [False, True]


def test_box_pools_outside_the_allowed_boxes_or_shards_wider_than_the_box_are_refused():
    with pytest.raises(ValidationError, match=r"box_pools: \['box-c'\] not in the allowed boxes \['box-a'\]"):
        Deployment.model_validate({"allowed_boxes": ["box-a"], "box_pools": {"box-c": {"gpus": 1}}})
    with pytest.raises(ValidationError, match="shard_gpus 4 > gpus 2"):
        Deployment.model_validate({"box_pools": {"box-a": {"gpus": 2, "shard_gpus": 4}}})


def test_the_form_shared_by_the_box_dags_offers_each_its_own_box_as_its_settings_would():
    deployment = Deployment.model_validate(TWO_BOXES)
    form = deployment.form()
    for resource in deployment.resources():
        settings = deployment.for_box(resource)
        built = settings.form()
        shared = box_params(form, resource.conn_id)
        assert {name: (p.value, p.schema) for name, p in shared.items()} == {
            name: (p.value, p.schema) for name, p in built.items()
        }
        assert shared["box.conn_ids"].value == [resource.conn_id]


# -- what a trigger of one box's DAG may do -----------------------------------------------------------------------


def test_a_run_of_one_boxs_dag_cannot_name_another_box():
    deployment = box_settings("box-a")
    assert deployment.form_choices()["box.conn_ids"] == ["box-a"]
    trigger(deployment)  # its own box: fine
    with pytest.raises(ParamValidationError):  # the form offers box-a alone
        trigger(deployment, **{"box.conn_ids": ["box-b"]})
    # and past the form (params as a trigger could send them), validate refuses it
    params = {name: param.value for name, param in deployment.form().items()}
    params.update(GOOD, **{"box.conn_ids": ["box-b"]})
    with pytest.raises(
        AirflowFailException,
        match=r"box.conn_ids: \['box-b'\] not allowed here; this deployment "
        r"allows \['box-a'\]",
    ):
        validate_run(params, {}, set(build_params()), RUN, deployment)


def test_a_run_that_uses_more_gpus_than_its_dag_holds_is_refused_naming_the_setting():
    """train.gpus and the extract backend are the settings' (a preset, a box's own run): a run of one box's DAG that
    would use more GPUs than the box has is refused by validate, naming the box_pools setting."""
    with pytest.raises(
        AirflowFailException,
        match=r"(?s)train: uses 8 GPUs .* box box-a has 4 \(box_pools.box-a in "
        r"the settings file.gpus\)",
    ):
        trigger(box_settings("box-a"), preset="wide")
    trigger(box_settings("box-b"), preset="wide")  # box-b has 8
    sglang = {
        **TWO_BOXES,
        "box_pools": {
            **TWO_BOXES["box_pools"],
            "box-b": {"gpus": 8, "shard_gpus": 2, "run": {"extract.backend": "sglang", "extract.sglang.tp_size": 4}},
        },
    }
    with pytest.raises(AirflowFailException, match=r"extract: each shard uses 4 GPUs .* holds 2 .*set it to 4"):
        trigger(box_settings("box-b", sglang))


def test_each_box_runs_with_its_own_facts_over_the_settings():
    """box_pools.<box>.run and .box: a box's own workdir, interpreter, ... over the settings' run and box, in that
    box's DAG only; the allow-lists' defaults take every box's."""
    settings = {
        **TWO_BOXES,
        "box": {"poll_interval_s": 2.0},
        "box_pools": {
            "box-a": {"gpus": 4},
            "box-b": {
                "gpus": 8,
                "run": {"workdir": "/scratch/eagle3", "target.dtype": "float16"},
                "box": {"python": "/opt/eagle3/bin/python"},
            },
        },
    }
    deployment = Deployment.model_validate(settings)
    assert deployment.allowed.workdirs() == ["/data/eagle3", "/scratch/eagle3"]
    assert deployment.allowed.pythons() == ["/opt/eagle3/bin/python", "python3"]
    a, b = trigger(box_settings("box-a", settings)), trigger(box_settings("box-b", settings))
    a, b = a["plan"], b["plan"]
    assert (a["config"]["workdir"], a["box"]["python"], a["config"]["target"]["dtype"]) == (
        "/data/eagle3",
        "python3",
        "bfloat16",
    )
    assert (b["config"]["workdir"], b["box"]["python"], b["config"]["target"]["dtype"]) == (
        "/scratch/eagle3",
        "/opt/eagle3/bin/python",
        "float16",
    )
    assert a["box"]["poll_interval_s"] == b["box"]["poll_interval_s"] == 2.0  # the settings' box, under each


# -- the DAGs as the dag-processor makes them ---------------------------------------------------------------------


PARSE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.serialization.serialized_objects import DagSerialization
bag = DagBag(dag_folder=sys.argv[1])
out = {"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": {}}
for dag_id, dag in bag.dags.items():
    dag = DagSerialization.from_dict(DagSerialization.to_dict(dag))  # what the scheduler reads
    out["dags"][dag_id] = {"max_active_runs": dag.max_active_runs, "timetable": type(dag.timetable).__name__,
                           "boxes": dag.params.get_param("box.conn_ids").value,
                           "tasks": {t.task_id: [t.pool, t.pool_slots] for t in dag.tasks}}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_boxes_make_two_dags_each_task_in_its_boxs_pool_with_its_gpus(airflow_home, tmp_path):
    """Two DAGs of max_active_runs 1 each: two runs at once, one per box, never sharing a pool; the settings'
    schedule on the default box's alone. What each task holds is read back from the serialized DAG, as the scheduler
    sees it."""
    settings = tmp_path / "dag-settings.json"
    settings.write_text(json.dumps({**TWO_BOXES, "schedule": "@weekly", "params": GOOD}))
    env = airflow_env(airflow_home, EAGLE3_DAG_SETTINGS=str(settings))
    proc = subprocess.run(
        [sys.executable, "-c", PARSE, str(REPO / "dags" / "eagle3_drafter.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert sorted(result["dags"]) == ["eagle3_drafter", "eagle3_drafter__box-b"]
    for dag_id, conn_id, gpus, shard, timetable in (
        ("eagle3_drafter", "box-a", 4, 1, "CronTriggerTimetable"),
        ("eagle3_drafter__box-b", "box-b", 8, 2, "NullTimetable"),
    ):
        dag = result["dags"][dag_id]
        assert dag["max_active_runs"] == 1 and dag["boxes"] == [conn_id] and dag["timetable"] == timetable
        pool = f"eagle3_box_{conn_id}"
        held = {task_id: slots for task_id, (name, slots) in dag["tasks"].items() if name == pool}
        assert held == {
            "gpus_idle": gpus,
            "generate": gpus,
            "extract": shard,
            "gpus_released": gpus,
            "train": gpus,
            "evaluate": gpus,
            "benchmark": gpus,
        }
        assert {name for task_id, (name, _) in dag["tasks"].items() if task_id not in held} == {"default_pool"}
    # create-pool makes both pools, each counting deferred tasks
    subprocess.run(
        [sys.executable, "-m", "eagle3_airflow.deployment", "create-pool", "--airflow", AIRFLOW],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    for pool, gpus in (("eagle3_box_box-a", 4), ("eagle3_box_box-b", 8)):
        shown = subprocess.run(
            [AIRFLOW, "pools", "get", pool, "-o", "json"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        (row,) = json.loads(shown.stdout)
        assert int(row["slots"]) == gpus and str(row["include_deferred"]).lower() == "true"
