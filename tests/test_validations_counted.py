"""One typed trip for the run config (issues 43 and 52): validated once per side, and the settings read once, when
the DAG file is parsed.

One run's control plane, counted: the run config's validations from the form (RunConfig, however it is reached: the
trigger's form, the settings' own checks of their layers), the loads of the sealed plan (RunPlan, the RunConfig inside
it: a task's one typed read of what validate sealed) and the settings file's reads, in validate and in every task
that uses the plan (the small tasks called as the DAG's @task wrappers call them; the sensors, remote jobs and
announce through verified_plan, which each of them calls first). The box is a stand-in that answers each command:
what is counted happens before any command runs.

Before issue 43 (the plan with a digest of a config kept beside it, checked again at every task against the settings
file re-read): 24 validations and 21 reads of the settings file for a one-shard run. Now: the form's config validated
once, in validate; each task loads the plan once; the settings file read by no task.
"""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

import pytest

from eagle3.config import RunConfig
from eagle3.contracts import PROTOCOL
from eagle3_airflow import plan as plan_module
from eagle3_airflow import tasks
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.plan import RunPlan
from eagle3_airflow.transport import CommandResult
from tests.conftest import RUN

# The tasks of a one-shard run that verify the plan before anything else (sensors, remote jobs, announce).
VERIFYING_TASKS = (
    "box_reachable",
    "gpus_idle",
    "disk_space",
    "generate",
    "extract[0]",
    "gpus_released",
    "vocab",
    "train",
    "export",
    "evaluate",
    "benchmark",
    "promoted",
)
REPLIES = {
    "box info": {"protocol": PROTOCOL, "python": "3.11", "packages": {}, "cuda": None, "gpus": [], "missing": []},
    "runs prune": {"runs": 1, "removed": [], "kept_beyond_keep": []},
    "lineage check": {"changed": True},
}


class Counted:
    """A pydantic model's validator that counts its validations."""

    def __init__(self, inner, counts: dict, what: str):
        self.inner, self.counts, self.what = inner, counts, what

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not name.startswith("validate_"):
            return attr

        def counted(*args, **kwargs):
            self.counts[self.what] += 1
            return attr(*args, **kwargs)

        return counted


def reply(argv, input=None, timeout=0) -> CommandResult:
    command = " ".join(argv)
    for key, value in REPLIES.items():
        if key in command:
            return CommandResult(argv, 0, json.dumps(value), "")
    return CommandResult(argv, 0, "/w/runs/r/config.json\n", "")  # init


@pytest.fixture
def counts(trust_settings, monkeypatch) -> dict:
    settings = json.loads(trust_settings.read_text())
    trust_settings.write_text(json.dumps({**settings, "keep_runs": 3, "reports_url": str(trust_settings.parent)}))
    counts = {"config validations": 0, "plan loads": 0, "settings reads": 0}
    monkeypatch.setattr(
        RunConfig, "__pydantic_validator__", Counted(RunConfig.__pydantic_validator__, counts, "config validations")
    )
    monkeypatch.setattr(
        RunPlan, "__pydantic_validator__", Counted(RunPlan.__pydantic_validator__, counts, "plan loads")
    )
    read_text = pathlib.Path.read_text

    def read(path, *args, **kwargs):
        counts["settings reads"] += path == trust_settings
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read)
    monkeypatch.setattr(plan_module, "box_for", lambda conn_id: SimpleNamespace(conn_id=conn_id, run=reply))
    monkeypatch.setattr(plan_module, "ensure_code", lambda *args, **kwargs: "/w/code/x")
    monkeypatch.setattr(tasks, "report_summary", lambda plan: {"run_dir": plan.run_dir})
    monkeypatch.setattr("eagle3_airflow.published.publish", lambda *args, **kwargs: {})
    return counts


def test_one_run_validates_its_config_once_and_no_task_reads_the_settings(counts):
    deployment = Deployment.from_env()  # the DAG file's parse: once per parse, not per task
    parsed = dict(counts)
    params = {name: param.value for name, param in deployment.form().items() if param.has_value}
    params.update({"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"})
    per_task = {}

    def run(name, call):
        before = dict(counts)
        call()
        per_task[name] = {what: counts[what] - before[what] for what in counts}

    plan = {}
    run("validate", lambda: plan.update(tasks.validate_run(params, {}, set(deployment.form()), RUN, deployment)))
    plan = plan["plan"]
    run("shards", lambda: tasks.shard_list(plan, dag_run=RUN))
    run("sync_code", lambda: tasks.sync_code(plan, dag_run=RUN))
    run("write_config", lambda: tasks.write_config(plan, dag_run=RUN))
    run("inputs_changed", lambda: tasks.inputs_changed(plan, dag_run=RUN))
    run("report", lambda: tasks.report(plan, dag_run=RUN))
    run("retention", lambda: tasks.prune_runs(plan, dag_run=RUN))
    for name in VERIFYING_TASKS:
        run(name, lambda: plan_module.verified_plan(plan, RUN))
    print(json.dumps({"parse": parsed, **per_task}))
    assert per_task.pop("validate") == {"config validations": 1, "plan loads": 1, "settings reads": 0}
    once = {"config validations": 0, "plan loads": 1, "settings reads": 0}
    assert {name: figures for name, figures in per_task.items() if figures != once} == {}
    assert len(per_task) == 6 + len(VERIFYING_TASKS)


def test_init_resolves_the_targets_facts_once_and_a_stage_reads_only_the_runs_config(make_config, monkeypatch):
    """The box side, counted: `init` validates the config as given and once more with the target's facts filled in;
    a stage process (every torchrun rank is one) loads the run's config.json with one validation and reads none of
    the target's files for the run's facts (before issue 52 each stage resolved them again: two validations and the
    target's config.json and generation_config.json read, per rank)."""
    from eagle3 import target
    from eagle3.__main__ import load_config
    from eagle3.config import write_run_config

    counts = {"config validations": 0}
    monkeypatch.setattr(
        RunConfig, "__pydantic_validator__", Counted(RunConfig.__pydantic_validator__, counts, "config validations")
    )
    path = write_run_config(make_config())
    assert counts["config validations"] == 2  # make_config: parse_run_config, then resolve_target_facts

    def refused(*args, **kwargs):
        raise AssertionError("a stage read the target's files for facts init resolved")

    for name in (
        "read_text_config",
        "read_target_facts",
        "read_architecture",
        "serving_sampling",
        "resolve_target_facts",
    ):
        monkeypatch.setattr(target, name, refused)
    counts["config validations"] = 0
    cfg = load_config(str(path))
    assert counts["config validations"] == 1
    assert cfg.target.num_hidden_layers == 8 and cfg.generate.temperature is not None
