"""A run directory is one user's Airflow runs' (issue 43, item 6), and run directories are named with their DAG id
(item 4): another user's run on one is refused at init, naming the run that owns it and the fix, so that an approver
cannot make the drafter in someone else's run directory and approve it as theirs; every run that wrote it is
listed. Real `eagle3 init` and `job start` processes, and the DAG's validate and write_config tasks on this machine
as the box."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from eagle3.disk.layout import CONFIG, OWNER
from eagle3_airflow.codesync import ensure_code
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.tasks import default_run_name, validate_run, write_config
from eagle3_airflow.transport import LocalBox
from tests.conftest import run_eagle3, tiny_run_data

ALICE_RUN = ("eagle3_drafter", "manual__2026-12-04T08:00:00+00:00", "alice")


def init(
    draft: Path,
    dag_id: str | None = None,
    run_id: str | None = None,
    user: str | None = None,
    redo_from: str | None = None,
):
    """`eagle3 init` as write_config runs it (each value one --name=value argument), or by hand (no dag_id)."""
    owner = [] if dag_id is None else [f"--airflow-dag-id={dag_id}", f"--airflow-run-id={run_id}"]
    owner += [f"--triggered-by={user}"] if user else []
    owner += [f"--redo-from={redo_from}"] if redo_from else []
    return run_eagle3("init", "--config", str(draft), *owner, check=False)


@pytest.fixture
def draft(tmp_path, tiny_target) -> Path:
    path = tmp_path / "draft.json"
    path.write_text(json.dumps(tiny_run_data(tiny_target, tmp_path / "work", "shared-name")))
    return path


def owners(tmp_path: Path) -> list[tuple]:
    record = json.loads((tmp_path / "work" / "runs" / "shared-name" / OWNER).read_text())
    return [(run["dag_id"], run["run_id"], run["triggered_by"], run["redo_from"]) for run in record["runs"]]


@pytest.mark.slow
def test_a_run_directory_is_its_first_airflow_runs_and_another_users_run_is_refused_naming_it(draft, tmp_path):
    """The owner's retries and clears init again (resume); a run another user triggered on the same run_name, or
    another DAG's run (a scheduled one: no user), is refused (exit 2) before it writes anything, naming the owner and
    the fixes; the owner and its config are unchanged."""
    assert init(draft, *ALICE_RUN).returncode == 0
    config = (tmp_path / "work" / "runs" / "shared-name" / CONFIG).read_bytes()
    assert init(draft, *ALICE_RUN).returncode == 0  # a retry, or a clear of write_config
    for other in (
        ("eagle3_drafter", "manual__2026-12-05T08:00:00+00:00", "bob"),
        ("eagle3_drafter__gpu-box-2", ALICE_RUN[1], "bob"),
        ("eagle3_drafter", "scheduled__x", None),
    ):
        refused = init(draft, *other)
        assert refused.returncode == 2, refused.stderr
        assert (
            "belongs to Airflow run 'manual__2026-12-04T08:00:00+00:00' of DAG 'eagle3_drafter' (triggered "
            "by 'alice')" in refused.stderr
        )
        assert "clears its failed task" in refused.stderr and "another run_name" in refused.stderr
    assert owners(tmp_path) == [(*ALICE_RUN, None)]
    assert (tmp_path / "work" / "runs" / "shared-name" / CONFIG).read_bytes() == config


@pytest.mark.slow
def test_the_same_users_later_run_takes_the_directory_over_and_every_run_that_wrote_it_is_listed(draft, tmp_path):
    """box.redo_from runs stages again in an existing directory from a new Airflow run: allowed to the user who
    triggered its owner, and then the redo run owns it, listed after the first. The attack of issue 43 item 6, an
    approver's redo in someone else's directory (whose propose task she would clear and approve as theirs), is
    refused, naming both users."""
    assert init(draft, *ALICE_RUN).returncode == 0
    attack = init(draft, "eagle3_drafter", "manual__2026-12-06T08:00:00+00:00", "bob", "evaluate")
    assert attack.returncode == 2 and "box.redo_from evaluate" in attack.stderr, attack.stderr
    assert "triggered by 'alice'" in attack.stderr and "triggered by 'bob'" in attack.stderr
    redo = ("eagle3_drafter", "manual__2026-12-07T08:00:00+00:00", "alice")
    assert init(draft, *redo, "train").returncode == 0
    assert init(draft, *redo, "train").returncode == 0  # the redo run's retry
    assert owners(tmp_path) == [(*ALICE_RUN, None), (*redo, "train")]
    assert init(draft, "eagle3_drafter", "manual__2026-12-08T08:00:00+00:00", "bob").returncode == 2


def as_host(monkeypatch, tmp_path: Path, name: str) -> None:
    """Run from here as host `name` (EAGLE3_HOST_ID_FILE, which the init processes inherit)."""
    path = tmp_path / f"machine-id-{name}"
    path.write_text(f"machine-id-of-{name}\n")
    monkeypatch.setenv("EAGLE3_HOST_ID_FILE", str(path))


@pytest.mark.slow
def test_init_records_the_host_of_each_run_and_the_owners_init_adds_or_moves_it(draft, tmp_path, monkeypatch):
    """Boxes may share a work directory, and only the box that made a run directory prunes it (eagle3.box.retention):
    init records its host beside the run. The owner's init run again on another box (a clear of write_config) moves
    it there, where the run's stages now run; a refused run changes no host."""
    as_host(monkeypatch, tmp_path, "gpu-box-1")
    assert init(draft, *ALICE_RUN).returncode == 0
    path = tmp_path / "work" / "runs" / "shared-name" / OWNER

    def hosts() -> list:
        return [run.get("host_id") for run in json.loads(path.read_text())["runs"]]

    assert hosts() == ["machine-id-of-gpu-box-1"]
    assert init(draft, *ALICE_RUN).returncode == 0  # a clear of write_config on the same box
    assert hosts() == ["machine-id-of-gpu-box-1"]
    as_host(monkeypatch, tmp_path, "gpu-box-2")
    assert init(draft, "eagle3_drafter", "manual__2026-12-05T08:00:00+00:00", "bob").returncode == 2
    assert hosts() == ["machine-id-of-gpu-box-1"]
    assert init(draft, *ALICE_RUN).returncode == 0
    assert hosts() == ["machine-id-of-gpu-box-2"] and owners(tmp_path) == [(*ALICE_RUN, None)]
    redo = ("eagle3_drafter", "manual__2026-12-07T08:00:00+00:00", "alice")
    as_host(monkeypatch, tmp_path, "gpu-box-1")
    assert init(draft, *redo, "train").returncode == 0
    assert hosts() == ["machine-id-of-gpu-box-2", "machine-id-of-gpu-box-1"]


