"""The DAG's small tasks (validate, sync code, write config, report, promotion) as plain functions.

The DAG file wraps them with @task; keeping them here keeps the DAG file to wiring and lets tests
call them directly. Each takes the run plan (and config) as validate sealed them into XCom and checks them
first (eagle3_airflow.plan.verified_plan): `dag_run`, which Airflow passes from the task's context, names the run
the seal must belong to. What a task reads back from the run (reports, plots) comes from the box through
eagle3_airflow.results, never from another task's XCom.
"""

from __future__ import annotations

import json
import logging

from airflow.sdk.exceptions import AirflowFailException

from eagle3.runlayout import REPORT
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import DEFAULT_PRESET, NOTES, PRESET, ParamsError, check_unknown_keys
from eagle3_airflow.plan import RunPlan, verified_config, verified_plan
from eagle3_airflow.results import RunFileRefused, read_json, run_summary
from eagle3_airflow.seal import task_key
from eagle3_airflow.transport import RemoteCommandError

log = logging.getLogger(__name__)

REQUIRED_BOX_PACKAGES = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic"]


def validate_run(params: dict, conf: dict, known: set[str], dag_run, deployment: Deployment | None = None) -> dict:
    """Params -> run plan + run config. Bad input, or a run that reaches past what the deployment allows (another
    box, service, endpoint, workdir or box variable), fails the task at once (no retries): nothing has started.
    The plan is sealed for this run (eagle3_airflow.seal) with the config's digest in it."""
    deployment = deployment or Deployment()
    try:
        check_unknown_keys(conf, known)
        form = {k: v for k, v in params.items() if k in known}
        config, box = deployment.configs(form, dag_run.run_id)
        config = deployment.settle(config)  # the normalised workdir, the settings' keep_versions
        deployment.check_run(config, box.conn_ids, box.stop_services, python=box.python)
    except ParamsError as err:
        raise AirflowFailException(str(err)) from None
    plan = RunPlan.build(config, box, deployment.box_env, notes=form.get(NOTES) or "")
    log.info("run %s in %s on %s, preset %s; %d extraction shard(s)", plan.run_name, plan.run_dir,
             ", ".join(plan.conn_ids), form.get(PRESET) or DEFAULT_PRESET, plan.num_shards)
    return {"plan": plan.sealed(dag_run, task_key(create=True)), "config": config.model_dump(mode="json")}


def shard_list(plan_dict: dict, dag_run=None) -> list[int]:
    """One extract task per shard (Airflow maps only over a task's whole return value)."""
    return list(range(verified_plan(plan_dict, dag_run).num_shards))


def sync_code(plan_dict: dict, config: dict, dag_run=None) -> dict:
    """Upload the eagle3 package to every box and record what each box has; fail early if a package is missing."""
    plan = verified_plan(plan_dict, dag_run)
    config = verified_config(config, plan)
    serves = (config["benchmark"]["enabled"] or config["evaluate"]["backend"] == "server"
              or (config["generate"]["enabled"] and config["generate"]["launch_server"]))
    # SGLang in box.python: the sglang capture backend, and a serving engine sglang without an interpreter of its own
    # (server.python; that one, or a vLLM, shows whether it starts when its stage starts it).
    needs_sglang = config["extract"]["backend"] == "sglang" or (
        serves and config["server"]["engine"] == "sglang" and not config["server"]["python"])
    require = ["--require", "sglang"] if needs_sglang else []
    facts = {}
    for conn_id in plan.conn_ids:
        box = plan.box(conn_id)
        where = plan.ensure_code(conn_id)
        result = box.run(plan.eagle3("box", "info", *require), timeout=300)
        try:
            info = result.json(f"python -m eagle3 box info on {conn_id}")
        except RemoteCommandError as err:
            raise AirflowFailException(
                f"{err}\nIs box.python ({plan.python!r}) the interpreter with requirements-box.txt installed?"
            ) from None
        log.info("%s: code in %s; python %s; packages %s; cuda %s; gpus %s", conn_id, where,
                 info["python"].split()[0], info["packages"], info.get("cuda"),
                 [(g.get("name"), g.get("memory_total_mib")) for g in info.get("gpus", [])])
        if info["missing"]:
            raise AirflowFailException(
                f"box {conn_id}: {plan.python} lacks {', '.join(info['missing'])}; install requirements-box.txt "
                "into it, or point box.python at the interpreter that has them"
            )
        facts[conn_id] = info
    return facts


def write_config(plan_dict: dict, config: dict, dag_run=None) -> str:
    """Write config.json into the run directory on the box (once; the box fills in and checks target facts)."""
    plan = verified_plan(plan_dict, dag_run)
    config = verified_config(config, plan)
    result = plan.box().run(plan.eagle3("init", "--config", "-"), input=json.dumps(config).encode(), timeout=300)
    if result.returncode == 2:  # a configuration the box refuses: retrying cannot help
        raise AirflowFailException(result.stderr.strip().removeprefix("error: "))
    path = result.check("python -m eagle3 init").stdout.strip()
    log.info("run config: %s", path)
    return path


