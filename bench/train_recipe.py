"""Benchmark: which training recipe gives the better drafter on the same data? Figures, not asserts.

    make demo && python bench/train_recipe.py [--run-dir demo-work/runs/demo] [--only NAME ...]

Every variant trains, exports and evaluates on the finished demo run's own store, vocab mapping and held-out
prompts (linked, not recomputed), with the demo's config but for the fields the variant changes, through the
same CLI stages the DAG runs. Printed per variant: optimizer steps, train seconds, the offline acceptance length
at the first k (decoding replayed on the validation split: what picks the checkpoint), and the measured acceptance
length at each k (first cycle in brackets).

Variants (the same epochs, so the same tokens seen):
  demo                 the demo's recipe when this benchmark was written: 2048 tokens per step, lr 1e-3
  no-first-draft       the demo's, with train.first_draft_position off (SpecForge's mask exactly)
  tokens-8192-lr1e-4   the config defaults before this benchmark: 8192 tokens per step, lr 1e-4
  one-sample-lr1e-4    SpecForge's default: one sample per rank per step (batch_tokens 16 puts every sample
                       in a batch of its own), lr 1e-4
  one-sample-lr1e-3    one sample per step at the demo's learning rate
  tokens-2048-lr1e-4   the demo's batch at the default learning rate
  tokens-256-lr1e-3    a few samples per step at the demo's learning rate: the demo's recipe, for time
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eagle3 import runlayout as layout

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work" / "train-recipe"
VARIANTS = {
    "demo": {},
    "no-first-draft": {"first_draft_position": False},
    "tokens-8192-lr1e-4": {"batch_tokens": 8192, "learning_rate": 1e-4},
    "one-sample-lr1e-4": {"batch_tokens": 16, "learning_rate": 1e-4},
    "one-sample-lr1e-3": {"batch_tokens": 16, "learning_rate": 1e-3},
    "tokens-2048-lr1e-4": {"batch_tokens": 2048, "learning_rate": 1e-4},
    "tokens-256-lr1e-3": {"batch_tokens": 256, "learning_rate": 1e-3},
}


def stage(name: str, config: Path) -> None:
    subprocess.run([sys.executable, "-m", "eagle3", name, "--config", str(config)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_variant(source: Path, name: str, train: dict) -> dict:
    config = json.loads((source / "config.json").read_text())
    config["workdir"], config["run_name"] = str(WORK), name
    config["train"].update(train)
    run_dir = WORK / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    # Read only by these stages: the store, the conversations, and which of the store's samples are the run's.
    for shared in (layout.HIDDEN_STATES, layout.GENERATE_DIR, layout.EXTRACT_DIR):
        (run_dir / shared).symlink_to(source / shared)
    shutil.copytree(source / layout.MAPPING_DIR, run_dir / layout.MAPPING_DIR)
    started = time.monotonic()
    stage("train", run_dir / "config.json")
    seconds = time.monotonic() - started
    stage("export", run_dir / "config.json")
    stage("evaluate", run_dir / "config.json")
    summary = json.loads((run_dir / layout.TRAIN_SUMMARY).read_text())
    report = json.loads((run_dir / layout.REPORT).read_text())
    return {"steps": summary["steps"], "train_s": seconds,
            "offline": next(iter(report["offline_accept_length"].values())),
            "measured": {k: (r["mean_accept_length"], r["first_cycle_accept_length"])
                         for k, r in report["speculative"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=REPO / "demo-work" / "runs" / "demo")
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="these variants only")
    args = parser.parse_args()
    if not (args.run_dir / layout.REPORT).exists():
        sys.exit(f"{args.run_dir}: no finished run here; run `make demo` first")
    print(f"{'variant':<20} {'steps':>6} {'train s':>8} {'offline':>9}  measured acceptance length (first cycle)")
    for name in args.only or VARIANTS:
        result = run_variant(args.run_dir.resolve(), name, VARIANTS[name])
        measured = "  ".join(f"k={k}: {m:.3f} ({f:.3f})" for k, (m, f) in result["measured"].items())
        print(f"{name:<20} {result['steps']:>6} {result['train_s']:>8.0f} {result['offline']:>9.3f}  {measured}",
              flush=True)


if __name__ == "__main__":
    main()