@pytest.mark.slow
def test_init_by_hand_and_airflow_runs_never_share_a_directory(draft, tmp_path):
    """By hand (no Airflow run named) init works as it always did where no Airflow run owns the directory; it is
    refused in one an Airflow run owns, and an Airflow run refuses a directory made by hand: whose it is is unknown."""
    assert init(draft).returncode == 0 and init(draft).returncode == 0
    refused = init(draft, *ALICE_RUN)
    assert refused.returncode == 2 and "no record of the Airflow run that owns it" in refused.stderr
    assert not (tmp_path / "work" / "runs" / "shared-name" / OWNER).exists()
    other = json.loads(draft.read_text())
    draft.write_text(json.dumps({**other, "run_name": "airflows"}))
    assert init(draft, *ALICE_RUN).returncode == 0
    by_hand = init(draft)
    assert by_hand.returncode == 2 and "init by hand does not write into an Airflow run's directory" in by_hand.stderr


@pytest.mark.slow
def test_a_value_that_names_no_airflow_run_is_refused():
    for argv, field in (
        (["--airflow-dag-id=a b", "--airflow-run-id=r"], "--airflow-dag-id"),
        (["--airflow-dag-id=d", "--airflow-run-id=r\nx"], "--airflow-run-id"),
        (["--airflow-dag-id=d"], "give both"),
    ):
        proc = run_eagle3("init", "--config", "/nonexistent.json", *argv, check=False)
        assert proc.returncode == 2 and field in proc.stderr, proc.stderr


