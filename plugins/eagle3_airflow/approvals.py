"""Promotion, whole: a training run proposes, the promotion DAG asks a person and promotes, and a promoted drafter
is announced on the drafter Asset. The DAG file wraps these with @task (and uses PromotionApproval as it is).

Without the settings' approve_promotion, evaluate promotes by itself and the training run's `promoted` task
(announce_promotion) puts the event on the drafter Asset. With it, evaluate holds the switch (`--hold-promotion`),
and the run's `propose_promotion` task puts an event on the proposals Asset (`<drafter_asset>.proposals`). The
promotion DAG, scheduled on that Asset, asks the settings' approvers (PromotionApproval) and, on Approve, makes the
switch on the box (promote_held) and puts the event on the drafter Asset (announce_approved_promotion). So a pending
approval holds no box, no pool slot and no run slot of the box's DAG (max_active_runs=1): the box trains the next run
while a person decides, and `lineage promote` refuses to switch over a drafter promoted meanwhile.

What the promotion DAG trusts of an event: nothing it says, only what it can check.
- Its source: an event the REST API created (`from_rest_api`, no source task) is no proposal; neither is one from
  another DAG or task than a drafter DAG's `propose_promotion`.
- Its extra: the propose task sealed it (eagle3_airflow.seal, kind "proposal") for its source run; inside, the plan
  validate sealed for that run. An edited extra, or one copied to another run, fails the seal.
- Its figures: none are used. The approval's body and the promote task read the proposal from the run's report on
  the box through the verified plan, and an approval holds only for the proposal digest it was given.
Several proposals may reach one promotion run (events that came in while the scheduler was busy): each gets its own
approval and promote in a mapped task group, each deciding alone.

The approval is Airflow's human-in-the-loop ApprovalOperator, asked of the settings' approvers only:
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
  run's proposal; promote checks the seal, the approver against the settings the promotion DAG was parsed with (those
  that assigned the approval), the triggering user, and that the proposal on the box is the one approved (a
  re-evaluated drafter needs a new approval).
A task marked successful by hand leaves no sealed record, and promote refuses to promote without one.

Someone is told: with the settings' `notify`, the approval's `notifiers` (ApprovalAsked) send the settings' channels
a message when the approval starts waiting: which run, who may approve, by when, where to answer, and the body.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import Asset, BaseNotifier, conf
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from eagle3.disk.layout import DRAFTER_DIR, REPORT
from eagle3_airflow.deployment import Approver, Deployment
from eagle3_airflow.notify import send
from eagle3_airflow.plan import RunPlan, verified_plan
from eagle3_airflow.pools import is_drafter_dag
from eagle3_airflow.results import read_json, read_or_fail, report_summary
from eagle3_airflow.seal import RunIds, RunRef, Tampered, digest, is_sealed, seal, task_key

if TYPE_CHECKING:
    from airflow.sdk import Context
    from jinja2 import Environment

log = logging.getLogger(__name__)

PROMOTION_DAG_ID = "eagle3_promotion"
PROPOSE_TASK = "propose_promotion"
PROPOSAL_XCOM = "the proposal in XCom (task `proposals`, one item of its return value)"
APPROVAL_XCOM = "the approval in XCom (task `approve_promotion` of this proposal, its return value)"
TRIGGER_AGAIN = "Clear the training run's propose_promotion task to propose its drafter again."
ASK_AGAIN = "Clear this proposal's approve_promotion task to ask the approvers again."
# What a person saw and approved, as evaluate held it: `lineage promote` rewrites the report's promotion (promoted,
# version, reason) but keeps these, so a retried promote still matches its approval.
PROPOSAL_KEYS = (
    "lineage",
    "accept_length",
    "current_before",
    "eval_set_prompts",
    "eval_set_pinned_by",
    "weights_sha256",
    "drafter_files_sha256",
)


def proposals_asset_name(drafter_asset: str) -> str:
    """The Asset training runs propose on; the promotion DAG is scheduled on it."""
    return f"{drafter_asset}.proposals"


# A promotion, a proposal, an approval: JSON objects (from the box's report, or XCom), dict[str, Any], each value
# checked where it is read. outlet_events and triggering_asset_events: the task's, from Airflow's context.
def proposal_digest(promotion: dict[str, Any]) -> str:
    return digest({key: promotion.get(key) for key in PROPOSAL_KEYS})


def report_promotion(plan: RunPlan) -> dict[str, Any] | None:
    """The promotion in the run's report on the box (held, made or refused); None without one."""
    evaluation = read_or_fail(lambda: read_json(plan, REPORT))
    if evaluation is None:  # evaluate was skipped: nothing changed
        return None
    promotion = evaluation.get("promotion")
    return promotion if isinstance(promotion, dict) else None


