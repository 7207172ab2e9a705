"""Issue 35, items 4 and 8 (the Airflow side), and issue 36's promotion DAG: a promotion needs an Approve by one of
the settings' approvers who did not trigger the training run, the approval shows its figures as the text they are,
and the promotion DAG acts only on proposals a training run's propose task sealed.

Written as the attacks a USER-role user can make: create an event on the proposals Asset through the REST API, or
edit a proposal (its event's extra, or the `proposals` task's XCom), or copy one run's to another; mark the approval
task successful by hand, PATCH its XCom (an Approve by someone else, or one from another run, for another training
run's proposal or for another proposal), approve their own run, or answer although not an approver (possible in
SimpleAuthManager's all-admins mode); and put markdown into a value that reaches the approval's body. The box is this
machine; the promote command itself is recorded, not run (the box side of `--approved-by` is another change's). The
approval's resume event is given as the API server builds it.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
from airflow.sdk import BaseNotifier
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, TaskAwaitingInput
from markdown_it import MarkdownIt

from eagle3_airflow import approvals
from eagle3_airflow import plan as plan_module
from eagle3_airflow.approvals import PROPOSE_TASK, PromotionApproval, proposals_from_events
from eagle3_airflow.deployment import Approver, Deployment
from eagle3_airflow.seal import Tampered
from eagle3_airflow.transport import CommandResult, LocalBox
from tests.conftest import RUN, plain_config, run_dir_of, run_plan, sealed

APPROVERS = [Approver.model_validate("bob"), Approver.model_validate("trigger-user")]  # RUN's trigger is one too
PROPOSALS = "eagle3_drafter.proposals"
# The promotion DAG's run the proposal's event started (RUN, the training run, proposed)
PROMOTION_RUN = SimpleNamespace(
    dag_id="eagle3_promotion", run_id="asset_triggered__2026-12-04T09:00:00+00:00", conf={}, triggering_user_name=None
)
BOLD = "**Security review: passed, approve**"
IMAGE = "![ok](https://collector.example/pixel.png)"
PROPOSAL = {
    "promoted": False,
    "pending_approval": True,
    "lineage": "f209",
    "lineage_dir": "/w/drafters/f209",
    "reason": f"better at k=3: 1.870 against the current 1.700 (margin 0) {BOLD} {IMAGE}",
    "accept_length": {"3": 1.87},
    "current": "/w/drafters/f209/current",
    "eval_set_prompts": 2,
    "current_before": {"version": "old-1a2b3c4d", "run": "old", "accept_length": {"3": 1.7}},
    "weights_sha256": "a" * 64,
    "drafter_files_sha256": "f" * 64,
}


def render(markdown: str) -> str:
    """The markdown as HTML, CommonMark with GitHub's tables and strikethrough, as the Airflow UI renders it."""
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)


def write_proposal(run_dir: str, **changes) -> None:
    evaluate = Path(run_dir) / "evaluate"
    evaluate.mkdir(parents=True, exist_ok=True)
    (evaluate / "report.json").write_text(json.dumps({"promotion": {**PROPOSAL, **changes}}))


@pytest.fixture
def promote_calls(monkeypatch) -> list:
    """The box as seen by the tasks: this machine, except that `lineage promote` is recorded and answered."""
    calls = []

    class RecordingBox(LocalBox):
        def run(self, argv, *, input=None, timeout=600):
            if "lineage" in argv and "promote" in argv:
                calls.append(argv)
                return CommandResult(argv, 0, json.dumps({"promoted": True, "reason": "approved"}), "")
            return super().run(argv, input=input, timeout=timeout)

    monkeypatch.setattr(plan_module, "box_for", lambda conn_id: RecordingBox())
    return calls


class Outlets:
    """A task's outlet_events: the event each Asset gets, by name."""

    def __init__(self):
        self.events = {}

    def __getitem__(self, asset):
        return self.events.setdefault(asset.name, SimpleNamespace(extra=None))


def propose(plan: dict, dag_run=RUN) -> dict:
    """The training run's propose_promotion task: the extra of its event on the proposals Asset."""
    outlets = Outlets()
    approvals.propose_promotion(plan, PROPOSALS, outlet_events=outlets, dag_run=dag_run)
    return outlets.events[PROPOSALS].extra


