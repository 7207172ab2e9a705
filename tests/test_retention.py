"""Retention on the box: old run directories pruned (never a promoted drafter's, never a live one), unused stores
collected only when asked, and nothing removed that is not the project's own or that lies behind a link."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from eagle3.box.retention import RetentionRefused, gc_stores, prune_runs
from eagle3.data.identity import capture_key, link_shared
from tests.conftest import run_eagle3


def make_run(workdir: Path, name: str, age_s: float, store: str | None = None) -> Path:
    """A run directory as `init` leaves it: config.json naming it (the two fields retention reads), and, given a
    store's fields, its hidden_states linked to the shared store of those fields."""
    run_dir = workdir / "runs" / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"run_name": name, "workdir": str(workdir)}))
    then = time.time() - age_s
    os.utime(run_dir / "config.json", (then, then))
    if store:
        link_shared(run_dir / "hidden_states", workdir / "stores" / store_key(store), {"store": store}, "", "")
    return run_dir


def store_key(label: str) -> str:
    return capture_key({"store": label})


def make_store(workdir: Path, label: str) -> str:
    """A shared store no run links to (yet): its directory named by its key, key.json holding its fields."""
    key = store_key(label)
    (workdir / "stores" / key).mkdir(parents=True)
    (workdir / "stores" / key / "key.json").write_text(json.dumps({"store": label}))
    return key


def promote(workdir: Path, version: str, run_dir: str) -> Path:
    """A promoted version whose promotion.json names `run_dir` as its drafter's run directory."""
    path = workdir / "drafters" / "lineage" / "versions" / version
    path.mkdir(parents=True)
    (path / "promotion.json").write_text(json.dumps({"run_dir": run_dir}))
    return path


@pytest.mark.slow
def test_prune_keeps_the_newest_and_every_promoted_or_live_run(tmp_path):
    workdir = tmp_path / "work"
    runs = {
        name: make_run(workdir, name, age_s=age)
        for name, age in [("week-1", 4000), ("week-2", 3000), ("week-3", 2000), ("week-4", 1000), ("week-5", 0)]
    }
    promote(workdir, "week-1-0123abcd", str(runs["week-1"]))
    run_eagle3("job", "start", "--jobs-dir", str(runs["week-2"] / "jobs"), "--key", "train", "--", "sleep", "60")
    try:
        outcome = prune_runs(workdir, keep=2)
    finally:
        run_eagle3("job", "kill", "--jobs-dir", str(runs["week-2"] / "jobs"), "--key", "train", "--grace-s", "1")
    assert outcome["removed"] == ["week-3"]
    assert outcome["kept_beyond_keep"] == {
        "week-1": "its drafter is a promoted version",
        "week-2": "a job of it is running",
    }
    assert sorted(p.name for p in (workdir / "runs").iterdir()) == ["week-1", "week-2", "week-4", "week-5"]
    assert prune_runs(workdir, keep=1, dry_run=True)["removed"] == ["week-2", "week-4"]  # the job is gone now
    assert (runs["week-4"] / "config.json").exists()  # dry run
    with pytest.raises(ValueError, match="keep at least the newest"):
        prune_runs(workdir, keep=0)


def propose(run_dir: Path, age_s: float) -> None:
    """evaluate --hold-promotion's report, `age_s` old: a promotion the promotion DAG asks a person about."""
    report = run_dir / "evaluate" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"promotion": {"promoted": False, "pending_approval": True}}))
    then = time.time() - age_s
    os.utime(report, (then, then))


