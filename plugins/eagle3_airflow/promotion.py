"""Promotion as its own DAG: a training run proposes, the promotion DAG asks a person and promotes.

With the settings' approve_promotion, a training run (a box's DAG) ends once its report is written: evaluate held
the switch (`--hold-promotion`), and the run's `propose_promotion` task puts an event on the proposals Asset
(`<drafter_asset>.proposals`). The promotion DAG, scheduled on that Asset, asks the settings' approvers
(eagle3_airflow.approval) and, on Approve, makes the switch on the box and puts the event on the drafter Asset. So
a pending approval holds no box, no pool slot and no run slot of the box's DAG (max_active_runs=1): the box trains
the next run while a person decides, and `lineage promote` refuses to switch over a drafter promoted meanwhile.

What the promotion DAG trusts of an event: nothing it says, only what it can check.
- Its source: an event the REST API created (`from_rest_api`, no source task) is no proposal; neither is one from
  another DAG or task than a drafter DAG's `propose_promotion`.
- Its extra: the propose task sealed it (eagle3_airflow.seal, kind "proposal") for its source run; inside, the plan
  validate sealed for that run. An edited extra, or one copied to another run, fails the seal.
- Its figures: none are used. The approval's body and the promote task read the proposal from the run's report on
  the box through the verified plan, and an approval holds only for the proposal digest it was given.
Several proposals may reach one promotion run (events that came in while the scheduler was busy): each gets its own
approval and promote in a mapped task group, each deciding alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from airflow.sdk.exceptions import AirflowSkipException

from eagle3_airflow.plan import RunPlan, verified_plan
from eagle3_airflow.pools import is_drafter_dag
from eagle3_airflow.seal import RunRef, Tampered, is_sealed, seal, task_key

log = logging.getLogger(__name__)

PROMOTION_DAG_ID = "eagle3_promotion"
PROPOSE_TASK = "propose_promotion"
PROPOSAL_XCOM = "the proposal in XCom (task `proposals`, one item of its return value)"
TRIGGER_AGAIN = "Clear the training run's propose_promotion task to propose its drafter again."


def proposals_asset_name(drafter_asset: str) -> str:
    """The Asset training runs propose on; the promotion DAG is scheduled on it."""
    return f"{drafter_asset}.proposals"


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


def sealed_proposal(plan_dict: dict, promotion: dict, dag_run) -> dict:
    """The proposal event's extra: the sealed plan, who triggered the run and the digest of the proposal held on the
    box, sealed for the training run (dag_run); the figures, for a person reading the event, are not sealed."""
    from eagle3_airflow.approval import proposal_digest

    body = {"plan": plan_dict, "triggered_by": getattr(dag_run, "triggering_user_name", None),
            "proposal_sha256": proposal_digest(promotion)}
    return {**body, "seal": seal("proposal", body, RunRef.of(dag_run), task_key()),
            "run_dir": plan_dict.get("run_dir"), "accept_length": promotion.get("accept_length")}


def verified_proposal(item) -> Proposal:
    """A proposal handed from task to task (XCom: {"source": {dag_id, run_id}, **the event's extra}), if its seal
    holds for its source run and the plan inside is that run's; Tampered otherwise."""
    if not isinstance(item, dict) or not isinstance(item.get("source"), dict) or "seal" not in item:
        raise Tampered(f"{PROPOSAL_XCOM} is no sealed proposal: an XCom edit? " + TRIGGER_AGAIN)
    source = RunRef(str(item["source"].get("dag_id")), str(item["source"].get("run_id")))
    body = {key: item.get(key) for key in ("plan", "triggered_by", "proposal_sha256")}
    if not is_drafter_dag(source.dag_id) or not is_sealed("proposal", body, source, task_key(), item["seal"]):
        raise Tampered(f"{PROPOSAL_XCOM} does not match its seal for {source.run_id} of {source.dag_id}: it was "
                       "edited, or it is another run's. " + TRIGGER_AGAIN)
    triggered_by = body["triggered_by"]
    return Proposal(source, verified_plan(body["plan"], source), None if triggered_by is None else str(triggered_by),
                    str(body["proposal_sha256"]))


def proposals_from_events(triggering_asset_events, asset_name: str) -> list[dict]:
    """The promotion run's proposals: each of its triggering events on the proposals Asset (`asset_name`) that a
    drafter DAG's propose task emitted and sealed, once per training run and proposal. An event that is none is
    left out, saying why in the log; with none left (a manual run, too) the run is skipped."""
    events = [event for asset in triggering_asset_events or {} for event in triggering_asset_events[asset]
              if event.asset.name == asset_name]
    found: dict[tuple, dict] = {}
    for event in events:
        extra = dict(event.extra or {})
        where = f"event of {event.timestamp:%Y-%m-%d %H:%M:%S} (from {event.source_dag_id}.{event.source_task_id})"
        if extra.get("from_rest_api") or event.source_task_id != PROPOSE_TASK or not event.source_dag_id \
                or not is_drafter_dag(event.source_dag_id) or not event.source_run_id:
            log.warning("%s: not emitted by a drafter DAG's %s task (created through the REST API?): no proposal",
                        where, PROPOSE_TASK)
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
