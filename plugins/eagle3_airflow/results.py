"""What a run produced, read back from its box: evaluate's report, the benchmark's, the plots, the lineage check
(whether anything changed since the current drafter), and the summary of them that the report task logs, the report
tab shows and the run's note and the approval's body put in words.

Everything comes from the verified plan (its box, its run directory) and the box, through
`python -m eagle3 report list|read` (eagle3/reportfiles.py): only the run's own regular files of the expected names,
never through a symlink, at most 8 MiB each. No path or figure is taken from another task's XCom, which the
USER role may edit.
"""

from __future__ import annotations

import base64
import json
import logging

from airflow.sdk.exceptions import AirflowFailException

from eagle3.runlayout import BENCHMARK_REPORT, DRAFTER_DIR, REPORT
from eagle3_airflow.plan import RunPlan

log = logging.getLogger(__name__)

REFUSED_EXIT = 2  # `python -m eagle3 report` refused the file (a link, not regular, too big, a name it never reads)
READ_TIMEOUT_S = 120


class RunFileRefused(Exception):
    """A file of the run the box would not hand out, or that is not what it should be; the message names it."""


def read_file(plan: RunPlan, name: str) -> bytes | None:
    """RUN_DIR/name from the run's first box, or None if it does not exist."""
    argv = plan.eagle3("report", "read", "--run-dir", plan.run_dir, "--name", name)
    result = plan.box().run(argv, timeout=READ_TIMEOUT_S)
    if result.returncode == REFUSED_EXIT:
        reason = result.stderr.strip().splitlines()[-1:] or ["refused"]
        raise RunFileRefused(f"{plan.conn_ids[0]}: {reason[0].removeprefix('error: ')}")
    answer = result.json(f"python -m eagle3 report read --name {name}")
    if not answer.get("present"):
        return None
    return base64.b64decode(answer["base64"], validate=True)


def read_json(plan: RunPlan, name: str) -> dict | None:
    """A report of the run as a JSON object, or None if it does not exist. Its content never goes into an error
    message: a file planted there would otherwise reach the task log."""
    data = read_file(plan, name)
    if data is None:
        return None
    path = f"{plan.run_dir}/{name} on {plan.conn_ids[0]}"
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        where = f" (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
        raise RunFileRefused(f"{path} is not valid JSON{where}; the stage that writes it did not finish it, or "
                             "someone replaced it: run that stage again (clear its task)") from None
    if not isinstance(value, dict):
        raise RunFileRefused(f"{path} is not a JSON object; run the stage that writes it again (clear its task)")
    return value


def list_plots(plan: RunPlan) -> list[str]:
    """The run's plots, `<stage>/<name>.png`, sorted."""
    argv = plan.eagle3("report", "list", "--run-dir", plan.run_dir)
    result = plan.box().run(argv, timeout=READ_TIMEOUT_S)
    if result.returncode == REFUSED_EXIT:
        raise RunFileRefused(f"{plan.conn_ids[0]}: {result.stderr.strip().removeprefix('error: ')}")
    return list(result.json("python -m eagle3 report list")["plots"])


def summarize(plan: RunPlan, evaluation: dict, plots: list[str], benchmark: dict | None = None) -> dict:
    """The run's figures, promotion and files (evaluate's report read from the box; paths from the plan)."""
    try:
        summary = {
            "run_dir": plan.run_dir,
            "drafter": f"{plan.run_dir}/{DRAFTER_DIR}",
            "report": f"{plan.run_dir}/{REPORT}",
            "plots": [f"{plan.run_dir}/{name}" for name in plots],
            "val_acc_per_position": [round(float(a), 3) for a in evaluation["val_acc_per_position"]],
            "measured_accept_length": {k: v["mean_accept_length"] for k, v in evaluation["speculative"].items()},
            # beside it: its noise over prompts, the ceiling on the same answers, training's offline prediction
            "accept_length_interval95": {k: v.get("accept_length_interval95")
                                         for k, v in evaluation["speculative"].items()},
            "ceiling_accept_length": {k: v.get("ceiling_accept_length") for k, v in evaluation["speculative"].items()},
            "offline_accept_length": evaluation.get("offline_accept_length"),
            # per public set (evaluate.benchmarks): the figures at each published configuration, the published
            # drafters' own at k=3 beside them (absent from reports written before public sets existed)
            "public_sets": {name: {"title": report.get("title", name), "prompts": report.get("prompts"),
                                   "answers_cut": report.get("answers_cut_at_max_new_tokens"),
                                   "accept_length": {k: v["mean_accept_length"]
                                                     for k, v in report["speculative"].items()},
                                   "interval95": {k: v.get("accept_length_interval95")
                                                  for k, v in report["speculative"].items()},
                                   "published_k3": report.get("published_k3")}
                            for name, report in (evaluation.get("public_sets") or {}).items()},
            # samples extracted by this run, and reused from the store runs with the same capture share
            "hidden_states": evaluation.get("hidden_states"),
            # measured against the lineage's current drafter on its pinned prompts; promoted or not, and why
            "promotion": evaluation.get("promotion"),
        }
        if benchmark is not None:
            summary["benchmark"] = {
                "engine": benchmark.get("engine", "sglang"),  # (benchmarks before vLLM were SGLang's)
                "report": f"{plan.run_dir}/{BENCHMARK_REPORT}",
                "accept_length": benchmark["mean_accept_length"],
                "output_tokens_per_s": {name: benchmark[name]["output_tokens_per_s"]
                                        for name in ("baseline", "eagle3")},
                "speedup": benchmark["speedup"],
            }
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise RunFileRefused(f"{plan.run_dir}/{REPORT} (or {BENCHMARK_REPORT}) on {plan.conn_ids[0]} lacks what a "
                             f"report has ({type(err).__name__}: {err}); run evaluate again (clear its task)") from None
    return summary


def run_summary(plan: RunPlan) -> dict | None:
    """summarize() of what the box holds now, or None when the run has no evaluation report (evaluate skipped)."""
    evaluation = read_json(plan, REPORT)
    if evaluation is None:
        return None
    benchmark = read_json(plan, BENCHMARK_REPORT) if plan.benchmark else None
    if plan.benchmark and benchmark is None:
        raise RunFileRefused(f"{plan.run_dir}/{BENCHMARK_REPORT} is missing on {plan.conn_ids[0]}, though the run has "
                             "benchmark.enabled: the benchmark stage did not finish")
    return summarize(plan, evaluation, list_plots(plan), benchmark)


def read_or_fail(what):
    """A file of the run the box refused, or one that is not what it should be, fails the task without a retry."""
    try:
        return what()
    except RunFileRefused as err:
        raise AirflowFailException(str(err)) from None


def check_inputs(plan: RunPlan) -> dict:
    """`python -m eagle3 lineage check`: whether the run's inputs changed since the lineage's current drafter."""
    result = plan.box().run(plan.eagle3("lineage", "check", "--config", plan.config_path), timeout=600)
    return result.json("python -m eagle3 lineage check")


def report_summary(plan: RunPlan) -> dict:
    """The summary the report task returns and publishes (and promote publishes again): run_summary with the form's
    notes, or, when evaluate was skipped, what the lineage check says stayed current. Logged line by line."""
    summary = _with_notes(read_or_fail(lambda: run_summary(plan)), plan)
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
