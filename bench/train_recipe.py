"""Benchmark: which training recipe gives the better drafter on the same data, over several seeds? Figures, not asserts.

    make demo && python bench/train_recipe.py [--run-dir demo-work/runs/demo] [--only NAME ...] [--seeds 3]

Every variant trains, exports and evaluates on the finished demo run's own store, split, vocab mapping and pinned
held-out prompts (linked, not recomputed), with the demo's config but for the fields the variant changes, through
the same CLI stages the DAG runs, once per seed (the seed sets the drafter's initial weights and the data order;
the split and the evaluation prompts stay the same; each source run gets a work directory, and so a lineage with
the prompts its own split holds out). Printed per variant and seed: optimizer steps, train seconds,
the offline acceptance length at the first k (decoding replayed on the validation split: what picks the
checkpoint), and the measured acceptance length at each k with its share of the ceiling (a drafter that always
agrees with the target on the same prompts). Then per variant: the mean over seeds, and the paired difference
from the first variant run (same seed, same prompts): mean, 95% t-interval over seeds, and range. Results are kept in
bench-work/train-recipe/results.jsonl: a variant and seed already measured with the same fields is not rerun.

Variants change `train.*` fields of the demo's config (dotted names below; a variant's "drafter" entry changes
drafter.* fields); the rest stays the demo's:
  demo                 the demo's recipe as it is
  epochs-x2            twice the epochs (twice the steps, the same schedule shape)
  epochs-x4            four times the epochs
  lr-3e-3              the demo's epochs at 3x the learning rate
  epochs-x4-lr-3e-4    four times the epochs at 0.3x the learning rate
  one-sample           SpecForge's default batch: one sample per step (batch_tokens empty)
  no-first-draft       train.first_draft_position off (SpecForge's mask exactly)
  lk-lambda            the LK loss that blends KL into 1 - expected acceptance (train.objective lk_lambda)
  lk-alpha             the LK loss -log expected acceptance (train.objective lk_alpha)
  eagle31              EAGLE-3.1's normalisations: drafter.fc_norm and drafter.norm_output on
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eagle3.disk import layout

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work" / "train-recipe"
RESULTS = WORK / "results.jsonl"
# Each variant's fields over the demo's config: an int is a multiple of the demo's epochs ("epochs": 2 -> twice).
VARIANTS: dict[str, dict] = {
    "demo": {},
    "epochs-x2": {"epochs": 2},
    "epochs-x4": {"epochs": 4},
    "lr-3e-3": {"learning_rate": 3e-3},
    "epochs-x4-lr-3e-4": {"epochs": 4, "learning_rate": 3e-4},
    "one-sample": {"batch_tokens": None},
    "no-first-draft": {"first_draft_position": False},
    "lk-lambda": {"objective": "lk_lambda"},
    "lk-alpha": {"objective": "lk_alpha"},
    "eagle31": {"drafter": {"fc_norm": True, "norm_output": True}},
}
# Sections a variant's run reads from the demo's run and never writes: linked, not recomputed.
LINKED = (layout.HIDDEN_STATES, layout.GENERATE_DIR, layout.EXTRACT_DIR, Path(layout.SPLIT_KEYS).parent.as_posix())


def stage(name: str, config: Path, log: Path) -> None:
    with log.open("a") as out:
        subprocess.run(
            [sys.executable, "-m", "eagle3", name, "--config", str(config)],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def variant_train_fields(source_train: dict, variant: dict) -> dict:
    fields = dict(variant)
    if "epochs" in fields:  # a multiple of the demo's epochs, so that the variants follow the demo's own recipe
        fields["epochs"] = source_train["epochs"] * fields["epochs"]
    return fields


def workdir_for(source: Path) -> Path:
    """One work directory per source run: a lineage pins its evaluation prompts once, so variants of two sources
    sharing one would all be measured on the prompts the first source's split held out (and trained without them)."""
    return WORK / hashlib.sha256(str(source).encode()).hexdigest()[:12]


def run_variant(source: Path, name: str, seed: int, train: dict) -> dict:
    config = json.loads((source / layout.CONFIG).read_text())
    run_name, workdir = f"{name}-seed{seed}", workdir_for(source)
    config["workdir"], config["run_name"], config["seed"] = str(workdir), run_name, seed
    config["drafter"].update(train.get("drafter", {}))
    config["train"].update({key: value for key, value in train.items() if key != "drafter"})
    config["evaluate"]["promote"] = False  # every variant against the same prompts, none against another
    run_dir = layout.run_dir_of(workdir, run_name)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / layout.CONFIG).write_text(json.dumps(config, indent=2))
    for shared in LINKED:
        (run_dir / shared).symlink_to(source / shared)
    shutil.copytree(source / layout.MAPPING_DIR, run_dir / layout.MAPPING_DIR)
    log = run_dir / "bench.log"
    started = time.monotonic()
    stage("train", run_dir / layout.CONFIG, log)
    seconds = time.monotonic() - started
    stage("export", run_dir / layout.CONFIG, log)
    stage("evaluate", run_dir / layout.CONFIG, log)
    summary = json.loads((run_dir / layout.TRAIN_SUMMARY).read_text())
    report = json.loads((run_dir / layout.REPORT).read_text())
    return {
        "variant": name,
        "seed": seed,
        "train": train,
        "steps": summary["steps"],
        "train_s": round(seconds, 1),
        "prompts": report["prompts"],
        "offline": report["offline_accept_length"],
        "measured": {
            k: {
                "mean": r["accept_length"],
                "interval95": r["accept_length_interval95"],
                "share_of_ceiling": r["share_of_ceiling"],
                "ceiling": r["ceiling_accept_length"],
            }
            for k, r in report["speculative"].items()
        },
    }


