"""The promotion's approval: Airflow's human-in-the-loop ApprovalOperator, asked of the settings' approvers only,
and what the promote task accepts as an approval. Both run in the promotion DAG (eagle3_airflow.promotion), one of
each per proposal: a training run's sealed proposal, re-checked by every task that uses it.

- Assigned users: the settings' `approvers` become the operator's `assigned_users`, which Airflow's API server
  enforces when someone answers (BaseAuthManager.is_authorized_hitl_task: the answering user's id must be one of
  them; SimpleAuthManager's all-admins mode lets everyone answer, so the checks below do not rely on it).
- The body (both drafters' figures) is made from the run's report on the box through the verified plan, never from
  another task's XCom, and escaped (eagle3_airflow.run_note), so a hostile value cannot render as an instruction.
- Who answered: the approval task, resumed, takes it from its resume event. The API server builds that event from
  the human-in-the-loop detail row when the authenticated user answers (HITLDetail.as_resume_event_payload:
  responded_by is that user) and stores it as the task instance's next_kwargs, which no public API writes. That is
  the most trustworthy source a running task has in Airflow 3.3: the Execution API's route for a task's own detail
  (GET /execution/hitlDetails/{ti id}, scope ti:self) is relayed by the triggerer only; a task's supervisor answers
  the Task SDK's get_hitl_detail_content_detail with "Unhandled request". The promote task could not read the
  approval's detail at all (ti:self), and the approval's XCom is the USER role's to edit. So the approval checks the
  answer itself (Approve, by one of the approvers, not by the user who triggered the training run, as its sealed
  proposal says) and hands the promote task a sealed record (eagle3_airflow.seal) of who approved which training
  run's proposal; promote checks the seal, the approver against the settings as they are then, the triggering user,
  and that the proposal on the box is the one approved (a re-evaluated drafter needs a new approval).

A task marked successful by hand leaves no sealed record, and promote refuses to promote without one.

Someone is told: with the settings' `notify`, the approval's `notifiers` (ApprovalAsked) send the settings' channels
a message when the approval starts waiting: which run, who may approve, by when, where to answer, and the body.
"""

from __future__ import annotations

import logging

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import BaseNotifier
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from eagle3.runlayout import DRAFTER_DIR
from eagle3_airflow.plan import RunPlan
from eagle3_airflow.promotion import Proposal, verified_proposal
from eagle3_airflow.seal import RunRef, Tampered, digest, is_sealed, seal, task_key

log = logging.getLogger(__name__)

APPROVAL_XCOM = "the approval in XCom (task `approve_promotion` of this proposal, its return value)"
ASK_AGAIN = "Clear this proposal's approve_promotion task to ask the approvers again."
# What a person saw and approved, as evaluate held it: `lineage promote` rewrites the report's promotion (promoted,
# version, reason) but keeps these, so a retried promote still matches its approval.
PROPOSAL_KEYS = ("lineage", "accept_length", "current_before", "eval_set_prompts", "eval_set_pinned_by",
                 "weights_sha256", "drafter_files_sha256")


def proposal_digest(promotion: dict) -> str:
    return digest({key: promotion.get(key) for key in PROPOSAL_KEYS})


def approval_body(plan: RunPlan, promotion: dict) -> str:
    """The approval's markdown: both drafters' figures and why evaluate proposes the switch, every value escaped."""
    from eagle3_airflow.run_note import note_markdown

    summary = {"drafter": f"{plan.run_dir}/{DRAFTER_DIR}", "promotion": promotion,
               "measured_accept_length": promotion.get("accept_length")}
    return note_markdown(summary, headline="proposed for promotion")


