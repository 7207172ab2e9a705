"""Serve the drafter in the serving engine and measure what users get: tokens accepted per step and output tokens/s.

    python -m eagle3 benchmark --config RUN_DIR/config.json

Two servers of the run's engine (server.engine: SGLang or vLLM, eagle3.engines), one after the other, on the box
(settings from the config's `server` section), both sent the same held-out prompts (as evaluate picks them) with
greedy decoding at benchmark.concurrency:
  baseline  the target alone
  eagle3    the target with the exported drafter (SGLang: --speculative-algorithm EAGLE3 with
            benchmark.num_steps/eagle_topk/num_draft_tokens; vLLM: an eagle3 speculative config, num_steps tokens)
Prompts go as token ids, and each engine reports what speculation did per request (eagle3.engines). Accept length is
the one definition evaluate uses too, SGLang's scheduler metric (avg_spec_accept_length): tokens committed per
verify step = (drafts that reached the output + one token of the target's own per step) / verify steps; the first
token, which prefill produces, is no verify step's. Beside it, labelled, completion tokens / verify steps (SGLang's
meta_info spec_accept_length, which counts that first token too). Output tokens/s = all completion tokens / wall
time.

Writes RUN_DIR/benchmark/benchmark.json (both runs, per-request figures, the speedup) and benchmark.png; each
server's log is beside them. The servers are stopped however the stage ends (see eagle3.engines.server).
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from typing import TYPE_CHECKING

import httpx

from eagle3.data.samples import DataError, SampleTokenizer
from eagle3.disk.fsutil import atomic_write_text
from eagle3.disk.layout import BENCHMARK_DIR, BENCHMARK_PLOT, BENCHMARK_REPORT, DRAFTER_CONFIG, DRAFTER_DIR
from eagle3.engines import Speculation, engine_for
from eagle3.engines.server import serving
from eagle3.stages.evaluate.prompts import held_out_prompts

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the progress lines


async def send_prompts(engine, base_url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> dict:
    """Every prompt once, `concurrency` at a time; per-request and whole-run figures."""
    slots = asyncio.Semaphore(concurrency)
    results: list[dict | None] = [None] * len(prompts)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with slots:
            started = time.monotonic()
            completion = await engine.complete(client, base_url, prompts[i], max_new_tokens)
            results[i] = {
                "completion_tokens": len(completion.output_ids),
                "verify_steps": completion.verify_steps,
                "accepted_drafts": completion.accepted,
                "latency_s": round(time.monotonic() - started, 4),
                "output_ids": completion.output_ids,
            }

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
        await asyncio.gather(*(one(i, client) for i in range(len(prompts))))
    seconds = time.monotonic() - started
    tokens = sum(r["completion_tokens"] for r in results)
    run = {
        "seconds": round(seconds, 3),
        "completion_tokens": tokens,
        "output_tokens_per_s": round(tokens / seconds, 2),
        "mean_latency_s": round(statistics.fmean(r["latency_s"] for r in results), 4),
        "requests": results,
    }
    steps = sum(r["verify_steps"] or 0 for r in results)
    if steps:
        for r in results:
            if r["verify_steps"]:
                r["accept_length"] = round((r["completion_tokens"] - 1) / r["verify_steps"], 4)
        # the headline (tokens committed per verify step) and SGLang's count beside it (eagle3.model.acceptance)
        run["accept_length"] = round(sum(r["completion_tokens"] - 1 for r in results if r["verify_steps"]) / steps, 4)
        run["sglang_accept_length"] = round(1 + sum(r["accepted_drafts"] or 0 for r in results) / steps, 4)
        run["completion_tokens_per_verify_step"] = round(tokens / steps, 4)
    return run


def run_benchmark(cfg: RunConfig) -> dict:
    bench = cfg.benchmark
    out = cfg.run_dir / BENCHMARK_DIR
    drafter = cfg.run_dir / DRAFTER_DIR
    if not (drafter / DRAFTER_CONFIG).exists():
        raise DataError(f"{drafter}: no exported drafter here; run the export stage first")
    prompts = held_out_prompts(cfg, SampleTokenizer.for_run(cfg), bench.num_prompts)
    if not prompts:
        raise ValueError("no held-out prompts: raise train.val_fraction or benchmark on more data")
    engine = engine_for(cfg)
    tree = {"num_steps": bench.num_steps, "eagle_topk": bench.eagle_topk, "num_draft_tokens": bench.num_draft_tokens}
    speculation = Speculation(drafter, bench.num_steps)
    runs = {}
    for name, spec in (("baseline", None), ("eagle3", speculation)):
        with serving(cfg, out / f"server-{name}.log", spec, tree if spec else None) as base_url:
            log.info(
                "benchmark: %s on %s: %d prompts, up to %d new tokens, concurrency %d",
                name,
                engine.name,
                len(prompts),
                bench.max_new_tokens,
                bench.concurrency,
            )
            runs[name] = asyncio.run(send_prompts(engine, base_url, prompts, bench.max_new_tokens, bench.concurrency))
        log.info(
            "benchmark: %s: %.1f output tokens/s%s",
            name,
            runs[name]["output_tokens_per_s"],
            f", accept length {runs[name]['accept_length']:.3f}" if "accept_length" in runs[name] else "",
        )

    pairs = zip(runs["baseline"]["requests"], runs["eagle3"]["requests"])
    identical = sum(b["output_ids"] == e["output_ids"] for b, e in pairs)
    report = {
        "engine": engine.name,
        "prompts": len(prompts),
        "max_new_tokens": bench.max_new_tokens,
        "concurrency": bench.concurrency,
        "speculative": {"drafter": str(drafter), **tree},
        "speedup": round(runs["eagle3"]["output_tokens_per_s"] / runs["baseline"]["output_tokens_per_s"], 4),
        "accept_length": runs["eagle3"].get("accept_length"),
        "sglang_accept_length": runs["eagle3"].get("sglang_accept_length"),
        "completion_tokens_per_verify_step": runs["eagle3"].get("completion_tokens_per_verify_step"),
        # Greedy speculation is lossless in exact arithmetic; batched GPU kernels can still flip a near-tie.
        "identical_outputs": f"{identical}/{len(prompts)}",
        **runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cfg.run_dir / BENCHMARK_REPORT, json.dumps(report, indent=2) + "\n")
    plot_benchmark(report, cfg.run_dir / BENCHMARK_PLOT)
    log.info(
        "benchmark: speedup %.2fx, accept length %s, identical outputs %s -> %s",
        report["speedup"],
        report["accept_length"],
        report["identical_outputs"],
        cfg.run_dir / BENCHMARK_REPORT,
    )
    return {k: v for k, v in report.items() if k not in runs} | {
        name: {k: v for k, v in run.items() if k != "requests"} for name, run in runs.items()
    }


def plot_benchmark(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, accept) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["baseline", "eagle3"]
    speed.bar(names, [report[n]["output_tokens_per_s"] for n in names], color=["gray", "tab:blue"])
    speed.set(ylabel="output tokens/s", title=f"speedup {report['speedup']:.2f}x (concurrency {report['concurrency']})")
    lengths = [r["accept_length"] for r in report["eagle3"]["requests"] if "accept_length" in r]
    accept.hist(lengths, bins=min(20, max(len(lengths), 1)), color="tab:blue")
    accept.set(
        xlabel="accept length (tokens per verify step)",
        ylabel="requests",
        title=f"accept length {report['accept_length']} over {report['prompts']} prompts",
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