def event(extra: dict, dag_run=RUN, task_id: str = PROPOSE_TASK) -> SimpleNamespace:
    """That extra as the promotion run's triggering event, from `task_id` of `dag_run` (None: the REST API's)."""
    return SimpleNamespace(
        asset=SimpleNamespace(name=PROPOSALS),
        extra=extra,
        source_task_id=task_id,
        source_dag_id=dag_run and dag_run.dag_id,
        source_run_id=dag_run and dag_run.run_id,
        timestamp=datetime(2026, 12, 4, 9, 0, tzinfo=UTC),
    )


def received(*events) -> list[dict]:
    """The promotion DAG's `proposals` task on those triggering events."""
    return proposals_from_events({PROPOSALS: list(events)}, PROPOSALS)  # keyed by Asset in Airflow: not read


@pytest.fixture
def proposed(plan) -> dict:
    """A proposal as the promotion DAG's `proposals` task hands it to its approval and promote tasks."""
    write_proposal(str(run_dir_of(plan)))
    (proposal,) = received(event(propose(plan)))
    return proposal


def answered(chosen: str, user: str | None) -> dict:
    """The approval task's resume event, as the API server builds it from the human-in-the-loop record when `user`
    answered (HITLDetail.as_resume_event_payload)."""
    return {
        "chosen_options": [chosen],
        "params_input": {},
        "timedout": False,
        "responded_at": datetime(2026, 12, 4, 9, 0, tzinfo=UTC),
        "responded_by_user": user and {"id": user, "name": user},
    }


def approval_task(proposal: dict) -> PromotionApproval:
    return PromotionApproval(task_id="approve_promotion", proposal=proposal, approvers=APPROVERS, defaults="Reject")


TI = SimpleNamespace(id="0199-ti", map_index=0)
CONTEXT_TI = {"dag_run": PROMOTION_RUN, "task_instance": TI, "ti": TI}


def approve(proposal: dict, user: str) -> dict:
    return approval_task(proposal).execute_complete(CONTEXT_TI, answered("Approve", user))


# -- what the promotion DAG takes for a proposal -----------------------------------------------------------------


@pytest.mark.slow
def test_the_promotion_dag_takes_only_proposals_a_training_runs_propose_task_sealed(plan, caplog):
    write_proposal(str(run_dir_of(plan)))
    extra = propose(plan)
    assert extra["triggered_by"] == RUN.triggering_user_name and extra["run_dir"] == str(run_dir_of(plan))
    (proposal,) = received(event(extra), event(extra))  # the same proposal twice: asked once
    assert proposal["source"] == {"dag_id": RUN.dag_id, "run_id": RUN.run_id}
    other_run = SimpleNamespace(dag_id=RUN.dag_id, run_id="manual__other", triggering_user_name="x")
    attacks = {
        "from the REST API": event({**extra, "from_rest_api": True}, dag_run=None, task_id=None),
        "from another task": event(extra, task_id="report"),
        "from another DAG": event(extra, dag_run=SimpleNamespace(dag_id="other_dag", run_id=RUN.run_id)),
        "by someone else": event({**extra, "triggered_by": "mallory"}),
        "copied to another run": event(extra, dag_run=other_run),
        "with no seal": event({key: value for key, value in extra.items() if key != "seal"}),
    }
    for why, forged in attacks.items():
        with pytest.raises(AirflowSkipException, match="no proposal among the triggering events"):
            received(forged)
        assert received(forged, event(extra)) == [proposal], why  # refused, and the real one still taken
    assert caplog.text.count(": refused: ") == 6 and caplog.text.count("not emitted by a drafter DAG") == 6  # x 2


@pytest.mark.slow
def test_a_run_that_proposes_nothing_puts_no_event(plan):
    write_proposal(str(run_dir_of(plan)), pending_approval=False, reason="not better")
    with pytest.raises(AirflowSkipException, match="nothing proposed for promotion"):
        propose(plan)


@pytest.mark.slow
def test_a_proposal_edited_in_xcom_is_refused_by_the_approval(proposed):
    with pytest.raises(Tampered, match="does not match its seal"):
        approval_task({**proposed, "triggered_by": "mallory"}).execute(CONTEXT_TI)
    with pytest.raises(Tampered, match="is no sealed proposal"):
        approval_task({"plan": proposed["plan"]}).execute(CONTEXT_TI)


