"""`make demo`: the pipeline's stages that exist so far, end to end on this machine (CPU, no download).

Builds the tiny DeepSeek-V3-shaped target (cached in .cache/tiny-target), writes a run config into
demo-work/runs/demo/, then runs extract, store verify, vocab, train, export and evaluate, and prints a
summary with where the drafter, its report and plots are. Each stage runs
as the DAG will run it on a box: `python -m eagle3 <stage> --config <run dir>/config.json`.
Running it again resumes: finished stages find their work done.
(Until the Airflow DAG lands, this script is the orchestrator; then `make demo` runs the DAG.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO / ".cache" / "tiny-target"
WORKDIR = REPO / "demo-work"


def eagle3(*args: str) -> str:
    """Run one box-side command; its log goes to the terminal, its stdout (JSON or a path) is returned."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "eagle3", *args], stdout=subprocess.PIPE, text=True, check=True)
    print(f"[demo] eagle3 {args[0]} done in {time.monotonic() - started:.1f}s", flush=True)
    return out.stdout


def main() -> None:
    started = time.monotonic()
    eagle3("make-tiny-target", str(TINY_TARGET))
    draft = {
        "run_name": "demo",
        "workdir": str(WORKDIR),
        "target": {"model_path": str(TINY_TARGET), "dtype": "float32"},
        "data": {"path": str(TINY_TARGET / "prompts.jsonl")},
        "vocab": {"draft_vocab_size": 512},
        "extract": {"batch_tokens": 4096, "chunk_mib": 32, "progress_interval_s": 5},
        "train": {"batch_tokens": 2048, "epochs": 2, "learning_rate": 1e-3, "save_every_steps": 20,
                  "val_fraction": 0.05, "progress_interval_s": 10},
        "evaluate": {"num_prompts": 32, "max_new_tokens": 48, "draft_lengths": [3, 7]},
    }
    WORKDIR.mkdir(exist_ok=True)
    draft_path = WORKDIR / "demo-config.json"
    draft_path.write_text(json.dumps(draft, indent=2))
    config = eagle3("init", "--config", str(draft_path)).strip()
    run_dir = Path(config).parent
    extract = json.loads(eagle3("extract", "--config", config))
    store = json.loads(eagle3("store", "verify", str(run_dir / "hidden_states")))
    vocab = json.loads(eagle3("vocab", "--config", config))
    train = json.loads(eagle3("train", "--config", config))
    export = json.loads(eagle3("export", "--config", config))
    report = json.loads(eagle3("evaluate", "--config", config))

    ideal = store["hidden_size"] * (len(store["aux_layers"]) + 1) * 2 + 4 + 1
    print()
    print("stage     samples  tokens   seconds  notes")
    rate = f"{extract['tokens_per_s']:.0f} tokens/s" if extract["samples_extracted"] else "already done"
    print(f"extract   {extract['samples_stored']:<8} {store['tokens']:<8} {extract['seconds']:<8.1f} "
          f"{extract['samples_extracted']} extracted this run ({rate}); "
          f"{extract['duplicates']} duplicate prompts skipped")
    print(f"store     {store['samples']:<8} {store['tokens']:<8} {'':8} "
          f"{store['bytes'] / 2**20:.1f} MiB, {store['bytes_per_token']:.1f} bytes/token "
          f"({store['bytes_per_token'] / ideal:.4f} x payload), aux layers {store['aux_layers']}")
    print(f"vocab     {'':8} {vocab['loss_tokens']:<8} {'':8} draft vocab {vocab['draft_vocab_size']} of "
          f"{vocab['target_vocab_size']} ids covers {vocab['coverage']:.2%} of assistant tokens")
    print(f"train     {'':8} {'':8} {train['seconds']:<8.1f} {train['steps']} steps; best step {train['best']['step']}")
    print(f"export    step {export['step']}: val acc per position {[round(a, 3) for a in export['val_acc']]}")
    print(f"          simulated (teacher-forced) acceptance length {export['val_accept_length']:.3f}")
    for k, result in report["speculative"].items():
        print(f"evaluate  k={k}: measured acceptance length {result['mean_accept_length']:.3f} on "
              f"{report['prompts']} held-out prompts; outputs equal to greedy: {result['identical_to_greedy']}")
    print(f"total {time.monotonic() - started:.0f}s")
    print(f"hidden states: {run_dir / 'hidden_states'}")
    print(f"vocab mapping: {run_dir / 'vocab_mapping'}")
    print(f"drafter:       {run_dir / 'drafter'}")
    print(f"report:        {run_dir / 'evaluate' / 'report.json'}")
    print(f"plots:         {run_dir / 'train' / 'loss.png'}, {run_dir / 'train' / 'accuracy.png'}, "
          f"{run_dir / 'evaluate' / 'acceptance.png'}")
    print(f"run directory: {run_dir}")


if __name__ == "__main__":
    main()