# -- the proposal: a training run's, and what the promotion DAG takes for one ---------------------------------------
def proposed_promotion(plan: RunPlan) -> dict[str, Any] | None:
    """The promotion evaluate held for approval, from the run's report on the box; None if there is none."""
    promotion = report_promotion(plan)
    if promotion is None or promotion.get("pending_approval") is not True:
        log.info(
            "no promotion to approve: %s",
            (promotion or {}).get("reason") if isinstance(promotion, dict) else "the report has none",
        )
        return None
    return promotion


def sealed_proposal(
    plan_dict: dict[str, Any], plan: RunPlan, promotion: dict[str, Any], dag_run: RunIds | None
) -> dict[str, Any]:
    """The proposal event's extra: the sealed plan (plan_dict, which `plan` verified), who triggered the run and the
    digest of the proposal held on the box, sealed for the training run (dag_run); the figures, for a person reading
    the event, are not sealed."""
    body = {
        "plan": plan_dict,
        "triggered_by": getattr(dag_run, "triggering_user_name", None),
        "proposal_sha256": proposal_digest(promotion),
    }
    return {
        **body,
        "seal": seal("proposal", body, RunRef.of(dag_run), task_key()),
        "run_dir": plan.run_dir,
        "accept_length": promotion.get("accept_length"),
    }


def propose_promotion(
    plan_dict: dict[str, Any], asset_name: str, outlet_events: Any = None, dag_run: RunIds | None = None
) -> dict[str, Any]:
    """With the settings' approve_promotion: an event on the proposals Asset when evaluate held a promotion for
    approval, which starts the promotion DAG; skipped (no event) when it holds none. The event's extra is sealed for
    this run; its proposal is read from the box, never from another task's XCom."""
    plan = verified_plan(plan_dict, dag_run)
    promotion = proposed_promotion(plan)
    if promotion is None:
        raise AirflowSkipException("nothing proposed for promotion: no approval asked")
    extra = sealed_proposal(plan_dict, plan, promotion, dag_run)
    outlet_events[Asset(asset_name)].extra = extra
    log.info(
        "proposed %s for promotion: event on asset %s; the promotion DAG asks the approvers", plan.run_dir, asset_name
    )
    return {"run_dir": plan.run_dir, "proposal_sha256": extra["proposal_sha256"]}


@dataclass(frozen=True)
class Proposal:
    """A proposal the promotion DAG may act on: the training run, its verified plan, who triggered it."""

    source: RunRef
    plan: RunPlan
    triggered_by: str | None
    proposal_sha256: str

    @property
    def label(self) -> str:
        return f"run {self.source.run_id} of {self.source.dag_id}"


def verified_proposal(item: object) -> Proposal:
    """A proposal handed from task to task (XCom: {"source": {dag_id, run_id}, **the event's extra}), if its seal
    holds for its source run and the plan inside is that run's; Tampered otherwise."""
    if not isinstance(item, dict) or not isinstance(item.get("source"), dict) or "seal" not in item:
        raise Tampered(f"{PROPOSAL_XCOM} is no sealed proposal: an XCom edit? " + TRIGGER_AGAIN)
    source = RunRef(str(item["source"].get("dag_id")), str(item["source"].get("run_id")))
    body = {key: item.get(key) for key in ("plan", "triggered_by", "proposal_sha256")}
    if not is_drafter_dag(source.dag_id) or not is_sealed("proposal", body, source, task_key(), item["seal"]):
        raise Tampered(
            f"{PROPOSAL_XCOM} does not match its seal for {source.run_id} of {source.dag_id}: it was "
            "edited, or it is another run's. " + TRIGGER_AGAIN
        )
    triggered_by = body["triggered_by"]
    return Proposal(
        source,
        verified_plan(body["plan"], source),
        None if triggered_by is None else str(triggered_by),
        str(body["proposal_sha256"]),
    )