def check_approver(user_id: str, user_name: str, approvers: list, triggering_user: str | None) -> None:
    """Refuse an Approve that does not come from one of `approvers` (Approver models) or that comes from the user
    who triggered the run."""
    names = [approver.name for approver in approvers]
    if user_id not in {approver.id for approver in approvers}:
        raise AirflowFailException(f"approve_promotion was answered Approve by {user_name!r}, who is not one of this "
                                   f"deployment's approvers {names} (settings key approvers): no promotion. "
                                   + ASK_AGAIN)
    if triggering_user is not None and user_name == triggering_user:
        others = [name for name in names if name != user_name]
        raise AirflowFailException(f"approve_promotion was answered Approve by {user_name!r}, who triggered the "
                                   f"training run: a promotion needs the Approve of another approver "
                                   f"({others or 'none listed'}). " + ASK_AGAIN)


class ApprovalAsked(BaseNotifier):
    """Tells the settings' notify channels that a promotion awaits an approver (the approval's `notifiers`)."""

    template_fields = ()

    def __init__(self, *, approvers: list, response_timeout_h: float, smtp_conn_id: str | None, to: list[str],
                 from_email: str | None, callables: list[str]):
        super().__init__()
        self.approvers = [approver.name for approver in approvers]
        self.response_timeout_h = response_timeout_h
        self.smtp_conn_id, self.to, self.from_email = smtp_conn_id, list(to), from_email
        self.callables = list(callables)

    def render_template_fields(self, context, jinja_env=None) -> None:
        """Nothing here is a template: the body holds values from the box (eagle3_airflow/notify.py says why)."""

    def notify(self, context) -> None:
        from eagle3_airflow.notify import send

        dag_run, task, ti = context["dag_run"], context["task"], context["ti"]
        source = task.source  # the training run, which PromotionApproval.execute verified before it asks
        subject = f"eagle3: approve the promotion of run {source.run_id}? ({source.dag_id})"
        mapped = f"/mapped/{ti.map_index}" if getattr(ti, "map_index", -1) not in (None, -1) else ""
        body = "\n".join([
            f"Run {source.run_id} of DAG {source.dag_id} proposes its drafter for promotion.",
            f"Who may approve: {', '.join(self.approvers)} (not the user who triggered the run).",
            f"Unanswered for {self.response_timeout_h:g} h, it is rejected.",
            f"Answer in the Airflow UI: /dags/{dag_run.dag_id}/runs/{dag_run.run_id}/tasks/{task.task_id}{mapped}"
            "/required_actions (Browse > Required Actions).",
            "", task.body or ""])
        send(subject, body, context, self.smtp_conn_id, self.to, self.from_email, self.callables)


class PromotionApproval(ApprovalOperator):
    """Asks the settings' approvers to approve the promotion a training run proposed; see the module docstring.

    :param proposal: one proposal of the promotion DAG's `proposals` task (eagle3_airflow.promotion).
    :param approvers: the settings' approvers (eagle3_airflow.deployment.Approver).
    """

    template_fields = ("proposal",)  # the subject and body are made in execute, from the box; never templates

    def __init__(self, *, proposal, approvers: list, **kwargs):
        super().__init__(subject="Promote a drafter?", assigned_users=[approver.hitl_user() for approver in approvers],
                         **kwargs)
        self.proposal = proposal
        self.approvers = list(approvers)
        self.source: RunRef | None = None

    def execute(self, context):
        proposal = verified_proposal(self.proposal)
        promotion = held_proposal(proposal)
        self.source = proposal.source
        self.subject = f"Promote the drafter of run {proposal.source.run_id}?"
        self.body = approval_body(proposal.plan, promotion)
        return super().execute(context)

    def execute_complete(self, context, event):
        dag_run = context["dag_run"]
        proposal = verified_proposal(self.proposal)
        answer = super().execute_complete(context=context, event=event)  # on Reject: downstream skipped
        if list(answer["chosen_options"]) != [self.APPROVE]:
            return answer
        user = event.get("responded_by_user")  # the API server's: the authenticated user who answered
        if not isinstance(user, dict) or not user.get("id") or not user.get("name"):
            raise Tampered("approve_promotion resumed with Approve, but with no user who answered it: no promotion. "
                           + ASK_AGAIN)
        user_id, user_name = str(user["id"]), str(user["name"])
        check_approver(user_id, user_name, self.approvers, proposal.triggered_by)
        promotion = held_proposal(proposal, fail=True)
        responded_at = event.get("responded_at")
        record = {"chosen_options": [self.APPROVE], "approved_by": user_name, "approver_id": user_id,
                  "responded_at": responded_at.isoformat() if hasattr(responded_at, "isoformat") else None,
                  "source": {"dag_id": proposal.source.dag_id, "run_id": proposal.source.run_id},
                  "proposal_sha256": proposal_digest(promotion)}
        log.info("approved by %s (id %s), one of the approvers: %s, proposal %s", user_name, user_id, proposal.label,
                 record["proposal_sha256"][:16])
        return {**record, "seal": seal("approval", record, RunRef.of(dag_run), task_key())}


