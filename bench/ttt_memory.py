"""Benchmark: the TTT attention's memory and speed against the sequence length T, the old dense attention
(eagle3.model.ttt_attention.dense_ttt_attention, [B, heads, T, T] scores per step) against the kernel training uses
(eagle3.model.ttt_attention.ttt_attention). Figures, not asserts.

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

    .venv/bin/python bench/ttt_memory.py --model

The memory model instead (the section "the memory model" below): the TTT step's peak on one GPU by part, from the
drafter's shape, T and the precision, with the loss in chunks (TTTObjective's default) and whole (the code before
issue 42). It is checked here twice: its activation counts against autograd's saved tensors at two small widths,
fp32 and bf16 autocast, chunks and whole; and forward + backward against the resident peak measured in fresh
processes at the tiny target's drafter, fp32 (the loss in chunks of 256 positions, and whole). Then it prints
Kimi-K2's drafter at T = 8k, 16k, 32k, and whether each fits an H100 80GB and an H200 141GB.
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

import eagle3.stages.train as train
from eagle3.model.drafter import DraftConfig, Eagle3Draft
from eagle3.model.ttt_attention import dense_ttt_attention, ttt_attention

KERNELS = {"old": dense_ttt_attention, "new": ttt_attention}
CFG = DraftConfig(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=65536,
    target_vocab_size=4096,
    draft_vocab_size=1024,
    aux_layer_ids=(1, 2, 3),
)
TTT_LENGTH = 7


def workload(kernel: str, t: int, seed: int = 0, logit_chunk: int | None = None):
    """The drafter with `kernel`'s attention, the TTT objective (its loss in chunks of `logit_chunk` positions;
    None: TTTObjective's default), and one sample of length t (random, seeded)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(CFG)
    draft.midlayer.self_attn.attention = KERNELS[kernel]
    target_lm_head = torch.randn(CFG.target_vocab_size, CFG.hidden_size) / 4
    draft_ids = torch.arange(0, CFG.target_vocab_size, CFG.target_vocab_size // CFG.draft_vocab_size)
    t2d = torch.zeros(CFG.target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    ids = torch.randint(0, CFG.target_vocab_size, (1, t))
    aux, last = torch.randn(1, t, 3 * CFG.hidden_size), torch.randn(1, t, CFG.hidden_size)

    def teachers():
        return train.make_teachers(ids, torch.ones_like(ids), last, target_lm_head, draft_ids, t2d, first_draft=True)

    return draft, train.TTTObjective(draft, TTT_LENGTH, logit_chunk=logit_chunk), aux, teachers, draft_ids


def proc_status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def measure_point(kernel: str, t: int, repeats: int, logit_chunk: int | None = None) -> dict:
    """In this (fresh) process: the peak resident memory of the first forward + backward of the TTT sequence, and
    the fastest of `repeats` such runs."""
    draft, objective, aux, teachers, draft_ids = workload(kernel, 64, logit_chunk=min(logit_chunk or 64, 32))
    objective(aux, teachers(), draft_ids)[0].backward()  # thread pools and kernels set up, not counted
    draft, objective, aux, teachers, draft_ids = workload(kernel, t, logit_chunk=logit_chunk)
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


def run_point(kernel: str, t: int, repeats: int, logit_chunk: int | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--point", kernel, str(t), str(repeats), str(logit_chunk or 0)],
        capture_output=True,
        text=True,
    )
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
        ratios = (
            f"{old['peak_bytes'] / new['peak_bytes']:8.1f}x",
            f"{old['seconds'] / new['seconds']:8.2f}x",
            f"{diff:.2e}",
        )
    else:
        ratios = (f"{'-':>9}", f"{'-':>9}", "-")
    return f"{t:>6}  {mib(old)} {mib(new)} {ratios[0]}  {rate(old)} {rate(new)} {ratios[1]}  {ratios[2]}"


# -- the memory model ----------------------------------------------------------------------------
#
# The TTT step's peak memory on one GPU, from the drafter's shape, the length T and the precision. Its parts:
#   resident     trainable weights (fp32 masters), their gradients and AdamW's two moments: 16 bytes a parameter;
#                under autocast their bf16 copies too (2 bytes; autograd keeps them for backward); the frozen
#                embedding and the target's lm_head, both [target vocab, H] fp32 as the Trainer holds them
#   batch        the stored states as Trainer reads them: aux [T, 3H] and the final state [T, H], fp32
#   teachers     p [T, draft vocab] fp32 and per-position ids, masks and mass (make_teachers)
#   activations  what autograd keeps for backward: per token and TTT step, and per token once (step 0's hidden
#                state; in chunks, nothing else: the teacher p the checkpoints hold is `teachers`)
#   transient    during backward: one step's activation gradients at a time, plus the loss's working set
#                (in chunks: one chunk's logits recomputed, their log-softmax, product and gradient; whole: a
#                step's [T, draft vocab] gradients); before forward, make_teachers' own (its full-vocab chunk)
# The activation coefficients were counted, not guessed: autograd's saved tensors (saved_tensors_hooks, distinct
# storages) at eight small geometries varying H, heads, head_dim, KV heads, MLP width and draft vocab, T and the
# TTT length one at a time, fit exactly (zero residual) by bytes per token =
#   fp32:      40 H + 16 heads*head_dim + 16 I + 8 head_dim + 4 heads + 21    a step   (+ 8 Vd - 9 unchunked)
#   bf16 (CPU autocast, as the GPU's): 42 H + 8 heads*head_dim + 8 I + 8 head_dim + 4 heads + 21  (unchunked: 40 H,
#              + 8 Vd - 9)
#   once:      4 H (fp32) / 6 H (bf16)
# i.e. ten [T, H] fp32 tensors a step (the norms work in fp32), four of width heads*head_dim (q, the repeated k and
# v, the attention output) and four of width I (gate, up, silu, their product), RoPE's cos and sin, the attention's
# log-sum-exp; unchunked, each step's log-softmax and teacher product [T, Vd] fp32. `--model` checks the counts
# again at other widths, and the whole forward + backward against resident peaks measured here.

GIB = 2**30
GPU_BYTES = {"H100 80GB": 81_559 * 2**20, "H200 141GB": 143_771 * 2**20}  # what nvidia-smi reports as total
ADAMW_BYTES = 4 + 4 + 8  # fp32 master, gradient, two moments


def trainable_params(cfg: DraftConfig) -> int:
    h, attn, kv, i = (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    norms = (4 + (len(cfg.aux_layer_ids) if getattr(cfg, "fc_norm", False) else 0)) * h
    return (
        len(cfg.aux_layer_ids) * h * h
        + 2 * h * (attn + 2 * kv)
        + attn * h
        + 3 * h * i
        + norms
        + cfg.draft_vocab_size * h
    )


def activation_bytes_per_token(cfg: DraftConfig, bf16: bool, chunked: bool) -> tuple[float, float]:
    """(bytes autograd keeps per token and TTT step, per token once), as counted (above)."""
    h, attn, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size
    wide = 8 if bf16 else 16  # q, k, v, attention output and the MLP's four: bf16 matmul outputs under autocast
    step = (42 if bf16 and chunked else 40) * h + wide * (attn + i) + 8 * cfg.head_dim + 4 * cfg.num_attention_heads
    step += 21 if chunked else 8 * cfg.draft_vocab_size + 12
    return step, (6 if bf16 else 4) * h


def memory_model(cfg: DraftConfig, t: int, bf16: bool, chunked: bool, batch: int = 1, ttt: int = TTT_LENGTH) -> dict:
    """The TTT training step's memory in bytes by part, and its peak (`peak`), for `batch` samples of length t."""
    tokens, vocab, draft_vocab, h = batch * t, cfg.target_vocab_size, cfg.draft_vocab_size, cfg.hidden_size
    params = trainable_params(cfg)
    per_step, once = activation_bytes_per_token(cfg, bf16, chunked)
    rows = min(tokens, train.LOGIT_LOSS_ELEMENTS // draft_vocab) if chunked else tokens
    parts = {
        "weights, gradients, AdamW": ADAMW_BYTES * params,
        "bf16 weight copies": 2 * params if bf16 else 0,
        "frozen embedding + target lm_head": 2 * 4 * vocab * h,
        "batch (aux + final states)": tokens * 16 * h,
        "teachers": tokens * (4 * draft_vocab + 18),
        "activations": tokens * (ttt * per_step + once),
        "backward transient": tokens * per_step + (rows * draft_vocab * 16 if chunked else tokens * draft_vocab * 8),
    }
    before_forward = tokens * (8 * h + 8 * draft_vocab) + train.LOGIT_CHUNK * vocab * 8  # make_teachers' own
    fixed = sum(v for k, v in parts.items() if k not in ("activations", "backward transient"))
    parts["peak"] = fixed + max(before_forward, parts["activations"] + parts["backward transient"])
    return parts


def saved_bytes(cfg: DraftConfig, t: int, bf16: bool, logit_chunk: int) -> int:
    """Bytes of the distinct storages autograd keeps over the objective's forward (weights, their bf16 copies,
    the batch and the teacher p left out: what activation_bytes_per_token counts)."""
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    vocab, draft_vocab = cfg.target_vocab_size, cfg.draft_vocab_size
    ids, aux, last = (
        torch.randint(0, vocab, (1, t)),
        torch.randn(1, t, 3 * cfg.hidden_size),
        torch.randn(1, t, cfg.hidden_size),
    )
    draft_ids = torch.arange(0, vocab, vocab // draft_vocab)[:draft_vocab]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    teachers = train.make_teachers(
        ids, torch.ones_like(ids), last, torch.randn(vocab, cfg.hidden_size), draft_ids, t2d, first_draft=True
    )
    left_out = {x.untyped_storage().data_ptr() for x in (*draft.parameters(), aux, teachers.p, teachers.draft_mass)}
    storages = {}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in left_out and t in x.shape:  # per position (not the weights' bf16 copies)
            storages[storage.data_ptr()] = storage.nbytes()
        return x

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
    ):
        train.TTTObjective(draft, TTT_LENGTH, logit_chunk=logit_chunk)(aux, teachers, draft_ids)
    return sum(storages.values())


def kimi_drafter() -> DraftConfig:
    """Kimi-K2's drafter as this project derives it (eagle3.target.drafter_shape from Kimi-K2's config.json:
    hidden 7168, intermediate 18432, vocab 163840): 56 heads of 128, 8 KV heads, MLP 18432; draft vocab 32000."""
    from eagle3.config import DrafterConfig
    from eagle3.target import drafter_shape

    target = {"hidden_size": 7168, "intermediate_size": 18432, "vocab_size": 163840, "rope_theta": 50000.0}
    g = drafter_shape(DrafterConfig(), target)
    return DraftConfig(
        hidden_size=7168,
        intermediate_size=g["intermediate_size"],
        num_attention_heads=g["num_attention_heads"],
        num_key_value_heads=g["num_key_value_heads"],
        head_dim=g["head_dim"],
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=131072,
        target_vocab_size=163840,
        draft_vocab_size=32000,
        aux_layer_ids=(2, 30, 58),
    )


def memory_model_report(check_lengths=(1024, 2048, 4096), chunk: int = 256) -> None:
    print("1. activation counts against autograd's saved tensors (bytes, T = 96, 7 steps):")
    for cfg in (
        DraftConfig(
            hidden_size=40,
            intermediate_size=72,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=8,
            rms_norm_eps=1e-6,
            rope_theta=1e4,
            max_position_embeddings=512,
            target_vocab_size=600,
            draft_vocab_size=300,
            aux_layer_ids=(1, 2, 3),
        ),
        CFG,
    ):
        for bf16 in (False, True):
            for chunked in (True, False):
                counted = saved_bytes(cfg, 96, bf16, 16 if chunked else 96)
                per_step, once = activation_bytes_per_token(cfg, bf16, chunked)
                print(
                    f"   hidden {cfg.hidden_size:>4} {'bf16' if bf16 else 'fp32'} {'chunks' if chunked else 'whole '}"
                    f"  model {96 * (TTT_LENGTH * per_step + once):>10.0f}  counted {counted:>10}"
                )
    print(
        f"2. forward + backward against resident peaks measured here (fp32, CPU, the tiny target's drafter, "
        f"loss in chunks of {chunk} positions or whole; each a fresh process; MiB):"
    )
    for t in check_lengths:
        for chunked in (True, False):
            point = run_point("new", t, 1, chunk if chunked else t)
            m = memory_model(CFG, t, bf16=False, chunked=chunked)
            m_rows = min(t, chunk) if chunked else t  # this check's chunk, not the default's
            model = (
                m["activations"]
                + t * activation_bytes_per_token(CFG, False, chunked)[0]
                + (m_rows * CFG.draft_vocab_size * 16 if chunked else t * CFG.draft_vocab_size * 8)
                + 4 * trainable_params(CFG)
            )  # gradients, allocated by this first backward
            measured = point.get("peak_bytes")
            print(
                f"   T {t:>5} {'chunks' if chunked else 'whole '}  model {model / 2**20:8.1f}  measured "
                f"{measured / 2**20 if measured else float('nan'):8.1f}  model/measured "
                f"{model / measured if measured else float('nan'):.2f}",
                flush=True,
            )
    kimi = kimi_drafter()
    print(
        f"3. Kimi-K2's drafter (hidden {kimi.hidden_size}, {kimi.num_attention_heads} heads x {kimi.head_dim}, "
        f"{kimi.num_key_value_heads} KV, MLP {kimi.intermediate_size}, draft vocab {kimi.draft_vocab_size} of "
        f"{kimi.target_vocab_size}; {trainable_params(kimi) / 1e9:.2f}B trained parameters), one GPU, one sample, "
        f"7 TTT steps, bf16 autocast over fp32 masters; GiB:"
    )
    names = list(memory_model(kimi, 8192, True, True))
    print(f"   {'T':>6} {'loss':>7}  " + "  ".join(f"{n[:18]:>18}" for n in names) + "  H100 80GB  H200 141GB")
    for t in (8192, 16384, 32768):
        for chunked in (False, True):
            m = memory_model(kimi, t, bf16=True, chunked=chunked)
            fits = ["fits" if m["peak"] <= cap * 0.95 else "no" for cap in GPU_BYTES.values()]
            print(
                f"   {t:>6} {'chunks' if chunked else 'whole':>7}  "
                + "  ".join(f"{m[n] / GIB:>18.1f}" for n in names)
                + f"  {fits[0]:>9}  {fits[1]:>10}"
            )
    print(
        "   (fits: the peak within 95% of the card's memory (H100 81,559 MiB, H200 143,771 MiB), the rest left to "
        "CUDA's context and fragmentation)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument(
        "--old-max", type=int, default=4096, help="longest T for the old attention (8192 would take about 13 GB here)"
    )
    parser.add_argument("--step-length", type=int, default=2048)
    parser.add_argument("--step-repeats", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs per point; the fastest is the one timed")
    parser.add_argument(
        "--model",
        action="store_true",
        help="the memory model instead: checked here at small widths, then Kimi-K2's drafter",
    )
    parser.add_argument("--point", nargs=4, help=argparse.SUPPRESS)  # KERNEL T REPEATS CHUNK: one child process
    args = parser.parse_args()
    if args.point:
        kernel, t, repeats, chunk = args.point
        print(json.dumps(measure_point(kernel, int(t), int(repeats), int(chunk) or None)))
        return
    if args.model:
        memory_model_report()
        return

    print(
        f"drafter hidden {CFG.hidden_size}, {CFG.num_attention_heads} heads x {CFG.head_dim}, MLP "
        f"{CFG.intermediate_size}, draft vocab {CFG.draft_vocab_size}; batch 1, {TTT_LENGTH} TTT steps, fp32, "
        f"{torch.get_num_threads()} threads; forward + backward of the TTT objective"
    )
    print(
        f"{'T':>6}  {'old peak MiB':>12} {'new peak MiB':>12} {'old/new':>8}  {'old tok/s':>9} {'new tok/s':>9} "
        f"{'new/old':>8}  max |loss diff| per TTT position"
    )
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
            print(
                f"{kernel}: peak memory ~ T^{fitted_exponent(points):.2f} (T = {points[0]['t']}..{points[-1]['t']}; "
                f"between the last two points T^{fitted_exponent(points[-2:]):.2f})"
            )

    t = args.step_length
    times = {"old": [], "new": []}
    for repeat in range(args.step_repeats):
        for kernel in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
            times[kernel].append(training_step_seconds(kernel, t))
    old_s, new_s = min(times["old"]), min(times["new"])
    print(
        f"one training step at T={t} (fastest of {args.step_repeats}): old {old_s:.3f} s, new {new_s:.3f} s, "
        f"new is {old_s / new_s:.2f}x as fast"
    )


if __name__ == "__main__":
    main()