def proposals_from_events(triggering_asset_events: Any, asset_name: str) -> list[dict[str, Any]]:
    """The promotion run's proposals: each of its triggering events on the proposals Asset (`asset_name`) that a
    drafter DAG's propose task emitted and sealed, once per training run and proposal. An event that is none is
    left out, saying why in the log; with none left (a manual run, too) the run is skipped."""
    events = [
        event
        for asset in triggering_asset_events or {}
        for event in triggering_asset_events[asset]
        if event.asset.name == asset_name
    ]
    found: dict[tuple[RunRef, str], dict[str, Any]] = {}
    for event in events:
        extra = dict(event.extra or {})
        where = f"event of {event.timestamp:%Y-%m-%d %H:%M:%S} (from {event.source_dag_id}.{event.source_task_id})"
        if (
            extra.get("from_rest_api")
            or event.source_task_id != PROPOSE_TASK
            or not event.source_dag_id
            or not is_drafter_dag(event.source_dag_id)
            or not event.source_run_id
        ):
            log.warning(
                "%s: not emitted by a drafter DAG's %s task (created through the REST API?): no proposal",
                where,
                PROPOSE_TASK,
            )
            continue
        item = {"source": {"dag_id": event.source_dag_id, "run_id": event.source_run_id}, **extra}
        try:
            proposal = verified_proposal(item)
        except Tampered as err:
            log.warning("%s: refused: %s", where, err)
            continue
        log.info("%s: proposes %s (%s)", where, proposal.plan.run_dir, proposal.proposal_sha256[:16])
        found[(proposal.source, proposal.proposal_sha256)] = item
    if not found:
        raise AirflowSkipException("no proposal among the triggering events: nothing to approve")
    return list(found.values())


# -- the approval --------------------------------------------------------------------------------------------------
def approval_body(plan: RunPlan, promotion: dict[str, Any]) -> str:
    """The approval's markdown: both drafters' figures and why evaluate proposes the switch, every value escaped."""
    from eagle3_airflow.run_note import note_markdown  # when the task runs: the DAG's parse does without it

    summary = {
        "drafter": f"{plan.run_dir}/{DRAFTER_DIR}",
        "promotion": promotion,
        "measured_accept_length": promotion.get("accept_length"),
    }
    return note_markdown(summary, headline="proposed for promotion")


def check_approver(user_id: str, user_name: str, approvers: list[Approver], triggering_user: str | None) -> None:
    """Refuse an Approve that does not come from one of `approvers` (Approver models) or that comes from the user
    who triggered the run."""
    names = [approver.name for approver in approvers]
    if user_id not in {approver.id for approver in approvers}:
        raise AirflowFailException(
            f"approve_promotion was answered Approve by {user_name!r}, who is not one of this "
            f"deployment's approvers {names} (settings key approvers): no promotion. " + ASK_AGAIN
        )
    if triggering_user is not None and user_name == triggering_user:
        others = [name for name in names if name != user_name]
        raise AirflowFailException(
            f"approve_promotion was answered Approve by {user_name!r}, who triggered the "
            f"training run: a promotion needs the Approve of another approver "
            f"({others or 'none listed'}). " + ASK_AGAIN
        )


def held_proposal(proposal: Proposal, fail: bool = False) -> dict[str, Any]:
    """The promotion the proposal's run holds on the box for approval, if it is still the one proposed. Otherwise
    the task is skipped: this very proposal was promoted already (approved in another promotion run: the training
    run proposed it again after a clear), or, before anyone answered, there is nothing to ask (evaluate ran again and
    proposed anew, or refused); with `fail` (an approval in hand) the latter fails."""
    promotion = report_promotion(proposal.plan) or {}
    same = bool(promotion) and proposal_digest(promotion) == proposal.proposal_sha256
    if same and promotion.get("pending_approval") is True:
        return promotion
    if same and promotion.get("promoted") is True:
        raise AirflowSkipException(
            f"{proposal.label}: this proposal was promoted already (approved by "
            f"{promotion.get('approved_by', 'another approval')}): nothing left to do"
        )
    why = (
        f"{proposal.plan.run_dir} holds another proposal than {proposal.label} made (evaluate ran again since)"
        if promotion.get("pending_approval") is True
        else f"{proposal.plan.run_dir} holds no promotion for approval ({promotion.get('reason', 'no report')})"
    )
    if fail:
        raise AirflowFailException(f"{why}: no promotion. {ASK_AGAIN}")
    raise AirflowSkipException(f"{why}: nothing to approve")


