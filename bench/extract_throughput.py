"""Benchmark: does writing hidden states stall compute? And what does a token cost on disk?

    python bench/extract_throughput.py [--hidden-size 2048 --num-layers 4 --samples 300]

Same shallow, wide, dense tiny target, same samples, same batches, one process:
  baseline   the bare forward pass: transformers with output_hidden_states=True, results dropped
  extract    the extract stage's parts: HfCapture (hooks, bf16 copy) handing batches to the
             BackgroundWriter -> ShardWriter (isfinite, safetensors chunks, fsync, manifest)
They alternate batch by batch (which goes first alternates too), over several passes, and each
extract step waits until the writer has taken its batch, so
the writer's whole cost is charged to extract (on 2 cores there is no idle core to hide it anyway), and
the VM's speed drift (10-20% between runs seen here) hits both sides alike. Printed figures:
  throughput ratio    extract tokens/s / baseline tokens/s        (goal >= 0.97)
  bytes/token ratio   store bytes per token / (4*H*2 + 4 + 1)    (goal <= 1.002; chunks + manifest)
and the baseline's MB/s of hidden states (what the writer must sustain). Then one whole `run_extract`
on the same data, wall clock, for reference. Figures, not asserts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work"


def build_target(hidden_size: int, num_layers: int, samples: int) -> Path:
    target = WORK / f"wide-h{hidden_size}-l{num_layers}-n{samples}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3",
            "make-tiny-target",
            str(target),
            "--hidden-size",
            str(hidden_size),
            "--num-layers",
            str(num_layers),
            "--dense",
            "--train-steps",
            "0",
            "--num-prompts",
            str(samples),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return target


def make_config(target: Path, batch_tokens: int):
    from eagle3.config import parse_run_config
    from eagle3.target import resolve_target_facts

    return resolve_target_facts(
        parse_run_config(
            {
                "run_name": "bench-extract",
                "workdir": str(WORK),
                "target": {"model_path": str(target), "dtype": "float32"},
                "data": {"path": str(target / "prompts.jsonl")},
                "vocab": {"draft_vocab_size": 256},
                # Chunks scaled to this CPU's output rate: on a GPU (~1 GB/s of states) a 256 MiB chunk is
                # committed every ~0.25 s; here 8 MiB chunks give a similar number of commits per compute second.
                "extract": {
                    "batch_tokens": batch_tokens,
                    "progress_interval_s": 3600,
                    "aux_layers": [0, 1, 2],
                    "chunk_mib": 8,
                },
            }
        )
    )


def padded(batch) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [len(s.input_ids) for s in batch]
    ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(batch):
        ids[row, : lengths[row]] = torch.tensor(s.input_ids)
        mask[row, : lengths[row]] = 1
    return ids, mask


def interleaved(cfg) -> dict:
    from transformers import AutoModelForCausalLM

    from eagle3.capture.hf import HfCapture
    from eagle3.data.samples import SampleTokenizer, read_conversations
    from eagle3.data.store import ShardWriter, StoreMeta, verify
    from eagle3.stages.extract import BackgroundWriter, plan_batches

    conversations, _ = read_conversations(cfg.data.path)
    batches = list(plan_batches(SampleTokenizer.for_run(cfg).iter(conversations), cfg.extract.batch_tokens))
    bare = AutoModelForCausalLM.from_pretrained(cfg.target.model_path, dtype=torch.float32).get_decoder().eval()
    capture = HfCapture(cfg)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    writer = ShardWriter(
        cfg.store_dir,
        0,
        StoreMeta(cfg.target.hidden_size, tuple(cfg.resolved_aux_layers())),
        chunk_bytes=cfg.extract.chunk_mib << 20,
    )
    background = BackgroundWriter(writer, cfg.extract.writer_queue_depth)

    def bare_step(batch) -> float:
        ids, mask = padded(batch)
        started = time.perf_counter()
        with torch.inference_mode():
            bare(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
        return time.perf_counter() - started

    def extract_step(batch) -> float:
        started = time.perf_counter()
        background.put(batch, capture.capture(batch))
        background.drain()
        return time.perf_counter() - started

    base_s = extract_s = 0.0
    ratios = []
    tokens = 0
    for i, batch in enumerate(batches):
        if i % 2:  # alternate which side goes first
            extract, base = extract_step(batch), bare_step(batch)
        else:
            base, extract = bare_step(batch), extract_step(batch)
        base_s, extract_s = base_s + base, extract_s + extract
        ratios.append(base / extract)
        tokens += sum(len(s.input_ids) for s in batch)
    started = time.perf_counter()
    background.close()  # the last chunk's write and fsync
    extract_s += time.perf_counter() - started
    writer.release()
    return {
        "tokens": tokens,
        "batches": len(batches),
        "base_s": base_s,
        "extract_s": extract_s,
        "batch_ratios": ratios,
        "store": verify(cfg.store_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes over the data")
    args = parser.parse_args()

    from eagle3.stages.extract import run_extract

    cfg = make_config(build_target(args.hidden_size, args.num_layers, args.samples), args.batch_tokens)
    payload_per_token = (len(cfg.resolved_aux_layers()) + 1) * cfg.target.hidden_size * 2 + 4 + 1

    runs = [interleaved(cfg) for _ in range(args.repeats)]
    run = {key: sum(r[key] for r in runs) for key in ("tokens", "base_s", "extract_s")}
    run["batch_ratios"] = [x for r in runs for x in r["batch_ratios"]]
    run["batches"] = sum(r["batches"] for r in runs)
    store = runs[-1]["store"]
    manifest_bytes = sum(p.stat().st_size for p in cfg.store_dir.glob("shard-*/manifest.jsonl"))
    bytes_per_token = (store["bytes"] + manifest_bytes) / store["tokens"]
    base_rate, extract_rate = run["tokens"] / run["base_s"], run["tokens"] / run["extract_s"]

    shutil.rmtree(cfg.run_dir)
    whole = run_extract(cfg)
    figures = {
        "target": f"DeepSeek-V3 dense, {args.num_layers} layers, hidden {cfg.target.hidden_size}, fp32 on CPU "
        f"({torch.get_num_threads()} threads)",
        "samples": store["samples"],
        "tokens": run["tokens"],
        "passes": args.repeats,
        "batches": run["batches"],
        "baseline_tokens_per_s": round(base_rate, 1),
        "baseline_state_MB_per_s": round(base_rate * payload_per_token / 1e6, 2),
        "extract_tokens_per_s": round(extract_rate, 1),
        "throughput_ratio": round(extract_rate / base_rate, 4),
        "throughput_ratio_batch_median": round(statistics.median(run["batch_ratios"]), 4),
        "throughput_ratio_per_pass": [round(r["base_s"] / r["extract_s"], 4) for r in runs],
        "bytes_per_token": round(bytes_per_token, 2),
        "payload_bytes_per_token": payload_per_token,
        "bytes_per_token_ratio": round(bytes_per_token / payload_per_token, 5),
        "run_extract_tokens_per_s_wall": whole["tokens_per_s"],
    }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
