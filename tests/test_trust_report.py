"""Issue 35, item 3: the report tab, the report task and the approval read only the run's own report files.

Written as the attacks: someone who can write into a shared workdir plants links, pipes and huge files in a run
directory; someone who can edit XCom names paths outside the run. The box side (eagle3/box/reportfiles.py, run here
through the local transport as `python -m eagle3 report manifest`) names only regular files of the expected names
under the real run directory, never through a link, at most 8 MiB, with their sizes and sha256; the Airflow side
(report task, report tab) fetches only those (SFTP, or a local read here), refuses bytes that differ from the
manifest, never reads anything else and never echoes a refused file's content.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException
from fastapi import HTTPException

from eagle3.box.reportfiles import MAX_FILE_BYTES, ReportFileRefused, list_plots, manifest_command, read_file
from eagle3_airflow import approvals, results, tasks
from eagle3_airflow.plan import RunPlan
from eagle3_airflow.transport import LocalBox
from tests.conftest import RUN, run_dir_of

SECRET = "SECRET-TOKEN-do-not-serve-4b1f"
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64

REPORT = {
    "val_acc_per_position": [0.61, 0.42],
    "offline_accept_length": {"3": 1.91},
    "speculative": {"3": {"accept_length": 1.87}},
    "public_sets": {},
    "hidden_states": {"store": "/w/stores/ab", "samples": 48, "extracted": 48, "reused": 0},
    "promotion": {
        "promoted": True,
        "reason": "the lineage's first drafter (k=3: 1.870)",
        "lineage": "f209",
        "version": "r-1a2b3c4d",
        "current": "/w/drafters/f209/current",
        "accept_length": {"3": 1.87},
        "current_before": None,
        "eval_set_prompts": 2,
    },
}


@pytest.fixture
def run_dir(plan) -> Path:
    """The plan fixture's run directory, with a real plot and a real report in it."""
    run_dir = run_dir_of(plan)
    (run_dir / "evaluate").mkdir(parents=True, exist_ok=True)
    (run_dir / "evaluate" / "report.json").write_text(json.dumps(REPORT))
    (run_dir / "train").mkdir(exist_ok=True)
    (run_dir / "train" / "loss.png").write_bytes(PNG)
    return run_dir


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "id_ed25519"
    path.parent.mkdir()
    path.write_text(f"-----BEGIN OPENSSH PRIVATE KEY----- {SECRET}\n")
    return path


def box_plan(plan: dict) -> RunPlan:
    return RunPlan.from_trusted(plan)


# -- the box side ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_plot_that_links_to_a_secret_is_neither_listed_nor_read(run_dir, secret):
    (run_dir / "evaluate" / "acceptance.png").symlink_to(secret)
    assert list_plots(str(run_dir)) == ["train/loss.png"]
    with pytest.raises(ReportFileRefused, match=r"evaluate/acceptance.png: refused .*never a symlink"):
        read_file(str(run_dir), "evaluate/acceptance.png")


def test_a_linked_stage_directory_or_run_directory_is_not_followed(run_dir, secret, tmp_path):
    (run_dir / "benchmark").symlink_to(secret.parent)  # benchmark/ -> a directory of someone else's
    (secret.parent / "benchmark.json").write_text(json.dumps({"stolen": SECRET}))
    (secret.parent / "x.png").write_bytes(PNG)
    with pytest.raises(ReportFileRefused, match=r"/benchmark: refused"):
        read_file(str(run_dir), "benchmark/benchmark.json")
    assert list_plots(str(run_dir)) == ["train/loss.png"]
    linked_run = tmp_path / "work" / "runs" / "linked"
    linked_run.symlink_to(run_dir)  # a run directory is never a link: the stages make a real one
    with pytest.raises(ReportFileRefused, match=r"runs/linked: not a real directory"):
        read_file(str(linked_run), "evaluate/report.json")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "../../../../etc/passwd",
        "evaluate/../../../../etc/passwd",
        "/etc/passwd",
        "evaluate/report.json/..",
        "jobs/train/log",
        "evaluate/proposal.json",
        "config.json",
        "a/b/c.png",
    ],
)
def test_only_the_reports_and_stage_plots_are_read_by_name(run_dir, name):
    with pytest.raises(ReportFileRefused, match="not a file the report reads"):
        read_file(str(run_dir), name)


