"""Preflight sensors against a real box (this machine through the local transport, the synced package, real
`python -m eagle3 box ...` commands). GPUs cannot exist here: a stand-in nvidia-smi (tests/fakes) is put
first on PATH, and a stand-in systemctl for the service-stop case; both are named so in their docstrings.
The `plan` and `gpus` fixtures are in tests/conftest.py; the foreign-GPU-process drill is in tests/faults/."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from eagle3_airflow.sensors import BoxReachableSensor, DiskSpaceSensor, GpuIdleSensor
from tests.conftest import CONTEXT, H200, VLLM, edited, poke, run_plan, sealed

# A TEST STAND-IN for systemctl (no systemd in a container): `is-active` answers from a state file,
# `stop` empties it and records the call. It takes the unit only after "--" (anything else exits 2), as the
# sensor must call it: a unit named like an option ("--all") must never reach systemctl as one.
FAKE_SYSTEMCTL = """#!/bin/sh
state="$FAKE_SYSTEMCTL_STATE"
case "$1 $2 $3" in
  "is-active --quiet --") grep -qx -- "$4" "$state" ;;
  "stop -- $3") echo "$3" >> "$state.stopped"; grep -vx -- "$3" "$state" > "$state.new"; mv "$state.new" "$state" ;;
  *) exit 2 ;;
esac
"""


@pytest.mark.slow
def test_gpus_idle(plan, gpus, capsys):
    gpus([{**H200, "memory.used": 1}])
    idle, log = poke(GpuIdleSensor, plan, capsys)
    assert idle
    assert "NVIDIA H200: 1 of 143771 MiB used" in log


@pytest.mark.slow
def test_memory_in_use_without_a_visible_process_is_busy(plan, gpus, capsys):
    gpus([{**H200, "memory.used": 9000}])
    idle, log = poke(GpuIdleSensor, plan, capsys)
    assert not idle and "9000 MiB used > 1024 MiB allowed" in log


@pytest.mark.slow
def test_no_gpu_on_a_box_that_needs_them(plan, gpus, capsys):
    gpus(error="No devices were found", exit_code=6)
    idle, log = poke(GpuIdleSensor, plan, capsys)
    assert not idle and "no GPUs visible" in log


@pytest.mark.slow
def test_a_box_with_too_few_gpus_for_the_shards_fails_at_once(plan, gpus, capsys):
    gpus([{**H200, "index": i, "uuid": f"GPU-{i}", "memory.used": 1} for i in range(4)])
    sglang = {"config.extract.backend": "sglang", "config.extract.sglang.tp_size": 2}
    assert poke(GpuIdleSensor, sealed(edited(plan, {**sglang, "config.extract.num_shards": 2})), capsys)[0]  # 2 x 2
    with pytest.raises(
        AirflowFailException,
        match=r"local has 4 GPUs, this run needs 6 there for 3 extraction "
        r"shard\(s\) x 2 GPU\(s\) each \(extract.num_shards",
    ):
        poke(GpuIdleSensor, sealed(edited(plan, {**sglang, "config.extract.num_shards": 3})), capsys)
    with pytest.raises(AirflowFailException, match=r"needs 8 there for training"):
        poke(GpuIdleSensor, sealed(edited(plan, {"config.train.nproc_per_node": 8})), capsys)


def test_cpu_runs_skip_the_gpu_check(plan, gpus, capsys):
    gpus(error="No devices were found", exit_code=6)
    idle, log = poke(GpuIdleSensor, sealed(edited(plan, {"box.require_gpus": False})), capsys)
    assert idle and "GPU check off" in log


def test_the_gpu_check_is_the_settings_never_a_triggers():
    """require_gpus, the idle threshold and the services stopped first are the settings' `box`: they reach the plan
    the sensors read, and a trigger's conf cannot turn the check off or loosen it."""
    from eagle3_airflow.deployment import Deployment
    from eagle3_airflow.params import build_params
    from eagle3_airflow.tasks import validate_run
    from tests.conftest import RUN

    deployment = Deployment(
        run={"workdir": "/data/eagle3"},
        allowed_services=["vllm.service"],
        box={"require_gpus": True, "gpu_max_used_mib": 512, "stop_services": ["vllm.service"]},
    )
    form = {name: param.value for name, param in deployment.form().items() if param.has_value}
    form.update({"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"})
    plan = validate_run(form, {}, set(build_params()), RUN, deployment)["plan"]
    box = plan["box"]
    assert (box["require_gpus"], box["gpu_max_used_mib"], box["stop_services"]) == (True, 512, ["vllm.service"])
    for key, value in (("box.require_gpus", False), ("box.gpu_max_used_mib", 1 << 20), ("box.stop_services", [])):
        with pytest.raises(AirflowFailException, match=rf"not trigger parameters: '{key}' \(the deployment's"):
            validate_run({**form, key: value}, {key: value}, set(build_params()), RUN, deployment)


