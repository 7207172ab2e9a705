"""Issue 35, items 4 and 8 (the Airflow side): a promotion needs an Approve by one of the settings' approvers who
did not trigger the run, and the approval shows its figures as the text they are.

Written as the attacks a USER-role user can make: mark the approval task successful by hand, PATCH its XCom
(an Approve by someone else, or one from another run or for another proposal), approve their own run, or answer
although not an approver (possible in SimpleAuthManager's all-admins mode); and put markdown into a value that
reaches the approval's body. The box is this machine; the promote command itself is recorded, not run (the box side
of `--approved-by` is another change's). The approval's resume event is given as the API server builds it.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskAwaitingInput
from markdown_it import MarkdownIt

from eagle3_airflow import approval as approval_module
from eagle3_airflow import plan as plan_module
from eagle3_airflow import tasks
from eagle3_airflow.approval import PromotionApproval
from eagle3_airflow.deployment import Approver, Deployment
from eagle3_airflow.plan import RunPlan
from eagle3_airflow.seal import Tampered
from eagle3_airflow.transport import CommandResult, LocalBox
from tests.conftest import CONTEXT, RUN, sealed

APPROVERS = [Approver.model_validate("bob"), Approver.model_validate("trigger-user")]  # RUN's trigger is one too
BOLD = "**Security review: passed, approve**"
IMAGE = "![ok](https://collector.example/pixel.png)"
PROPOSAL = {"promoted": False, "pending_approval": True, "lineage": "f209", "lineage_dir": "/w/drafters/f209",
            "reason": f"better at k=3: 1.870 against the current 1.700 (margin 0) {BOLD} {IMAGE}",
            "accept_length": {"3": 1.87}, "current": "/w/drafters/f209/current", "eval_set_prompts": 2,
            "current_before": {"version": "old-1a2b3c4d", "run": "old", "accept_length": {"3": 1.7}}}


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


@pytest.fixture
def proposed(plan) -> dict:
    write_proposal(plan["run_dir"])
    return plan


def answered(chosen: str, user: str | None) -> dict:
    """The approval task's resume event, as the API server builds it from the human-in-the-loop record when `user`
    answered (HITLDetail.as_resume_event_payload)."""
    return {"chosen_options": [chosen], "params_input": {}, "timedout": False,
            "responded_at": datetime(2026, 12, 4, 9, 0, tzinfo=UTC),
            "responded_by_user": user and {"id": user, "name": user}}


def approval_task(plan: dict) -> PromotionApproval:
    return PromotionApproval(task_id="approve_promotion", subject="Promote?", plan=plan, approvers=APPROVERS,
                             defaults="Reject")


CONTEXT_TI = {**CONTEXT, "task_instance": SimpleNamespace(id="0199-ti"), "ti": SimpleNamespace(id="0199-ti")}


def approve(plan: dict, user: str) -> dict:
    return approval_task(plan).execute_complete(CONTEXT_TI, answered("Approve", user))


# -- who is asked, and what they read ---------------------------------------------------------------------------


def test_the_approval_is_assigned_to_the_approvers_and_its_body_comes_from_the_box_as_text(proposed, monkeypatch):
    asked = {}
    monkeypatch.setattr("airflow.providers.standard.operators.hitl.upsert_hitl_detail",
                        lambda **request: asked.update(request))
    task = approval_task(proposed)
    assert task.assigned_users == [{"id": "bob", "name": "bob"}, {"id": "trigger-user", "name": "trigger-user"}]
    with pytest.raises(TaskAwaitingInput):
        task.execute(CONTEXT_TI)
    html = render(asked["body"])
    assert "<strong>" not in html and "<img" not in html and "<a " not in html
    assert BOLD in html and IMAGE.replace("&", "&amp;") in html  # shown as the characters they are
    assert "| 3 |" not in html and "<td>1.870</td>" in html and "<td>1.700</td>" in html  # the figures: a table


def test_a_workdir_with_a_backtick_stays_a_path_in_the_body(tmp_path, trust_settings, monkeypatch):
    """The issue's attack: a workdir with a backtick ended the code span, and what followed rendered as markup."""
    from eagle3_airflow.codesync import ensure_code

    workdir = tmp_path / "w`![x](collector.example/p.png)`**approve**"
    plan = sealed(RunPlan(run_name="r", workdir=str(workdir), run_dir=str(workdir / "runs" / "r"),
                          conn_ids=["local"], python=sys.executable, num_shards=1, generate=False, benchmark=False,
                          require_gpus=False, gpu_max_used_mib=0))
    ensure_code(LocalBox(), sys.executable, str(workdir))
    write_proposal(plan["run_dir"])
    asked = {}
    monkeypatch.setattr("airflow.providers.standard.operators.hitl.upsert_hitl_detail",
                        lambda **request: asked.update(request))
    with pytest.raises(TaskAwaitingInput):
        approval_task(plan).execute(CONTEXT_TI)
    html = render(asked["body"])
    assert "<img" not in html and "<strong>" not in html
    assert f"<code>{workdir}/runs/r/drafter</code>".replace("&", "&amp;") in html.replace("&quot;", '"')


