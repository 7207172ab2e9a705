"""Retention on the box: old run directories pruned (never a promoted drafter's, never a live one), unused stores
collected only when asked."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from eagle3.retention import gc_stores, prune_runs
from tests.conftest import run_eagle3


def make_run(workdir: Path, name: str, age_s: float, store: str | None = None) -> Path:
    run_dir = workdir / "runs" / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}\n")
    then = time.time() - age_s
    os.utime(run_dir / "config.json", (then, then))
    if store:
        (workdir / "stores" / store).mkdir(parents=True, exist_ok=True)
        (run_dir / "hidden_states").symlink_to(Path("..", "..", "stores", store))
    return run_dir


def test_prune_keeps_the_newest_and_every_promoted_or_live_run(tmp_path):
    workdir = tmp_path / "work"
    runs = {name: make_run(workdir, name, age_s=age) for name, age in
            [("week-1", 4000), ("week-2", 3000), ("week-3", 2000), ("week-4", 1000), ("week-5", 0)]}
    version = workdir / "drafters" / "lineage" / "versions" / "week-1-0123abcd"
    version.mkdir(parents=True)
    (version / "promotion.json").write_text(json.dumps({"run_dir": str(runs["week-1"])}))
    run_eagle3("job", "start", "--jobs-dir", str(runs["week-2"] / "jobs"), "--key", "train", "--", "sleep", "60")
    try:
        outcome = prune_runs(workdir, keep=2)
    finally:
        run_eagle3("job", "kill", "--jobs-dir", str(runs["week-2"] / "jobs"), "--key", "train", "--grace-s", "1")
    assert outcome["removed"] == ["week-3"]
    assert outcome["kept_beyond_keep"] == {"week-1": "its drafter is a promoted version",
                                           "week-2": "a job of it is running"}
    assert sorted(p.name for p in (workdir / "runs").iterdir()) == ["week-1", "week-2", "week-4", "week-5"]
    assert prune_runs(workdir, keep=1, dry_run=True)["removed"] == ["week-2", "week-4"]  # the job is gone now
    assert (runs["week-4"] / "config.json").exists()  # dry run
    with pytest.raises(ValueError, match="keep at least the newest"):
        prune_runs(workdir, keep=0)


def test_store_gc_removes_only_what_no_run_links_to(tmp_path):
    workdir = tmp_path / "work"
    make_run(workdir, "kept", 0, store="aaaa")
    make_run(workdir, "gone", 10, store="bbbb")
    (workdir / "stores" / "orphan").mkdir()
    assert gc_stores(workdir, dry_run=True)["stores"] == {"kept": ["aaaa", "bbbb"], "removed": ["orphan"]}
    assert (workdir / "stores" / "orphan").exists()
    assert prune_runs(workdir, keep=1)["removed"] == ["gone"]  # first the run directories, then what they used
    result = json.loads(run_eagle3("store", "gc", "--workdir", str(workdir)).stdout)
    assert result["stores"] == {"kept": ["aaaa"], "removed": ["bbbb", "orphan"]}
    assert sorted(p.name for p in (workdir / "stores").iterdir()) == ["aaaa"]
