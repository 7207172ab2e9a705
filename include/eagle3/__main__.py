"""Command line of the box side: `python -m eagle3 <command> ...`. Each command: parse, load, call one function.

Stages read everything from the run config (`--config RUN_DIR/config.json`); no user value is ever
passed on a command line except paths.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import tokenize
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.contracts import STALE_AFTER_S, Exit

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger("eagle3")

# Each command imports what it runs inside its own function: `job poll`, which the trigger runs every few seconds for
# hours, and `--help` must not pay for torch, transformers or pydantic.


def load_config(path: str):
    """The run config as `init` wrote it, the target's facts resolved: one read, one validation. Imported here, not
    at the top: `job poll`, which the trigger runs every few seconds for hours, must not pay for pydantic."""
    from eagle3.config import ConfigError, load_run_config

    cfg = load_run_config(path)
    if cfg.target.num_hidden_layers is None:
        raise ConfigError(
            path,
            "the target's facts are not filled in",
            "write the run's config with `python -m eagle3 init --config FILE` first, which resolves them",
        )
    return cfg


def cmd_make_tiny_target(args) -> None:
    from eagle3.demo.tiny_target import TinyTargetSpec, build

    given = {name: getattr(args, name) for name in ("hidden_size", "num_layers", "train_steps", "num_prompts", "seed")}
    spec = TinyTargetSpec(moe=not args.dense, **{name: value for name, value in given.items() if value is not None})
    print(build(Path(args.dir), spec))


def cmd_init(args) -> None:
    from eagle3.config import ConfigError, parse_run_config, write_run_config
    from eagle3.jobs.runowner import AirflowRun, claimed
    from eagle3.target import resolve_target_facts

    if (args.airflow_dag_id is None) != (args.airflow_run_id is None):
        raise ConfigError(
            "--airflow-dag-id, --airflow-run-id",
            "they name the Airflow run together",
            "give both, or neither (init by hand)",
        )
    owner = (
        AirflowRun(args.airflow_dag_id, args.airflow_run_id, args.triggered_by, args.redo_from)
        if args.airflow_dag_id is not None
        else None
    )
    source = "stdin" if args.config == "-" else args.config
    try:
        draft = json.loads(sys.stdin.read() if args.config == "-" else Path(args.config).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(source, f"cannot read it as JSON ({err})", "give a JSON object of run fields") from None
    from eagle3.data.identity import attach_store

    cfg = resolve_target_facts(parse_run_config(draft, source))
    warn_of_served_config_gaps(cfg)
    warn_of_rope_not_carried(cfg)
    with claimed(cfg.run_dir, owner):  # another Airflow run's directory is refused before anything is written
        path = write_run_config(cfg)
        attach_store(cfg)  # RUN_DIR/hidden_states -> {workdir}/stores/<capture key>, fixed now for every later try
    print(path)


def warn_of_rope_not_carried(cfg: RunConfig) -> None:
    """drafter.rope_scaling "none" on a target that scales its RoPE: say what is not carried (a choice, not an error:
    a drafter that only ever drafts at short context may do without)."""
    from eagle3.target import read_text_config, target_rope

    scaling = target_rope(read_text_config(cfg.target.model_path))[1]
    if scaling and cfg.drafter.rope_scaling == "none":
        logging.getLogger("eagle3.init").warning(
            "drafter.rope_scaling is none: the target scales its RoPE (%s), the drafter will not; it is trained and "
            "served with plain theta %s, so at long contexts its positions mean other rotations than the target's",
            scaling,
            cfg.drafter.rope_theta,
        )


def warn_of_served_config_gaps(cfg: RunConfig) -> None:
    """A target config.json that SGLang or vLLM would not load (or would route differently): say so at init, naming
    the fields, rather than when a server fails to start hours later. A warning: training needs none of them."""
    from eagle3.engines import served_config_gaps
    from eagle3.target import read_architecture, read_text_config

    gaps = served_config_gaps(read_text_config(cfg.target.model_path), read_architecture(cfg.target.model_path))
    if gaps:
        logging.getLogger("eagle3.init").warning(
            "%s/config.json lacks what the serving engines read (SGLang, vLLM): %s. Serving the target (generate, "
            "evaluate with backend server, benchmark) will fail or differ from transformers; add them as the model's "
            'release has them (DeepSeek-V3 and Kimi-K2.5: topk_method "noaux_tc", scoring_func "sigmoid", '
            "moe_layer_freq 1)",
            cfg.target.model_path,
            "; ".join(f"{name}: {why}" for name, why in gaps.items()),
        )


def cmd_config_schema(args) -> None:
    from eagle3.config import RunConfig

    print(json.dumps(RunConfig.model_json_schema(), indent=2))


def cmd_extract(args) -> None:
    from eagle3.stages.extract import run_extract

    cfg = load_config(args.config)
    num_shards = args.num_shards or cfg.extract.num_shards
    if args.shard is not None:
        print(json.dumps(run_extract(cfg, args.shard, num_shards, args.gpu_group), indent=2))
        return
    # By hand, without --shard: every shard in turn on this GPU group (the DAG runs them in parallel).
    results = []
    for shard in range(num_shards):
        if num_shards > 1:
            log.info("extract: shard %d of %d (no --shard given: extracting every shard in turn)", shard, num_shards)
        results.append(run_extract(cfg, shard, num_shards, args.gpu_group))
    print(json.dumps(results[0] if num_shards == 1 else results, indent=2))


# Stages that take only the run config: name -> (module, function). Each prints its result as JSON on stdout (its
# log goes to stderr); its --help is its module's docstring (stage_help).
STAGES = {
    "generate": ("eagle3.stages.generate", "run_generate"),
    "vocab": ("eagle3.stages.vocab", "run_vocab"),
    "train": ("eagle3.stages.train", "run_train"),
    "export": ("eagle3.stages.export", "run_export"),
    "evaluate": ("eagle3.stages.evaluate", "run_evaluate"),
    "benchmark": ("eagle3.stages.benchmark", "run_benchmark"),
}


def stage_help(module: str) -> tuple[str, str]:
    """(one line, the rest) of a stage module's docstring, the one place a stage is described. Read from the source
    without importing the module: every command builds this parser, `job poll` every few seconds, and must not load
    torch for it."""
    with open(importlib.util.find_spec(module).origin, "rb") as source:
        for token in tokenize.tokenize(source.readline):
            if token.type == tokenize.STRING:
                first, _, rest = inspect.cleandoc(ast.literal_eval(token.string)).partition("\n")
                return first.rstrip("."), rest.strip()
            if token.type not in (tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                break
    raise RuntimeError(f"{module} has no docstring: a stage's --help is its docstring")


def cmd_stage(args) -> None:
    if args.command == "train":
        from eagle3.stages.train import launch_command

        launch = launch_command(load_config(args.config), args.config)
        if launch is not None:  # several ranks: become torchrun, which runs this command once per rank
            os.execvpe(launch[0][0], launch[0], launch[1])
    module, function = STAGES[args.command]
    run = getattr(importlib.import_module(module), function)
    options = {"hold_promotion": True} if getattr(args, "hold_promotion", False) else {}
    result = run(load_config(args.config), **options)
    if result:  # under torchrun only rank 0 returns a summary
        print(json.dumps(result, indent=2))


def cmd_store_verify(args) -> None:
    from eagle3.data.store import verify

    print(json.dumps(verify(args.dir), indent=2))


def cmd_store_digest(args) -> None:
    from eagle3.data.store import digest

    print(digest(args.dir))


def cmd_store_gc(args) -> None:
    from eagle3.box.retention import gc_stores

    print(json.dumps(gc_stores(args.workdir, args.dry_run), indent=2))


def cmd_runs_prune(args) -> None:
    from eagle3.box.retention import prune_runs

    print(json.dumps(prune_runs(args.workdir, args.keep, args.dry_run, args.keep_proposals_h * 3600), indent=2))


def cmd_lineage_check(args) -> None:
    from eagle3.stages.promote import check_inputs

    print(json.dumps(check_inputs(load_config(args.config)), indent=2))


def cmd_lineage_promote(args) -> None:
    from eagle3.stages.promote import promote_held

    print(json.dumps(promote_held(load_config(args.config), args.approved_by, args.approved_files), indent=2))


def cmd_report(args) -> None:
    from eagle3.box.reportfiles import ReportFileRefused, manifest_command

    try:
        result = manifest_command(args.run_dir, args.name or [], plots=args.plots)
    except ReportFileRefused as err:  # the run directory is a link, not absolute, or missing
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(Exit.REFUSED) from None
    print(json.dumps(result))


def cmd_box_info(args) -> None:
    from eagle3.box.facts import box_info

    print(json.dumps(box_info(require=args.require or (), nvidia_smi=args.nvidia_smi), indent=2))


def cmd_box_gpus(args) -> None:
    from eagle3.box.facts import gpu_report, mark_job_processes

    report = gpu_report(args.nvidia_smi)
    if args.jobs_dir:
        mark_job_processes(report, args.jobs_dir)
    print(json.dumps(report, indent=2))


def cmd_box_disk(args) -> None:
    from eagle3.box.facts import disk_estimate

    print(json.dumps(disk_estimate(load_config(args.config), args.margin), indent=2))


def cmd_job(args) -> None:
    from eagle3.jobs import job, jobdir, supervisor
    from eagle3.jobs.runowner import AirflowRun

    if args.job_command == "supervise":
        supervisor.supervise(args.jobs_dir, args.key)
        return
    if args.job_command == "start":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        try:
            first_s = args.first_progress_timeout_s or args.stall_timeout_s
            stall = supervisor.StallLimits(first_s, args.stall_timeout_s) if args.stall_timeout_s else None
            if (args.airflow_dag_id is None) != (args.airflow_run_id is None):
                raise jobdir.JobError(
                    "--airflow-dag-id and --airflow-run-id name the Airflow run together: give both, or neither"
                )
            owner = AirflowRun(args.airflow_dag_id, args.airflow_run_id) if args.airflow_dag_id is not None else None
            result = job.start_job(
                args.jobs_dir,
                args.key,
                argv,
                args.heartbeat_s,
                args.stale_after_s,
                args.pass_env,
                stall,
                args.redo,
                args.set_aside,
                owner,
            )
        except job.ForeignJob as err:  # another host runs it: no retry from here helps while it does
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(Exit.FOREIGN) from None
        except job.JobLaunchError as err:  # not a usage error: a retry may well succeed
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(Exit.FAILED) from None
    elif args.job_command == "poll":
        if args.from_try_start or (args.stream and args.log_offset is None):
            offset = None  # the try's first line, or the stream's cursor
        else:
            offset = args.log_offset or 0
        result = job.poll_job(args.jobs_dir, args.key, offset, args.max_log_bytes, args.stale_after_s, args.stream)
    else:
        result = job.kill_job(args.jobs_dir, args.key, args.grace_s, args.detach)
        print(json.dumps(result))
        # Refused, and nothing records the job as over (state.json unreadable, or the kernel said no): the job may
        # run on, and whoever asked for the kill must hear it.
        if result["refused"] and (result["state"] or {}).get("status", "running") == "running":
            print(f"error: job {args.key} was not killed: {result['refused']}", file=sys.stderr)
            raise SystemExit(Exit.FAILED)
        return
    print(json.dumps(result))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-tiny-target", help="build the tiny DeepSeek-V3-shaped target (no download)")
    p.add_argument("dir", help="output directory; reused if already built with the same arguments")
    # Defaults: eagle3.demo.tiny_target.TinyTargetSpec's (the demo's and the tests' target).
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--dense", action="store_true", help="dense MLP in every layer (no MoE); for I/O benchmarks")
    p.add_argument("--train-steps", type=int, help="0: untrained weights (enough for I/O benchmarks)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--seed", type=int)
    p.set_defaults(func=cmd_make_tiny_target)

    p = sub.add_parser(
        "init",
        help="validate a run config, fill in the target's facts, write RUN_DIR/config.json",
        description="With --airflow-dag-id and --airflow-run-id (the DAG's write_config task), the run "
        "directory belongs to that Airflow run, recorded in RUN_DIR/owner.json: its retries and clears "
        "go on in it, another run is refused (exit 2) naming the owner, except a redo (--redo-from) "
        "triggered by the owner's user, which takes it over (eagle3/jobs/runowner.py).",
    )
    p.add_argument("--config", required=True, help="a run config JSON (see `config schema`); - reads stdin")
    p.add_argument("--airflow-dag-id", default=None, metavar="DAG_ID", help="the DAG of the Airflow run that inits")
    p.add_argument("--airflow-run-id", default=None, metavar="RUN_ID", help="that Airflow run's id")
    p.add_argument(
        "--triggered-by",
        default=None,
        metavar="USER",
        help="the user who triggered that run (none: the scheduler, an Asset or the CLI)",
    )
    p.add_argument(
        "--redo-from",
        default=None,
        metavar="STAGE",
        help="that run redoes this stage and every later one (box.redo_from)",
    )
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("config", help="run-config tools")
    config_sub = p.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    config_sub.add_parser("schema", help="print the run config's JSON schema").set_defaults(func=cmd_config_schema)

    help_text, description = stage_help("eagle3.stages.extract")
    p = sub.add_parser(
        "extract", help=help_text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="RUN_DIR/config.json")
    p.add_argument(
        "--shard",
        type=int,
        default=None,
        help="which shard this process extracts (0-based); default: every shard, one after the other",
    )
    p.add_argument("--num-shards", type=int, default=None, help="default: extract.num_shards from the config")
    p.add_argument(
        "--gpu-group",
        type=int,
        default=0,
        help="which of the box's GPU groups the shard uses: GPU K (hf backend, extract.device auto) or "
        "GPUs K*tp_size.. (sglang backend). The DAG numbers each box's shards 0, 1, ...; default 0",
    )
    p.set_defaults(func=cmd_extract)

    for name, (module, _) in STAGES.items():
        help_text, description = stage_help(module)
        p = sub.add_parser(
            name, help=help_text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.add_argument("--config", required=True, help="RUN_DIR/config.json")
        if name == "evaluate":
            p.add_argument(
                "--hold-promotion",
                action="store_true",
                help="decide on the promotion but leave the switch to `lineage promote`, which the DAG "
                "runs once a person approved (the deployment's approve_promotion)",
            )
        p.set_defaults(func=cmd_stage)

    p = sub.add_parser("store", help="inspect a hidden-state store")
    store_sub = p.add_subparsers(dest="store_command", required=True, metavar="SUBCOMMAND")
    v = store_sub.add_parser(
        "verify",
        help="check every chunk against the manifest (an fp8 store's scales and payload too); print JSON stats",
    )
    v.add_argument("dir", help="the store directory (RUN_DIR/hidden_states)")
    v.set_defaults(func=cmd_store_verify)
    d = store_sub.add_parser(
        "digest",
        help="sha256 over all samples in id order, as stored (an fp8 store's scales "
        "too): equal digests = equal content",
    )
    d.add_argument("dir", help="the store directory (RUN_DIR/hidden_states)")
    d.set_defaults(func=cmd_store_digest)
    g = store_sub.add_parser(
        "gc",
        help="remove the shared stores and answers caches no run directory links to",
        description="Never run by the DAG: a store is what makes the next rerun cheap. Prune "
        "run directories first (runs prune), then collect what none of the rest uses. Removes "
        "only directories with the project's key.json (its fields hash to the name), never "
        "through a link: a symlinked work directory, stores/, generated/ or runs/ is refused "
        "(exit 2), and entries that are not stores are listed, not removed.",
    )
    g.add_argument("--workdir", required=True)
    g.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    g.set_defaults(func=cmd_store_gc)

    p = sub.add_parser("runs", help="the run directories of a work directory")
    runs_sub = p.add_subparsers(dest="runs_command", required=True, metavar="SUBCOMMAND")
    r = runs_sub.add_parser(
        "prune",
        help="remove run directories beyond the newest --keep, except promoted "
        "drafters', another host's, those with a live job and those awaiting approval",
        description="A run directory is one whose config.json names it (workdir and run_name, "
        "compared resolved); other entries of runs/ are listed, never removed. One whose "
        "owner.json records that another host made it (boxes sharing a work directory) is kept: "
        "only that host's prune removes it. A symlinked work directory, runs/ or drafters/, and a "
        "promotion.json that names no run directory, are refused (exit 2), naming the path.",
    )
    r.add_argument("--workdir", required=True)
    r.add_argument("--keep", type=int, required=True, help="how many of the newest run directories to keep")
    r.add_argument(
        "--keep-proposals-h",
        type=float,
        default=0.0,
        metavar="H",
        help="also keep a run whose promotion awaits approval, for H hours after evaluate proposed it "
        "(the DAG passes the settings' approval_timeout_h; default 0: not kept for that)",
    )
    r.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    r.set_defaults(func=cmd_runs_prune)

    p = sub.add_parser("lineage", help="the drafters of this run's lineage ({workdir}/drafters/<lineage>)")
    lineage_sub = p.add_subparsers(dest="lineage_command", required=True, metavar="SUBCOMMAND")
    c = lineage_sub.add_parser(
        "check",
        help="after vocab: has anything the drafter is made from changed since the current drafter? JSON",
        description="Compares this run's training inputs (its samples of the store, the vocab mapping, the train, "
        "drafter and export settings, the seed, the split rule and the pinned evaluation set) with those of the "
        "lineage's current drafter. The DAG skips training when nothing changed.",
    )
    c.add_argument("--config", required=True, help="RUN_DIR/config.json")
    c.set_defaults(func=cmd_lineage_check)
    c = lineage_sub.add_parser(
        "promote",
        help="after an approval: make the promotion `evaluate --hold-promotion` held; JSON",
        description="Switches the lineage's current drafter to this run's, as evaluate decided, unless another run "
        "promoted one since (then nothing is switched, and the report says so). Promotes only the bytes evaluate "
        "measured: the copy in versions/ is checked against the proposal's digests before the switch. Rewrites the "
        "promotion in RUN_DIR/evaluate/report.json; promotion.json records who approved. Safe to rerun (then it says "
        '"already current").',
    )
    c.add_argument("--config", required=True, help="RUN_DIR/config.json")
    c.add_argument(
        "--approved-by",
        required=True,
        metavar="USER",
        help="the user who approved the promotion, as the caller verified it (the DAG's approval task)",
    )
    c.add_argument(
        "--approved-files",
        required=True,
        metavar="SHA256",
        help="the drafter files the approval named (the held promotion's drafter_files_sha256): a "
        "proposal.json whose files differ is refused",
    )
    c.set_defaults(func=cmd_lineage_promote)

    p = sub.add_parser(
        "report",
        help="a run's plots and reports for the control plane: regular files only, no links, capped",
        description="What the report task and the approval may read back (eagle3/box/reportfiles.py): "
        "<stage>/<name>.png and evaluate/report.json, benchmark/benchmark.json, under the real run directory, "
        "never through a symlink, at most 8 MiB each. JSON on stdout; a refusal exits 2 naming the path. The "
        "control plane fetches the files `manifest` names by SFTP and refuses bytes whose size or sha256 differ.",
    )
    report_sub = p.add_subparsers(dest="report_command", required=True, metavar="SUBCOMMAND")
    r = report_sub.add_parser(
        "manifest",
        help='which of the run\'s files the control plane may fetch: {"files": [{"name", "size", '
        '"sha256"} or {"name", "present": false} or {"name", "refused"}], "plots": [...] with --plots}; '
        "the bytes travel by SFTP and are checked against it",
    )
    r.add_argument("--run-dir", required=True)
    r.add_argument(
        "--name",
        action="append",
        help="<stage>/<name>.png, evaluate/report.json or benchmark/benchmark.json (repeatable)",
    )
    r.add_argument("--plots", action="store_true", help="also list the run's plots: <stage>/<name>.png")
    r.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "box",
        help="facts about this box as JSON (for the sensors)",
        description="Report, never judge: exit 0 whatever the box's state; the caller decides from the JSON.",
    )
    box_sub = p.add_subparsers(dest="box_command", required=True, metavar="SUBCOMMAND")
    b = box_sub.add_parser(
        "info",
        help="python, host, boot id, package versions, GPUs, torch's CUDA view (where a "
        "GPU is listed), missing packages",
    )
    b.add_argument(
        "--require", action="append", metavar="PACKAGE", help="also require this package, e.g. sglang (repeatable)"
    )
    b.add_argument("--nvidia-smi", default=None, help="path of nvidia-smi (default: found on PATH)")
    b.set_defaults(func=cmd_box_info)
    b = box_sub.add_parser("gpus", help="GPUs and their compute processes, from nvidia-smi")
    b.add_argument("--nvidia-smi", default=None, help="path of nvidia-smi (default: found on PATH)")
    b.add_argument(
        "--jobs-dir",
        default=None,
        help='tag processes of live jobs in this directory as ours ("job": key) so they are not foreign',
    )
    b.set_defaults(func=cmd_box_gpus)
    b = box_sub.add_parser("disk", help="does the run's extraction fit on its disk (tokens counted once, cached)")
    b.add_argument("--config", required=True, help="RUN_DIR/config.json")
    b.add_argument("--margin", type=float, default=1.2, help="safety factor on the hidden-state bytes")
    b.set_defaults(func=cmd_box_disk)

    p = sub.add_parser(
        "job",
        help="run a command detached from the SSH session; re-attach, poll and kill it by key",
        description="Jobs live in JOBS_DIR/KEY/ (state.json, log, spec.json, lock), private to this user (0700). "
        "Each command prints one JSON object. start is idempotent: it attaches to a live or succeeded job and "
        "relaunches a dead one; an unreadable state.json counts as dead. start exits 1 when a retry may do (the "
        "supervisor did not come up), 2 when retrying cannot help (a usage error; the run directory is another "
        "Airflow run's; a job file that is a link or another user's) and 3 when the job runs on another host "
        "sharing the work directory (neither started again nor redone from here).",
    )
    job_sub = p.add_subparsers(dest="job_command", required=True, metavar="SUBCOMMAND")
    start = job_sub.add_parser("start", help="start the job unless it is alive: job start ... -- CMD ARG...")
    poll = job_sub.add_parser("poll", help="effective status (running, dead, ...) and new log text")
    kill = job_sub.add_parser(
        "kill",
        help="SIGTERM the job's process group, SIGKILL it after the grace period",
        description="Signals the job's process group only if it is provably the job's (its supervisor leads it, in "
        'this boot, with the recorded start time); the answer\'s "signalled" says whether it got a signal and '
        '"refused" why not. Exits 1 when the job may still run: state.json unreadable, or the kernel refused.',
    )
    supervise = job_sub.add_parser("supervise")  # internal (start runs it); no help=, so --help doesn't list it
    for q in (start, poll, kill, supervise):
        q.add_argument("--jobs-dir", required=True, help="directory holding one subdirectory per job")
        q.add_argument("--key", required=True, help="the job's name: [A-Za-z0-9][A-Za-z0-9._-]{0,199}")
        q.set_defaults(func=cmd_job)
    for q in (start, poll):
        q.add_argument(
            "--stale-after-s",
            type=float,
            default=STALE_AFTER_S,
            help="a running job whose heartbeat is older counts as dead",
        )
    start.add_argument("--heartbeat-s", type=float, default=10.0, help="how often the supervisor updates state.json")
    start.add_argument(
        "--stall-timeout-s",
        type=float,
        default=0.0,
        help="kill the stage and fail the try when it reports no progress (eagle3.jobs.progress.beat) "
        "for this long; 0: never",
    )
    start.add_argument(
        "--first-progress-timeout-s",
        type=float,
        default=0.0,
        help="the same limit until its first progress report (model loading); default: --stall-timeout-s",
    )
    start.add_argument(
        "--pass-env",
        action="append",
        default=[],
        metavar="NAME",
        help="also pass this environment variable to the command (repeatable); beyond these it gets "
        "only an allowlist (PATH, HOME, LANG, CUDA_*, HF_*, NCCL_*, TORCH_*, EAGLE3_*, ...), and "
        "spec.json records the names, never the values",
    )
    start.add_argument(
        "--redo",
        default=None,
        metavar="NAME",
        help="run the job again from scratch once for this request NAME, even if it succeeded: its "
        "earlier tries go to redone/<time>/ in the job's directory and each --set-aside output is "
        "renamed NAME.before-redo-<time>; a later start with the same NAME attaches or resumes as usual",
    )
    start.add_argument(
        "--set-aside",
        action="append",
        default=[],
        metavar="PATH",
        help="with --redo: an output of the stage (an entry of the run directory) to rename aside",
    )
    start.add_argument(
        "--airflow-dag-id",
        default=None,
        metavar="DAG_ID",
        help="with --airflow-run-id: the Airflow run that starts the job; refused (exit 2) where the "
        "run directory holding --jobs-dir belongs to another run (RUN_DIR/owner.json)",
    )
    start.add_argument("--airflow-run-id", default=None, metavar="RUN_ID", help="that Airflow run's id")
    start.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    poll.add_argument(
        "--log-offset",
        type=int,
        default=None,
        help="byte offset to read the log from (last log_offset); default 0, or with --stream its cursor",
    )
    poll.add_argument(
        "--stream",
        default=None,
        metavar="NAME",
        help="keep this caller's place in the log on the box (cursor.json): --log-offset is recorded "
        "as how far NAME has copied the log, and without --log-offset the poll reads on from there (a "
        "caller that lost its place, such as a trigger rebuilt after a triggerer restart)",
    )
    poll.add_argument(
        "--from-try-start",
        action="store_true",
        help="read the log from the first line of the recorded try (its log_start), not --log-offset: "
        "the log holds every try",
    )
    poll.add_argument("--max-log-bytes", type=int, default=65536)
    kill.add_argument("--grace-s", type=float, default=20.0, help="time between SIGTERM and SIGKILL")
    kill.add_argument(
        "--detach",
        action="store_true",
        help='answer as soon as the SIGTERM is sent ("detached": true); a detached process holding the '
        "job's lock SIGKILLs what is left after --grace-s and records the kill",
    )
    return parser


def exit_code_for(err: Exception) -> Exit | None:
    """REFUSED: the input is wrong (a field or file, named in the message); FAILED: the server failed us, a retry may
    do; None: a bug, shown with its traceback. The error classes are imported only now, for light commands' sake."""
    from eagle3.config import ConfigError
    from eagle3.data.samples import DataError
    from eagle3.disk.hostid import HostIdError
    from eagle3.jobs.jobdir import JobError
    from eagle3.jobs.runowner import RunDirOwned
    from eagle3.model.layer_ids import LayerIdError

    if isinstance(err, (ConfigError, DataError, HostIdError, JobError, LayerIdError, RunDirOwned)):
        return Exit.REFUSED
    from eagle3.data.store import StoreBusy, StoreError  # torch-heavy
    from eagle3.engines.server import ServerError
    from eagle3.stages.generate import GenerateAborted
    from eagle3.stages.vocab import VocabError

    if isinstance(err, StoreBusy):  # a writer that does not wait (extract does): the retry finds the samples stored
        return Exit.FAILED
    if isinstance(err, (StoreError, VocabError)):
        return Exit.REFUSED
    if isinstance(err, (GenerateAborted, ServerError)):
        return Exit.FAILED
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except Exception as err:
        code = exit_code_for(err)
        if code is None:
            raise
        print(f"error: {err}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