def check_inputs(plan: RunPlan) -> dict:
    result = plan.box().run(plan.eagle3("lineage", "check", "--config", plan.config_path), timeout=600)
    return result.json("python -m eagle3 lineage check")


def inputs_changed(plan_dict: dict, dag_run=None) -> bool:
    """After vocab: False (training, export and evaluation are skipped) when the run's samples, vocab mapping and
    settings equal those the lineage's current drafter was trained from (eagle3.promote.check_inputs)."""
    plan = verified_plan(plan_dict, dag_run)
    if plan.redo_from:  # asked for by name: run whatever changed (eagle3_airflow.jobs, RemoteJobOperator._redo)
        log.info("box.redo_from %s: training, export and evaluation run, changed inputs or not", plan.redo_from)
        return True
    check = check_inputs(plan)
    if check["changed"]:
        log.info("inputs: new since the current drafter (%s); training", check.get("current") or "none yet")
        return True
    log.info("nothing changed since run %s: its drafter %s is current (acceptance %s); skipping training, export "
             "and evaluation", check["unchanged_since"], check["current_drafter"], check["current_accept_length"])
    return False


def _read(what):
    """A file of the run the box refused, or one that is not what it should be, fails the task without a retry."""
    try:
        return what()
    except RunFileRefused as err:
        raise AirflowFailException(str(err)) from None


def report(plan_dict: dict, dag_run=None, deployment: Deployment | None = None) -> dict:
    """Collect the run's results from the box (figures, and where the drafter, report and plots are) and publish them
    with its report files to the settings' reports store, where the report tab reads them (eagle3_airflow.published)."""
    from eagle3_airflow.published import publish, run_folder

    plan = verified_plan(plan_dict, dag_run)
    summary = _summary(plan)
    deployment = deployment or Deployment.from_env()
    _read(lambda: publish(plan, summary, run_folder(deployment, dag_run.dag_id, dag_run.run_id), log))
    return summary


def _summary(plan: RunPlan) -> dict:
    summary = _with_notes(_read(lambda: run_summary(plan)), plan)
    if summary is None:  # evaluate was skipped: say why
        report_path = f"{plan.run_dir}/{REPORT}"
        check = check_inputs(plan)
        if check["changed"]:
            raise AirflowFailException(f"{report_path} is missing, though the inputs changed: evaluate did not run")
        summary = _with_notes({
            "run_dir": plan.run_dir, "nothing_changed_since": check["unchanged_since"],
            "drafter": check["current_drafter"], "measured_accept_length": check["current_accept_length"],
            "promotion": {"promoted": False, "reason": f"nothing changed since run {check['unchanged_since']}"}}, plan)
        log.info("nothing changed since run %s; the lineage's drafter stays %s (measured acceptance %s)",
                 check["unchanged_since"], check["current_drafter"], check["current_accept_length"])
        return summary
    if (summary["promotion"] or {}).get("pending_approval"):  # the promotion DAG asks; its promote republishes
        summary["promotion"]["reason"] += "; proposed for approval (the promotion DAG asks the approvers)"
    for key, value in summary.items():
        log.info("%-24s %s", key, value)
    return summary


def _with_notes(summary: dict | None, plan: RunPlan) -> dict | None:
    """The form's notes (why this run) beside the figures, for the run's note."""
    return {**summary, "notes": plan.notes} if summary is not None and plan.notes else summary


def report_promotion(plan: RunPlan) -> dict | None:
    """The promotion in the run's report on the box (held, made or refused); None without one."""
    evaluation = _read(lambda: read_json(plan, REPORT))
    if evaluation is None:  # evaluate was skipped: nothing changed
        return None
    promotion = evaluation.get("promotion")
    return promotion if isinstance(promotion, dict) else None


def proposed_promotion(plan: RunPlan) -> dict | None:
    """The promotion evaluate held for approval, from the run's report on the box; None if there is none."""
    promotion = report_promotion(plan)
    if promotion is None or promotion.get("pending_approval") is not True:
        log.info("no promotion to approve: %s", (promotion or {}).get("reason") if isinstance(promotion, dict)
                 else "the report has none")
        return None
    return promotion


def propose_promotion(plan_dict: dict, asset_name: str, outlet_events=None, dag_run=None) -> dict:
    """With the settings' approve_promotion: an event on the proposals Asset when evaluate held a promotion for
    approval, which starts the promotion DAG (eagle3_airflow.promotion); skipped (no event) when it holds none. The
    event's extra is sealed for this run; its proposal is read from the box, never from another task's XCom."""
    from airflow.sdk import Asset
    from airflow.sdk.exceptions import AirflowSkipException

    from eagle3_airflow.promotion import sealed_proposal

    plan = verified_plan(plan_dict, dag_run)
    promotion = proposed_promotion(plan)
    if promotion is None:
        raise AirflowSkipException("nothing proposed for promotion: no approval asked")
    extra = sealed_proposal(plan_dict, promotion, dag_run)
    outlet_events[Asset(asset_name)].extra = extra
    log.info("proposed %s for promotion: event on asset %s; the promotion DAG asks the approvers", plan.run_dir,
             asset_name)
    return {"run_dir": plan.run_dir, "proposal_sha256": extra["proposal_sha256"]}