class ApprovalAsked(BaseNotifier):
    """Tells the settings' notify channels that a promotion awaits an approver (the approval's `notifiers`)."""

    template_fields = ()

    def __init__(
        self,
        *,
        approvers: list[Approver],
        response_timeout_h: float,
        smtp_conn_id: str | None,
        to: list[str],
        from_email: str | None,
        notifiers: list[dict[str, Any]],
    ) -> None:
        super().__init__()
        self.approvers = [approver.name for approver in approvers]
        self.response_timeout_h = response_timeout_h
        self.smtp_conn_id, self.to, self.from_email = smtp_conn_id, list(to), from_email
        self.notifiers = list(notifiers)

    def render_template_fields(self, context: Context, jinja_env: Environment | None = None) -> None:
        """Nothing here is a template: the body holds values from the box (eagle3_airflow/notify.py says why)."""

    def notify(self, context: Context) -> None:
        dag_run, task, ti = context["dag_run"], context["task"], context["ti"]
        assert isinstance(task, PromotionApproval) and task.source is not None  # (its notifier, called from execute)
        source = task.source  # the training run, which PromotionApproval.execute verified before it asks
        subject = f"eagle3: approve the promotion of run {source.run_id}? ({source.dag_id})"
        mapped = f"/mapped/{ti.map_index}" if getattr(ti, "map_index", -1) not in (None, -1) else ""
        # Absolute, on the API server's [api] base_url, as the Task SDK builds a task's log_url: a mail reader has no
        # page to resolve a relative link against.
        base_url = conf.get("api", "base_url", fallback="http://localhost:8080/").rstrip("/")
        body = "\n".join(
            [
                f"Run {source.run_id} of DAG {source.dag_id} proposes its drafter for promotion.",
                f"Who may approve: {', '.join(self.approvers)} (not the user who triggered the run).",
                f"Unanswered for {self.response_timeout_h:g} h, it is rejected.",
                f"Answer in the Airflow UI: {base_url}/dags/{dag_run.dag_id}/runs/{quote(dag_run.run_id)}/tasks/"
                f"{task.task_id}{mapped}/required_actions (Browse > Required Actions).",
                "",
                task.body or "",
            ]
        )
        send(subject, body, context, self.smtp_conn_id, self.to, self.from_email, self.notifiers)


def approval_notifiers(settings: Deployment) -> list[ApprovalAsked]:
    """The promotion approval's notifiers: the settings' notify channels hear that an approval is waiting."""
    if settings.notify is None:
        return []
    return [
        ApprovalAsked(
            approvers=settings.approvers, response_timeout_h=settings.approval_timeout_h, **settings.notify.kwargs()
        )
    ]