# -- through the DAG's tasks ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dags_write_config_refuses_another_airflow_runs_directory(tmp_path, tiny_target, monkeypatch):
    """validate then write_config, as the DAG runs them, with this machine as the box: a second Airflow run that
    names the first's run_name fails write_config for good (no retry can help), naming the owner; the first run's
    clear of write_config goes on."""
    deployment = Deployment(
        allowed_boxes=["local"],
        allowed_workdirs=[str(tmp_path)],
        allowed_pythons=[sys.executable],
        box={"python": sys.executable},
        params={"box.conn_ids": ["local"]},
        run={"workdir": str(tmp_path / "work"), "vocab.draft_vocab_size": 512},
    )
    settings = tmp_path / "dag-settings.json"
    settings.write_text(deployment.model_dump_json(exclude_defaults=True))
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))  # as the DAG file parses it (no task reads it)
    params = {k: p.value for k, p in deployment.form().items() if p.has_value}
    params.update(
        {
            "target.model_path": str(tiny_target),
            "data.path": str(tiny_target / "prompts.jsonl"),
            "run_name": "alices-run",
        }
    )

    def trigger(run_id: str, user: str) -> tuple[dict, SimpleNamespace]:
        dag_run = SimpleNamespace(dag_id="eagle3_drafter", run_id=run_id, conf={}, triggering_user_name=user)
        return validate_run(params, {}, set(deployment.form()), dag_run, deployment), dag_run

    alice, alice_run = trigger("manual__2026-12-04T08:00:00+00:00", "alice")
    ensure_code(LocalBox(), sys.executable, alice["plan"]["config"]["workdir"])
    written = write_config(alice["plan"], dag_run=alice_run)
    assert write_config(alice["plan"], dag_run=alice_run) == written  # cleared: resumes
    bob, bob_run = trigger("manual__2026-12-05T08:00:00+00:00", "bob")
    with pytest.raises(
        AirflowFailException,
        match=r"alices-run belongs to Airflow run 'manual__2026-12-04T08:00:00"
        r"\+00:00' of DAG 'eagle3_drafter' \(triggered by 'alice'\)",
    ):
        write_config(bob["plan"], dag_run=bob_run)
    record = json.loads((Path(written).parent / OWNER).read_text())
    assert [(run["run_id"], run["triggered_by"]) for run in record["runs"]] == [(alice_run.run_id, "alice")]


def test_an_unnamed_run_is_named_with_its_dag_id_so_two_boxes_dags_never_share_a_directory():
    """Item 4: every box's DAG used to be scheduled, and a run's directory was named after its run id alone, which
    both DAGs' runs of one tick share: both boxes trained in one directory. The DAG id is in the name now, and a name
    longer than run_name allows stays one run's."""
    tick = "scheduled__2026-11-29T00:00:00+00:00"
    names = {dag_id: default_run_name(dag_id, tick) for dag_id in ("eagle3_drafter", "eagle3_drafter__gpu-box-2")}
    assert names["eagle3_drafter"] == "eagle3_drafter.scheduled__2026-11-29T00-00-00-00-00"
    assert len(set(names.values())) == 2
    long_box = "eagle3_drafter__" + "b" * 60
    runs = [f"manual__2026-12-04T08:00:00.{micro}+00:00" for micro in ("000001", "000002")]
    long_names = [default_run_name(long_box, run_id) for run_id in runs]
    assert len(set(long_names)) == 2 and all(len(name) <= 64 for name in long_names)
    assert all(name.startswith("eagle3_drafter__bbbb") for name in long_names)


@pytest.mark.slow
def test_a_stage_of_another_airflow_run_is_not_started_in_an_owned_directory(draft, tmp_path):
    """A run refused at init must not write by another way: its write_config marked successful (by whoever may mark
    and clear tasks, as in the attack above), its stages' `job start` names the run, and the box refuses it in a
    directory another run owns, redo or not (exit 2, nothing launched). The owner's start goes on."""
    assert init(draft, *ALICE_RUN).returncode == 0
    jobs = tmp_path / "work" / "runs" / "shared-name" / "jobs"

    def start(dag_id: str, run_id: str, *redo: str):
        return run_eagle3(
            "job",
            "start",
            "--jobs-dir",
            str(jobs),
            "--key",
            "train",
            f"--airflow-dag-id={dag_id}",
            f"--airflow-run-id={run_id}",
            *redo,
            "--",
            sys.executable,
            "-c",
            "1",
            check=False,
        )

    for redo in ([], ["--redo", "run-0123456789abcdef", "--set-aside", str(jobs.parent / "train")]):
        refused = start("eagle3_drafter", "manual__2026-12-06T08:00:00+00:00", *redo)
        assert (
            refused.returncode == 2 and "belongs to Airflow run 'manual__2026-12-04T08:00:00+00:00'" in refused.stderr
        ), refused.stderr
        assert not (jobs / "train" / "state.json").exists()
    assert json.loads(start("eagle3_drafter", ALICE_RUN[1]).stdout)["try"] == 1
    later = ("eagle3_drafter", "manual__2026-12-07T08:00:00+00:00", "alice")  # alice's next run takes it over
    assert init(draft, *later).returncode == 0
    superseded = start("eagle3_drafter", ALICE_RUN[1])
    assert superseded.returncode == 2 and "took the directory over from this run" in superseded.stderr