@pytest.mark.slow
def test_a_run_whose_proposal_may_still_be_approved_is_kept_until_the_approval_times_out(tmp_path):
    """approve_promotion: the training run ends before a person approves (in the promotion DAG), and a later run's
    retention must not remove the drafter awaiting approval; once the approval has timed out, it goes as any."""
    workdir = tmp_path / "work"
    runs = {name: make_run(workdir, name, age_s=age) for name, age in [("waiting", 3000), ("newest", 0)]}
    propose(runs["waiting"], age_s=2 * 3600)
    kept = json.loads(
        run_eagle3("runs", "prune", "--workdir", str(workdir), "--keep", "1", "--keep-proposals-h", "72").stdout
    )
    assert (kept["removed"], kept["kept_beyond_keep"]) == ([], {"waiting": "its drafter awaits approval"})
    timed_out = json.loads(
        run_eagle3("runs", "prune", "--workdir", str(workdir), "--keep", "1", "--keep-proposals-h", "1").stdout
    )
    assert timed_out["removed"] == ["waiting"] and not runs["waiting"].exists()


@pytest.mark.slow
def test_store_gc_removes_only_what_no_run_links_to(tmp_path):
    workdir = tmp_path / "work"
    make_run(workdir, "kept", 0, store="a")
    make_run(workdir, "gone", 10, store="b")
    orphan = make_store(workdir, "orphan")
    a, b = store_key("a"), store_key("b")
    assert gc_stores(workdir, dry_run=True)["stores"] == {"kept": sorted([a, b]), "removed": [orphan], "not_stores": {}}
    assert (workdir / "stores" / orphan).exists()
    assert prune_runs(workdir, keep=1)["removed"] == ["gone"]  # first the run directories, then what they used
    result = json.loads(run_eagle3("store", "gc", "--workdir", str(workdir)).stdout)
    assert result["stores"] == {"kept": [a], "removed": sorted([b, orphan]), "not_stores": {}}
    assert sorted(p.name for p in (workdir / "stores").iterdir()) == [a]


# -- attacks: a workdir the trigger chose, links, markers that are not the project's ----------------------------------


def test_prune_removes_no_folder_that_merely_holds_a_config_json(tmp_path):
    """Attack: `runs prune` in a work directory the trigger chose (here a home directory with a runs/ folder of
    another tool's) removed every old folder that held any config.json."""
    home = tmp_path / "home"
    theirs = {
        "experiment": {"lr": 0.1},
        "copied": {"run_name": "elsewhere", "workdir": "/data/work"},
        "relative": {"run_name": "relative", "workdir": "home"},
    }
    for name, config in theirs.items():
        (home / "runs" / name).mkdir(parents=True)
        (home / "runs" / name / "config.json").write_text(json.dumps(config))
        os.utime(home / "runs" / name / "config.json", (0, 0))  # the oldest there are
    (home / "runs" / "no-config").mkdir()
    outside = tmp_path / "outside"  # a directory reached through a link, with a config.json naming the link
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"run_name": "link", "workdir": str(home)}))
    (home / "runs" / "link").symlink_to(outside)
    make_run(home, "ours-old", 100)
    make_run(home, "ours-new", 0)

    outcome = prune_runs(home, keep=1)
    assert outcome["removed"] == ["ours-old"] and outcome["runs"] == 2
    assert outcome["not_run_dirs"] == {
        "copied": "its config.json names another run directory (/data/work/runs/elsewhere)",
        "experiment": "its config.json is not a run config (no absolute workdir and run_name)",
        "link": "a symbolic link, not a run directory",
        "no-config": "no config.json",
        "relative": "its config.json is not a run config (no absolute workdir and run_name)",
    }
    assert sorted(p.name for p in (home / "runs").iterdir()) == sorted([*theirs, "no-config", "link", "ours-new"])
    assert (outside / "config.json").exists()


