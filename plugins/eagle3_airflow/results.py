"""What a run produced, read back from its box: evaluate's report, the benchmark's, the plots, the lineage check
(whether anything changed since the current drafter), and the summary of them that the report task logs, the report
tab shows and the run's note and the approval's body put in words.

Everything comes from the verified plan (its box, its run directory) and the box. The box's code decides which files
exist and may be read (`python -m eagle3 report manifest`, eagle3/box/reportfiles.py: only the run's own regular files
of the expected names, never through a symlink, at most 8 MiB each) and prints their sizes and sha256; the bytes come by
the SSH connection's SFTP (a local read on the local box, eagle3_airflow.transport's `fetch`), at most the size the
manifest gives, and bytes whose size or sha256 differ from it are refused: a file swapped for a link or rewritten
between the manifest and the fetch is never served. No path or figure is taken from another task's XCom, which the USER
role may edit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

from airflow.sdk.exceptions import AirflowFailException

from eagle3.box.reportfiles import MAX_FILE_BYTES, allowed_name
from eagle3.contracts import Exit, FileManifest, ManifestEntry
from eagle3.disk.layout import BENCHMARK_REPORT, DRAFTER_DIR, REPORT
from eagle3_airflow.plan import RunPlan
from eagle3_airflow.transport import CommandResult, FileRefused

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 120
SHA256 = re.compile(r"^[0-9a-f]{64}$")
T = TypeVar("T")


class RunFileRefused(Exception):
    """A file of the run the box would not hand out, or that is not what it should be; the message names it."""


def read_files(plan: RunPlan, names: list[str], plots: bool = False) -> tuple[dict[str, bytes | None], list[str]]:
    """RUN_DIR/name for each name from the run's first box (None for one that does not exist), and with `plots`
    the run's plots (`<stage>/<name>.png`, sorted) as of the same moment; one connection for them all."""
    where = plan.box.conn_ids[0]
    for name in names:  # the box refuses them too; a name of ours that is not one is a bug here, said as such
        if not allowed_name(name):
            raise ValueError(f"{name!r} is not a report file name")
    box = plan.remote()
    with box.connected():
        result = box.run(
            plan.eagle3(
                "report",
                "manifest",
                "--run-dir",
                plan.run_dir,
                *(arg for name in names for arg in ("--name", name)),
                *(("--plots",) if plots else ()),
            ),
            timeout=READ_TIMEOUT_S,
        )
        if result.returncode == Exit.REFUSED:  # the run directory itself (a link, not absolute, missing)
            raise RunFileRefused(f"{where}: {_last_error(result)}")
        manifest: FileManifest = result.json("python -m eagle3 report manifest")
        entries = _checked_entries(manifest, names, where)
        run_dir = plan.run_dir.rstrip("/")
        wanted = {f"{run_dir}/{name}": entry for name, entry in entries.items() if entry["present"]}
        try:
            fetched = box.fetch({path: entry["size"] for path, entry in wanted.items()}, timeout=READ_TIMEOUT_S)
        except FileRefused as err:
            raise RunFileRefused(
                f"{where}: {err} (changed since the box's manifest: a link, a pipe or another file put in its place)"
            ) from None
    files: dict[str, bytes | None] = dict.fromkeys(names)
    for path, entry in wanted.items():
        data = fetched.get(path)
        if data is None:  # removed since the manifest (a retention run): as if it never was
            continue
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RunFileRefused(
                f"{path} on {where}: its bytes differ from the box's manifest (size or sha256): it "
                "changed between the manifest and the fetch, or was swapped; refused. Run the task "
                "again once nothing writes the run directory"
            )
        files[entry["name"]] = data
    return files, list(manifest.get("plots") or []) if plots else []