def promote_held(proposal_item: dict, approval, dag_run=None, deployment: Deployment | None = None) -> dict:
    """Approved (the promotion DAG): make the switch the training run's evaluate held (`python -m eagle3 lineage
    promote --approved-by USER`, safe to retry), only on an Approve the approval task sealed in this run for this
    proposal, by one of the settings' approvers who did not trigger the training run; then publish the training
    run's report again, which now says promoted."""
    from eagle3_airflow.approval import verified_approval
    from eagle3_airflow.promotion import verified_proposal
    from eagle3_airflow.published import publish, run_folder

    proposal = verified_proposal(proposal_item)
    plan = proposal.plan
    evaluation = _read(lambda: read_json(plan, REPORT)) or {}
    promotion = evaluation.get("promotion") if isinstance(evaluation.get("promotion"), dict) else {}
    # Held for approval; or promoted already, by a try of this task that died before it returned (lineage promote
    # rewrote the report, keeping what was proposed, so the approval's seal still matches).
    if promotion.get("pending_approval") is not True and promotion.get("promoted") is not True:
        raise AirflowFailException(f"{plan.run_dir}/{REPORT} holds no promotion for approval: nothing to promote")
    deployment = deployment or Deployment.from_env()
    approver = verified_approval(approval, proposal, promotion, dag_run, deployment)
    files = promotion.get("drafter_files_sha256")
    if not isinstance(files, str):
        raise AirflowFailException(f"{plan.run_dir}/{REPORT}: the held promotion names no drafter files (held by an "
                                   "evaluate from before approvals covered them); evaluate again and approve that")
    argv = plan.eagle3("lineage", "promote", "--config", plan.config_path, f"--approved-by={approver}",
                       f"--approved-files={files}")
    outcome = plan.box().run(argv, timeout=3600).json("python -m eagle3 lineage promote")
    log.info("%s: %s (approved by %s)", "promoted" if outcome["promoted"] else "not promoted", outcome["reason"],
             approver)
    # The training run's report tab: promoted now. Done is done: a failure here must not fail (and retry) the promote
    # task, whose `promoted` event deployments wait on.
    try:
        folder = run_folder(deployment, proposal.source.dag_id, proposal.source.run_id)
        _read(lambda: publish(plan, _summary(plan), folder, log))
    except (AirflowFailException, OSError, ValueError) as err:
        log.warning("the report of %s was not published again (its report tab still says proposed): %s",
                    proposal.label, err)
    return outcome


def announce_promotion(plan_dict: dict, asset_name: str, outlet_events=None, dag_run=None) -> dict:
    """An event on the drafter Asset when the run's drafter was promoted, for a deployment DAG scheduled on it;
    skipped (no event) when it was not, with the reason. The event's extra comes from the run's report on the box
    and the verified plan, never from the report task's XCom."""
    return _announce(verified_plan(plan_dict, dag_run), asset_name, outlet_events)


def announce_approved_promotion(proposal_item: dict, asset_name: str, outlet_events=None) -> dict:
    """announce_promotion, in the promotion DAG: for the training run of a verified proposal."""
    from eagle3_airflow.promotion import verified_proposal

    return _announce(verified_proposal(proposal_item).plan, asset_name, outlet_events)


def _announce(plan: RunPlan, asset_name: str, outlet_events) -> dict:
    from airflow.sdk import Asset
    from airflow.sdk.exceptions import AirflowSkipException

    evaluation = _read(lambda: read_json(plan, REPORT))
    if evaluation is None:
        raise AirflowSkipException("not promoted: evaluate did not run (nothing changed since the current drafter)")
    promotion = evaluation.get("promotion") if isinstance(evaluation.get("promotion"), dict) else {}
    if promotion.get("promoted") is not True:
        raise AirflowSkipException(f"not promoted: {promotion.get('reason', 'no promotion in the report')}")
    states = evaluation.get("hidden_states") if isinstance(evaluation.get("hidden_states"), dict) else {}
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


def prune_runs(plan_dict: dict, keep_runs: int | None, keep_proposals_h: float = 0, dag_run=None) -> dict:
    """The settings' retention: run directories beyond the newest keep_runs go (eagle3.retention); skipped
    without keep_runs. In the verified plan's workdir, which the settings allow (allowed_workdirs). A run whose
    proposal the promotion DAG may still approve (within keep_proposals_h: the approval's timeout) is kept."""
    from airflow.sdk.exceptions import AirflowSkipException

    if keep_runs is None:
        raise AirflowSkipException("keep_runs is not set in the settings file: every run directory is kept")
    plan = verified_plan(plan_dict, dag_run)
    argv = plan.eagle3("runs", "prune", "--workdir", plan.workdir, "--keep", str(keep_runs),
                       f"--keep-proposals-h={keep_proposals_h:g}")
    outcome = plan.box().run(argv, timeout=3600).json("python -m eagle3 runs prune")
    log.info("retention: %d run directories, kept the newest %d; removed %s; kept beyond that: %s", outcome["runs"],
             keep_runs, outcome["removed"] or "none", outcome["kept_beyond_keep"] or "none")
    return outcome