def load_results() -> list[dict]:
    if not RESULTS.exists():
        return []
    return [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def print_row(result: dict) -> None:
    measured = "  ".join(f"k={k}: {m['mean']:.3f} ({m['share_of_ceiling']:.0%})" for k, m in result["measured"].items())
    offline = next(iter(result["offline"].values()))
    print(
        f"{result['variant']:<20} {result['seed']:>4} {result['steps']:>6} {result['train_s']:>8.0f} {offline:>8.3f}"
        f"  {measured}",
        flush=True,
    )


# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30): the paired difference over n seeds has n-1.
T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def interval95(differences: list[float]) -> tuple[float, float] | None:
    """The 95% t-interval of the mean of paired differences (one per seed: the seed's spread is in it), or None
    under two seeds."""
    if len(differences) < 2:
        return None
    half = T95[min(len(differences) - 1, len(T95)) - 1] * statistics.stdev(differences) / len(differences) ** 0.5
    mean = statistics.fmean(differences)
    return mean - half, mean + half


def print_summary(results: list[dict], names: list[str]) -> None:
    by_variant = {name: {r["seed"]: r for r in results if r["variant"] == name} for name in names}
    base = names[0]
    print(
        f"\nover seeds: mean measured acceptance length (share of the ceiling); paired difference from {base} "
        "(mean, 95% t-interval over seeds, range)"
    )
    for name in names:
        runs = by_variant[name]
        if not runs:
            continue
        parts = []
        for k in next(iter(runs.values()))["measured"]:
            means = [r["measured"][k]["mean"] for r in runs.values()]
            share = statistics.fmean(r["measured"][k]["share_of_ceiling"] for r in runs.values())
            text = f"k={k}: {statistics.fmean(means):.3f} ({share:.0%})"
            paired = [
                r["measured"][k]["mean"] - by_variant[base][seed]["measured"][k]["mean"]
                for seed, r in runs.items()
                if seed in by_variant[base]
            ]
            if name != base and paired:
                low_high = interval95(paired)
                text += f" {statistics.fmean(paired):+.3f}"
                text += f" CI [{low_high[0]:+.3f}, {low_high[1]:+.3f}]" if low_high else ""
                text += f" range [{min(paired):+.3f}, {max(paired):+.3f}]"
            parts.append(text)
        print(f"{name:<20} {len(runs)} seeds  " + "   ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=REPO / "demo-work" / "runs" / "demo")
    parser.add_argument(
        "--only",
        nargs="*",
        choices=sorted(VARIANTS),
        help="these variants only (the first is the one the others are compared with)",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every variant")
    parser.add_argument(
        "--save-every-steps",
        type=int,
        help="for every variant (validation picks the best checkpoint among these; default: the demo's)",
    )
    args = parser.parse_args()
    source = args.run_dir.resolve()
    if not (source / layout.REPORT).exists():
        sys.exit(f"{source}: no finished run here; run `make demo` first")
    source_train = json.loads((source / layout.CONFIG).read_text())["train"]
    names = args.only or list(VARIANTS)
    WORK.mkdir(parents=True, exist_ok=True)
    done = load_results()
    print(
        f"{'variant':<20} {'seed':>4} {'steps':>6} {'train s':>8} {'offline':>8}  measured acceptance length "
        "(share of the ceiling)"
    )
    for seed in range(args.seeds):
        for name in names:
            train = variant_train_fields(source_train, VARIANTS[name])
            if args.save_every_steps:
                train["save_every_steps"] = args.save_every_steps
            key = {"source": str(source), "variant": name, "seed": seed, "train": train}
            known = [r for r in done if {k: r.get(k) for k in key} == key]
            result = known[-1] if known else {"source": str(source), **run_variant(source, name, seed, train)}
            if not known:
                with RESULTS.open("a") as out:
                    out.write(json.dumps(result) + "\n")
                done.append(result)
            print_row(result)
    print_summary([r for r in done if r.get("source") == str(source)], names)


if __name__ == "__main__":
    main()