def test_a_run_directory_that_climbs_out_is_refused(run_dir):
    with pytest.raises(ReportFileRefused, match="absolute path without '..'"):
        read_file(f"{run_dir}/../../../../etc", "evaluate/report.json")


@pytest.mark.slow
def test_a_huge_plot_is_refused_by_its_size_without_being_read(run_dir):
    """A 100 MB "plot" grew the API server by 270 MiB (base64 over SSH, decoded, served). Now the box leaves it out
    of the list and refuses it by fstat size, before reading a byte (the file is sparse: reading it would take
    seconds, refusing it takes none)."""
    huge = run_dir / "evaluate" / "acceptance.png"
    with open(huge, "wb") as f:
        f.truncate(100 << 20)
    assert "evaluate/acceptance.png" not in list_plots(str(run_dir))
    with pytest.raises(ReportFileRefused, match=rf"104857600 bytes, more than the {MAX_FILE_BYTES}"):
        read_file(str(run_dir), "evaluate/acceptance.png")
    with open(huge, "r+b") as f:  # at the cap it is served
        f.truncate(MAX_FILE_BYTES)
    assert len(read_file(str(run_dir), "evaluate/acceptance.png")) == MAX_FILE_BYTES


@pytest.mark.slow
def test_a_pipe_in_place_of_a_plot_neither_blocks_nor_is_read(run_dir):
    os.mkfifo(run_dir / "evaluate" / "acceptance.png")
    assert list_plots(str(run_dir)) == ["train/loss.png"]
    with pytest.raises(ReportFileRefused, match="not a regular file"):
        read_file(str(run_dir), "evaluate/acceptance.png")


@pytest.mark.slow
def test_the_manifest_names_each_file_with_its_size_and_digest_and_refuses_links_one_by_one(run_dir, secret):
    """What the control plane may fetch, decided on the box: size and sha256 of what the box read through its checks,
    absent files as absent, a linked or unknown name refused by name (its target's content nowhere), the plots."""
    import hashlib

    (run_dir / "evaluate" / "acceptance.png").symlink_to(secret)
    manifest = manifest_command(
        str(run_dir),
        [
            "evaluate/report.json",
            "train/loss.png",
            "evaluate/acceptance.png",
            "benchmark/benchmark.json",
            "config.json",
        ],
        plots=True,
    )
    report = (run_dir / "evaluate" / "report.json").read_bytes()
    assert manifest["files"][:2] == [
        {
            "name": "evaluate/report.json",
            "present": True,
            "size": len(report),
            "sha256": hashlib.sha256(report).hexdigest(),
        },
        {"name": "train/loss.png", "present": True, "size": len(PNG), "sha256": hashlib.sha256(PNG).hexdigest()},
    ]
    assert "never a symlink" in manifest["files"][2]["refused"]
    assert manifest["files"][3] == {"name": "benchmark/benchmark.json", "present": False}
    assert "not a file the report reads" in manifest["files"][4]["refused"]
    assert manifest["plots"] == ["train/loss.png"] and SECRET not in json.dumps(manifest)
    with pytest.raises(ReportFileRefused, match="a run directory is never a symlink"):
        linked = run_dir.with_name("linked")
        linked.symlink_to(run_dir)
        manifest_command(str(linked), ["evaluate/report.json"])


# -- the Airflow side, through `python -m eagle3 report` on the box ----------------------------------------------


def swap_before_fetch(monkeypatch, path: Path, swap) -> None:
    """Run `swap` between the box's manifest naming `path` and the fetch of its bytes (someone writing the run
    directory then)."""
    fetch = LocalBox.fetch

    def swapped(self, files, **kwargs):
        if str(path) in files:
            swap()
        return fetch(self, files, **kwargs)

    monkeypatch.setattr(LocalBox, "fetch", swapped)


