"""What a run produced, read back from its box: evaluate's report, the benchmark's, the plots, and the summary of
them that the report task logs, the report tab shows and the run's note and the approval's body put in words.

Everything comes from the verified plan (its box, its run directory) and the box, through
`python -m eagle3 report list|read` (eagle3/reportfiles.py): only the run's own regular files of the expected names,
never through a symlink, at most 8 MiB each. No path or figure is taken from another task's XCom, which the
USER role may edit.
"""

from __future__ import annotations

import base64
import json

from eagle3.runlayout import BENCHMARK_REPORT, DRAFTER_DIR, REPORT
from eagle3_airflow.plan import RunPlan

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

