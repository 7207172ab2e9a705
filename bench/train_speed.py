"""Benchmark: how fast does the train stage run on CPU, against another version of its code? Figures, not asserts.

    python bench/train_speed.py [--run-dir DIR] [--baseline-rev REV] [--steps 120] [--repeats 5] [--threads 1]
                                [--validate]

Trains the first --steps optimizer steps of a finished run's train stage (its config, store, split and vocab
mapping: by default bench-work/train-speed/runs/demo, else demo-work/runs/demo) in a fresh process, once with the
working tree's code and once with --baseline-rev's train-side files (TRAIN_SIDE: the rest of include/eagle3 is the
working tree's, so that a config written by it still loads; the baseline must have the same folders), alternating which
goes first, --repeats times. Nothing is written to the run directory (no checkpoints, metrics or TensorBoard): the steps
are Trainer.train_step itself, and --validate times one Trainer.validate after them.

Printed per try: ms per step (wall and process CPU, over the steps after the first 5) and, with --validate, the
validation's seconds; then the medians and the baseline / working-tree ratio of each. Also whether the two computed
the same: the largest difference between their losses step by step (relative), and with --validate the validation
figures side by side (the offline acceptance length per k, the accuracy per TTT position).

The machine is shared: interleaved tries and medians, and CPU time beside wall time, are there to see through the
noise. --threads sets torch's intra-op threads in both (0: what each version sets itself: the baseline torch's
default, one per core; the trainer now one on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work" / "train-speed"
# (paths under include/eagle3: a --baseline-rev from before the folders of issue 52 has them elsewhere)
TRAIN_SIDE = (
    "stages/train.py",
    "model/drafter.py",
    "model/ttt_attention.py",
    "data/store.py",
    "model/acceptance.py",
    "records/checkpoint.py",
)
WARMUP_STEPS = 5


def baseline_tree(rev: str) -> Path:
    """include/ as the working tree has it, with the train-side files as `rev` has them."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    root = WORK / f"baseline-{sha}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(REPO / "include", root / "include", ignore=shutil.ignore_patterns("__pycache__"))
    for name in TRAIN_SIDE:
        source = subprocess.run(
            ["git", "show", f"{rev}:include/eagle3/{name}"], cwd=REPO, check=True, capture_output=True
        ).stdout
        (root / "include" / "eagle3" / name).write_bytes(source)
    return root / "include"


def worker(args) -> None:
    if args.threads:  # (the trainer keeps an OMP_NUM_THREADS it is given)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import logging

    from eagle3.__main__ import load_config
    from eagle3.stages.train import Trainer

    logging.disable(logging.INFO)
    trainer = Trainer(load_config(str(args.run_dir / "config.json")))
    losses, wall, cpu = [], 0.0, 0.0
    for step, sample_ids in trainer.batches_from(0):
        if step == args.steps:
            break
        started, started_cpu = time.perf_counter(), time.process_time()
        losses.append(trainer.train_step(sample_ids)[0])
        if step >= WARMUP_STEPS:
            wall, cpu = wall + time.perf_counter() - started, cpu + time.process_time() - started_cpu
    timed = args.steps - WARMUP_STEPS
    result = {"ms_per_step": 1000 * wall / timed, "cpu_ms_per_step": 1000 * cpu / timed, "losses": losses}
    if args.validate:
        started = time.perf_counter()
        val = trainer.validate()
        result |= {
            "validate_s": time.perf_counter() - started,
            "val_acc": val["val_acc"],
            "offline": {k: v["accept_length"] for k, v in val["val_offline"].items()},
            "val_loss": val["val_loss"],
        }
    print(json.dumps(result))


def run_one(include: Path, args) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--worker",
        "--run-dir",
        str(args.run_dir),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ] + (["--validate"] if args.validate else [])
    env = dict(os.environ, PYTHONPATH=str(include))
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_run = WORK / "runs" / "demo"
    parser.add_argument(
        "--run-dir", type=Path, default=default_run if default_run.exists() else REPO / "demo-work" / "runs" / "demo"
    )
    parser.add_argument("--baseline-rev", default="HEAD", help="the train-side files to compare with (git revision)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per try (the first 5 not timed)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: each version's own)")
    parser.add_argument("--validate", action="store_true", help="also time one validation pass after the steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.run_dir = args.run_dir.resolve()
    if args.worker:
        worker(args)
        return
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} untimed ones")
    trees = {"baseline": baseline_tree(args.baseline_rev), "working tree": REPO / "include"}
    print(
        f"{args.run_dir}: {args.steps} steps a try, threads {args.threads or 'default'}, baseline {args.baseline_rev}"
    )
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
        for name in order:
            r = run_one(trees[name], args)
            results[name].append(r)
            validate = f", validate {r['validate_s']:.1f} s" if args.validate else ""
            print(
                f"  try {repeat + 1} {name:12s} {r['ms_per_step']:7.1f} ms/step wall, {r['cpu_ms_per_step']:7.1f} "
                f"CPU{validate}",
                flush=True,
            )

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    keys = ["ms_per_step", "cpu_ms_per_step"] + (["validate_s"] if args.validate else [])
    print("medians:")
    for key in keys:
        base, new = median("baseline", key), median("working tree", key)
        print(f"  {key:16s} baseline {base:8.2f}  working tree {new:8.2f}  ratio {base / new:5.2f}x")
    base, new = results["baseline"][0], results["working tree"][0]
    worst = max(abs(a - b) / abs(a) for a, b in zip(base["losses"], new["losses"]))
    print(
        f"losses over {len(base['losses'])} steps: largest relative difference {worst:.2e} "
        f"(first {base['losses'][0]:.6f} / {new['losses'][0]:.6f}, last {base['losses'][-1]:.6f} / "
        f"{new['losses'][-1]:.6f})"
    )
    if args.validate:
        for name, r in (("baseline", base), ("working tree", new)):
            print(
                f"  {name:12s} offline acceptance {r['offline']}, val loss {r['val_loss']:.6f}, val acc "
                f"{[round(a, 4) for a in r['val_acc']]}"
            )


if __name__ == "__main__":
    main()
