"""The DAG's small tasks (validate, shards, sync code, write config, inputs changed, report, retention) as plain
functions; the promotion's are eagle3_airflow.approvals's.

The DAG file wraps them with @task; keeping them here keeps the DAG file to wiring and lets tests
call them directly. validate is the one that reads the deployment's settings (as the DAG file parsed them) and the
one that validates the run config; every other task takes the run plan, the config inside it, as validate sealed it
into XCom and checks it first (eagle3_airflow.plan.verified_plan): `dag_run`, which Airflow passes from the task's
context, names the run the seal must belong to. No task reads the settings file. What a task reads back from the run
(reports, plots) comes from the box through eagle3_airflow.results, never from another task's XCom.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from eagle3.contracts import PROTOCOL, BoxInfo, Exit
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import DEFAULT_PRESET, NOTES, PRESET, ParamsError, check_unknown_keys, default_run_name
from eagle3_airflow.plan import RunPlan, verified_plan
from eagle3_airflow.results import check_inputs, read_or_fail, report_summary
from eagle3_airflow.seal import RunIds, task_key
from eagle3_airflow.transport import RemoteCommandError

log = logging.getLogger(__name__)

REQUIRED_BOX_PACKAGES = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic"]


def validate_run(
    params: dict[str, Any], conf: dict[str, Any], known: set[str], dag_run: RunIds, deployment: Deployment | None = None
) -> dict[str, Any]:
    """Params -> {"plan": the sealed run plan}, the run config inside it. Bad input, or a run that reaches past what
    the deployment allows (another box, service, endpoint, workdir or box variable), fails the task at once (no
    retries): nothing has started. `deployment`: the settings as the DAG file parsed them (default: the built-in
    ones); what later tasks need of them goes into the plan, which is sealed for this run (eagle3_airflow.seal)."""
    deployment = deployment or Deployment()
    try:
        check_unknown_keys(conf, known)
        form = {k: v for k, v in params.items() if k in known}
        if not form.get("run_name"):  # empty: the run's own directory, named after its DAG and run
            form["run_name"] = default_run_name(dag_run.dag_id, dag_run.run_id)
        config, box = deployment.configs(form, dag_run.run_id)
        config = deployment.settle(config)  # the normalised workdir, the settings' keep_versions
        deployment.allowed.check_run(config, box.conn_ids, box.stop_services, python=box.python)
    except ParamsError as err:
        raise AirflowFailException(str(err)) from None
    plan = RunPlan.build(config, box, deployment, notes=form.get(NOTES) or "")
    log.info(
        "run %s in %s on %s, preset %s; %d extraction shard(s)",
        config.run_name,
        plan.run_dir,
        ", ".join(box.conn_ids),
        form.get(PRESET) or DEFAULT_PRESET,
        config.extract.num_shards,
    )
    return {"plan": plan.sealed(dag_run, task_key())}


# plan_dict: the plan as validate sealed it into XCom (verified_plan checks it); dag_run: the task's, from its context
# (None only where Airflow gave none, which verified_plan refuses).
def shard_list(plan_dict: dict[str, Any], dag_run: RunIds | None = None) -> list[int]:
    """One extract task per shard (Airflow maps only over a task's whole return value)."""
    return list(range(verified_plan(plan_dict, dag_run).config.extract.num_shards))


def sync_code(plan_dict: dict[str, Any], dag_run: RunIds | None = None) -> dict[str, BoxInfo]:
    """Upload the eagle3 package to every box and record what each box has; fail early if a package is missing."""
    plan = verified_plan(plan_dict, dag_run)
    # (A server.python of its own, or a vLLM, shows whether it starts when its stage starts it.)
    require = ["--require", "sglang"] if plan.config.needs_sglang else []
    facts: dict[str, BoxInfo] = {}
    for conn_id in plan.box.conn_ids:
        where = plan.ensure_code(conn_id)
        result = plan.remote(conn_id).run(plan.eagle3("box", "info", *require), timeout=300)
        try:
            info: BoxInfo = result.json(f"python -m eagle3 box info on {conn_id}")
        except RemoteCommandError as err:
            raise AirflowFailException(
                f"{err}\nIs box.python ({plan.box.python!r}) the interpreter with requirements-box.txt installed?"
            ) from None
        if info.get("protocol") != PROTOCOL:
            raise AirflowFailException(
                f"box {conn_id}: this run's code there ({where}) speaks protocol {info.get('protocol')!r}, this "
                f"worker's {PROTOCOL}: the run was validated with other code than this worker runs. Clear the run's "
                "validate task with its downstream tasks (validate pins this worker's code; stages that finished stay "
                "finished), or let workers of the run's own version finish it"
            )
        log.info(
            "%s: code in %s; python %s; packages %s; cuda %s; gpus %s",
            conn_id,
            where,
            info["python"].split()[0],
            info["packages"],
            info.get("cuda"),
            [(g.get("name"), g.get("memory_total_mib")) for g in info.get("gpus", [])],
        )
        if info["missing"]:
            raise AirflowFailException(
                f"box {conn_id}: {plan.box.python} lacks {', '.join(info['missing'])}; install requirements-box.txt "
                "into it, or point box.python at the interpreter that has them"
            )
        facts[conn_id] = info
    return facts


def init_owner_args(plan: RunPlan, dag_run: RunIds) -> list[str]:
    """`eagle3 init`'s arguments naming the Airflow run that inits the run directory, which it then belongs to
    (eagle3.jobs.runowner): from the task's own DAG run, never XCom; each one `--name=value` argument, so that no value
    (a run id is the API caller's choice) can read as an option."""
    user = getattr(dag_run, "triggering_user_name", None)
    return [
        f"--airflow-dag-id={dag_run.dag_id}",
        f"--airflow-run-id={dag_run.run_id}",
        *([f"--triggered-by={user}"] if user else []),
        *([f"--redo-from={plan.redo_from}"] if plan.redo_from else []),
    ]


def write_config(plan_dict: dict[str, Any], dag_run: RunIds | None = None) -> str:
    """Write the plan's run config into the run directory on the box as config.json (once; the box validates it, fills
    in and checks target facts), and make the directory this Airflow run's: another run's directory is refused
    (eagle3.jobs.runowner)."""
    plan = verified_plan(plan_dict, dag_run)
    assert dag_run is not None  # (verified_plan refuses a missing one)
    owner = init_owner_args(plan, dag_run)
    result = plan.remote().run(
        plan.eagle3("init", "--config", "-", *owner), input=plan.config.model_dump_json().encode(), timeout=300
    )
    if result.returncode == Exit.REFUSED:  # a configuration the box refuses, or another run's directory
        raise AirflowFailException(result.stderr.strip().removeprefix("error: "))
    path = result.check("python -m eagle3 init").stdout.strip()
    log.info("run config: %s", path)
    return path


def inputs_changed(plan_dict: dict[str, Any], dag_run: RunIds | None = None) -> bool:
    """After vocab: False (training, export and evaluation are skipped) when the run's samples, vocab mapping and
    settings equal those the lineage's current drafter was trained from (eagle3.stages.promote.check_inputs)."""
    plan = verified_plan(plan_dict, dag_run)
    if plan.redo_from:  # asked for by name: run whatever changed (eagle3_airflow.remote_job, RemoteJobOperator._redo)
        log.info("box.redo_from %s: training, export and evaluation run, changed inputs or not", plan.redo_from)
        return True
    check = check_inputs(plan)
    if check["changed"]:
        log.info("inputs: new since the current drafter (%s); training", check.get("current") or "none yet")
        return True
    log.info(
        "nothing changed since run %s: its drafter %s is current (acceptance %s); skipping training, export "
        "and evaluation",
        check["unchanged_since"],
        check["current_drafter"],
        check["current_accept_length"],
    )
    return False


def report(plan_dict: dict[str, Any], dag_run: RunIds | None = None) -> dict[str, Any]:
    """Collect the run's results from the box (figures, and where the drafter, report and plots are) and publish them
    with its report files to the reports store the plan carries (the settings' when validate planned the run), where
    the report tab reads them (eagle3_airflow.published)."""
    from eagle3_airflow.published import publish, run_folder  # when the task runs: the DAG's parse does without it

    plan = verified_plan(plan_dict, dag_run)
    assert dag_run is not None  # (verified_plan refuses a missing one)
    summary = report_summary(plan)
    read_or_fail(lambda: publish(plan, summary, run_folder(plan, dag_run.dag_id, dag_run.run_id), log))
    return summary


def prune_runs(plan_dict: dict[str, Any], dag_run: RunIds | None = None) -> dict[str, Any]:
    """The settings' retention, as the plan carries it: run directories beyond the newest keep_runs go
    (eagle3.box.retention); skipped without keep_runs. In the verified plan's workdir, which the settings allowed
    (allowed_workdirs). A run whose proposal the promotion DAG may still approve (within keep_proposals_h: the
    approval's timeout) is kept."""
    from airflow.sdk.exceptions import AirflowSkipException

    plan = verified_plan(plan_dict, dag_run)
    if plan.keep_runs is None:
        raise AirflowSkipException(
            "keep_runs was not set in the settings this run was validated with: every run directory is kept"
        )
    argv = plan.eagle3(
        "runs",
        "prune",
        "--workdir",
        plan.config.workdir,
        "--keep",
        str(plan.keep_runs),
        f"--keep-proposals-h={plan.keep_proposals_h:g}",
    )
    outcome: dict[str, Any] = plan.remote().run(argv, timeout=3600).json("python -m eagle3 runs prune")
    log.info(
        "retention: %d run directories, kept the newest %d; removed %s; kept beyond that: %s",
        outcome["runs"],
        plan.keep_runs,
        outcome["removed"] or "none",
        outcome["kept_beyond_keep"] or "none",
    )
    return outcome
