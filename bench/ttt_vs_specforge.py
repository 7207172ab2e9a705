"""Benchmark: one TTT training step of this project against SpecForge HEAD's on the same objective, CPU, side by
side. Figures, not asserts (issue 42: ours must stay at least 1.2x as fast at T = 2048 and 8192, fp32 and bf16).

    git --git-dir=/work/.mirror/sgl-project+SpecForge/repo worktree add --detach /tmp/specforge HEAD
    .venv/bin/python bench/ttt_vs_specforge.py [--specforge /tmp/specforge] [--lengths 2048 8192]
        [--dtypes fp32 bf16] [--backends sdpa flex_attention] [--repeats 3] [--profile]

SpecForge is imported from its worktree (outside this repository, never installed here). Its one import this
project's venv lacks is triton, which specforge/core/loss.py needs for its GPU loss kernel: a stand-in module lets
the import through, and on CPU the step takes the loss from SpecForge's own reference, specforge.core.loss.
_compute_loss (the same formula the kernel computes, compiled by torch.compile like the rest of SpecForge's CPU
path). Nothing else of SpecForge's is replaced.

Workload: the drafter at the width bench/ttt_memory.py uses (the tiny target's drafter: hidden 256, 4 heads of 64,
4 KV heads, MLP 512, draft vocab 1024 of 4096; other widths by flag), batch 1, random seeded states, one sample of
length T, every position trained. Both drafters start from the same weights (SpecForge's weight names are ours).
One training step on each side, as its trainer takes it from stored states:
  ours       eagle3.stages.train: make_teachers (target lm_head over the stored final states, SpecForge's mask:
             first_draft off), TTTObjective (7 steps, kl), backward, clip_grad_norm_, AdamW
  SpecForge  OnlineEagle3Model (length 7, kl) with its compact teacher (target_hidden_for_compact and the lm_head,
             as its offline trainer passes them), the steps' losses weighted 0.8^i as its trainer sums them,
             backward, clip_grad_norm_, AdamW
bf16: both forwards under torch.autocast("cpu", dtype=torch.bfloat16) over fp32 weights (what training does on a
GPU with torch.autocast("cuda")). SpecForge's attention backend: sdpa, its eager TTT attention ([T, T] scores a
step). Its training configs' default, flex_attention, cannot train on CPU: torch 2.13's flex attention raises
"FlexAttention does not support backward on CPU" (the flag stays for a GPU run). Before timing, one step of
each (compilation, thread pools) is run and their per-step losses compared: the same objective, to rounding.

Timing: the steps alternate (ours, theirs, then theirs, ours, ...), and each side's fastest of --repeats is taken:
on a shared machine a single run can be slowed several times over, and the fastest is the least disturbed. On a
busy machine, --clock cpu --threads 1 times the process's own CPU seconds instead of the wall clock. The
ratio is SpecForge's seconds over ours (above 1: ours is faster). --profile prints torch.profiler's top operators
of one step of each side.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch

import eagle3.stages.train as train
from eagle3.model.drafter import DraftConfig, Eagle3Draft

STEP_DECAY, MAX_GRAD_NORM, TTT_LENGTH = train.STEP_DECAY, 0.5, 7


def import_specforge(path: Path):
    """SpecForge's OnlineEagle3Model and LlamaForCausalLMEagle3 from a worktree at `path`, its GPU loss kernel's
    module imported through a stand-in triton (this CPU venv has none) and its loss taken from SpecForge's reference
    implementation."""
    torch.compile(lambda x: x)  # loads torch's compiler stack, which probes for triton, before the stand-in exists
    sys.path.insert(0, str(path))
    stand_in, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    stand_in.jit, stand_in.language, language.constexpr = (lambda f: f), language, object
    sys.modules.update({"triton": stand_in, "triton.language": language})
    try:
        import specforge.algorithms.eagle3.model as eagle3_model
        import specforge.core.loss as loss
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]

    class ReferenceLoss:  # LogSoftmaxLoss.apply's signature, SpecForge's own torch formula
        apply = staticmethod(loss._compute_loss)

    eagle3_model.LogSoftmaxLoss = ReferenceLoss
    return eagle3_model.OnlineEagle3Model, LlamaForCausalLMEagle3


class Workload:
    """One seeded sample of length t, and the two drafters with the same initial weights."""

    def __init__(self, cfg: DraftConfig, t: int, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg, self.t = cfg, t
        vocab, draft_vocab = cfg.target_vocab_size, cfg.draft_vocab_size
        self.ids = torch.randint(0, vocab, (1, t))
        self.aux = torch.randn(1, t, 3 * cfg.hidden_size)
        self.last = torch.randn(1, t, cfg.hidden_size)
        self.target_lm_head = torch.randn(vocab, cfg.hidden_size) / 4
        self.draft_ids = torch.arange(0, vocab, vocab // draft_vocab)[:draft_vocab]
        self.t2d = torch.zeros(vocab, dtype=torch.bool)
        self.t2d[self.draft_ids] = True
        self.draft = Eagle3Draft(cfg)

    def teachers(self) -> train.Teachers:
        return train.make_teachers(
            self.ids, torch.ones_like(self.ids), self.last, self.target_lm_head, self.draft_ids, self.t2d
        )


class Ours:
    name = "ours"

    def __init__(self, w: Workload, autocast: bool):
        self.w, self.autocast = w, autocast
        self.objective = train.TTTObjective(w.draft, TTT_LENGTH)
        self.optimizer = torch.optim.AdamW([p for p in w.draft.parameters() if p.requires_grad], lr=1e-4)

    def step(self) -> list[float]:
        w = self.w
        teachers = w.teachers()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss, plosses, _, _ = self.objective(w.aux, teachers, w.draft_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.objective.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return plosses.tolist()


class SpecForge:
    name = "SpecForge"

    def __init__(self, w: Workload, autocast: bool, backend: str, classes):
        from transformers import LlamaConfig

        online_model, draft_class = classes
        cfg = w.cfg
        config = LlamaConfig(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            max_position_embeddings=cfg.max_position_embeddings,
            vocab_size=cfg.target_vocab_size,
            hidden_act="silu",
            pad_token_id=0,
            tie_word_embeddings=False,
        )
        config.draft_vocab_size = cfg.draft_vocab_size
        draft = draft_class(config, attention_backend=backend)
        state = {**w.draft.state_dict(), "t2d": w.t2d, "d2t": w.draft_ids - torch.arange(len(w.draft_ids))}
        draft.load_state_dict(state, strict=True)
        draft.embed_tokens.weight.requires_grad_(False)  # the target's, frozen (SpecForge's freeze_embedding)
        self.w, self.autocast, self.draft = w, autocast, draft
        self.model = online_model(draft, length=TTT_LENGTH, attention_backend=backend)
        self.optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
        # Its data pipeline hands over ids and final states shifted once, and the loss mask as [B, T, 1]; the mask
        # is ours (SpecForge's: every position but the last), so that both train the same positions.
        self.loss_mask = w.teachers().loss_mask[..., None].long()

    def step(self) -> list[float]:
        w = self.w
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            plosses, *_ = self.model(
                input_ids=train.shift_left(w.ids),
                attention_mask=torch.ones_like(w.ids),
                target=None,
                loss_mask=self.loss_mask,
                hidden_states=w.aux,
                target_hidden_for_compact=train.shift_left(w.last),
                target_head_weight=w.target_lm_head,
            )
        loss = sum(STEP_DECAY**i * ploss for i, ploss in enumerate(plosses))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return [float(p.detach()) for p in plosses]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(side, clock) -> float:
    started = clock()
    side.step()
    return clock() - started


def profile(side) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step()
    print(f"--- {side.name}: top operators by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def compare(
    cfg: DraftConfig, t: int, dtype: str, backend: str, repeats: int, classes, show_profile: bool, clock
) -> dict:
    autocast = dtype == "bf16"
    ours = Ours(Workload(cfg, t), autocast)
    theirs = SpecForge(Workload(cfg, t), autocast, backend, classes)
    ours_losses, their_losses = ours.step(), theirs.step()  # also compiles and warms up
    loss_diff = max(abs(a - b) for a, b in zip(ours_losses, their_losses))
    times = {"ours": [], "SpecForge": []}
    for repeat in range(repeats):
        for side in (ours, theirs) if repeat % 2 == 0 else (theirs, ours):
            times[side.name].append(timed(side, clock))
    if show_profile:
        profile(ours)
        profile(theirs)
    ours_s, theirs_s = min(times["ours"]), min(times["SpecForge"])
    return {
        "t": t,
        "dtype": dtype,
        "backend": backend,
        "ours_s": ours_s,
        "specforge_s": theirs_s,
        "ratio": theirs_s / ours_s,
        "loss_diff": loss_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--specforge",
        type=Path,
        default=Path("/tmp/specforge"),
        help="a SpecForge worktree (git worktree add from its mirror)",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=["sdpa", "flex_attention"],
        default=["sdpa"],
        help="SpecForge's attention backend(s); flex_attention has no backward on CPU (torch 2.13)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per side; the fastest is taken")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--draft-vocab", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="torch.profiler's top operators, one step a side")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: seconds of the step (an idle machine); cpu: this process's CPU seconds, which "
        "other tenants of a busy machine disturb far less (with --threads 1: no waits between threads)",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = DraftConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=max(args.lengths) + TTT_LENGTH,
        target_vocab_size=args.vocab,
        draft_vocab_size=args.draft_vocab,
        aux_layer_ids=(1, 2, 3),
    )
    classes = import_specforge(args.specforge)
    print(
        f"drafter hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim} "
        f"({cfg.num_key_value_heads} KV), MLP {cfg.intermediate_size}, draft vocab {cfg.draft_vocab_size} of "
        f"{cfg.target_vocab_size}; batch 1, "
        f"{TTT_LENGTH} TTT steps, kl; {torch.get_num_threads()} threads; {args.clock} clock, fastest of "
        f"{args.repeats}, alternating"
    )
    print(
        f"{'T':>6} {'dtype':>5} {'SpecForge attention':>20} {'ours s':>8} {'SpecForge s':>11} {'ratio':>7}  "
        "max |ploss diff| of the first steps"
    )
    for t in args.lengths:
        for dtype in args.dtypes:
            for backend in args.backends:
                r = compare(cfg, t, dtype, backend, args.repeats, classes, args.profile, CLOCKS[args.clock])
                print(
                    f"{t:>6} {dtype:>5} {backend:>20} {r['ours_s']:>8.3f} {r['specforge_s']:>11.3f} "
                    f"{r['ratio']:>6.2f}x  {r['loss_diff']:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
