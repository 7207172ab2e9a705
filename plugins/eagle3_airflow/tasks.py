"""The DAG's small tasks (validate, sync code, write config, report) as plain functions.

The DAG file wraps them with @task; keeping them here keeps the DAG file to wiring and lets tests
call them directly.
"""

from __future__ import annotations

import json
import logging

from airflow.sdk.exceptions import AirflowFailException

from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import ParamsError, check_unknown_keys, params_to_configs
from eagle3_airflow.plan import RunPlan
from eagle3_airflow.transport import RemoteCommandError

log = logging.getLogger(__name__)

REQUIRED_BOX_PACKAGES = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic"]


def validate_run(params: dict, conf: dict, known: set[str], run_id: str, deployment: Deployment | None = None) -> dict:
    """Params -> run plan + run config. Bad input, or a run that reaches past what the deployment allows (another
    box, service, endpoint host or box variable), fails the task at once (no retries): nothing has started."""
    deployment = deployment or Deployment()
    try:
        check_unknown_keys(conf, known)
        config, box = params_to_configs({k: v for k, v in params.items() if k in known}, run_id)
        gen = config.generate
        uses_endpoint = gen.enabled and gen.backend == "server" and not gen.launch_server
        deployment.check(box.conn_ids, box.stop_services, gen.endpoint if uses_endpoint else None, gen.api_key_env)
    except ParamsError as err:
        raise AirflowFailException(str(err)) from None
    plan = RunPlan.build(config, box, deployment.box_env)
    log.info("run %s in %s on %s; %d extraction shard(s)", plan.run_name, plan.run_dir, ", ".join(plan.conn_ids),
             plan.num_shards)
    return {"plan": plan.to_xcom(), "config": config.model_dump(mode="json")}


def sync_code(plan_dict: dict, config: dict) -> dict:
    """Upload the eagle3 package to every box and record what each box has; fail early if a package is missing."""
    plan = RunPlan.from_xcom(plan_dict)
    needs_sglang = (config["extract"]["backend"] == "sglang" or config["benchmark"]["enabled"]
                    or (config["generate"]["enabled"] and config["generate"]["launch_server"]))
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


def write_config(plan_dict: dict, config: dict) -> str:
    """Write config.json into the run directory on the box (once; the box fills in and checks target facts)."""
    plan = RunPlan.from_xcom(plan_dict)
    result = plan.box().run(plan.eagle3("init", "--config", "-"), input=json.dumps(config).encode(), timeout=300)
    if result.returncode == 2:  # a configuration the box refuses: retrying cannot help
        raise AirflowFailException(result.stderr.strip().removeprefix("error: "))
    path = result.check("python -m eagle3 init").stdout.strip()
    log.info("run config: %s", path)
    return path


def check_inputs(plan: RunPlan) -> dict:
    result = plan.box().run(plan.eagle3("lineage", "check", "--config", plan.config_path), timeout=600)
    return result.json("python -m eagle3 lineage check")


def inputs_changed(plan_dict: dict) -> bool:
    """After vocab: False (training, export and evaluation are skipped) when the run's samples, vocab mapping and
    settings equal those the lineage's current drafter was trained from (eagle3.promote.check_inputs)."""
    check = check_inputs(RunPlan.from_xcom(plan_dict))
    if check["changed"]:
        log.info("inputs: new since the current drafter (%s); training", check.get("current") or "none yet")
        return True
    log.info("nothing changed since run %s: its drafter %s is current (acceptance %s); skipping training, export "
             "and evaluation", check["unchanged_since"], check["current_drafter"], check["current_accept_length"])
    return False