# -- who is asked, and what they read ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_approval_is_assigned_to_the_approvers_and_its_body_comes_from_the_box_as_text(proposed, monkeypatch):
    asked = {}
    monkeypatch.setattr(
        "airflow.providers.standard.operators.hitl.upsert_hitl_detail", lambda **request: asked.update(request)
    )
    task = approval_task(proposed)
    assert task.assigned_users == [{"id": "bob", "name": "bob"}, {"id": "trigger-user", "name": "trigger-user"}]
    with pytest.raises(TaskAwaitingInput):
        task.execute(CONTEXT_TI)
    html = render(asked["body"])
    assert "<strong>" not in html and "<img" not in html and "<a " not in html
    assert BOLD in html and IMAGE.replace("&", "&amp;") in html  # shown as the characters they are
    assert "| 3 |" not in html and "<td>1.870</td>" in html and "<td>1.700</td>" in html  # the figures: a table


@pytest.mark.slow
def test_a_workdir_with_a_backtick_stays_a_path_in_the_body(tmp_path, trust_settings, monkeypatch):
    """The issue's attack: a workdir with a backtick ended the code span, and what followed rendered as markup."""
    from eagle3_airflow.codesync import ensure_code

    workdir = tmp_path / "w`![x](collector.example/p.png)`**approve**"
    plan = sealed(run_plan(plain_config(workdir), require_gpus=False, gpu_max_used_mib=0))
    ensure_code(LocalBox(), sys.executable, str(workdir))
    write_proposal(str(run_dir_of(plan)))
    (proposal,) = received(event(propose(plan)))
    asked = {}
    monkeypatch.setattr(
        "airflow.providers.standard.operators.hitl.upsert_hitl_detail", lambda **request: asked.update(request)
    )
    with pytest.raises(TaskAwaitingInput):
        approval_task(proposal).execute(CONTEXT_TI)
    html = render(asked["body"])
    assert "<img" not in html and "<strong>" not in html
    assert f"<code>{workdir}/runs/r/drafter</code>".replace("&", "&amp;") in html.replace("&quot;", '"')


# -- who may approve ---------------------------------------------------------------------------------------------


def promote(proposal: dict, approval, deployment=None) -> dict:
    """The promotion DAG's promote task for `proposal`, given `approval` (its approval task's XCom)."""
    return approvals.promote_held(
        proposal, approval, dag_run=PROMOTION_RUN, deployment=deployment or Deployment(approvers=APPROVERS)
    )


@pytest.mark.slow
def test_an_approve_by_an_approver_who_did_not_trigger_the_run_is_sealed_for_promote(proposed, promote_calls):
    record = approve(proposed, "bob")
    assert record["approved_by"] == "bob" and "seal" in record
    outcome = promote(proposed, record)
    assert outcome["promoted"]
    (argv,) = promote_calls
    assert argv[-6:] == [
        "lineage",
        "promote",
        "--config",
        f"{run_dir_of(proposed['plan'])}/config.json",
        "--approved-by=bob",
        f"--approved-files={'f' * 64}",
    ]  # the files the approval covered


@pytest.mark.slow
def test_the_user_who_triggered_the_run_cannot_approve_it(proposed):
    """The promotion run has no triggering user (an Asset event started it): the proposal's sealed one counts."""
    with pytest.raises(
        AirflowFailException,
        match=r"answered Approve by 'trigger-user', who triggered the training "
        r"run: a promotion needs the Approve of another approver "
        r"\(\['bob'\]\)",
    ):
        approve(proposed, "trigger-user")


@pytest.mark.slow
def test_an_answer_by_someone_not_among_the_approvers_promotes_nothing(proposed):
    """SimpleAuthManager's all-admins mode lets any user answer: the task checks the approvers itself."""
    with pytest.raises(
        AirflowFailException,
        match=r"answered Approve by 'mallory', who is not one of this "
        r"deployment's approvers \['bob', 'trigger-user'\]",
    ):
        approve(proposed, "mallory")


