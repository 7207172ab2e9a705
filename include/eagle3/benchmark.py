"""Serve the drafter in SGLang and measure what users get: tokens accepted per step and output tokens/s.

    python -m eagle3 benchmark --config RUN_DIR/config.json

Two servers, one after the other, on the box (settings from the config's `server` section), both sent the same
held-out prompts (as evaluate picks them) with greedy decoding at benchmark.concurrency:
  baseline  the target alone
  eagle3    the target with the exported drafter: --speculative-algorithm EAGLE3
            --speculative-draft-model-path RUN_DIR/drafter --speculative-num-steps/-eagle-topk/-num-draft-tokens
Requests go to SGLang's native POST /generate with the prompt's token ids, because its meta_info reports what
speculation did per request: spec_verify_ct (verify steps), spec_num_correct_drafts and completion_tokens.
Accept length is SGLang's scheduler metric (avg_spec_accept_length), the one definition evaluate uses too:
tokens committed per verify step = (accepted drafts + one bonus token per step) / verify steps; the first token,
which prefill produces, is no verify step's. Beside it, labelled, completion tokens / verify steps (meta_info's
spec_accept_length, which counts that first token too). Output tokens/s = all completion tokens / wall time.

Writes RUN_DIR/benchmark/benchmark.json (both runs, per-request figures, the speedup) and benchmark.png; each
server's log is beside them. The servers are stopped however the stage ends (see eagle3.server).
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time

import httpx

from eagle3.data import DataError
from eagle3.fsutil import atomic_write_text

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the progress lines


async def send_prompts(base_url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> dict:
    """Every prompt once, `concurrency` at a time; per-request and whole-run figures."""
    slots = asyncio.Semaphore(concurrency)
    results: list[dict | None] = [None] * len(prompts)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with slots:
            started = time.monotonic()
            response = await client.post(f"{base_url}/generate", json={
                "input_ids": prompts[i], "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
            })
            response.raise_for_status()
            answer = response.json()
            meta = answer["meta_info"]
            results[i] = {
                "completion_tokens": meta["completion_tokens"],
                "verify_steps": meta.get("spec_verify_ct"),
                "correct_drafts": meta.get("spec_num_correct_drafts"),
                "latency_s": round(time.monotonic() - started, 4),
                "output_ids": answer.get("output_ids"),
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
    steps = [r["verify_steps"] for r in results]
    if all(s for s in steps):
        for r in results:
            r["accept_length"] = round(committed_per_step(r), 4)
        run["mean_accept_length"] = round(sum(committed_per_step(r) * r["verify_steps"] for r in results)
                                          / sum(steps), 4)
        run["completion_tokens_per_verify_step"] = round(tokens / sum(steps), 4)
    return run


def committed_per_step(request: dict) -> float:
    """SGLang's accept length of one request: (correct drafts + 1 bonus token per verify step) / verify steps.
    A server whose meta_info lacks spec_num_correct_drafts: completion tokens less prefill's first token."""
    steps = request["verify_steps"]
    if request.get("correct_drafts") is not None:
        return (request["correct_drafts"] + steps) / steps
    return (request["completion_tokens"] - 1) / steps


def run_benchmark(cfg) -> dict:
    from eagle3.data import SampleTokenizer
    from eagle3.evaluate import held_out_prompts
    from eagle3.export import DRAFTER_DIR
    from eagle3.server import sglang_server

    bench = cfg.benchmark
    out = cfg.run_dir / "benchmark"
    drafter = cfg.run_dir / DRAFTER_DIR
    if not (drafter / "config.json").exists():
        raise DataError(f"{drafter}: no exported drafter here; run the export stage first")
    prompts = held_out_prompts(cfg, SampleTokenizer.for_run(cfg), bench.num_prompts)
    if not prompts:
        raise ValueError("no held-out prompts: raise train.val_fraction or benchmark on more data")
    speculative_flags = {
        "speculative-algorithm": "EAGLE3",
        "speculative-draft-model-path": str(drafter),
        "speculative-num-steps": bench.num_steps,
        "speculative-eagle-topk": bench.eagle_topk,
        "speculative-num-draft-tokens": bench.num_draft_tokens,
    }
    runs = {}
    for name, flags in (("baseline", {}), ("eagle3", speculative_flags)):
        with sglang_server(cfg, out / f"server-{name}.log", flags) as base_url:
            log.info("benchmark: %s: %d prompts, up to %d new tokens, concurrency %d", name, len(prompts),
                     bench.max_new_tokens, bench.concurrency)
            runs[name] = asyncio.run(send_prompts(base_url, prompts, bench.max_new_tokens, bench.concurrency))
        log.info("benchmark: %s: %.1f output tokens/s%s", name, runs[name]["output_tokens_per_s"],
                 f", accept length {runs[name]['mean_accept_length']:.3f}" if "mean_accept_length" in runs[name]
                 else "")

    pairs = zip(runs["baseline"]["requests"], runs["eagle3"]["requests"])
    identical = sum(b["output_ids"] == e["output_ids"] for b, e in pairs)
    report = {
        "prompts": len(prompts),
        "max_new_tokens": bench.max_new_tokens,
        "concurrency": bench.concurrency,
        "speculative_flags": speculative_flags,
        "speedup": round(runs["eagle3"]["output_tokens_per_s"] / runs["baseline"]["output_tokens_per_s"], 4),
        "mean_accept_length": runs["eagle3"].get("mean_accept_length"),
        "completion_tokens_per_verify_step": runs["eagle3"].get("completion_tokens_per_verify_step"),
        # Greedy speculation is lossless in exact arithmetic; batched GPU kernels can still flip a near-tie.
        "identical_outputs": f"{identical}/{len(prompts)}",
        **runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "benchmark.json", json.dumps(report, indent=2) + "\n")
    plot_benchmark(report, out / "benchmark.png")
    log.info("benchmark: speedup %.2fx, accept length %s, identical outputs %s -> %s", report["speedup"],
             report["mean_accept_length"], report["identical_outputs"], out / "benchmark.json")
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
    speed.set(ylabel="output tokens/s", title=f"speedup {report['speedup']:.2f}x "
                                              f"(concurrency {report['concurrency']})")
    lengths = [r["accept_length"] for r in report["eagle3"]["requests"] if "accept_length" in r]
    accept.hist(lengths, bins=min(20, max(len(lengths), 1)), color="tab:blue")
    accept.set(xlabel="accept length (tokens per verify step)", ylabel="requests",
               title=f"mean {report['mean_accept_length']} over {report['prompts']} prompts")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