@pytest.mark.slow
@pytest.mark.parametrize("swap", ["link", "rewritten", "grown", "pipe"])
def test_a_file_swapped_between_manifest_and_fetch_is_refused_not_served(
    run_dir, plan, secret, reports, monkeypatch, swap
):
    """The box vouches for a file's size and sha256; the bytes come by another channel (SFTP, a local read here)
    a moment later. A link to a secret, a rewrite of the same size, a file grown past what the manifest said, a pipe:
    each fails the task naming the file, and nothing of it is published or echoed."""
    plot = run_dir / "train" / "loss.png"

    def replace():
        plot.unlink()
        if swap == "link":
            plot.symlink_to(secret)
        elif swap == "rewritten":  # the same size, other bytes: only the digest tells
            plot.write_bytes(SECRET.encode().ljust(len(PNG), b"\0")[: len(PNG)])
        elif swap == "grown":
            plot.write_bytes(PNG + SECRET.encode())
        else:
            os.mkfifo(plot)

    swap_before_fetch(monkeypatch, plot, replace)
    with pytest.raises(AirflowFailException, match=r"train/loss.png") as refused:
        tasks.report(plan, dag_run=RUN)
    assert "refused" in str(refused.value) and SECRET not in str(refused.value)
    assert not [path for path in reports.rglob("*") if path.is_file() and SECRET.encode() in path.read_bytes()]


@pytest.mark.slow
def test_the_report_reads_its_files_in_one_manifest_and_fetch_per_step(run_dir, plan, monkeypatch):
    """Not one box command per file: the summary asks once (its reports and the plots), the publication once."""
    (run_dir / "evaluate" / "acceptance.png").write_bytes(PNG)
    run, fetch = LocalBox.run, LocalBox.fetch
    commands, fetches = [], []
    monkeypatch.setattr(LocalBox, "run", lambda self, argv, **k: commands.append(argv) or run(self, argv, **k))
    monkeypatch.setattr(
        LocalBox, "fetch", lambda self, files, **k: fetches.append(sorted(files)) or fetch(self, files, **k)
    )
    plan_ = box_plan(plan)
    files, plots = results.read_files(plan_, ["evaluate/report.json"], plots=True)
    assert plots == ["evaluate/acceptance.png", "train/loss.png"]
    assert json.loads(files["evaluate/report.json"]) == REPORT
    files, _ = results.read_files(plan_, plots)
    assert files == {"evaluate/acceptance.png": PNG, "train/loss.png": PNG}
    assert len(commands) == 2 and all("manifest" in argv for argv in commands) and len(fetches) == 2


@pytest.mark.slow
def test_the_report_task_reads_figures_and_plots_from_the_box_only(run_dir, plan, secret):
    (run_dir / "evaluate" / "acceptance.png").symlink_to(secret)
    summary = tasks.report(plan, dag_run=RUN)
    assert summary["plots"] == [f"{run_dir}/train/loss.png"]  # the link is not a plot of the run
    assert summary["measured_accept_length"] == {"3": 1.87} and summary["promotion"]["version"] == "r-1a2b3c4d"


@pytest.mark.slow
def test_a_linked_report_puts_nothing_of_its_target_into_the_task_error(run_dir, plan, secret):
    """A symlinked report.json used to fail the report task with the file's last 2000 characters in its error."""
    report = run_dir / "evaluate" / "report.json"
    report.unlink()
    report.symlink_to(secret)
    with pytest.raises(AirflowFailException) as refused:
        tasks.report(plan, dag_run=RUN)
    assert f"{run_dir}/evaluate/report.json: refused" in str(refused.value) and SECRET not in str(refused.value)
    # A regular report that is not JSON (someone wrote a secret into it): named, its content not echoed.
    report.unlink()
    report.write_text(f"not json {SECRET}")
    with pytest.raises(AirflowFailException, match=r"evaluate/report.json on local is not valid JSON") as refused:
        tasks.report(plan, dag_run=RUN)
    assert SECRET not in str(refused.value)


@pytest.mark.slow
def test_the_approval_reads_the_proposal_through_the_same_refusals(run_dir, plan, secret):
    report = run_dir / "evaluate" / "report.json"
    report.unlink()
    report.symlink_to(secret)
    with pytest.raises(AirflowFailException, match="refused") as refused:
        approvals.propose_promotion(plan, "eagle3_drafter.proposals", outlet_events={}, dag_run=RUN)
    assert SECRET not in str(refused.value)