@pytest.mark.slow
def test_configured_services_are_stopped_before_the_check(plan, gpus, tmp_path, capsys, monkeypatch):
    systemctl = tmp_path / "systemctl"
    systemctl.write_text(FAKE_SYSTEMCTL)
    systemctl.chmod(systemctl.stat().st_mode | stat.S_IEXEC)
    units = tmp_path / "active-units"
    units.write_text("vllm.service\n")
    monkeypatch.setenv("FAKE_SYSTEMCTL_STATE", str(units))
    gpus([{**H200, "memory.used": 2}])
    services = sealed(edited(plan, {"box.stop_services": ["vllm.service", "other.service"]}))
    idle, log = poke(GpuIdleSensor, services, capsys)
    assert idle
    assert "stopped service vllm.service" in log
    assert Path(f"{units}.stopped").read_text() == "vllm.service\n"  # the inactive unit was left alone


@pytest.mark.slow
def test_disk_space_below_and_above_the_estimate(plan, capsys):
    import json

    from eagle3.box.facts import TOKEN_CACHE_NAME
    from eagle3_airflow.plan import RunPlan

    enough, log = poke(DiskSpaceSensor, plan, capsys)
    assert enough and "free on" in log
    # The same run on data of a thousand trillion tokens, as the box's cached count says: it cannot fit.
    cache = Path(RunPlan.from_trusted(plan).run_dir) / TOKEN_CACHE_NAME
    counted = json.loads(cache.read_text())
    cache.write_text(json.dumps({**counted, "counts": {**counted["counts"], "tokens": 10**15}}))
    enough, log = poke(DiskSpaceSensor, plan, capsys)
    assert not enough and "not enough disk: need" in log


@pytest.mark.slow
def test_box_reachable_waits_for_an_ssh_box_that_does_not_answer(plan, capsys, monkeypatch, fresh_sshd):
    monkeypatch.setenv("AIRFLOW_CONN_GPU_BOX", fresh_sshd.airflow_conn_json())
    ssh_plan = sealed(edited(plan, {"box.conn_ids": ["gpu_box"]}))
    assert poke(BoxReachableSensor, ssh_plan, capsys)[0]
    fresh_sshd.stop()
    reachable, log = poke(BoxReachableSensor, ssh_plan, capsys)
    assert not reachable and "waiting for box gpu_box" in log
    fresh_sshd.start()
    assert poke(BoxReachableSensor, ssh_plan, capsys)[0]


