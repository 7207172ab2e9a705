"""Clear must always resume, inside a run's lateness deadline too (issue 51), on SQLite Airflow with the local box.

`airflow standalone` (the real scheduler, triggerer and API server; LocalExecutor), the DAG's settings with
notify.late_after_h 1 h and one retry. A run triggered through the REST API is queued, so it has its lateness
deadline an hour ahead (`airflow dags test` creates its run running, never queued: no deadline, nothing to clear
inside, and no scheduler to run what a clear queues). Its train dies on every try (tests/dagruns.py killing_python)
until its retries are spent and the run fails; then `train` and what follows it are cleared through the REST API,
as the UI's clear dialog does, while the deadline is still ahead. With Airflow 3.3's own queued-at deadline that
clear answered HTTP 500 (apache/airflow#70368); the lateness alert's reference is the project's now
(eagle3_airflow.notify.RunFirstQueuedAt).

The run directory is the baseline's through vocab (tests/dagruns.py copy_through_vocab): extract and vocab re-attach
to their succeeded jobs, and the drafter must come out byte for byte the baseline's.
"""

from __future__ import annotations

import json
import time
import urllib.error
from datetime import UTC, datetime

import pytest

from eagle3.records.checkpoint import checkpoint_dirs
from tests.airflow_env import airflow_standalone
from tests.dagruns import copy_through_vocab, killing_python, settings_env, sha256, tiny_layers

pytestmark = pytest.mark.slow

DAG_ID = "eagle3_drafter"
LATE_AFTER_H = 1.0
KILL_TRAIN = "kill-train"  # while this file is in the test's directory, every train dies (killing_python)
STARTUP_TIMEOUT_S = 300
RUN_TIMEOUT_S = 900
RUN_POLL_S = 3.0  # every REST call costs the api server's one worker CPU that the run's tasks need


def clear_status(server, body: dict) -> tuple[int, str]:
    """POST a clear to the REST API: its HTTP status and body (an error's too)."""
    try:
        return 200, server.request(f"/api/v2/dags/{DAG_ID}/clearTaskInstances", body, token=server.token).decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def run_deadlines(server, run_id: str) -> list[dict]:
    """The run's deadlines, as the UI's run page reads them (its private /ui API: the public one has none)."""
    return json.loads(server.request(f"/ui/dags/{DAG_ID}/dagRuns/{run_id}/deadlines", token=server.token))["deadlines"]


@pytest.mark.timeout(1800)
def test_a_failed_train_cleared_inside_the_lateness_deadline_resumes_from_its_checkpoint(
    baseline_run, tiny_target, tmp_path
):
    """Real: `airflow standalone`, the REST API, the local box, the job protocol. The run fails with train dead on
    both tries, after a checkpoint; its lateness deadline is an hour ahead and not missed. The REST clear of train
    and its downstream answers 200 (Airflow's DAGRUN_QUEUED_AT: 500, and nothing is cleared); the run is queued
    again, train's next try resumes from the checkpoint the dead tries left, and the run succeeds with the
    baseline's drafter, byte for byte."""
    run_dir = copy_through_vocab(baseline_run, tmp_path / "box")
    python = killing_python(tmp_path / "killing-python", tmp_path / KILL_TRAIN, run_dir / "train" / "checkpoints")
    (tmp_path / KILL_TRAIN).touch()
    conf, layers = tiny_layers(tiny_target, tmp_path / "box", **{"box.python": str(python)})
    settings = settings_env(
        tmp_path,
        **layers,
        retries=1,
        retry_delay_s=1,
        allowed_boxes=["local"],
        allowed_pythons=[str(python)],
        notify={"late_after_h": LATE_AFTER_H},
    )

    with airflow_standalone(tmp_path, tmp_path / "standalone.log", [DAG_ID], STARTUP_TIMEOUT_S, **settings) as server:
        server.api(f"/dags/{DAG_ID}", {"is_paused": False}, method="PATCH")
        run_id = server.api(f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]

        def run_state() -> str:
            return server.api(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]

        def train() -> dict:
            return server.api(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train")

        server.wait_until(
            lambda: run_state() in ("success", "failed"),
            "the run to fail at train",
            time.monotonic() + RUN_TIMEOUT_S,
            every_s=RUN_POLL_S,
        )
        failed_train = train()
        assert (run_state(), failed_train["state"], failed_train["try_number"]) == ("failed", "failed", 2), (
            failed_train,
            server.tail(),
        )
        checkpoint = checkpoint_dirs(run_dir / "train" / "checkpoints")[-1]
        (deadline,) = run_deadlines(server, run_id)
        left_s = (datetime.fromisoformat(deadline["deadline_time"]) - datetime.now(UTC)).total_seconds()
        print(f"train failed on both tries after {checkpoint.name}; the lateness deadline is {left_s:.0f} s ahead")
        assert not deadline["missed"] and left_s > 60, deadline

        (tmp_path / KILL_TRAIN).unlink()  # the box is mended; the person clears
        status, body = clear_status(
            server,
            {
                "dry_run": False,
                "dag_run_id": run_id,
                "task_ids": ["train"],
                "only_failed": False,
                "include_downstream": True,
                "include_upstream": False,
                "reset_dag_runs": True,
            },
        )
        print(f"the clear inside the deadline answered HTTP {status}")
        assert status == 200, (body, server.tail())
        assert "train" in {ti["task_id"] for ti in json.loads(body)["task_instances"]}, body

        server.wait_until(
            lambda: run_state() in ("success", "failed"),
            "the cleared run to end",
            time.monotonic() + RUN_TIMEOUT_S,
            every_s=RUN_POLL_S,
        )
        resumed_train = train()
        assert (run_state(), resumed_train["state"]) == ("success", "success"), (resumed_train, server.tail())
        log = server.task_log(DAG_ID, run_id, "train", resumed_train["try_number"])
    resumed = f"train: resumed from {checkpoint}"
    print(f"train's try {resumed_train['try_number']}: {resumed}")
    assert resumed in log, log[-3000:]
    assert sha256(run_dir / "drafter" / "model.safetensors") == sha256(baseline_run / "drafter" / "model.safetensors")