def held_proposal(proposal: Proposal, fail: bool = False) -> dict:
    """The promotion the proposal's run holds on the box for approval, if it is still the one proposed. Otherwise
    the task is skipped: this very proposal was promoted already (approved in another promotion run: the training
    run proposed it again after a clear), or, before anyone answered, there is nothing to ask (evaluate ran again and
    proposed anew, or refused); with `fail` (an approval in hand) the latter fails."""
    from eagle3_airflow.tasks import report_promotion

    promotion = report_promotion(proposal.plan) or {}
    same = bool(promotion) and proposal_digest(promotion) == proposal.proposal_sha256
    if same and promotion.get("pending_approval") is True:
        return promotion
    if same and promotion.get("promoted") is True:
        raise AirflowSkipException(f"{proposal.label}: this proposal was promoted already (approved by "
                                   f"{promotion.get('approved_by', 'another approval')}): nothing left to do")
    why = (f"{proposal.plan.run_dir} holds another proposal than {proposal.label} made (evaluate ran again since)"
           if promotion.get("pending_approval") is True else
           f"{proposal.plan.run_dir} holds no promotion for approval ({promotion.get('reason', 'no report')})")
    if fail:
        raise AirflowFailException(f"{why}: no promotion. {ASK_AGAIN}")
    raise AirflowSkipException(f"{why}: nothing to approve")


def verified_approval(approval, proposal: Proposal, promotion: dict, dag_run, deployment) -> str:
    """The approver's name, if `approval` (the approval task's XCom) is a sealed Approve, in this promotion run, of
    this proposal's `promotion` by one of the settings' approvers who did not trigger the training run; otherwise
    the promote task fails, saying why."""
    if not isinstance(approval, dict) or "seal" not in approval:
        raise Tampered(f"{APPROVAL_XCOM} is no sealed approval (was the task marked successful by hand, or its XCom "
                       "edited?): no promotion. " + ASK_AGAIN)
    body = {key: value for key, value in approval.items() if key != "seal"}
    if not is_sealed("approval", body, RunRef.of(dag_run), task_key(), approval["seal"]):
        raise Tampered(f"{APPROVAL_XCOM} does not match its seal: it was edited, or it is another run's: no promotion. "
                       + ASK_AGAIN)
    if body.get("chosen_options") != [ApprovalOperator.APPROVE]:
        raise Tampered(f"{APPROVAL_XCOM} is no Approve: no promotion. " + ASK_AGAIN)
    if body.get("source") != {"dag_id": proposal.source.dag_id, "run_id": proposal.source.run_id}:
        raise Tampered(f"{APPROVAL_XCOM} approved another training run's proposal than {proposal.label}: no "
                       "promotion. " + ASK_AGAIN)
    check_approver(str(body.get("approver_id")), str(body.get("approved_by")), deployment.approvers,
                   proposal.triggered_by)
    if body.get("proposal_sha256") != proposal_digest(promotion):
        raise Tampered(f"{APPROVAL_XCOM} approved another proposal than the one {proposal.plan.run_dir} holds now "
                       "(evaluate ran again since): no promotion. " + ASK_AGAIN)
    return str(body["approved_by"])
