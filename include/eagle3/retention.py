"""What a scheduled pipeline leaves behind, removed on purpose: old run directories, then unused shared stores.

    python -m eagle3 runs prune --workdir W --keep N [--dry-run]
    python -m eagle3 store gc --workdir W [--dry-run]

A weekly run writes a run directory (checkpoints, logs, a drafter copy: hundreds of GB at Kimi scale) and
shares its hidden states in {workdir}/stores/. `runs prune` keeps the newest N run directories (by their
config.json's time) and every run directory a promoted drafter came from (its promotion.json names it), and never
one with a live job; the DAG's `retention` task runs it with the settings file's keep_runs. `store gc` removes the
stores and answers caches ({workdir}/generated/) that no remaining run directory links to: it is never run by
the DAG, because a store is what makes the next rerun cheap; a person decides when to give it up.

Light (no torch): runs on the box from the DAG in a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle3.job import DEFAULT_STALE_AFTER_S, liveness, read_state


def promoted_run_dirs(workdir: Path) -> set[Path]:
    """Run directories whose drafter is a kept version of some lineage."""
    dirs = set()
    for record in Path(workdir).glob("drafters/*/versions/*/promotion.json"):
        dirs.add(Path(json.loads(record.read_text())["run_dir"]))
    return dirs


def has_live_job(run_dir: Path) -> bool:
    for job in (run_dir / "jobs").glob("*"):
        try:
            status, _ = liveness(read_state(job), DEFAULT_STALE_AFTER_S)
        except Exception:  # noqa: BLE001 - an unreadable job: keep the run, a person looks at it
            return True
        if status == "running":
            return True
    return False


def prune_runs(workdir: str | Path, keep: int, dry_run: bool = False) -> dict:
    """Remove run directories beyond the newest `keep`, except promoted drafters' and those with a live job."""
    if keep < 1:
        from eagle3.config import ConfigError

        raise ConfigError(f"--keep {keep}: keep at least the newest run directory (1)")
    workdir = Path(workdir)
    runs = sorted((d for d in (workdir / "runs").glob("*") if (d / "config.json").is_file()),
                  key=lambda d: (d / "config.json").stat().st_mtime, reverse=True)
    promoted = promoted_run_dirs(workdir)
    removed, kept_for = [], {}
    for run_dir in runs[keep:]:
        if run_dir in promoted:
            kept_for[run_dir.name] = "its drafter is a promoted version"
        elif has_live_job(run_dir):
            kept_for[run_dir.name] = "a job of it is running"
        else:
            removed.append(run_dir.name)
            if not dry_run:
                shutil.rmtree(run_dir)
    return {"runs": len(runs), "keep": keep, "removed": sorted(removed), "kept_beyond_keep": kept_for,
            "dry_run": dry_run}


def linked(workdir: Path, link_glob: str) -> set[str]:
    return {link.resolve().name for link in workdir.glob(link_glob) if link.is_symlink()}


def gc_stores(workdir: str | Path, dry_run: bool = False) -> dict:
    """Remove the stores and answers caches that no run directory links to (RUN_DIR/hidden_states,
    RUN_DIR/generate/parts)."""
    workdir = Path(workdir)
    result = {"dry_run": dry_run}
    for kind, root, link_glob in (("stores", workdir / "stores", "runs/*/hidden_states"),
                                  ("generated", workdir / "generated", "runs/*/generate/parts")):
        used = linked(workdir, link_glob)
        unused = sorted(d.name for d in root.glob("*") if d.is_dir() and d.name not in used)
        for name in unused:
            if not dry_run:
                shutil.rmtree(root / name)
        result[kind] = {"kept": sorted(used), "removed": unused}
    return result