def report(plan_dict: dict) -> dict:
    """Collect the run's results from the box: figures, and where the drafter, report and plots are."""
    plan = RunPlan.from_xcom(plan_dict)
    box = plan.box()
    report_path = f"{plan.run_dir}/evaluate/report.json"
    if box.run(["test", "-e", report_path]).returncode != 0:  # evaluate was skipped: say why
        check = check_inputs(plan)
        if check["changed"]:
            raise AirflowFailException(f"{report_path} is missing, though the inputs changed: evaluate did not run")
        summary = {"run_dir": plan.run_dir, "nothing_changed_since": check["unchanged_since"],
                   "drafter": check["current_drafter"], "measured_accept_length": check["current_accept_length"],
                   "promotion": {"promoted": False, "reason": f"nothing changed since run {check['unchanged_since']}"}}
        log.info("nothing changed since run %s; the lineage's drafter stays %s (measured acceptance %s)",
                 check["unchanged_since"], check["current_drafter"], check["current_accept_length"])
        return summary
    evaluation = box.run(["cat", report_path]).json(f"reading {report_path}")
    plots = sorted(box.run(["find", plan.run_dir, "-name", "*.png"]).check("listing plots").stdout.split())
    summary = {
        "run_dir": plan.run_dir,
        "drafter": f"{plan.run_dir}/drafter",
        "report": report_path,
        "plots": plots,
        "val_acc_per_position": [round(a, 3) for a in evaluation["val_acc_per_position"]],
        "simulated_accept_length": evaluation["simulated_accept_length_teacher_forced"],
        "measured_accept_length": {k: v["mean_accept_length"] for k, v in evaluation["speculative"].items()},
        # samples extracted by this run, and reused from the store runs with the same capture share
        "hidden_states": evaluation.get("hidden_states"),
        # measured against the lineage's current drafter on its pinned prompts; promoted or not, and why
        "promotion": evaluation.get("promotion"),
    }
    if (summary["promotion"] or {}).get("pending_approval"):  # promote_held runs before the report when approved
        summary["promotion"]["reason"] += "; held for approval, not approved (rejected, or timed out)"
    if plan.benchmark:
        benchmark_path = f"{plan.run_dir}/benchmark/benchmark.json"
        benchmark = box.run(["cat", benchmark_path]).json(f"reading {benchmark_path}")
        summary["sglang_benchmark"] = {
            "report": benchmark_path,
            "accept_length": benchmark["mean_accept_length"],
            "output_tokens_per_s": {name: benchmark[name]["output_tokens_per_s"] for name in ("baseline", "eagle3")},
            "speedup": benchmark["speedup"],
        }
    for key, value in summary.items():
        log.info("%-24s %s", key, value)
    return summary


def promotion_proposed(plan_dict: dict) -> str | bool:
    """With the deployment's approve_promotion: did evaluate propose a promotion? The proposal as markdown (the
    approval's body: both drafters' figures), or False, which skips the approval (nothing to approve)."""
    from eagle3_airflow.run_note import note_markdown

    plan = RunPlan.from_xcom(plan_dict)
    report_path = f"{plan.run_dir}/evaluate/report.json"
    read = plan.box().run(["cat", report_path])
    if read.returncode != 0:  # evaluate was skipped: nothing changed
        return False
    promotion = read.json(f"reading {report_path}")["promotion"]
    if not promotion.get("pending_approval"):
        log.info("no promotion to approve: %s", promotion.get("reason"))
        return False
    summary = {"drafter": f"{plan.run_dir}/drafter", "promotion": promotion,
               "measured_accept_length": promotion["accept_length"]}
    return note_markdown(summary, headline="proposed for promotion")


def promote_held(plan_dict: dict) -> dict:
    """Approved: make the switch evaluate held (`python -m eagle3 lineage promote`, safe to retry)."""
    plan = RunPlan.from_xcom(plan_dict)
    outcome = plan.box().run(plan.eagle3("lineage", "promote", "--config", plan.config_path),
                             timeout=3600).json("python -m eagle3 lineage promote")
    log.info("%s: %s", "promoted" if outcome["promoted"] else "not promoted", outcome["reason"])
    return outcome


def announce_promotion(plan_dict: dict, summary: dict, asset_name: str, outlet_events=None) -> dict:
    """An event on the drafter Asset when the run's drafter was promoted, for a deployment DAG scheduled on it;
    skipped (no event) when it was not, with the reason."""
    from airflow.sdk import Asset
    from airflow.sdk.exceptions import AirflowSkipException

    promotion = summary.get("promotion") or {}
    if not promotion.get("promoted"):
        raise AirflowSkipException(f"not promoted: {promotion.get('reason', 'no promotion in the report')}")
    plan = RunPlan.from_xcom(plan_dict)
    extra = {
        "run_dir": plan.run_dir,
        "lineage": promotion["lineage"],
        "version": promotion["version"],
        "drafter": promotion["current"],  # the lineage's `current` link: what to serve
        "accept_length": promotion["accept_length"],
        "previous": promotion["current_before"],
        "eval_set_prompts": promotion["eval_set_prompts"],
        "store": (summary.get("hidden_states") or {}).get("store"),
        "code_digest": plan.code_digest,
    }
    outlet_events[Asset(asset_name)].extra = extra
    log.info("promoted %s: event on asset %s with %s", promotion["version"], asset_name, extra)
    return extra


def prune_runs(plan_dict: dict, keep_runs: int | None) -> dict:
    """The settings' retention: run directories beyond the newest keep_runs go (eagle3.retention); skipped
    without keep_runs."""
    from airflow.sdk.exceptions import AirflowSkipException

    if keep_runs is None:
        raise AirflowSkipException("keep_runs is not set in the settings file: every run directory is kept")
    plan = RunPlan.from_xcom(plan_dict)
    outcome = plan.box().run(plan.eagle3("runs", "prune", "--workdir", plan.workdir, "--keep", str(keep_runs)),
                             timeout=3600).json("python -m eagle3 runs prune")
    log.info("retention: %d run directories, kept the newest %d; removed %s; kept beyond that: %s", outcome["runs"],
             keep_runs, outcome["removed"] or "none", outcome["kept_beyond_keep"] or "none")
    return outcome