# -- who may approve ---------------------------------------------------------------------------------------------


def test_an_approve_by_an_approver_who_did_not_trigger_the_run_is_sealed_for_promote(proposed, promote_calls):
    record = approve(proposed, "bob")
    assert record["approved_by"] == "bob" and "seal" in record
    outcome = tasks.promote_held(proposed, record, dag_run=RUN, deployment=Deployment(approvers=APPROVERS))
    assert outcome["promoted"]
    (argv,) = promote_calls
    assert argv[-5:] == ["lineage", "promote", "--config", f"{proposed['run_dir']}/config.json",
                         "--approved-by=bob"]


def test_the_user_who_triggered_the_run_cannot_approve_it(proposed):
    with pytest.raises(AirflowFailException, match=r"answered Approve by 'trigger-user', who triggered this run: a "
                                                   r"promotion needs the Approve of another approver \(\['bob'\]\)"):
        approve(proposed, "trigger-user")


def test_an_answer_by_someone_not_among_the_approvers_promotes_nothing(proposed):
    """SimpleAuthManager's all-admins mode lets any user answer: the task checks the approvers itself."""
    with pytest.raises(AirflowFailException, match=r"answered Approve by 'mallory', who is not one of this "
                                                   r"deployment's approvers \['bob', 'trigger-user'\]"):
        approve(proposed, "mallory")


def test_an_approve_nobody_gave_is_no_approval(proposed):
    with pytest.raises(Tampered, match="resumed with Approve, but with no user who answered it"):
        approval_task(proposed).execute_complete(CONTEXT_TI, answered("Approve", None))


def test_a_rejection_returns_no_approval(proposed):
    answer = approval_task(proposed).execute_complete(CONTEXT_TI, answered("Reject", "bob"))
    assert "seal" not in answer


# -- what promote accepts as an approval -----------------------------------------------------------------------


def test_promote_refuses_without_a_sealed_approval(proposed, promote_calls):
    """The approval task marked successful by hand leaves no record; a hand-written XCom has no valid seal."""
    deployment = Deployment(approvers=APPROVERS)
    forged = {"chosen_options": ["Approve"], "approved_by": "bob", "approver_id": "bob", "responded_at": None,
              "proposal_sha256": approval_module.proposal_digest(PROPOSAL)}
    for approval, why in ((None, "is no sealed approval"), (forged, "is no sealed approval"),
                          ({**forged, "seal": "0" * 64}, "does not match its seal")):
        with pytest.raises(Tampered, match=why):
            tasks.promote_held(proposed, approval, dag_run=RUN, deployment=deployment)
    record = approve(proposed, "bob")
    with pytest.raises(Tampered, match="does not match its seal"):  # the approver edited in XCom
        tasks.promote_held(proposed, {**record, "approved_by": "trigger-user", "approver_id": "trigger-user"},
                           dag_run=RUN, deployment=deployment)
    other_run = SimpleNamespace(dag_id=RUN.dag_id, run_id="manual__other", triggering_user_name="x")
    with pytest.raises(Tampered, match="or it is another run's"):  # bob's approval of another run, pasted in
        tasks.promote_held(sealed(proposed, other_run), record, dag_run=other_run, deployment=deployment)
    assert promote_calls == []