# -- the report tab: what the report task published, no box ------------------------------------------------------


@pytest.fixture
def reports(tmp_path, monkeypatch) -> Path:
    """The default reports store, $AIRFLOW_HOME/eagle3-reports, in this test's own AIRFLOW_HOME."""
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow-home"))
    return tmp_path / "airflow-home" / "eagle3-reports"


@pytest.mark.slow
def test_the_report_tab_serves_what_the_report_task_published_with_the_box_gone(run_dir, plan, secret, reports):
    """Issue 36: the API server has no box key; the tab used to SSH to the box and 500 on any real one. Now the
    report task publishes the run's report and plots, and the tab serves only that publication."""
    from eagle3_airflow import report_view

    (run_dir / "evaluate" / "acceptance.png").symlink_to(secret)  # a planted link: not a plot of the run
    tasks.report(plan, dag_run=RUN)
    folder = reports / "eagle3_drafter" / "manual__2026-12-04T08%3A00%3A00%2B00%3A00"
    assert json.loads((folder / "report.json").read_text()) == REPORT
    assert (folder / "plots" / "000.png").read_bytes() == PNG and len(list((folder / "plots").iterdir())) == 1
    assert not [path for path in reports.rglob("*") if path.is_file() and SECRET.encode() in path.read_bytes()]
    assert not list(folder.glob(".*.tmp"))  # written under temporary names, renamed into place

    os.rename(run_dir, run_dir.with_name("gone"))  # the box lost the run (or is down): the tab does not care
    page = report_view.report_page("eagle3_drafter", RUN.run_id, None)
    assert "1.870" in page and "promoted" in page and page.count("<img") == 1 and "train/loss.png" in page
    response = report_view.plot("eagle3_drafter", RUN.run_id, 0, None)
    assert response.body == PNG and response.headers["x-content-type-options"] == "nosniff"
    with pytest.raises(HTTPException) as missing:
        report_view.plot("eagle3_drafter", RUN.run_id, 1, None)
    assert missing.value.status_code == 404
    assert json.loads(report_view.report_json("eagle3_drafter", RUN.run_id, None).body) == REPORT


def test_the_report_tab_of_a_run_that_published_nothing_says_so(reports):
    from eagle3_airflow import report_view

    page = report_view.report_page("eagle3_drafter", "manual__never", None)
    assert "id='unpublished'" in page and "report task has not run yet" in page
    with pytest.raises(HTTPException) as missing:
        report_view.report_json("eagle3_drafter", "manual__never", None)
    assert missing.value.status_code == 404


@pytest.mark.parametrize("run_id", ["..", "../../etc", "a/../../b", "."])
def test_a_run_id_names_one_folder_of_the_store_and_nothing_outside_it(reports, run_id):
    """Run ids become one percent-encoded path component, dots included: no id reaches out of its DAG's folder."""
    from eagle3_airflow.deployment import Deployment
    from eagle3_airflow.published import reports_root, run_folder

    folder = run_folder(Deployment(), "eagle3_drafter", run_id)
    assert folder.parent == reports_root(Deployment()) / "eagle3_drafter" and "/" not in folder.name
    assert ".." not in folder.name and folder.name != "."


@pytest.mark.slow
def test_the_tab_serves_only_files_the_publication_names(run_dir, plan, reports, secret):
    """A file dropped into a run's published folder (or a summary.json naming another path) is not served."""
    from eagle3_airflow import report_view
    from eagle3_airflow.published import SUMMARY

    tasks.report(plan, dag_run=RUN)
    folder = reports / "eagle3_drafter" / "manual__2026-12-04T08%3A00%3A00%2B00%3A00"
    manifest = json.loads((folder / SUMMARY).read_text())
    manifest["plots"] = [{"file": "../../../../elsewhere/id_ed25519", "name": "x"}]
    (folder / SUMMARY).write_text(json.dumps(manifest))
    with pytest.raises(HTTPException) as refused:
        report_view.plot("eagle3_drafter", RUN.run_id, 0, None)
    assert refused.value.status_code == 404
