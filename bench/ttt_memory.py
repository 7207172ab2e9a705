"""Benchmark: the TTT attention's memory and speed against the sequence length T, the old dense attention
(eagle3.ttt_attention.dense_ttt_attention, [B, heads, T, T] scores per step) against the kernel training uses
(eagle3.ttt_attention.ttt_attention). Figures, not asserts.

    .venv/bin/python bench/ttt_memory.py [--lengths 1024 2048 4096 8192 16384] [--old-max 4096]

Workload: the drafter at a width that fits this 2-core VM (hidden 256, 4 heads of 64, 4 KV heads, MLP 512,
draft vocab 1024 of 4096: the tiny target's drafter), batch 1, the TTT objective (train.TTTObjective, 7 steps,
SpecForge's loss on random teachers) forward and backward: one TTT step sequence as training runs it, fp32.

Peak memory: the process's resident high-water mark (VmHWM in /proc/self/status) over that forward and backward,
less the resident size just before it, each point in a fresh process. Resident memory, because it is what runs a
box out of memory, and it counts everything: the tensors autograd keeps, the temporaries of forward and backward,
and the fused kernel's own buffers, which no Python-level tracker sees (tracemalloc sees only Python's allocator,
not torch's; torch has no allocator statistics on CPU). Each process first runs a 64-token sequence (thread pools,
kernel set-up) and then resets the mark (writing 5 to /proc/self/clear_refs), so the figure is what the length
costs. A fresh process per point, because a process's allocator keeps freed memory. Tokens/s: T over the
wall time of that forward + backward, the fastest of --repeats (other tenants of this VM's 2 cores, invisible
to ps, slow single runs by up to 10x). The growth exponent is the slope of log(peak) against log(T),
least squares over the points measured, and between the last two (at this width the old attention's T^2 part
overtakes the linear rest, logits and MLP, only near 4096: its exponent tends to 2 from below); the loss per TTT
position is compared at every T both ran.

Then one full training step at T=2048 as Trainer.train_step takes it minus reading the store (teachers from a
full-vocab lm_head, the objective, backward, gradient clipping, AdamW), old and new alternating, the fastest of
five each (the least disturbed by other tenants), and their ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import eagle3.train as train
from eagle3.model import DraftConfig, Eagle3Draft
from eagle3.ttt_attention import dense_ttt_attention, ttt_attention

KERNELS = {"old": dense_ttt_attention, "new": ttt_attention}
CFG = DraftConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                  rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=65536, target_vocab_size=4096,
                  draft_vocab_size=1024, aux_layer_ids=(1, 2, 3))
TTT_LENGTH = 7


def workload(kernel: str, t: int, seed: int = 0):
    """The drafter with `kernel`'s attention, the TTT objective, and one sample of length t (random, seeded)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(CFG)
    draft.midlayer.self_attn.attention = KERNELS[kernel]
    target_lm_head = torch.randn(CFG.target_vocab_size, CFG.hidden_size) / 4
    draft_ids = torch.arange(0, CFG.target_vocab_size, CFG.target_vocab_size // CFG.draft_vocab_size)
    t2d = torch.zeros(CFG.target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    ids = torch.randint(0, CFG.target_vocab_size, (1, t))
    aux, last = torch.randn(1, t, 3 * CFG.hidden_size), torch.randn(1, t, CFG.hidden_size)
    teachers = lambda: train.make_teachers(ids, torch.ones_like(ids), last, target_lm_head,  # noqa: E731
                                           draft_ids, t2d, first_draft=True)
    return draft, train.TTTObjective(draft, TTT_LENGTH), aux, teachers, draft_ids


def proc_status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def measure_point(kernel: str, t: int, repeats: int) -> dict:
    """In this (fresh) process: the peak resident memory of the first forward + backward of the TTT sequence, and
    the fastest of `repeats` such runs."""
    draft, objective, aux, teachers, draft_ids = workload(kernel, 64)
    objective(aux, teachers(), draft_ids)[0].backward()  # thread pools and kernels set up, not counted
    draft, objective, aux, teachers, draft_ids = workload(kernel, t)
    t_ = teachers()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before, times, peak = proc_status("VmRSS"), [], None
    for _ in range(repeats):
        draft.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss, plosses, *_ = objective(aux, t_, draft_ids)
        loss.backward()
        times.append(time.perf_counter() - started)
        # the first run's: a later one may find freed memory scattered over the allocator's arenas and map more
        peak = peak or proc_status("VmHWM") - before
    return {"kernel": kernel, "t": t, "peak_bytes": peak, "seconds": min(times), "plosses": plosses.tolist()}


def run_point(kernel: str, t: int, repeats: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--point", kernel, str(t), str(repeats)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"kernel": kernel, "t": t, "error": (proc.stderr.strip().splitlines() or ["killed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def training_step_seconds(kernel: str, t: int) -> float:
    draft, objective, aux, teachers, draft_ids = workload(kernel, t)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    started = time.perf_counter()
    loss, *_ = objective(aux, teachers(), draft_ids)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(objective.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def fitted_exponent(points: list[dict]) -> float:
    return float(np.polyfit(np.log([p["t"] for p in points]), np.log([p["peak_bytes"] for p in points]), 1)[0])


def row(t: int, old: dict | None, new: dict | None) -> str:
    mib = lambda p: f"{p['peak_bytes'] / 2**20:12.1f}" if p else f"{'-':>12}"  # noqa: E731
    rate = lambda p: f"{t / p['seconds']:9.0f}" if p else f"{'-':>9}"  # noqa: E731
    if old and new:
        diff = max(abs(a - b) for a, b in zip(old["plosses"], new["plosses"]))
        ratios = (f"{old['peak_bytes'] / new['peak_bytes']:8.1f}x", f"{old['seconds'] / new['seconds']:8.2f}x",
                  f"{diff:.2e}")
    else:
        ratios = (f"{'-':>9}", f"{'-':>9}", "-")
    return f"{t:>6}  {mib(old)} {mib(new)} {ratios[0]}  {rate(old)} {rate(new)} {ratios[1]}  {ratios[2]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--old-max", type=int, default=4096,
                        help="longest T for the old attention (8192 would take about 13 GB here)")
    parser.add_argument("--step-length", type=int, default=2048)
    parser.add_argument("--step-repeats", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs per point; the fastest is the one timed")
    parser.add_argument("--point", nargs=3, help=argparse.SUPPRESS)  # KERNEL T REPEATS: one child process
    args = parser.parse_args()
    if args.point:
        print(json.dumps(measure_point(args.point[0], int(args.point[1]), int(args.point[2]))))
        return

    print(f"drafter hidden {CFG.hidden_size}, {CFG.num_attention_heads} heads x {CFG.head_dim}, MLP "
          f"{CFG.intermediate_size}, draft vocab {CFG.draft_vocab_size}; batch 1, {TTT_LENGTH} TTT steps, fp32, "
          f"{torch.get_num_threads()} threads; forward + backward of the TTT objective")
    print(f"{'T':>6}  {'old peak MiB':>12} {'new peak MiB':>12} {'old/new':>8}  {'old tok/s':>9} {'new tok/s':>9} "
          f"{'new/old':>8}  max |loss diff| per TTT position")
    results = {"old": [], "new": []}
    for t in args.lengths:
        old = run_point("old", t, args.repeats) if t <= args.old_max else None
        new = run_point("new", t, args.repeats)
        for point in (old, new):
            if point and "error" in point:
                print(f"{t:>6}  {point['kernel']}: failed: {point['error']}")
            elif point:
                results[point["kernel"]].append(point)
        print(row(t, old if old and "error" not in old else None, new if "error" not in new else None), flush=True)
    for kernel, points in results.items():
        if len(points) >= 2:
            print(f"{kernel}: peak memory ~ T^{fitted_exponent(points):.2f} (T = {points[0]['t']}..{points[-1]['t']}; "
                  f"between the last two points T^{fitted_exponent(points[-2:]):.2f})")

    t = args.step_length
    times = {"old": [], "new": []}
    for repeat in range(args.step_repeats):
        for kernel in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
            times[kernel].append(training_step_seconds(kernel, t))
    old_s, new_s = min(times["old"]), min(times["new"])
    print(f"one training step at T={t} (fastest of {args.step_repeats}): old {old_s:.3f} s, new {new_s:.3f} s, "
          f"new is {old_s / new_s:.2f}x as fast")


if __name__ == "__main__":
    main()