class PromotionApproval(ApprovalOperator):
    """Asks the settings' approvers to approve the promotion a training run proposed; see the module docstring.

    :param proposal: one proposal of the promotion DAG's `proposals` task (proposals_from_events).
    :param approvers: the settings' approvers (eagle3_airflow.deployment.Approver).
    """

    template_fields = ("proposal",)  # the subject and body are made in execute, from the box; never templates

    # proposal: an XComArg, a dict once rendered (verified_proposal checks it); kwargs: ApprovalOperator's
    def __init__(self, *, proposal: Any, approvers: list[Approver], **kwargs: Any) -> None:
        super().__init__(
            subject="Promote a drafter?", assigned_users=[approver.hitl_user() for approver in approvers], **kwargs
        )
        self.proposal = proposal
        self.approvers = list(approvers)
        self.source: RunRef | None = None

    def execute(self, context: Context) -> object:  # (what ApprovalOperator.execute returns: it waits for the answer)
        proposal = verified_proposal(self.proposal)
        promotion = held_proposal(proposal)
        self.source = proposal.source
        self.subject = f"Promote the drafter of run {proposal.source.run_id}?"
        self.body = approval_body(proposal.plan, promotion)
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        dag_run = context["dag_run"]
        proposal = verified_proposal(self.proposal)
        answer: dict[str, Any] = super().execute_complete(context=context, event=event)  # on Reject: downstream skipped
        if list(answer["chosen_options"]) != [self.APPROVE]:
            return answer
        user = event.get("responded_by_user")  # the API server's: the authenticated user who answered
        if not isinstance(user, dict) or not user.get("id") or not user.get("name"):
            raise Tampered(
                "approve_promotion resumed with Approve, but with no user who answered it: no promotion. " + ASK_AGAIN
            )
        user_id, user_name = str(user["id"]), str(user["name"])
        check_approver(user_id, user_name, self.approvers, proposal.triggered_by)
        promotion = held_proposal(proposal, fail=True)
        responded_at: object = event.get("responded_at")
        record: dict[str, Any] = {
            "chosen_options": [self.APPROVE],
            "approved_by": user_name,
            "approver_id": user_id,
            "responded_at": responded_at.isoformat() if hasattr(responded_at, "isoformat") else None,
            "source": {"dag_id": proposal.source.dag_id, "run_id": proposal.source.run_id},
            "proposal_sha256": proposal_digest(promotion),
        }
        log.info(
            "approved by %s (id %s), one of the approvers: %s, proposal %s",
            user_name,
            user_id,
            proposal.label,
            record["proposal_sha256"][:16],
        )
        return {**record, "seal": seal("approval", record, RunRef.of(dag_run), task_key())}


def verified_approval(
    approval: object, proposal: Proposal, promotion: dict[str, Any], dag_run: RunIds | None, deployment: Deployment
) -> str:
    """The approver's name, if `approval` (the approval task's XCom) is a sealed Approve, in this promotion run, of
    this proposal's `promotion` by one of the settings' approvers who did not trigger the training run; otherwise
    the promote task fails, saying why."""
    if not isinstance(approval, dict) or "seal" not in approval:
        raise Tampered(
            f"{APPROVAL_XCOM} is no sealed approval (was the task marked successful by hand, or its XCom "
            "edited?): no promotion. " + ASK_AGAIN
        )
    body = {key: value for key, value in approval.items() if key != "seal"}
    if not is_sealed("approval", body, RunRef.of(dag_run), task_key(), approval["seal"]):
        raise Tampered(
            f"{APPROVAL_XCOM} does not match its seal: it was edited, or it is another run's: no promotion. "
            + ASK_AGAIN
        )
    if body.get("chosen_options") != [ApprovalOperator.APPROVE]:
        raise Tampered(f"{APPROVAL_XCOM} is no Approve: no promotion. " + ASK_AGAIN)
    if body.get("source") != {"dag_id": proposal.source.dag_id, "run_id": proposal.source.run_id}:
        raise Tampered(
            f"{APPROVAL_XCOM} approved another training run's proposal than {proposal.label}: no "
            "promotion. " + ASK_AGAIN
        )
    check_approver(
        str(body.get("approver_id")), str(body.get("approved_by")), deployment.approvers, proposal.triggered_by
    )
    if body.get("proposal_sha256") != proposal_digest(promotion):
        raise Tampered(
            f"{APPROVAL_XCOM} approved another proposal than the one {proposal.plan.run_dir} holds now "
            "(evaluate ran again since): no promotion. " + ASK_AGAIN
        )
    return str(body["approved_by"])