def _checked_entries(manifest: FileManifest, names: list[str], where: str) -> dict[str, ManifestEntry]:
    """The manifest's entry for each name asked for, each the shape `report manifest` prints; a refused one
    raises RunFileRefused with the box's reason."""
    try:
        entries = {entry["name"]: entry for entry in manifest["files"]}
        if set(entries) != set(names) or (
            manifest.get("plots") is not None
            and not all(isinstance(name, str) and allowed_name(name) for name in manifest["plots"])
        ):
            raise ValueError("other names than asked for")
        for name in names:
            entry = entries[name]
            if "refused" in entry:
                raise RunFileRefused(f"{where}: {str(entry['refused']).removeprefix('error: ')}")
            if entry["present"] is not True:
                entry["present"] = False
                continue
            if not (
                isinstance(entry["size"], int)
                and 0 <= entry["size"] <= MAX_FILE_BYTES
                and isinstance(entry["sha256"], str)
                and SHA256.match(entry["sha256"])
            ):
                raise ValueError(f"{name}: no size within {MAX_FILE_BYTES} bytes and sha256")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise RunFileRefused(
            f"{where}: `python -m eagle3 report manifest` answered what it never prints ({err})"
        ) from None
    return entries


def _last_error(result: CommandResult) -> str:
    reason = result.stderr.strip().splitlines()[-1:] or ["refused"]
    return reason[0].removeprefix("error: ")


def read_file(plan: RunPlan, name: str) -> bytes | None:
    """RUN_DIR/name from the run's first box, or None if it does not exist (read_files of one)."""
    return read_files(plan, [name])[0][name]


def read_json(plan: RunPlan, name: str) -> dict[str, Any] | None:
    """A report of the run as a JSON object, or None if it does not exist. Its content never goes into an error
    message: a file planted there would otherwise reach the task log."""
    return _json_object(plan, name, read_file(plan, name))