def test_an_approval_holds_for_the_proposal_it_approved_only(proposed, promote_calls):
    record = approve(proposed, "bob")
    write_proposal(proposed["run_dir"], accept_length={"3": 1.2})  # evaluate ran again: another drafter
    with pytest.raises(Tampered, match="approved another proposal than the one"):
        tasks.promote_held(proposed, record, dag_run=RUN, deployment=Deployment(approvers=APPROVERS))
    assert promote_calls == []


def test_an_approver_removed_from_the_settings_since_cannot_promote(proposed, promote_calls):
    record = approve(proposed, "bob")
    with pytest.raises(AirflowFailException, match=r"'bob', who is not one of this deployment's approvers"):
        tasks.promote_held(proposed, record, dag_run=RUN,
                           deployment=Deployment(approvers=["carol"], approve_promotion=True))
    assert promote_calls == []


def test_a_retry_after_the_switch_still_matches_its_approval(proposed, promote_calls):
    """`lineage promote` rewrites the report's promotion (promoted, the version) and keeps what was proposed: a
    retry of promote whose first try died after the switch goes through again (the box answers it idempotently)."""
    record = approve(proposed, "bob")
    write_proposal(proposed["run_dir"], promoted=True, pending_approval=False, version="r-1a2b3c4d",
                   reason=PROPOSAL["reason"] + "; approved")
    tasks.promote_held(proposed, record, dag_run=RUN, deployment=Deployment(approvers=APPROVERS))
    assert len(promote_calls) == 1


# -- someone is told ---------------------------------------------------------------------------------------------

def test_a_waiting_approval_tells_the_settings_channels_who_may_answer_where_and_the_figures_as_text(proposed,
                                                                                                      monkeypatch):
    """The issue: a pending approval told nobody. The settings' notify channels hear it, and a template in a value
    from the box is sent as the characters it is, never evaluated."""
    write_proposal(proposed["run_dir"], reason="better {{ 6 * 7 }}")
    heard = []  # a notify channel (`notify.callables`, module:function) that records what it is sent
    monkeypatch.setitem(sys.modules, "eagle3_test_channel",
                        SimpleNamespace(heard=lambda *message: heard.append(message)))
    monkeypatch.setattr("airflow.providers.standard.operators.hitl.upsert_hitl_detail", lambda **request: None)
    deployment = Deployment(approve_promotion=True, approvers=["bob", "carol"], approval_timeout_h=24,
                            notify={"callables": ["eagle3_test_channel:heard"]})
    assert Deployment(approve_promotion=True, approvers=["bob"]).approval_notifiers() == []  # no notify: silent
    task = PromotionApproval(task_id="approve_promotion", subject="Promote?", plan=proposed,
                             approvers=deployment.approvers, defaults="Reject",
                             notifiers=deployment.approval_notifiers())
    with pytest.raises(TaskAwaitingInput):
        task.execute({**CONTEXT_TI, "task": task})
    ((subject, body),) = heard
    assert RUN.run_id in subject and RUN.dag_id in subject
    assert "bob, carol" in body and "24 h" in body
    assert f"/dags/{RUN.dag_id}/runs/{RUN.run_id}/tasks/approve_promotion/required_actions" in body
    assert "| 3 | 1.870 | 1.700 |" in body  # the figures, as the approval's body shows them
    assert r"better \{\{ 6 \* 7 \}\}" in body and "42" not in body  # escaped as in the body, never rendered
