"""What a scheduled pipeline leaves behind, removed on purpose: old run directories, then unused shared stores.

    python -m eagle3 runs prune --workdir W --keep N [--dry-run]
    python -m eagle3 store gc --workdir W [--dry-run]

A weekly run writes a run directory (checkpoints, logs, a drafter copy: hundreds of GB at Kimi scale) and
shares its hidden states in {workdir}/stores/. `runs prune` keeps the newest N run directories (by their
config.json's time) and every run directory a promoted drafter came from (its promotion.json names it), and never
one with a live job, on this host or recorded running on another (a work directory two boxes share), nor one whose
owner.json says another host made it (eagle3.jobs.runowner: a run of that box between two stages has no live job, and
only its own box's retention prunes it); the DAG's `retention` task runs it with the settings file's keep_runs. A run
directory no Airflow run owns (`eagle3 init` by hand) is any host's to prune. `store gc` removes the stores
and answers caches ({workdir}/generated/) that no remaining run directory links to: it is never run by the DAG,
because a store is what makes the next rerun cheap; a person decides when to give it up.

The work directory may be one a trigger chose, and anyone who can write there can put things in it: what is
removed must carry the project's own marker, and nothing is removed through a symbolic link.
  - A run directory is {workdir}/runs/<name>/ holding a config.json (a regular file) whose workdir and run_name
    name that very directory, compared resolved: a folder that merely holds some config.json is not one.
  - A store or answers cache is {workdir}/stores/<key>/ or {workdir}/generated/<key>/ holding a key.json (a
    regular file) whose fields hash to <key> (eagle3.data.identity.capture_key), as every one the project makes does.
  - The work directory and its runs/, stores/, generated/ and drafters/ must not be symbolic links (refused, with
    the path named: what would be removed is the link's target); an entry that is a link is never removed, and
    every entry that is not the project's is listed with the reason, never removed.
  - Paths are compared resolved: a promotion.json naming its run directory with a trailing slash, `//`, or through
    a link protects it all the same. A promotion.json that cannot be read refuses the prune, naming it: which run
    directory it protects is then unknown.
Removal itself opens the parent without following a link, and shutil.rmtree refuses a link in its way, so a link
swapped in after the checks removes nothing either.

Light (no torch): runs on the box from the DAG in a second.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from eagle3.config import ConfigError
from eagle3.contracts import STALE_AFTER_S
from eagle3.data.identity import capture_key
from eagle3.disk.fsutil import remove_tree_in
from eagle3.disk.hostid import read_host_id
from eagle3.disk.layout import (
    CONFIG,
    DRAFTERS,
    GENERATED,
    GENERATED_PARTS,
    HIDDEN_STATES,
    JOBS,
    KEY_RECORD,
    OWNER,
    PROMOTION_RECORD,
    REPORT,
    RUNS,
    STORES,
    VERSIONS,
    run_dir_of,
)
from eagle3.jobs.jobdir import read_state
from eagle3.jobs.processes import liveness
from eagle3.jobs.runowner import owner_host

MARKER_MAX_BYTES = 1 << 20  # a run's config.json, a store's key.json or a promotion.json: a few KB each


class RetentionRefused(ConfigError):
    """A work directory retention will not remove anything from; the message names the path and the fix."""


def refuse_links(workdir: Path, *roots: str) -> None:
    """Refuse a work directory, or a root under it, that is a symbolic link."""
    for path in (workdir, *(workdir / root for root in roots)):
        if path.is_symlink():
            raise RetentionRefused(
                path,
                f"a symbolic link (to {os.readlink(path)}); retention removes nothing through a link, for what it "
                "removed would be the link's target; nothing was removed",
                f"give --workdir as the real directory, and make {', '.join(f'{r}/' for r in roots)} real "
                "directories in it",
            )


def read_marker(path: Path) -> tuple[object, str | None]:
    """(parsed JSON, None) of a marker file, or (None, why it is no marker): it must be a regular file (not a link)
    of at most MARKER_MAX_BYTES holding JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, f"no {path.name}"
    except OSError as err:
        return None, f"its {path.name} cannot be opened ({err.strerror}; a symbolic link?)"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, f"its {path.name} is not a regular file"
        data = f.read(MARKER_MAX_BYTES + 1)
    if len(data) > MARKER_MAX_BYTES:
        return None, f"its {path.name} is over {MARKER_MAX_BYTES} bytes"
    try:
        return json.loads(data.decode("utf-8")), None
    except (UnicodeDecodeError, ValueError):
        return None, f"its {path.name} is not JSON"


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `run_dir` (an entry of {workdir}/runs/) is not a run directory the project made, or None."""
    if run_dir.is_symlink():
        return "a symbolic link, not a run directory"
    if not run_dir.is_dir():
        return "not a directory"
    config, problem = read_marker(run_dir / CONFIG)
    if problem:
        return problem
    if not (
        isinstance(config, dict)
        and isinstance(config.get("workdir"), str)
        and isinstance(config.get("run_name"), str)
        and os.path.isabs(config["workdir"])
    ):
        return "its config.json is not a run config (no absolute workdir and run_name)"
    named = run_dir_of(config["workdir"], config["run_name"])
    if named.resolve() != run_dir.resolve():
        return f"its config.json names another run directory ({named})"
    return None


def promoted_run_dirs(workdir: Path) -> set[Path]:
    """Run directories (resolved) whose drafter is a kept version of some lineage. Refuses (RetentionRefused) a
    promotion.json that names none: the run directory it protects is unknown."""
    dirs = set()
    for record_path in sorted(Path(workdir).glob(f"{DRAFTERS}/*/{VERSIONS}/*/{PROMOTION_RECORD}")):
        record, problem = read_marker(record_path)
        if problem is None and isinstance(record, dict):
            if isinstance(record.get("run_dir"), str) and os.path.isabs(record["run_dir"]):
                dirs.add(Path(record["run_dir"]).resolve())
                continue
            if isinstance(record.get("run"), str) and record["run"]:  # (a record that names only the run)
                dirs.add(run_dir_of(workdir, record["run"]).resolve())
                continue
            problem = "it names no run directory (run_dir) or run"
        raise RetentionRefused(
            record_path,
            f"{problem or 'not a JSON object'}; it should name the run directory its drafter came from, which must "
            "never be pruned; nothing was removed",
            "restore it (or remove its version directory), then prune again",
        )
    return dirs


def live_job(run_dir: Path) -> str | None:
    """Why the run has a job that may be running, or None: one alive on this host, one recorded running on another
    host (two boxes sharing the work directory: this host cannot tell it is dead, so it never counts it so), or one
    whose state cannot be read (a person looks at it)."""
    for job in sorted((run_dir / JOBS).glob("*")):
        try:
            status, _ = liveness(read_state(job), STALE_AFTER_S)
        except Exception:  # noqa: BLE001 - an unreadable job: keep the run, a person looks at it
            return f"the state of job {job.name} cannot be read"
        if status == "running":
            return "a job of it is running"
        if status == "foreign":
            return f"job {job.name} of it runs on another host"
    return None


def other_hosts_run(run_dir: Path) -> str | None:
    """Why the run directory is not this host's to remove, or None: its owner.json records that another host made it
    (several boxes sharing the work directory), or cannot be read (whose it is cannot be told: a person looks at it).
    None also where no owner is recorded (init by hand)."""
    if not (run_dir / OWNER).exists() and not (run_dir / OWNER).is_symlink():
        return None
    record, problem = read_marker(run_dir / OWNER)
    runs = record.get("runs") if isinstance(record, dict) else None
    if problem or not (isinstance(runs, list) and runs and all(isinstance(entry, dict) for entry in runs)):
        return (
            f"{problem or 'its owner.json is not a record of the Airflow runs that wrote it'}: which host's it is "
            "cannot be told; look at it, then remove the directory by hand if it is to go"
        )
    host = owner_host(runs)
    if host["host_id"] == read_host_id():
        return None
    return (
        f"owned by host {host['host']!r} (host id {host['host_id']}), which made it: only that host's retention "
        "prunes it (if that host is gone for good, remove the directory by hand)"
    )


def awaits_approval(run_dir: Path, hold_s: float) -> bool:
    """The run's evaluate holds a promotion for approval (approve_promotion: the promotion DAG asks a person after
    the run ended) proposed less than `hold_s` ago; after that the approval has timed out, and the run goes as any."""
    report_path = run_dir / REPORT
    report, problem = read_marker(report_path)
    if problem or not isinstance(report, dict) or not isinstance(report.get("promotion"), dict):
        return False
    return report["promotion"].get("pending_approval") is True and time.time() - report_path.stat().st_mtime < hold_s


def prune_runs(workdir: str | Path, keep: int, dry_run: bool = False, proposal_hold_s: float = 0) -> dict:
    """Remove run directories beyond the newest `keep`, except promoted drafters', another host's (other_hosts_run),
    those with a live job and those whose proposal may still be approved (proposed less than `proposal_hold_s` ago);
    "kept_beyond_keep" says why each of those stays. Every run directory counts towards `keep`, another host's too
    (the disk is one). "not_run_dirs" lists the entries of runs/ that are not the project's run directories, each
    with the reason: never removed, never counted."""
    if keep < 1:
        raise ConfigError("--keep", f"{keep} would keep no run directory", "keep at least the newest (1)")
    workdir = Path(workdir)
    refuse_links(workdir, RUNS, DRAFTERS)
    runs_root = workdir / RUNS
    runs, not_run_dirs = [], {}
    for entry in sorted(runs_root.iterdir()) if runs_root.is_dir() else []:
        problem = run_dir_problem(entry)
        if problem:
            not_run_dirs[entry.name] = problem
        else:
            runs.append(entry)
    runs.sort(key=lambda d: (d / CONFIG).stat().st_mtime, reverse=True)
    promoted = promoted_run_dirs(workdir)
    removed, kept_for = [], {}
    for run_dir in runs[keep:]:
        if run_dir.resolve() in promoted:
            kept_for[run_dir.name] = "its drafter is a promoted version"
        elif live := live_job(run_dir):  # (first: a job running now says more than who made the run)
            kept_for[run_dir.name] = live
        elif others := other_hosts_run(run_dir):
            kept_for[run_dir.name] = others
        elif awaits_approval(run_dir, proposal_hold_s):
            kept_for[run_dir.name] = "its drafter awaits approval"
        else:
            removed.append(run_dir.name)
            if not dry_run:
                remove_tree_in(runs_root, run_dir.name)
    return {
        "runs": len(runs),
        "keep": keep,
        "removed": sorted(removed),
        "kept_beyond_keep": kept_for,
        "not_run_dirs": not_run_dirs,
        "dry_run": dry_run,
    }


def store_problem(directory: Path) -> str | None:
    """Why `directory` (an entry of stores/ or generated/) is not a store or answers cache the project made."""
    if directory.is_symlink():
        return "a symbolic link, not a store"
    if not directory.is_dir():
        return "not a directory"
    fields, problem = read_marker(directory / KEY_RECORD)
    if problem:
        return problem
    if not isinstance(fields, dict) or capture_key(fields) != directory.name:
        return f"its key.json does not hash to its name {directory.name!r}"
    return None


def linked(workdir: Path, link_glob: str) -> set[Path]:
    """Where the links matching `link_glob` lead, resolved."""
    return {link.resolve() for link in workdir.glob(link_glob) if link.is_symlink()}


def gc_stores(workdir: str | Path, dry_run: bool = False) -> dict:
    """Remove the stores and answers caches that no run directory links to (RUN_DIR/hidden_states,
    RUN_DIR/generate/parts). Per kind: "kept" (linked to), "removed", and "not_stores": entries that are not the
    project's stores, each with the reason, never removed."""
    workdir = Path(workdir)
    refuse_links(workdir, RUNS, STORES, GENERATED)
    result = {"dry_run": dry_run}
    for kind, link_glob in ((STORES, f"{RUNS}/*/{HIDDEN_STATES}"), (GENERATED, f"{RUNS}/*/{GENERATED_PARTS}")):
        root = workdir / kind
        used = linked(workdir, link_glob)
        kept, unused, not_stores = [], [], {}
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink() and entry.resolve() in used:
                kept.append(entry.name)
            elif problem := store_problem(entry):
                not_stores[entry.name] = problem
            else:
                unused.append(entry.name)
        for name in unused:
            if not dry_run:
                remove_tree_in(root, name)
        result[kind] = {"kept": kept, "removed": unused, "not_stores": not_stores}
    return result
