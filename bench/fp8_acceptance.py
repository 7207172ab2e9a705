"""Benchmark: what storing hidden states as fp8 costs the drafter, measured finely enough to see 0.02. Figures, not
asserts.

    make demo && python bench/fp8_acceptance.py [--seeds 0 1 2 3 4] [--prompts 1000] [--k 3] [--jobs 2]

The demo's own evaluation cannot settle it: on its 32 (or 49) held-out prompts one verify cycle more or less moves
the acceptance length by 0.025-0.04 at k=3, and a training seed moves it by more than that. So, on the finished
demo run's regenerated conversations and through the same CLI stages the DAG runs:
  1. extract them twice, once with `extract.state_dtype` bf16 and once fp8_e4m3, and build the vocab mapping;
  2. per seed, train and export one drafter on each store (the run's `seed`: weights and data order);
  3. measure every drafter with real speculative decoding (eagle3.stages.evaluate.decoding.speculative_greedy, chain
  drafts of k,
     verified by the target) on the same fresh prompts: new draws of the tiny target's synthetic tasks whose
     question is in none of the data's conversations.
Printed: per seed the acceptance length of each dtype and the difference, with the seed's interval over prompts
(paired bootstrap: the same prompts, and, speculation being lossless, the same target tokens for both drafters);
then the mean difference over seeds with a 95 % t-interval (the seeds' spread is in it), and "within 0.02"
(`--margin`) as two one-sided t-tests at 5 %: whether a loss, and a gain, of more than 0.02 are ruled out.
Then both drafters' validation accuracy per draft position, each measured on the bf16 store's validation split, so
that both meet the same teachers, with the same test against 0.5 points (`--margin-points`). Everything lands in
bench-work/fp8-acceptance/; a rerun reuses what is there (stores, drafters, measurements), so seeds can be added
later.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from statistics import NormalDist, stdev

from eagle3.disk.fsutil import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work" / "fp8-acceptance"
DTYPES = ("bf16", "fp8_e4m3")
FRESH_STREAM = 2_000_003  # tiny_target draws the training task from seed 0 and the data from seed + 1_000_003
# Student's t for 1..10 degrees of freedom, by quantile (beyond 10: t_quantile's expansion)
T_TABLE = {
    0.975: (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228),
    0.95: (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812),
}


def stage(name: str, config: Path, threads: int = 1) -> None:
    """One box-side stage through the CLI, as the DAG runs it; its log goes beside the config."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(config.parent / f"{name}.log", "w") as log:
        subprocess.run(
            [sys.executable, "-m", "eagle3", name, "--config", str(config)],
            check=True,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def new_run(source: Path, name: str, **changes) -> Path:
    """A run directory under WORK with the demo's config but for `changes` (dotted section.field or top-level
    keys), reading the demo's regenerated conversations."""
    config = json.loads((source / "config.json").read_text())
    config["workdir"], config["run_name"] = str(WORK), name
    for key, value in changes.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    run_dir = WORK / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    (run_dir / "generate").symlink_to(source / "generate")
    return run_dir


def store_run(source: Path, dtype: str) -> Path:
    """The run that extracted the demo's conversations as `dtype` states, and built the vocab mapping."""
    run_dir = WORK / "runs" / f"store-{dtype}"
    if not (run_dir / "vocab_mapping" / "meta.json").exists():
        run_dir = new_run(source, f"store-{dtype}", **{"extract.state_dtype": dtype})
        stage("extract", run_dir / "config.json", threads=2)
        stage("vocab", run_dir / "config.json", threads=2)
    return run_dir


def train_drafter(source: Path, dtype: str, seed: int) -> Path:
    """Train and export the drafter of one seed on one store; returns its drafter directory."""
    name = f"{dtype}-seed{seed}"
    drafter = WORK / "runs" / name / "drafter"
    if (drafter / "export.json").exists():
        return drafter
    stored = WORK / "runs" / f"store-{dtype}"
    run_dir = new_run(source, name, seed=seed, **{"extract.state_dtype": dtype})
    (run_dir / "hidden_states").symlink_to(os.readlink(stored / "hidden_states"))  # the shared store, relative
    shutil.copytree(stored / "extract", run_dir / "extract")  # which samples are this run's
    shutil.copytree(stored / "vocab_mapping", run_dir / "vocab_mapping")
    stage("train", run_dir / "config.json")
    stage("export", run_dir / "config.json")
    return drafter


def fresh_prompts(source: Path, count: int) -> list[list[dict]]:
    """`count` new conversations' opening turns (system prompt, if drawn, and the first question), none of whose
    questions is in the data."""
    from eagle3.demo.tiny_target import synthetic_conversation

    config = json.loads((source / "config.json").read_text())
    seen = {
        turn["value"]
        for line in Path(config["data"]["path"]).read_text().splitlines()  # (ShareGPT, as built)
        for turn in json.loads(line)["conversations"]
        if turn["from"] == "human"
    }
    rng, prompts = random.Random(FRESH_STREAM), []
    while len(prompts) < count:
        messages = synthetic_conversation(rng)
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if messages[first_answer - 1]["content"] not in seen:
            prompts.append(messages[:first_answer])
    return prompts


def measure(config_path: str, drafter_dir: str, prompts: list[list[dict]], k: int, max_new: int) -> dict:
    """Per prompt, the drafts accepted in each verify cycle of speculative greedy decoding, and the tokens made."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoConfig

    from eagle3.capture.hf import HfCapture
    from eagle3.config import load_run_config
    from eagle3.data.samples import SampleTokenizer
    from eagle3.stages.evaluate.decoding import speculative_greedy
    from eagle3.stages.export import load_exported_drafter

    cfg = load_run_config(config_path)
    eos = AutoConfig.from_pretrained(cfg.target.model_path).eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tokenizing = SampleTokenizer.for_run(cfg)
    target = HfCapture(cfg)
    drafter, draft_to_target = load_exported_drafter(drafter_dir, cfg.target.model_path)
    cycles, outputs = [], []
    with torch.no_grad():
        for messages in prompts:
            tokens, accepted = speculative_greedy(
                target, drafter, draft_to_target, tokenizing.prompt_ids(messages), k, max_new, eos
            )
            cycles.append(accepted)
            outputs.append(tokens)
    return {"cycles": cycles, "outputs": outputs}


def val_acc_against_bf16(seed: int) -> dict[str, list[float]]:
    """Teacher-forced accuracy per draft position of both drafters of `seed` on the validation split of the bf16
    store: the trainer's own validation, with the teachers a bf16 store gives. (Each training run reports it on
    its own store, and fp8's final states give slightly other teachers, so those two figures do not compare.)"""
    import torch

    from eagle3.config import load_run_config
    from eagle3.records.checkpoint import load_checkpoint
    from eagle3.stages.train import Trainer

    torch.set_num_threads(2)
    trainer = Trainer(load_run_config(WORK / "runs" / f"bf16-seed{seed}" / "config.json"))
    accs = {}
    for dtype in DTYPES:
        exported = json.loads((WORK / "runs" / f"{dtype}-seed{seed}" / "drafter" / "export.json").read_text())
        trainer.draft.load_state_dict(load_checkpoint(Path(exported["checkpoint"]))["model"], strict=False)
        accs[dtype] = trainer.validate()["val_acc"]
    return accs


def accept_length(cycles: list[list[int]], prompts=None) -> float:
    """SGLang's avg_spec_accept_length over these prompts' cycles: 1 + accepted drafts per verify step."""
    chosen = cycles if prompts is None else [cycles[i] for i in prompts]
    steps = sum(len(c) for c in chosen)
    return 1 + sum(map(sum, chosen)) / max(steps, 1)


def paired_interval(ours: list[list[int]], theirs: list[list[int]], draws: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval over prompts of accept_length(ours) - accept_length(theirs), the same prompts drawn
    for both."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = len(ours)
    diffs = []
    for _ in range(draws):
        sample = rng.integers(0, n, n)
        diffs.append(accept_length(ours, sample) - accept_length(theirs, sample))
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile p (0.975 or 0.95): the table up to 10 degrees of freedom, beyond it the Cornish-Fisher
    expansion around the normal quantile (Abramowitz & Stegun 26.7.5; at 0.975, 2.2009 for 11 against 2.2010,
    closer beyond). No scipy in the control plane's environment for two numbers."""
    if df <= 10:
        return T_TABLE[p][df - 1]
    z = NormalDist().inv_cdf(p)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def t_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided t-interval of the mean over seeds (confidence 0.95 or 0.90)."""
    mean, sem = sum(values) / len(values), stdev(values) / len(values) ** 0.5
    half = t_quantile(1 - (1 - confidence) / 2, len(values) - 1) * sem
    return mean - half, mean + half


def equivalence(differences: list[float], margin: float, number: str) -> str:
    """ "Within +-margin" as two one-sided t-tests at 5 % (TOST), read off the 90 % interval of the mean difference:
    a loss of more than `margin` is ruled out when its lower end is above -margin (fp8 is not worse: what the goal
    asks), a gain of more than `margin` when its upper end is below +margin; both ruled out is equivalence. A small
    mean in a wide interval rules out nothing."""
    low, high = t_interval(differences, confidence=0.90)

    def verdict(ruled_out: bool) -> str:
        return "ruled out" if ruled_out else "NOT ruled out"

    return (
        f"90% interval [{number.format(low)}, {number.format(high)}]: fp8 worse by more than {margin:g} "
        f"{verdict(low > -margin)}, better by more than {margin:g} {verdict(high < margin)} "
        f"(one-sided t-tests at 5%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=REPO / "demo-work" / "runs" / "demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--prompts", type=int, default=1000, help="fresh prompts every drafter is measured on")
    parser.add_argument("--k", type=int, default=3, help="draft length")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the demo's evaluate.max_new_tokens")
    parser.add_argument("--jobs", type=int, default=2, help="trainings and measurements at a time, one thread each")
    parser.add_argument("--margin", type=float, default=0.02, help="acceptance length difference to rule out")
    parser.add_argument(
        "--margin-points",
        type=float,
        default=0.5,
        help="validation accuracy difference (points, mean of positions) to rule out",
    )
    args = parser.parse_args()
    source = args.run_dir.resolve()
    if not (source / "generate" / "conversations.jsonl").exists():
        sys.exit(f"{source}: no finished demo run with regenerated conversations here; run `make demo` first")
    WORK.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    for dtype in DTYPES:
        store_run(source, dtype)
    pairs = [(dtype, seed) for seed in args.seeds for dtype in DTYPES]
    with ProcessPoolExecutor(args.jobs) as pool:
        drafters = dict(zip(pairs, pool.map(train_drafter, [source] * len(pairs), *zip(*pairs))))
    print(f"stores and {len(pairs)} drafters ready after {time.monotonic() - started:.0f} s", flush=True)

    prompts = fresh_prompts(source, args.prompts)
    results_file = WORK / f"measured-k{args.k}-p{args.prompts}-n{args.max_new_tokens}.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    todo = [pair for pair in pairs if f"{pair[0]}-seed{pair[1]}" not in results]
    config = str(WORK / "runs" / "store-bf16" / "config.json")
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {
            pair: pool.submit(measure, config, str(drafters[pair]), prompts, args.k, args.max_new_tokens)
            for pair in todo
        }
        for (dtype, seed), future in futures.items():
            results[f"{dtype}-seed{seed}"] = future.result()
            atomic_write_text(results_file, json.dumps(results))  # a killed bench keeps what it measured
    print(f"measured after {time.monotonic() - started:.0f} s", flush=True)

    print(f"\nacceptance length at k={args.k} on {args.prompts} fresh prompts (max {args.max_new_tokens} new tokens)")
    print(f"{'seed':>4} {'bf16':>7} {'fp8':>7} {'fp8-bf16':>9}  95% over prompts (paired)  cycles bf16/fp8")
    differences = []
    for seed in args.seeds:
        ours, theirs = results[f"fp8_e4m3-seed{seed}"], results[f"bf16-seed{seed}"]
        if ours["outputs"] != theirs["outputs"]:
            sys.exit(f"seed {seed}: the two drafters' outputs differ: speculation was not lossless")
        fp8, bf16 = accept_length(ours["cycles"]), accept_length(theirs["cycles"])
        low, high = paired_interval(ours["cycles"], theirs["cycles"])
        differences.append(fp8 - bf16)
        print(
            f"{seed:>4} {bf16:>7.3f} {fp8:>7.3f} {fp8 - bf16:>+9.3f}  [{low:+.3f}, {high:+.3f}]"
            f"{'':>13}{sum(map(len, theirs['cycles']))}/{sum(map(len, ours['cycles']))}"
        )
    bf16_all = [accept_length(results[f"bf16-seed{s}"]["cycles"]) for s in args.seeds]
    fp8_all = [accept_length(results[f"fp8_e4m3-seed{s}"]["cycles"]) for s in args.seeds]
    mean = sum(differences) / len(differences)
    print(f"mean {sum(bf16_all) / len(bf16_all):>7.3f} {sum(fp8_all) / len(fp8_all):>7.3f} {mean:>+9.3f}")
    if len(differences) > 1:
        low, high = t_interval(differences)
        print(
            f"fp8 - bf16 over {len(differences)} seeds: {mean:+.3f}, 95% interval [{low:+.3f}, {high:+.3f}]; "
            f"seed-to-seed spread (sd) bf16 {stdev(bf16_all):.3f}, fp8 {stdev(fp8_all):.3f}, "
            f"difference {stdev(differences):.3f}"
        )
        print(equivalence(differences, args.margin, "{:+.3f}"))

    print("\nvalidation accuracy per draft position on the bf16 store's validation split (the same teachers for both)")
    print(f"{'seed':>4} {'bf16 (mean of positions)':>25} {'fp8':>7} {'fp8-bf16':>9}  per position fp8-bf16 (points)")
    gaps = []
    val_file = WORK / "val-acc.json"  # per seed; the drafters of a seed never change once exported
    val_accs = json.loads(val_file.read_text()) if val_file.exists() else {}
    for seed in args.seeds:
        if str(seed) not in val_accs:
            val_accs[str(seed)] = val_acc_against_bf16(seed)
            atomic_write_text(val_file, json.dumps(val_accs))
        accs = val_accs[str(seed)]
        bf16, fp8 = (sum(accs[d]) / len(accs[d]) for d in DTYPES)
        gaps.append(100 * (fp8 - bf16))
        per_position = " ".join(f"{100 * (f - b):+.1f}" for b, f in zip(accs["bf16"], accs["fp8_e4m3"]))
        print(f"{seed:>4} {bf16:>25.4f} {fp8:>7.4f} {gaps[-1]:>+8.2f}p  {per_position}")
    if len(gaps) > 1:
        low, high = t_interval(gaps)
        print(
            f"fp8 - bf16 over {len(gaps)} seeds: {sum(gaps) / len(gaps):+.2f} points, 95% interval "
            f"[{low:+.2f}, {high:+.2f}]"
        )
        print(equivalence(gaps, args.margin_points, "{:+.2f}"))


if __name__ == "__main__":
    main()