@pytest.mark.parametrize("root", ["workdir", "runs", "drafters"])
def test_prune_refuses_a_symlinked_root_naming_it(tmp_path, root):
    """Attack: with runs/ (or the work directory, or drafters/) a link, what prune removes is the link's target."""
    real = tmp_path / "real"
    make_run(real, "old", 100)
    make_run(real, "new", 0)
    (real / "drafters").mkdir()
    workdir = tmp_path / "work"
    if root == "workdir":
        workdir.symlink_to(real)
        link = workdir
    else:
        workdir.mkdir()
        for name in ("runs", "drafters"):
            (workdir / name).symlink_to(real / name) if name == root else (workdir / name).mkdir()
        link = workdir / root
    with pytest.raises(RetentionRefused) as refused:
        prune_runs(workdir, keep=1)
    assert refused.value.where == str(link) and refused.value.fact.startswith(f"a symbolic link (to {real}")
    assert sorted(p.name for p in (real / "runs").iterdir()) == ["new", "old"]


def test_a_promoted_run_spelled_differently_in_its_promotion_json_is_kept(tmp_path):
    """Attack (or just another spelling): promotion.json named the run directory with a trailing slash, a `//`, or
    through a link to the work directory; the run it protects was pruned all the same."""
    workdir = tmp_path / "work"
    alias = tmp_path / "alias"
    alias.symlink_to(workdir, target_is_directory=True)
    spellings = {
        "slash": f"{workdir}/runs/slash/",
        "double": f"{workdir}//runs//double",
        "linked": f"{alias}/runs/linked",
    }
    for age, (name, spelling) in enumerate(spellings.items(), start=1):
        make_run(workdir, name, 100 * age)
        promote(workdir, f"{name}-00000000", spelling)
    make_run(workdir, "new", 0)
    outcome = prune_runs(workdir, keep=1)
    assert outcome["removed"] == []
    assert outcome["kept_beyond_keep"] == {name: "its drafter is a promoted version" for name in spellings}


@pytest.mark.slow
def test_a_bad_promotion_json_refuses_the_prune_naming_it(tmp_path):
    """Attack: a promotion.json that is not JSON (or names no run) ended prune in a traceback. Which run directory
    it protects is unknown, so nothing is removed, and the file is named."""
    workdir = tmp_path / "work"
    make_run(workdir, "old", 100)
    make_run(workdir, "new", 0)
    version = promote(workdir, "old-0123abcd", "")
    for text in ("{not json", json.dumps({"accept_length": {}}), json.dumps(["a list"])):
        (version / "promotion.json").write_text(text)
        proc = run_eagle3("runs", "prune", "--workdir", str(workdir), "--keep", "1", check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"error: {version / 'promotion.json'}: ")
        assert "it should name the run directory its drafter came from" in proc.stderr
        assert (workdir / "runs" / "old").exists()


