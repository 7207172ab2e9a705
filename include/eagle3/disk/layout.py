"""Where everything lives in a work directory, a run directory and a lineage: every path named once, here.

    {workdir}/
      runs/<run_name>/         one run directory per run (RUNS)
      stores/<key>/            hidden-state stores, shared by runs with the same capture (STORES)
      generated/<key>/         regenerated answers, shared by runs with the same generation (GENERATED)
      drafters/<lineage key>/  a lineage: its pinned evaluation set and promoted drafters (DRAFTERS)

Paths inside a run directory or a lineage are relative POSIX strings: `Path(run_dir) / REPORT` on the box,
`f"{plan.run_dir}/{REPORT}"` in the control plane, which names the box's paths without touching them. Light (no
torch, no pydantic): the DAG and `job poll` import it.
"""

from __future__ import annotations

from pathlib import Path

# -- a work directory -------------------------------------------------------------------------------------------
RUNS, STORES, GENERATED, DRAFTERS = "runs", "stores", "generated", "drafters"

# -- a run directory, stage by stage ------------------------------------------------------------------------------
CONFIG = "config.json"  # the validated run config (`eagle3 init`); it also marks the directory as a run's
OWNER = "owner.json"  # the Airflow runs that wrote the directory, its owner last (`eagle3 init`; eagle3.jobs.runowner)
OWNER_LOCK = "owner.lock"  # held while init checks and records the owner
JOBS = "jobs"  # jobs/<key>/: the detached stage jobs (eagle3.jobs.job)
GENERATE_DIR = "generate"
CONVERSATIONS = f"{GENERATE_DIR}/conversations.jsonl"  # the regenerated conversations extract reads (generate on)
GENERATED_PARTS = f"{GENERATE_DIR}/parts"  # a link to the shared answers in {workdir}/generated/<key>
GENERATE_STATS = f"{GENERATE_DIR}/stats.json"
HIDDEN_STATES = "hidden_states"  # a link to the shared store in {workdir}/stores/<key>
EXTRACT_DIR = "extract"  # per shard: the samples it stored (run_samples_path) and its stats (run_stats_path)
SPLIT_KEYS = "split/keys.json"  # every conversation's split key (eagle3.stages.split)
MAPPING_DIR = "vocab_mapping"  # a mapping directory (eagle3.stages.vocab) holds the three files named next
D2T_FILE, T2D_FILE, MAPPING_META = "d2t.npy", "t2d.npy", "meta.json"
MAPPING_D2T, MAPPING_T2D = f"{MAPPING_DIR}/{D2T_FILE}", f"{MAPPING_DIR}/{T2D_FILE}"
TRAIN_DIR = "train"
CHECKPOINTS = f"{TRAIN_DIR}/checkpoints"  # step-NNNNNN/ (eagle3.records.checkpoint)
TRAIN_INIT = f"{TRAIN_DIR}/init"  # the weights a warm start begins from: init.json, model.safetensors
TRAIN_METRICS = f"{TRAIN_DIR}/metrics.jsonl"
TRAIN_SUMMARY = f"{TRAIN_DIR}/summary.json"
TRAIN_TENSORBOARD = f"{TRAIN_DIR}/tensorboard"
LOSS_PLOT, ACCURACY_PLOT = f"{TRAIN_DIR}/loss.png", f"{TRAIN_DIR}/accuracy.png"
DRAFTER_DIR = "drafter"  # the exported drafter: a drafter directory, below (eagle3.stages.export)
EVALUATE_DIR = "evaluate"
REPORT = f"{EVALUATE_DIR}/report.json"  # evaluate's figures and the promotion decision
PROPOSAL = f"{EVALUATE_DIR}/proposal.json"  # a promotion evaluate decided on and held for approval
ACCEPTANCE_PLOT = f"{EVALUATE_DIR}/acceptance.png"
BENCHMARK_DIR = "benchmark"
BENCHMARK_REPORT = f"{BENCHMARK_DIR}/benchmark.json"
BENCHMARK_PLOT = f"{BENCHMARK_DIR}/benchmark.png"
# The reports the control plane may read back (eagle3.box.reportfiles); besides them only `<stage>/<name>.png`.
READABLE_REPORTS = (REPORT, BENCHMARK_REPORT)

# What each stage a run may redo (the DAG's box.redo_from) writes in the run directory, in pipeline order: a redo
# renames these aside and redoes every later stage too, so that no output from before a redo sits beside one after.
REDO_OUTPUTS = {
    "vocab": (MAPPING_DIR,),
    "train": (TRAIN_DIR,),
    "export": (DRAFTER_DIR,),
    "evaluate": (EVALUATE_DIR,),
    "benchmark": (BENCHMARK_DIR,),
}

# -- a drafter directory (RUN_DIR/drafter, and each promoted version of a lineage) ----------------------------------
DRAFTER_CONFIG = "config.json"  # what the engines load
WEIGHTS = "model.safetensors"
EXPORT_RECORD = "export.json"  # which checkpoint, its figures, the layers each engine reads

# -- a lineage: {workdir}/drafters/<lineage key>/ (eagle3.records.lineage)
# ------------------------------------------------
KEY_RECORD = "key.json"  # what a shared directory's key covers (stores and generated answers have one too)
EVAL_SET = "eval_set.json"
VERSIONS = "versions"  # versions/<name>/: a promoted drafter's files and its PROMOTION_RECORD
CURRENT = "current"  # a link to the promoted version
PROMOTION_RECORD = "promotion.json"
LINEAGE_LOCK = ".lock"


def run_dir_of(workdir: str | Path, run_name: str) -> Path:
    return Path(workdir) / RUNS / run_name


def lineage_dir_of(workdir: str | Path, key: str) -> Path:
    return Path(workdir) / DRAFTERS / key


def run_samples_path(run_dir: Path, shard: int) -> Path:
    """The sample ids one run's extract shard stored (or found stored), one per line: the run's part of a
    shared store. Written when the shard is complete, so its presence means done."""
    return Path(run_dir) / EXTRACT_DIR / f"shard-{shard:05d}.samples"


def run_stats_path(run_dir: Path, shard: int) -> Path:
    return Path(run_dir) / EXTRACT_DIR / f"shard-{shard:05d}.stats.json"