def _json_object(plan: RunPlan, name: str, data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    path = f"{plan.run_dir}/{name} on {plan.box.conn_ids[0]}"
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        where = f" (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
        raise RunFileRefused(
            f"{path} is not valid JSON{where}; the stage that writes it did not finish it, or "
            "someone replaced it: run that stage again (clear its task)"
        ) from None
    if not isinstance(value, dict):
        raise RunFileRefused(f"{path} is not a JSON object; run the stage that writes it again (clear its task)")
    return value


def summarize(
    plan: RunPlan, evaluation: dict[str, Any], plots: list[str], benchmark: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run's figures, promotion and files (evaluate's report read from the box; paths from the plan)."""
    try:
        summary: dict[str, Any] = {
            "run_dir": plan.run_dir,
            "drafter": f"{plan.run_dir}/{DRAFTER_DIR}",
            "report": f"{plan.run_dir}/{REPORT}",
            "plots": [f"{plan.run_dir}/{name}" for name in plots],
            "val_acc_per_position": [round(float(a), 3) for a in evaluation["val_acc_per_position"]],
            "measured_accept_length": {k: v["accept_length"] for k, v in evaluation["speculative"].items()},
            # beside it: its noise over prompts, the ceiling on the same answers, training's offline prediction
            "accept_length_interval95": {
                k: v.get("accept_length_interval95") for k, v in evaluation["speculative"].items()
            },
            "ceiling_accept_length": {k: v.get("ceiling_accept_length") for k, v in evaluation["speculative"].items()},
            "offline_accept_length": evaluation.get("offline_accept_length"),
            # per public set (evaluate.benchmarks): the figures at each published configuration, the published
            # drafters' own at k=3 beside them
            "public_sets": {
                name: {
                    "title": report.get("title", name),
                    "prompts": report.get("prompts"),
                    "answers_cut": report.get("answers_cut_at_max_new_tokens"),
                    "accept_length": {k: v["accept_length"] for k, v in report["speculative"].items()},
                    "interval95": {k: v.get("accept_length_interval95") for k, v in report["speculative"].items()},
                    "published_k3": report.get("published_k3"),
                }
                for name, report in evaluation["public_sets"].items()
            },
            # samples extracted by this run, and reused from the store runs with the same capture share
            "hidden_states": evaluation.get("hidden_states"),
            # measured against the lineage's current drafter on its pinned prompts; promoted or not, and why
            "promotion": evaluation.get("promotion"),
        }
        if benchmark is not None:
            summary["benchmark"] = {
                "engine": benchmark["engine"],
                "report": f"{plan.run_dir}/{BENCHMARK_REPORT}",
                "accept_length": benchmark["accept_length"],
                "output_tokens_per_s": {
                    name: benchmark[name]["output_tokens_per_s"] for name in ("baseline", "eagle3")
                },
                "speedup": benchmark["speedup"],
            }
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise RunFileRefused(
            f"{plan.run_dir}/{REPORT} (or {BENCHMARK_REPORT}) on {plan.box.conn_ids[0]} lacks what a "
            f"report has ({type(err).__name__}: {err}); run evaluate again (clear its task)"
        ) from None
    return summary


def run_summary(plan: RunPlan) -> dict[str, Any] | None:
    """summarize() of what the box holds now, or None when the run has no evaluation report (evaluate skipped)."""
    names = [REPORT, *((BENCHMARK_REPORT,) if plan.config.benchmark.enabled else ())]
    files, plots = read_files(plan, names, plots=True)  # one manifest, one fetch
    evaluation = _json_object(plan, REPORT, files[REPORT])
    if evaluation is None:
        return None
    benchmark = _json_object(plan, BENCHMARK_REPORT, files.get(BENCHMARK_REPORT))
    if plan.config.benchmark.enabled and benchmark is None:
        raise RunFileRefused(
            f"{plan.run_dir}/{BENCHMARK_REPORT} is missing on {plan.box.conn_ids[0]}, though the run "
            "has benchmark.enabled: the benchmark stage did not finish"
        )
    return summarize(plan, evaluation, plots, benchmark)


def read_or_fail(what: Callable[[], T]) -> T:
    """A file of the run the box refused, or one that is not what it should be, fails the task without a retry."""
    try:
        return what()
    except RunFileRefused as err:
        raise AirflowFailException(str(err)) from None


def check_inputs(plan: RunPlan) -> dict[str, Any]:
    """`python -m eagle3 lineage check`: whether the run's inputs changed since the lineage's current drafter."""
    result = plan.remote().run(plan.eagle3("lineage", "check", "--config", plan.config_path), timeout=600)
    check: dict[str, Any] = result.json("python -m eagle3 lineage check")
    return check


def report_summary(plan: RunPlan) -> dict[str, Any]:
    """The summary the report task returns and publishes (and promote publishes again): run_summary with the form's
    notes, or, when evaluate was skipped, what the lineage check says stayed current. Logged line by line."""
    summary = read_or_fail(lambda: run_summary(plan))
    if summary is None:  # evaluate was skipped: say why
        report_path = f"{plan.run_dir}/{REPORT}"
        check = check_inputs(plan)
        if check["changed"]:
            raise AirflowFailException(f"{report_path} is missing, though the inputs changed: evaluate did not run")
        summary = _with_notes(
            {
                "run_dir": plan.run_dir,
                "nothing_changed_since": check["unchanged_since"],
                "drafter": check["current_drafter"],
                "measured_accept_length": check["current_accept_length"],
                "promotion": {"promoted": False, "reason": f"nothing changed since run {check['unchanged_since']}"},
            },
            plan,
        )
        log.info(
            "nothing changed since run %s; the lineage's drafter stays %s (measured acceptance %s)",
            check["unchanged_since"],
            check["current_drafter"],
            check["current_accept_length"],
        )
        return summary
    summary = _with_notes(summary, plan)
    if (summary["promotion"] or {}).get("pending_approval"):  # the promotion DAG asks; its promote republishes
        summary["promotion"]["reason"] += "; proposed for approval (the promotion DAG asks the approvers)"
    for key, value in summary.items():
        log.info("%-24s %s", key, value)
    return summary


def _with_notes(summary: dict[str, Any], plan: RunPlan) -> dict[str, Any]:
    """The form's notes (why this run) beside the figures, for the run's note."""
    return {**summary, "notes": plan.notes} if plan.notes else summary