@pytest.mark.slow
def test_an_approve_nobody_gave_is_no_approval(proposed):
    with pytest.raises(Tampered, match="resumed with Approve, but with no user who answered it"):
        approval_task(proposed).execute_complete(CONTEXT_TI, answered("Approve", None))


@pytest.mark.slow
def test_a_rejection_returns_no_approval(proposed):
    answer = approval_task(proposed).execute_complete(CONTEXT_TI, answered("Reject", "bob"))
    assert "seal" not in answer


# -- what promote accepts as an approval -----------------------------------------------------------------------


@pytest.mark.slow
def test_promote_refuses_without_a_sealed_approval(proposed, promote_calls):
    """The approval task marked successful by hand leaves no record; a hand-written XCom has no valid seal."""
    deployment = Deployment(approvers=APPROVERS)
    forged = {
        "chosen_options": ["Approve"],
        "approved_by": "bob",
        "approver_id": "bob",
        "responded_at": None,
        "proposal_sha256": approvals.proposal_digest(PROPOSAL),
    }
    for approval, why in (
        (None, "is no sealed approval"),
        (forged, "is no sealed approval"),
        ({**forged, "seal": "0" * 64}, "does not match its seal"),
    ):
        with pytest.raises(Tampered, match=why):
            promote(proposed, approval, deployment)
    record = approve(proposed, "bob")
    with pytest.raises(Tampered, match="does not match its seal"):  # the approver edited in XCom
        promote(proposed, {**record, "approved_by": "trigger-user", "approver_id": "trigger-user"}, deployment)
    other_run = SimpleNamespace(dag_id=PROMOTION_RUN.dag_id, run_id="asset_triggered__other")
    with pytest.raises(Tampered, match="or it is another run's"):  # bob's approval in another promotion run
        approvals.promote_held(proposed, record, dag_run=other_run, deployment=deployment)
    assert promote_calls == []


@pytest.mark.slow
def test_an_approval_of_another_training_runs_proposal_promotes_nothing(proposed, promote_calls, tmp_path):
    """Two proposals in one promotion run: the approval of one, pasted into the other's XCom, holds for neither."""
    other_training_run = SimpleNamespace(dag_id=RUN.dag_id, run_id="manual__second", triggering_user_name="alice")
    other = sealed(proposed["plan"], other_training_run)
    (other_proposal,) = received(event(propose(other, other_training_run), dag_run=other_training_run))
    with pytest.raises(Tampered, match="approved another training run's proposal than run manual__second"):
        promote(other_proposal, approve(proposed, "bob"))
    assert promote_calls == []


@pytest.mark.slow
def test_an_approval_holds_for_the_proposal_it_approved_only(proposed, promote_calls):
    record = approve(proposed, "bob")
    write_proposal(str(run_dir_of(proposed["plan"])), accept_length={"3": 1.2})  # evaluate ran again: another drafter
    with pytest.raises(Tampered, match="approved another proposal than the one"):
        promote(proposed, record)
    assert promote_calls == []
    # Issue 43's attack: the drafter and its proposal rewritten after the Approve, the figures kept. The approval
    # covers the held promotion's drafter files (what `lineage promote --approved-files` then insists on).
    write_proposal(str(run_dir_of(proposed["plan"])), drafter_files_sha256="e" * 64)
    with pytest.raises(Tampered, match="approved another proposal than the one"):
        promote(proposed, record)
    assert promote_calls == []


@pytest.mark.slow
def test_an_approver_removed_from_the_settings_since_cannot_promote(proposed, promote_calls):
    record = approve(proposed, "bob")
    with pytest.raises(AirflowFailException, match=r"'bob', who is not one of this deployment's approvers"):
        promote(proposed, record, Deployment(approvers=["carol"], approve_promotion=True))
    assert promote_calls == []


@pytest.mark.slow
def test_a_retry_after_the_switch_still_matches_its_approval(proposed, promote_calls):
    """`lineage promote` rewrites the report's promotion (promoted, the version) and keeps what was proposed: a
    retry of promote whose first try died after the switch goes through again (the box answers it idempotently)."""
    record = approve(proposed, "bob")
    write_proposal(
        str(run_dir_of(proposed["plan"])),
        promoted=True,
        pending_approval=False,
        version="r-1a2b3c4d",
        reason=PROPOSAL["reason"] + "; approved",
    )
    promote(proposed, record)
    assert len(promote_calls) == 1