# -- the switch, and the event that announces it --------------------------------------------------------------------
def promote_held(
    proposal_item: dict[str, Any], approval: object, dag_run: RunIds | None = None, deployment: Deployment | None = None
) -> dict[str, Any]:
    """Approved (the promotion DAG): make the switch the training run's evaluate held (`python -m eagle3 lineage
    promote --approved-by USER`, safe to retry), only on an Approve the approval task sealed in this run for this
    proposal, by one of the settings' approvers who did not trigger the training run; then publish the training
    run's report again, which now says promoted."""
    from eagle3_airflow.published import publish, run_folder  # when the task runs: the DAG's parse does without it

    proposal = verified_proposal(proposal_item)
    plan = proposal.plan
    evaluation = read_or_fail(lambda: read_json(plan, REPORT)) or {}
    promotion: dict[str, Any] = evaluation["promotion"] if isinstance(evaluation.get("promotion"), dict) else {}
    # Held for approval; or promoted already, by a try of this task that died before it returned (lineage promote
    # rewrote the report, keeping what was proposed, so the approval's seal still matches).
    if promotion.get("pending_approval") is not True and promotion.get("promoted") is not True:
        raise AirflowFailException(f"{plan.run_dir}/{REPORT} holds no promotion for approval: nothing to promote")
    deployment = deployment or Deployment.from_env()
    approver = verified_approval(approval, proposal, promotion, dag_run, deployment)
    files = promotion.get("drafter_files_sha256")
    if not isinstance(files, str):
        raise AirflowFailException(
            f"{plan.run_dir}/{REPORT}: the held promotion names no drafter files; evaluate again and approve that"
        )
    argv = plan.eagle3(
        "lineage", "promote", "--config", plan.config_path, f"--approved-by={approver}", f"--approved-files={files}"
    )
    outcome: dict[str, Any] = plan.remote().run(argv, timeout=3600).json("python -m eagle3 lineage promote")
    log.info(
        "%s: %s (approved by %s)", "promoted" if outcome["promoted"] else "not promoted", outcome["reason"], approver
    )
    # The training run's report tab: promoted now. Done is done: a failure here must not fail (and retry) the promote
    # task, whose `promoted` event deployments wait on.
    try:
        # the store the training run published to: its plan's, as the settings were when it was validated
        folder = run_folder(plan, proposal.source.dag_id, proposal.source.run_id)
        read_or_fail(lambda: publish(plan, report_summary(plan), folder, log))
    except (AirflowFailException, OSError, ValueError) as err:
        log.warning(
            "the report of %s was not published again (its report tab still says proposed): %s", proposal.label, err
        )
    return outcome


def announce_promotion(
    plan_dict: dict[str, Any], asset_name: str, outlet_events: Any = None, dag_run: RunIds | None = None
) -> dict[str, Any]:
    """An event on the drafter Asset when the run's drafter was promoted, for a deployment DAG scheduled on it;
    skipped (no event) when it was not, with the reason. The event's extra comes from the run's report on the box
    and the verified plan, never from the report task's XCom."""
    return _announce(verified_plan(plan_dict, dag_run), asset_name, outlet_events)


def announce_approved_promotion(
    proposal_item: dict[str, Any], asset_name: str, outlet_events: Any = None
) -> dict[str, Any]:
    """announce_promotion, in the promotion DAG: for the training run of a verified proposal."""
    return _announce(verified_proposal(proposal_item).plan, asset_name, outlet_events)


def _announce(plan: RunPlan, asset_name: str, outlet_events: Any) -> dict[str, Any]:
    evaluation = read_or_fail(lambda: read_json(plan, REPORT))
    if evaluation is None:
        raise AirflowSkipException("not promoted: evaluate did not run (nothing changed since the current drafter)")
    promotion: dict[str, Any] = evaluation["promotion"] if isinstance(evaluation.get("promotion"), dict) else {}
    if promotion.get("promoted") is not True:
        raise AirflowSkipException(f"not promoted: {promotion.get('reason', 'no promotion in the report')}")
    states: dict[str, Any] = evaluation["hidden_states"] if isinstance(evaluation.get("hidden_states"), dict) else {}
    try:
        extra = {
            "run_dir": plan.run_dir,
            "lineage": promotion["lineage"],
            "version": promotion["version"],
            "drafter": promotion["current"],  # the lineage's `current` link: what to serve
            "accept_length": promotion["accept_length"],
            "previous": promotion["current_before"],
            "eval_set_prompts": promotion["eval_set_prompts"],
            "store": states.get("store"),
            "code_digest": plan.code_digest,
        }
    except KeyError as err:
        raise AirflowFailException(f"{plan.run_dir}/{REPORT}: its promotion lacks {err}; run evaluate again") from None
    outlet_events[Asset(asset_name)].extra = extra
    log.info("promoted %s: event on asset %s with %s", promotion["version"], asset_name, extra)
    return extra
