"""box.redo_from: a finished stage runs again, explicitly, and never leaves an output made before the redo beside
one made after it (issue 36, Operations). A clear of a succeeded stage still only re-attaches to it."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from eagle3.disk.layout import REDO_OUTPUTS
from eagle3_airflow.params import BoxSettings
from eagle3_airflow.plan import REDO_ORDER
from eagle3_airflow.remote_job import RemoteJobOperator
from tests.conftest import CONTEXT, edited, run_dir_of, sealed

WRITE = (
    "import os, sys\nos.makedirs(sys.argv[1], exist_ok=True)\n"
    "open(os.path.join(sys.argv[1], 'model'), 'a').write(sys.argv[2])\n"
)


class WritingStage(RemoteJobOperator):
    """A stage that appends its marker to run_dir/<its output>/model, as a resuming stage would add to what it finds."""

    marker = ""

    def _stage_argv(self) -> list[str]:
        return [sys.executable, "-c", WRITE, f"{self.run_plan.run_dir}/{REDO_OUTPUTS[self.stage][0]}", self.marker]


def run_stage(plan: dict, stage: str, marker: str) -> dict:
    """What a try of the task does on the box: job start, then wait for the job (the trigger's part, here a poll)."""
    operator = WritingStage(task_id=stage, stage=stage, plan=plan)
    operator.marker = marker
    context = {**CONTEXT, "ti": SimpleNamespace(task_id=stage, map_index=-1, try_number=1, id="ti")}
    operator.verify_plan(context)
    key = operator.submit_job(context)
    deadline = time.monotonic() + 30
    while (status := operator.get_job_status(key, context)) == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == "succeeded"
    return operator._poll(key)["state"]


@pytest.mark.slow
def test_redo_from_runs_that_stage_and_every_later_one_again_with_the_old_outputs_set_aside(plan):
    run_dir = run_dir_of(plan)
    for stage in ("vocab", "train", "export"):
        run_stage(plan, stage, "old")
    run_stage(plan, "train", "cleared")  # a clear of a succeeded stage: re-attaches, runs nothing
    assert (run_dir / "train" / "model").read_text() == "old"

    redo = sealed(edited(plan, {"box.redo_from": "train"}))
    assert [run_stage(redo, stage, "new")["try"] for stage in ("vocab", "train", "export")] == [1, 1, 1]
    assert (run_dir / "vocab_mapping" / "model").read_text() == "old"  # before redo_from: kept
    for output in ("train", "drafter"):
        assert (run_dir / output / "model").read_text() == "new"  # made from scratch, nothing of the old one
        (aside,) = run_dir.glob(f"{output}.before-redo-*")
        assert (aside / "model").read_text() == "old"  # kept whole, beside it
    run_stage(redo, "train", "retry")  # a retry of the redo run: the same redo, so it re-attaches
    assert (run_dir / "train" / "model").read_text() == "new"


@pytest.mark.slow
def test_redo_skips_no_stage_as_nothing_changed_and_names_only_known_stages(plan, monkeypatch):
    from eagle3_airflow import tasks

    monkeypatch.setattr(
        tasks,
        "check_inputs",
        lambda plan: {
            "changed": False,
            "unchanged_since": "earlier",
            "current_drafter": "v1",
            "current_accept_length": 2.5,
        },
    )
    assert tasks.inputs_changed(plan, dag_run=CONTEXT["dag_run"]) is False
    assert tasks.inputs_changed(sealed(edited(plan, {"box.redo_from": "evaluate"})), dag_run=CONTEXT["dag_run"]) is True
    assert BoxSettings.model_fields["redo_from"].annotation.__args__ == ("none", *REDO_ORDER)
    with pytest.raises(ValueError, match="redo_from"):
        BoxSettings(redo_from="extract")


def test_redo_from_is_the_forms_choice_and_reaches_the_plan():
    """A person asks for the redo when they trigger (the form's box.redo_from); the plan carries it to the stages."""
    from eagle3_airflow.deployment import Deployment
    from eagle3_airflow.params import FORM_FIELDS, build_params
    from eagle3_airflow.tasks import validate_run
    from tests.conftest import RUN

    assert "box.redo_from" in FORM_FIELDS and build_params()["box.redo_from"].value == "none"
    deployment = Deployment(run={"workdir": "/data/eagle3"})
    form = {name: param.value for name, param in deployment.form().items() if param.has_value}
    form.update({"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl"})
    assert validate_run(form, {}, set(build_params()), RUN, deployment)["plan"]["box"]["redo_from"] == "none"
    redo = validate_run(
        {**form, "box.redo_from": "train"}, {"box.redo_from": "train"}, set(build_params()), RUN, deployment
    )
    assert redo["plan"]["box"]["redo_from"] == "train"