@pytest.mark.slow
def test_this_runs_own_job_on_the_gpu_is_not_foreign(plan, gpus, capsys):
    """A GPU process in the process group of a live job of this run (say train, still running when a cleared
    run checks the GPUs again) is ours: the sensor names it and does not wait for it."""
    from eagle3.jobs.job import kill_job, start_job
    from eagle3_airflow.plan import RunPlan

    def run_plan_of(sealed_plan: dict) -> RunPlan:
        return RunPlan.from_trusted(sealed_plan)

    jobs_dir = run_plan_of(plan).jobs_dir
    job = start_job(jobs_dir, "train", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = {**VLLM, "pid": job["child_pid"], "process_name": "python -m eagle3 train"}
        gpus([{**H200, "memory.used": 70500}], [ours])
        idle, log = poke(GpuIdleSensor, plan, capsys)
        assert idle
        assert f"pid {job['child_pid']} python -m eagle3 train (70000 MiB) belongs to this run's job train" in log
        gpus([{**H200, "memory.used": 140500}], [ours, VLLM])  # and a stranger beside it is still foreign
        idle, log = poke(GpuIdleSensor, plan, capsys)
        assert not idle and "pid 4242 python3 -m vllm" in log
    finally:
        kill_job(jobs_dir, "train", grace_s=1)


def test_the_plan_knows_how_many_gpus_each_box_needs(make_config):
    sglang = make_config(
        extract={"backend": "sglang", "num_shards": 3, "sglang": {"tp_size": 4}}, train={"gpus": [0, 5]}
    )
    plan = run_plan(sglang, conn_ids=["a", "b"])
    assert plan.gpus_needed("a") == (
        8,
        "2 extraction shard(s) x 4 GPU(s) each (extract.num_shards, extract.sglang.tp_size with the sglang backend)",
    )
    assert plan.gpus_needed("b")[0] == 4  # one shard, and no training there
    assert plan.config.train_gpus == 6  # GPU index 5 must exist on the first box
    # (tp 4: the tiny drafter's 4 heads must split across the server that loads it)
    engine = "the serving engine that generate, evaluate or benchmark start (server.tp_size)"
    for served in (
        make_config(benchmark={"enabled": True}, server={"tp_size": 4}),
        make_config(evaluate={"backend": "server"}, server={"tp_size": 4}),
        make_config(generate={"enabled": True, "launch_server": True}, server={"tp_size": 4}),
    ):
        assert run_plan(served).gpus_needed("local") == (4, engine)
    named = run_plan(make_config(extract={"device": "cuda:0", "num_shards": 4}))
    assert named.gpus_needed("local")[0] == 1  # a device the user named: only training's rank counts


# -- waiting in the triggerer --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_busy_box_defers_to_the_triggerer_which_checks_until_the_gpus_are_free(plan, gpus, capsys):
    """Ready at once: done in the worker, no deferral. Busy: the sensor defers to BoxCheckTrigger, which runs the
    same check from the triggerer (the async transport) until the GPUs are free, then resumes the task."""
    import asyncio

    from airflow.sdk.exceptions import TaskDeferred

    from eagle3_airflow.sensors import BoxCheckTrigger

    gpus([{**H200, "memory.used": 1}])
    assert GpuIdleSensor(task_id="gpus_idle", plan=plan).execute(CONTEXT) is None

    gpus([{**H200, "memory.used": 90000}], [VLLM])
    sensor = GpuIdleSensor(task_id="gpus_idle", plan=plan, poke_interval=0.2, timeout=3600)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(CONTEXT)
    trigger = deferred.value.trigger
    assert isinstance(trigger, BoxCheckTrigger) and deferred.value.timeout.total_seconds() == 3600
    classpath, kwargs = trigger.serialize()
    assert classpath == "eagle3_airflow.sensors.BoxCheckTrigger" and kwargs["check"] == "gpus"

    seen = []

    async def wait_until_seen_busy_then_free_the_gpus():
        # Wait on what the trigger logs, not on a clock: on a loaded machine one check can take seconds.
        events = trigger.run()
        waiting = asyncio.ensure_future(events.__anext__())
        for _ in range(600):
            seen.append(capsys.readouterr().out)
            if "pid 4242 python3 -m vllm" in "".join(seen) or waiting.done():
                break
            await asyncio.sleep(0.1)
        assert not waiting.done(), "the trigger fired while vLLM still held the GPU"
        gpus([{**H200, "memory.used": 1}])
        return await asyncio.wait_for(waiting, 60)

    capsys.readouterr()
    event = asyncio.run(wait_until_seen_busy_then_free_the_gpus())
    assert event.payload == {"status": "ready"}
    assert "pid 4242 python3 -m vllm" in "".join(seen)  # what the trigger saw goes to the task log
    sensor.execute_complete({}, event.payload)


@pytest.mark.slow
def test_what_waiting_cannot_fix_fails_the_deferred_sensor(plan, gpus):
    import asyncio

    from eagle3_airflow.sensors import BoxCheckTrigger

    gpus([{**H200, "memory.used": 1}])
    trigger = BoxCheckTrigger(check="gpus", plan=edited(plan, {"config.train.nproc_per_node": 8}), poke_interval_s=0.1)
    event = asyncio.run(trigger.run().__anext__())
    assert event.payload["status"] == "failed" and "needs 8 there for training" in event.payload["message"]
    with pytest.raises(AirflowFailException, match="needs 8 there for training"):
        GpuIdleSensor(task_id="gpus_idle", plan=plan).execute_complete({}, event.payload)