@pytest.mark.slow
def test_the_same_proposal_asked_twice_is_promoted_once_and_the_second_approval_skips(proposed, promote_calls):
    """The training run proposed again after a clear (same drafter, same digest) while the first promotion run still
    waited: two promotion runs ask the same question. The first Approve promotes; the second question, asked or
    answered after that, is skipped, not failed: nothing is left to do."""
    write_proposal(
        str(run_dir_of(proposed["plan"])),
        promoted=True,
        pending_approval=False,
        version="r-1a2b3c4d",
        approved_by="bob",
        reason=PROPOSAL["reason"] + "; approved",
    )
    with pytest.raises(AirflowSkipException, match=r"this proposal was promoted already \(approved by bob\)"):
        approval_task(proposed).execute(CONTEXT_TI)
    with pytest.raises(AirflowSkipException, match="promoted already"):
        approve(proposed, "bob")
    write_proposal(str(run_dir_of(proposed["plan"])), pending_approval=False, reason="not better by the margin")
    with pytest.raises(
        AirflowFailException,
        match=r"holds no promotion for approval \(not better by the margin\): "
        r"no promotion",
    ):  # an approval in hand, and nothing to approve
        approve(proposed, "bob")
    assert promote_calls == []


# -- someone is told ---------------------------------------------------------------------------------------------


class Heard(BaseNotifier):
    """A notify channel (one of the settings' `notify.notifiers`, as a provider's notifier class) that records the
    message it is made with."""

    messages: ClassVar[list[tuple[str, str]]] = []
    template_fields = ("subject", "body")  # as a provider's: rendering them would evaluate the body's braces

    def __init__(self, *, subject: str, body: str):
        super().__init__()
        self.subject, self.body = subject, body

    def notify(self, context):
        Heard.messages.append((self.subject, self.body))


@pytest.mark.slow
def test_a_waiting_approval_tells_the_settings_channels_who_may_answer_where_and_the_figures_as_text(
    proposed, monkeypatch
):
    """The issue: a pending approval told nobody. The settings' notify channels hear it, and a template in a value
    from the box is sent as the characters it is, never evaluated."""
    write_proposal(str(run_dir_of(proposed["plan"])), reason="better {{ 6 * 7 }}")
    (proposed,) = received(event(propose(proposed["plan"])))  # the same run, its proposal made anew
    monkeypatch.setattr(Heard, "messages", [])
    monkeypatch.setattr("airflow.providers.standard.operators.hitl.upsert_hitl_detail", lambda **request: None)
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example/")
    deployment = Deployment(
        approve_promotion=True,
        approvers=["bob", "carol"],
        approval_timeout_h=24,
        notify={
            "notifiers": [{"class": f"{Heard.__module__}.Heard", "kwargs": {"subject": "{subject}", "body": "{body}"}}]
        },
    )
    assert approvals.approval_notifiers(Deployment(approve_promotion=True, approvers=["bob"])) == []  # no notify
    task = PromotionApproval(
        task_id="approve_promotion",
        proposal=proposed,
        approvers=deployment.approvers,
        defaults="Reject",
        notifiers=approvals.approval_notifiers(deployment),
    )
    with pytest.raises(TaskAwaitingInput):
        task.execute({**CONTEXT_TI, "task": task})
    ((subject, body),) = Heard.messages
    assert RUN.run_id in subject and RUN.dag_id in subject
    assert "bob, carol" in body and "24 h" in body
    # absolute, on [api] base_url, the run id quoted as in the Task SDK's log_url (its ':' and '+')
    assert (
        f"https://airflow.example/dags/{PROMOTION_RUN.dag_id}/runs/asset_triggered__2026-12-04T09%3A00%3A00%2B00"
        "%3A00/tasks/approve_promotion/mapped/0/required_actions"
    ) in body
    assert "| 3 | 1.870 | 1.700 |" in body  # the figures, as the approval's body shows them
    assert r"better \{\{ 6 \* 7 \}\}" in body and "42" not in body  # escaped as in the body, never rendered