@pytest.mark.slow
@pytest.mark.parametrize("root", ["stores", "generated", "runs"])
def test_store_gc_refuses_a_symlinked_root_naming_it(tmp_path, root):
    """Attack: `store gc` through a symlinked stores/ removed every unlinked folder in the link's target."""
    workdir = tmp_path / "work"
    make_run(workdir, "run", 0)
    target = tmp_path / "someones"
    (target / "folder").mkdir(parents=True)
    (workdir / root).rename(tmp_path / "moved") if root == "runs" else None
    (workdir / root).symlink_to(tmp_path / "moved" if root == "runs" else target)
    proc = run_eagle3("store", "gc", "--workdir", str(workdir), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {workdir / root}: a symbolic link")
    assert (target / "folder").exists()


def test_store_gc_removes_only_marked_stores_and_nothing_behind_a_link(tmp_path):
    """Attack: every folder in stores/ that no run linked to was removed, whatever it was: a folder of someone's,
    one with a key.json of another key, and (through a link) a real store elsewhere."""
    workdir = tmp_path / "work"
    make_run(workdir, "run", 0, store="used")
    unused = make_store(workdir, "unused")
    stores = workdir / "stores"
    (stores / "someones").mkdir()
    (stores / "someones" / "data.txt").write_text("keep me")
    (stores / "renamed").mkdir()
    (stores / "renamed" / "key.json").write_text(json.dumps({"store": "x"}))  # its fields hash to another name
    elsewhere = tmp_path / "elsewhere"
    make_store(elsewhere, "far")
    (stores / store_key("far")).symlink_to(elsewhere / "stores" / store_key("far"))

    result = gc_stores(workdir)["stores"]
    assert result["removed"] == [unused] and result["kept"] == [store_key("used")]
    assert result["not_stores"] == {
        "renamed": "its key.json does not hash to its name 'renamed'",
        "someones": "no key.json",
        store_key("far"): "a symbolic link, not a store",
    }
    assert (stores / "someones" / "data.txt").exists() and (elsewhere / "stores" / store_key("far")).exists()
    assert sorted(p.name for p in stores.iterdir()) == sorted(
        [store_key("used"), "someones", "renamed", store_key("far")]
    )


def test_a_link_swapped_in_after_the_checks_removes_nothing(tmp_path):
    """The last line of defence: removal opens the parent without following a link and rmtree refuses one, so a run
    directory replaced by a link between the checks and the removal takes nothing of the link's target with it."""
    from eagle3.disk.fsutil import UnsafeTree, remove_tree_in

    target = tmp_path / "target"
    (target / "inside").mkdir(parents=True)
    runs = tmp_path / "work" / "runs"
    runs.mkdir(parents=True)
    (runs / "swapped").symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        remove_tree_in(runs, "swapped")
    (tmp_path / "runs-link").symlink_to(runs)
    (runs / "real").mkdir()
    with pytest.raises(UnsafeTree, match=f"^{tmp_path / 'runs-link'}: a symbolic link"):  # the parent itself
        remove_tree_in(tmp_path / "runs-link", "real")
    assert (target / "inside").is_dir() and (runs / "real").is_dir()


def another_hosts_running_job(run_dir: Path, key: str = "train") -> dict:
    """The state.json a supervisor on another box sharing this work directory writes for its running job: that
    host's id, boot id and pid (a pid no process here has), its last heartbeat an hour old, as one seen across a
    slow or partitioned shared filesystem. This machine is one host, so the other host is its recorded identity;
    what the test proves is what this host does on that record."""
    directory = run_dir / "jobs" / key
    directory.mkdir(parents=True)
    state = {
        "key": key,
        "try": 1,
        "status": "running",
        "pid": 4_000_000,
        "pgid": 4_000_000,
        "pid_start_ticks": 123,
        "boot_id": "boot-of-gpu-box-1",
        "host": "gpu-box-1",
        "host_id": "machine-id-of-gpu-box-1",
        "argv": ["x"],
        "started_at": "2026-01-01T00:00:00Z",
        "heartbeat_at": time.time() - 3600,
        "exit_code": None,
        "ended_at": None,
        "log_start": 0,
    }
    (directory / "state.json").write_text(json.dumps(state))
    directory.chmod(0o700)
    return state


def test_a_run_whose_job_runs_on_another_host_is_never_pruned(tmp_path, monkeypatch):
    """Two boxes share the work directory (issue 43, item 4): box B's retention must not remove the run directory
    of a job box A runs, though box A's boot id, pid and heartbeat mean nothing here. Its own host's record of the
    same job, a boot later, is a dead job, and that run goes."""
    this_host = tmp_path / "machine-id"
    this_host.write_text("machine-id-of-gpu-box-2\n")
    monkeypatch.setenv("EAGLE3_HOST_ID_FILE", str(this_host))
    workdir = tmp_path / "work"
    runs = {
        name: make_run(workdir, name, age_s=age)
        for name, age in [("box-1-run", 3000), ("box-2-old", 2000), ("box-2-new", 0)]
    }
    another_hosts_running_job(runs["box-1-run"])
    own = another_hosts_running_job(runs["box-2-old"])  # this host's own job, recorded before a reboot
    state = runs["box-2-old"] / "jobs" / "train" / "state.json"
    state.write_text(json.dumps({**own, "host": "gpu-box-2", "host_id": "machine-id-of-gpu-box-2"}))
    outcome = prune_runs(workdir, keep=1)
    assert outcome["removed"] == ["box-2-old"]
    assert outcome["kept_beyond_keep"] == {"box-1-run": "job train of it runs on another host"}
    assert (runs["box-1-run"] / "jobs" / "train" / "state.json").exists()


def as_host(monkeypatch, tmp_path: Path, name: str) -> None:
    """Run from here as host `name` (EAGLE3_HOST_ID_FILE): one machine, two boxes by their records."""
    path = tmp_path / f"machine-id-{name}"
    path.write_text(f"machine-id-of-{name}\n")
    monkeypatch.setenv("EAGLE3_HOST_ID_FILE", str(path))


def owned_by_this_host(run_dir: Path, run_id: str) -> None:
    """Record an Airflow run as the run directory's owner, as `eagle3 init` does on the host it runs on."""
    from eagle3.jobs.runowner import AirflowRun, write_owners

    write_owners(run_dir, [AirflowRun("eagle3_drafter", run_id).record()])


def test_a_run_another_host_made_is_never_pruned_here_even_between_two_stages(tmp_path, monkeypatch):
    """Two boxes share the work directory. Box A's run is between two stages (extract done, train not started yet):
    no job of it runs, so the live-job rule alone let box B's retention remove it under box A. Its owner.json says
    box A made it: box B keeps it, saying so, and prunes its own old run and the run directory no Airflow run owns
    (init by hand). Box A's retention prunes box A's run."""
    workdir = tmp_path / "work"
    runs = {
        name: make_run(workdir, name, age_s=age)
        for name, age in [("box-1-between-stages", 3000), ("no-owner", 2600), ("box-2-old", 2000), ("box-2-new", 0)]
    }
    as_host(monkeypatch, tmp_path, "gpu-box-1")
    owned_by_this_host(runs["box-1-between-stages"], "scheduled__box-1")
    done = runs["box-1-between-stages"] / "jobs" / "extract.0"
    done.mkdir(parents=True, mode=0o700)
    (done / "state.json").write_text(
        json.dumps(
            {**another_hosts_running_job(tmp_path / "scratch", "extract.0"), "status": "succeeded", "exit_code": 0}
        )
    )
    as_host(monkeypatch, tmp_path, "gpu-box-2")
    for name in ("box-2-old", "box-2-new"):
        owned_by_this_host(runs[name], f"scheduled__{name}")

    outcome = prune_runs(workdir, keep=1)
    assert outcome["removed"] == ["box-2-old", "no-owner"]
    kept = outcome["kept_beyond_keep"]
    assert list(kept) == ["box-1-between-stages"]
    assert (
        kept["box-1-between-stages"].startswith("owned by host ")
        and "(host id machine-id-of-gpu-box-1), which made it: only that host's retention prunes it"
        in kept["box-1-between-stages"]
    )
    assert (runs["box-1-between-stages"] / "jobs" / "extract.0" / "state.json").exists()

    as_host(monkeypatch, tmp_path, "gpu-box-1")
    assert prune_runs(workdir, keep=1)["removed"] == ["box-1-between-stages"]  # its own old run


def test_a_run_whose_owner_json_cannot_be_read_is_kept_naming_it(tmp_path):
    """Which host made it cannot be told: kept for a person to look at, never removed on a guess."""
    workdir = tmp_path / "work"
    old = make_run(workdir, "old", age_s=1000)
    make_run(workdir, "new", age_s=0)
    (old / "owner.json").write_text("{not json")
    outcome = prune_runs(workdir, keep=1)
    assert outcome["removed"] == [] and old.is_dir()
    reason = outcome["kept_beyond_keep"]["old"]
    assert reason.startswith("its owner.json is not JSON: which host's it is cannot be told"), reason
