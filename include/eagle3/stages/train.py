"""Training the EAGLE-3 drafter with training-time test (TTT), exactly resumable.

    python -m eagle3 train --config RUN_DIR/config.json

One rank per `train.gpus` entry (or `train.nproc_per_node`): with more than one, the command re-runs
itself under torchrun (`launch_command`), with CUDA_VISIBLE_DEVICES set to those GPUs; DDP over nccl,
gloo on CPU. Under an outside torchrun it just joins.

Reads the hidden-state store and the vocab mapping; writes {run dir}/train/:
  checkpoints/step-NNNNNN/   plain-dict checkpoints (eagle3.records.checkpoint); the last `train.keep_last` are kept,
                             plus the best (by the offline acceptance length on the validation split)
  metrics.jsonl              one line per progress interval and per validation
  tensorboard/               the same as TensorBoard events (tensorboard --logdir RUN_DIR/train/tensorboard)
  loss.png, accuracy.png     at the end
A restart continues from the newest checkpoint with model, optimizer, schedule, RNG and data position
restored: the final weights are bit-identical to an uninterrupted run (tests/test_train.py kills one).

The objective (SpecForge's, which SGLang-served drafters are trained with):
  shift once   the teacher at position t is the target's distribution after token t+1: the stored final
               hidden state and the input ids are shifted left by one (zero fill); the loss mask is not
               shifted and each sample's own last position is 0
  decoding's   (train.first_draft_position, on by default; off: SpecForge's mask exactly) only the drafts
  drafts       decoding makes: from the answer's first draft after prefill (the prompt's last token) to its end of
               turn, each TTT step only while its chain stays in the answer; never a target after the end of turn
  teachers     target logits = target lm_head(final hidden state); teacher token = argmax over the FULL
               vocab (in chunks); p = softmax over the draft-vocab columns, fp32;
               position_mask = t2d[teacher] * loss_mask
  TTT step i   the previous step's output is the next hidden input; ids, p, teacher and masks shift left
               by one after each step; RoPE positions are offset by i
  loss         sum_i 0.8^i * ploss_i, ploss_i = sum(position_mask * -sum(p * log_softmax(logits))) / (B*T)
               (train.objective "kl", the default); or an LK loss (train.objective "lk_lambda" / "lk_alpha";
               Samarin et al. 2026, arXiv 2602.23881, SpecForge's lk_loss_type), which targets the expected
               acceptance alpha_i = masked mean of sum_v min(p_full(v), q(v)) over the draft vocab directly, p_full
               being the target's full-vocab distribution (not renormalised: the drafter cannot propose the rest):
               lk_lambda  w_i * ploss_i + (1 - w_i) * (1 - alpha_i), w_i = exp(-train.lk_kl_decay * alpha_i) (no
                          gradient through w_i): KL while the drafter is poor, acceptance once it is good
               lk_alpha   -mean(log sum_v min(p_full, q)) over the same positions
  accuracy     acc_i = #(d2t-mapped draft argmax == teacher where loss_mask) / #loss_mask
  memory       each step's logits, loss terms and accuracy are taken a chunk of positions at a time, checkpointed
               (TTTObjective): no step keeps [T, draft vocab] tensors for backward, so long contexts train
  offline      acceptance length per k of evaluate.draft_lengths: greedy speculative decoding replayed on the
               validation split's stored states (eagle3.model.acceptance): what evaluate measures, up to the prompts
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3.config import ConfigError, RunConfig
from eagle3.data.store import open_run_store
from eagle3.disk.fsutil import atomic_dir, atomic_write_text
from eagle3.disk.layout import (
    ACCURACY_PLOT,
    CHECKPOINTS,
    LOSS_PLOT,
    MAPPING_DIR,
    TRAIN_INIT,
    TRAIN_METRICS,
    TRAIN_SUMMARY,
    TRAIN_TENSORBOARD,
    WEIGHTS,
)
from eagle3.jobs.progress import beat, human_duration
from eagle3.model.acceptance import committed_tokens, replay
from eagle3.model.acceptance import figures as acceptance_figures
from eagle3.model.drafter import LM_HEAD_KEYS, Eagle3Draft, Rows, build_draft_model, load_target_tensor
from eagle3.records.checkpoint import BEST_BY, checkpoint_dirs, load_checkpoint, read_meta, save_checkpoint
from eagle3.records.lineage import Lineage, weights_digest
from eagle3.stages.split import EVALUATION, TRAINING, VALIDATION, run_split
from eagle3.stages.vocab import load_mapping

log = logging.getLogger(__name__)

STEP_DECAY = 0.8
INIT_RECORD = "init.json"  # in RUN_DIR/train/init/: which promoted version a warm start copied, and its digest
LOGIT_CHUNK = 2048  # positions per full-vocab matmul when looking for the teacher token
LOGIT_LOSS_ELEMENTS = 1 << 26  # draft-vocab logits per chunk of a TTT step's loss (256 MiB in fp32; TTTObjective)
# Padded tokens per validation pass (several of training's batches at once; Trainer.validate): the demo's 256-token
# batches by about 60, none of a one-sample-a-step run's long samples (a pass holds [tokens, draft vocab] teachers)
VAL_BATCH_TOKENS = 1 << 14


# -- the objective: pure functions ------------------------------------------------------------


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """x[:, t] <- x[:, t+1], zero at the end (dim 1 is time)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


@dataclass
class Teachers:
    input_ids: torch.Tensor  # [B, T] ids shifted once: the token after each position
    p: torch.Tensor  # [B, T, Vd] target distribution over the draft vocab, fp32
    teacher: torch.Tensor  # [B, T] the target's argmax over its full vocab
    in_draft_vocab: torch.Tensor  # [B, T] the teacher is a draft-vocab token (t2d[teacher])
    loss_mask: torch.Tensor  # [B, T] positions trained at TTT step 0
    draft_mass: torch.Tensor  # [B, T] the target's full-vocab probability of the draft vocab (p_full = p * it)
    chained: bool = False  # step i trains only where every step before it did (chains that stay in the answer)

    @property
    def position_mask(self) -> torch.Tensor:
        """Step 0's loss positions: trained, with a teacher the drafter can propose."""
        return self.in_draft_vocab & self.loss_mask


def make_teachers(
    input_ids,
    loss_mask,
    last_hidden,
    target_lm_head,
    draft_ids,
    t2d,
    lengths=None,
    first_draft: bool = False,
    only_read: bool = False,
) -> Teachers:
    """Targets for one padded batch. Never builds [T, full vocab] logits for a whole sample at once.

    loss_mask: [B, T] the answer tokens (assistant turns). lengths: [B] each sample's own length (None: all fill
    the batch); its last position has no teacher (the state after it is padding), so it is masked per sample.
    first_draft: train the drafts decoding makes, and only those: position t drafts once tokens t+1 and t+2 are
    the answer's (from the prompt's last token, where the first draft after prefill starts, to two before the end
    of turn), and TTT step i only while tokens up to t+2+i are (chains never run past the end of turn). Without
    it, SpecForge's mask: every answer token's position, shifted along each step, targets after the end of turn
    included. only_read: p, teacher and draft_mass only where TTTObjective reads them, zero elsewhere: TTT step i
    at t reads position t+i, which step 0 trains (step_masks) or decoding drafts from (decoding_masks), for any
    i; the rest of a padded batch (prompts, padding) never needs the target's logits."""
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    if lengths is None:
        lengths = torch.full(loss_mask.shape[:1], loss_mask.shape[1], device=loss_mask.device)
    answer = loss_mask.bool() & (positions[None] < lengths[:, None])
    if first_draft:
        trained = drafted(answer)
    else:
        trained = answer & (positions[None] < lengths[:, None] - 1)
    b, n = loss_mask.shape
    rows = rows_of(trained | drafted(answer)) if only_read else torch.arange(b * n, device=loss_mask.device)
    last = read_shifted(last_hidden, rows, 1).float()  # the final state after each position: shifted once
    teacher, full_logsumexp = (
        torch.empty(len(rows), dtype=dtype, device=last.device) for dtype in (torch.long, torch.float32)
    )
    for start in range(0, len(rows), LOGIT_CHUNK):
        logits = last[start : start + LOGIT_CHUNK] @ target_lm_head.T
        teacher[start : start + LOGIT_CHUNK] = logits.argmax(-1)
        full_logsumexp[start : start + LOGIT_CHUNK] = logits.logsumexp(-1)
    draft_logits = last @ target_lm_head[draft_ids].T
    p = draft_logits.softmax(-1)
    draft_mass = (draft_logits.logsumexp(-1) - full_logsumexp).exp()
    if only_read:  # back to the batch's layout, zeros where nothing reads
        teacher, p, draft_mass = (
            x.new_zeros(b * n, *x.shape[1:]).index_copy_(0, rows, x) for x in (teacher, p, draft_mass)
        )
    teacher, p, draft_mass = teacher.view(b, n), p.view(b, n, -1), draft_mass.view(b, n)
    return Teachers(shift_left(input_ids), p, teacher, t2d[teacher], trained, draft_mass, chained=first_draft)


def drafted(answer: torch.Tensor) -> torch.Tensor:
    """[B, T] where decoding drafts: position t once tokens t+1 and t+2 are the answer's."""
    return shift_left(answer) & shift_left(shift_left(answer))


def chain(first: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """`first` for step 0, then each step only where the step before holds at t and t+1."""
    masks = [first]
    for _ in range(steps - 1):
        masks.append(masks[-1] & shift_left(masks[-1]))
    return masks


def step_masks(t: Teachers, steps: int) -> list[torch.Tensor]:
    """The positions each TTT step trains: step 0's, then shifted along one token a step (SpecForge's), or, for
    chained teachers, only where the step before trained too (a chain that left the answer stays out)."""
    if t.chained:
        return chain(t.loss_mask, steps)
    masks = [t.loss_mask]
    for _ in range(steps - 1):
        masks.append(shift_left(masks[-1]))
    return masks


def decoding_masks(loss_mask: torch.Tensor, lengths: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Where greedy decoding's chains reach TTT step i: tokens t+1..t+2+i all the answer's. What the offline
    replay (eagle3.model.acceptance.replay) reads of the agreements, whatever the objective trains; with
    train.first_draft_position these are step_masks' own."""
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    return chain(drafted(loss_mask.bool() & (positions[None] < lengths[:, None])), steps)


OBJECTIVES = ("kl", "lk_lambda", "lk_alpha")


def expected_acceptance(p_full: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[positions] the chance that speculative sampling accepts a draft from q (the drafter's distribution over the
    draft vocab) when the target's distribution is p_full (its full-vocab probabilities of the draft vocab):
    sum min(p, q)."""
    return torch.minimum(p_full, q).sum(-1)


def step_loss(
    objective: str, ploss: torch.Tensor, alpha: torch.Tensor, mask: torch.Tensor, kl_decay: float, total=torch.sum
) -> torch.Tensor:
    """One TTT step's loss: `ploss` the KL-equivalent cross-entropy (SpecForge's normalisation), `alpha` the
    expected acceptance at some positions, `mask` those it counts over. `total`: how positions are summed (per
    group of them: TTTObjective's groups)."""
    if objective == "kl":
        return ploss
    count = total(mask).clamp(min=1)
    if objective == "lk_alpha":
        return -total(torch.where(mask, alpha.clamp(min=1e-12).log(), 0.0)) / count
    mean_alpha = total(alpha * mask) / count
    kl_weight = torch.exp(-kl_decay * mean_alpha.detach())
    return kl_weight * ploss + (1 - kl_weight) * (1 - mean_alpha)


def group_sums(group: torch.Tensor, groups: int):
    """x [positions] -> its sums by group [groups], `group` giving each position's."""
    return lambda x: torch.zeros(groups, device=x.device).index_add(0, group, x.float())


def rows_of(mask: torch.Tensor) -> torch.Tensor:
    """The flat positions (b * T + t) where a [B, T] mask holds, ascending."""
    return mask.flatten().nonzero().squeeze(1)


@dataclass(frozen=True)
class Shifted:
    """Reads of [B, T, ...] tensors shifted left some steps (shift_left, zeros past the end) at some flat positions
    (b * T + t): what a TTT step reads there, gathered from the one unshifted tensor rather than from a shifted copy
    per step. One for all the tensors a step reads at those positions."""

    index: torch.Tensor  # the position read for each
    inside: torch.Tensor | None  # False where that lies past the end of the row (read as zero); None: nowhere

    @classmethod
    def at(cls, rows: torch.Tensor, steps: int, length: int) -> Shifted:
        inside = rows % length + steps < length
        if bool(inside.all()):  # (what TTTObjective reads always is: a step's positions stay in the row)
            return cls(rows + steps, None)
        return cls(torch.where(inside, rows + steps, rows), inside)

    def part(self, start: int, end: int) -> Shifted:
        return Shifted(self.index[start:end], None if self.inside is None else self.inside[start:end])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        values = x.flatten(0, 1)[self.index]
        if self.inside is None:
            return values
        return torch.where(self.inside.view(-1, *[1] * (values.dim() - 1)), values, values.new_zeros(()))


def read_shifted(x: torch.Tensor, rows: torch.Tensor, steps: int) -> torch.Tensor:
    """x [B, T, ...] shifted left `steps` times, at flat positions `rows` (Shifted)."""
    return Shifted.at(rows, steps, x.shape[1])(x)


class TTTObjective(nn.Module):
    """The drafter unrolled for ttt_length steps. forward returns (loss, plosses, accs, agrees): agrees[i] [B, T] is
    where step i's draft (mapped through d2t) equals the teacher, at the positions step i trains (and those
    `also_agree` asks for), False elsewhere; plosses[i] is step i's cross-entropy whatever the objective (what the
    curves plot). DDP wraps this.

    Only what the loss reads is computed. A position's chain of steps depends on no other position but through
    step 0's keys and values, and its loss on no other position at all: so step i runs (Eagle3Draft.step_rows) at
    the positions it or a later step trains, nested step in step, and step 0's keys and values up to each row's
    last such position. On the demo's batches that is 16% of the padded positions at step 0 down to 3% at step 6
    where every step used to run on all of them, padding included; the loss, the gradients, the accuracies and
    the agreements the offline replay reads are the same, up to the order float sums are taken in.

    Each step's logits and the terms taken from them (cross-entropy, expected acceptance, agreement) are computed
    `logit_chunk` x B positions at a time (default: LOGIT_LOSS_ELEMENTS logits per chunk). With more than one chunk
    each is checkpointed: backward recomputes its logits from the step's normed state, which autograd keeps anyway,
    so no step keeps its [positions, draft vocab] logits, log-probabilities or teacher product (at Kimi's drafter,
    T = 32k, 4 GB each, a step) and the loss part of the peak is one chunk's. The teacher p is gathered from the one
    tensor make_teachers built inside each chunk, never copied per step."""

    def __init__(
        self,
        draft: Eagle3Draft,
        ttt_length: int,
        objective: str = "kl",
        lk_kl_decay: float = 3.0,
        logit_chunk: int | None = None,
    ):
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"train.objective {objective!r}: one of {', '.join(OBJECTIVES)}")
        self.draft, self.ttt_length, self.kind, self.lk_kl_decay = draft, ttt_length, objective, lk_kl_decay
        self.logit_chunk = logit_chunk

    def chunk_positions(self, batch: int) -> int:
        return self.logit_chunk or max(1, LOGIT_LOSS_ELEMENTS // (batch * self.draft.cfg.draft_vocab_size))

    def chunk_terms(self, normed, p, draft_mass, counted, teacher, draft_ids, read: Shifted, start: int, end: int):
        """A TTT step's terms at its loss rows start..end (`read`: what the step reads at them), [n] each: the
        cross-entropy, the expected acceptance (None for kl), where the draft agrees with the teacher."""
        logits = self.draft.lm_head(normed[start:end])
        logp = F.log_softmax(logits.float(), dim=-1)
        read = read.part(start, end)
        p = read(p)
        ce = -(counted[start:end, None] * p * logp).sum(-1)
        alpha = None
        if self.kind != "kl":
            alpha = expected_acceptance(p * read(draft_mass)[:, None], logp.exp())
        return ce, alpha, draft_ids[logits.argmax(-1)] == teacher[start:end]

    def forward(self, aux, t: Teachers, draft_ids, also_agree: list[torch.Tensor] | None = None, groups=None):
        """also_agree: [B, T] a step, positions whose agreement is wanted besides the trained ones. groups: (each
        row's group [B], each group's padded positions [G]): loss [G], plosses and accs [steps, G], each group's as
        a batch of its own would have them (rows never see each other; validation computes batches together)."""
        b, n = t.input_ids.shape
        padded = b * n if groups is None else groups[1]  # what each cross-entropy is divided by
        masks = step_masks(t, self.ttt_length)
        wanted = masks if also_agree is None else [m | a for m, a in zip(masks, also_agree)]
        runs, later = [], torch.zeros_like(wanted[0])  # step i runs where it or a later step is wanted
        for w in reversed(wanted):
            later = later | w
            runs.insert(0, later)
        prefix = runs[0].flip(1).cumsum(1).flip(1) > 0  # step 0's keys: up to each row's last position that runs
        previous = rows_of(prefix)
        hidden = self.draft.fc(aux.flatten(0, 1)[previous])
        # slot[r]: where flat position r is among the rows of the step that last computed it
        slot = torch.zeros(b * n, dtype=torch.long, device=aux.device)
        slot[previous] = torch.arange(len(previous), device=aux.device)
        size = self.chunk_positions(b) * b
        cache, loss, plosses, accs = [], 0.0, [], []
        agrees = torch.zeros(self.ttt_length, b * n, dtype=torch.bool, device=aux.device)
        for i, (mask, run, want) in enumerate(zip(masks, runs, wanted)):
            here = rows_of(run)
            if i == 0:  # keys and values at every row of the prefix, queries where step 0 runs
                rows, ids, positions = Rows(previous, (b, n), slot[here]), t.input_ids.flatten()[previous], previous % n
            else:
                read = Shifted.at(here, i, n)
                rows, ids, positions = Rows(here, (b, n)), read(t.input_ids), here % n + i
                hidden = hidden[slot[here]]
            normed, hidden = self.draft.step_rows(ids, hidden, positions, rows, cache)
            slot[here] = torch.arange(len(here), device=aux.device)
            scored = rows_of(want)
            if i == 0 or len(scored) != len(here):  # (a later step's positions run here without a loss of their own)
                read = Shifted.at(scored, i, n)
            if len(scored) != len(here):
                normed = normed[slot[scored]]
            at_mask = mask.flatten()[scored]
            total = torch.sum if groups is None else group_sums(groups[0][scored // n], len(padded))
            counted = read(t.in_draft_vocab) & at_mask
            teacher = read(t.teacher)
            args = (normed, t.p, t.draft_mass, counted, teacher, draft_ids, read)
            if len(scored) <= size:
                ce, alpha, agree = self.chunk_terms(*args, 0, len(scored))
            else:
                parts = [
                    checkpoint(
                        self.chunk_terms,
                        *args,
                        start,
                        min(start + size, len(scored)),
                        use_reentrant=False,
                        preserve_rng_state=False,
                    )
                    for start in range(0, len(scored), size)
                ]
                ce = torch.cat([part[0] for part in parts])
                alpha = torch.cat([part[1] for part in parts]) if self.kind != "kl" else None
                agree = torch.cat([part[2] for part in parts])
            ploss = total(ce) / padded
            accs.append(total(agree & at_mask) / total(at_mask).clamp(min=1))
            plosses.append(ploss.detach())
            agrees[i, scored] = agree
            loss = loss + STEP_DECAY**i * step_loss(self.kind, ploss, alpha, counted, self.lk_kl_decay, total)
        return loss, torch.stack(plosses), torch.stack(accs), agrees.view(self.ttt_length, b, n)


# -- data ---------------------------------------------------------------------------------------


def plan_epoch(
    ids_and_lengths: list[tuple[str, int]], batch_tokens: int | None, seed: int, epoch: int
) -> list[list[str]]:
    """Shuffle by (seed, epoch), then cut into batches of at most `batch_tokens` padded tokens (None: one
    sample each)."""
    order = torch.randperm(len(ids_and_lengths), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    batches, batch, longest = [], [], 0
    for index in order.tolist():
        sample_id, length = ids_and_lengths[index]
        if batch and (batch_tokens is None or (len(batch) + 1) * max(longest, length) > batch_tokens):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(sample_id)
        longest = max(longest, length)
    if batch:
        batches.append(batch)
    return batches


def merge_batches(batches: list[list[str]], lengths: dict[str, int], budget: int) -> list[list[list[str]]]:
    """Consecutive batches in groups, each as many as fit in `budget` padded tokens together (at least one)."""
    groups, group, samples, longest = [], [], 0, 0
    for batch in batches:
        size, length = len(batch), max(lengths[sid] for sid in batch)
        if group and (samples + size) * max(longest, length) > budget:
            groups.append(group)
            group, samples, longest = [], 0, 0
        group.append(batch)
        samples, longest = samples + size, max(longest, length)
    if group:
        groups.append(group)
    return groups


def pin_initial_weights(cfg: RunConfig) -> dict:
    """What a warm-started run starts from, chosen once, by its first try, and kept in RUN_DIR/train/init/
    (init.json, and a copy of the drafter's model.safetensors): every later try starts from the same weights,
    though the lineage's current drafter may have been switched or pruned in between. A try that resumes from
    a checkpoint never reads it."""
    init_dir = cfg.run_dir / TRAIN_INIT
    if (init_dir / INIT_RECORD).exists():
        return json.loads((init_dir / INIT_RECORD).read_text())
    lineage = Lineage(cfg)
    current = lineage.current()
    record = {"init_from": cfg.train.init_from, "lineage": lineage.key, "version": None}
    with atomic_dir(init_dir) as tmp:
        if current is not None:
            shutil.copy2(current.path / WEIGHTS, tmp / WEIGHTS)
            record.update(version=current.name, weights_sha256=weights_digest(tmp))
        (tmp / INIT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def started_from(cfg: RunConfig) -> str | None:
    """The promoted version a warm-started run began from (None: from scratch)."""
    try:
        return json.loads((cfg.run_dir / TRAIN_INIT / INIT_RECORD).read_text())["version"]
    except FileNotFoundError:
        return None


def load_warm_start(draft: Eagle3Draft, weights: dict[str, torch.Tensor], draft_ids: torch.Tensor) -> int:
    """Copy an exported drafter of the same lineage into `draft` (the same shapes: the lineage fixes them).
    lm_head's rows stand for draft tokens, and this run's vocab mapping may hold other tokens than the one the
    drafter was trained with: each row is taken by the target token it stands for, and a token new to the draft
    vocabulary keeps its fresh row. Returns how many rows were taken."""
    weights = dict(weights)
    d2t = weights.pop("d2t")
    weights.pop("t2d", None)
    state = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    if set(weights) != set(state) or any(weights[k].shape != state[k].shape for k in state):
        raise ConfigError(
            "train.init_from", "current: the lineage's drafter does not fit this drafter's shape", "set it to scratch"
        )
    row_of_token = {int(token): row for row, token in enumerate(d2t + torch.arange(len(d2t)))}
    taken = [
        (row, row_of_token[int(token)]) for row, token in enumerate(draft_ids.tolist()) if int(token) in row_of_token
    ]
    with torch.no_grad():
        for key, tensor in weights.items():
            if key != "lm_head.weight":
                state[key].copy_(tensor.float())
        if taken:
            rows, old_rows = map(torch.tensor, zip(*taken))
            state["lm_head.weight"][rows.to(state["lm_head.weight"].device)] = (
                weights["lm_head.weight"][old_rows].float().to(state["lm_head.weight"].device)
            )
    return len(taken)


def die_with_parent() -> None:
    """torchrun starts each rank in a session of its own, so killing torchrun's process group (a job
    runner stopping a task, a kill -9) would leave the ranks running, on the GPUs, writing checkpoints.
    Ask the kernel to SIGKILL this rank when its parent (torchrun) dies. Linux only; a no-op elsewhere."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before we asked
        os._exit(1)


# -- the loop -----------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.distributed:
            die_with_parent()
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            if torch.cuda.is_available():  # (all_gather_object sends through the current device: this rank's own)
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.device = torch.device(
            f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
        )
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The drafter's CPU operations are small: a second intra-op thread gains nothing, and while another
            # process holds a core (Airflow's polls, other jobs) OpenMP's spinning barriers made steps 6-12x slower
            # on 2 cores (bench/train_speed.py --threads 2). torchrun's ranks get OMP_NUM_THREADS=1 already.
            torch.set_num_threads(1)
        self.ckpt_root = cfg.run_dir / CHECKPOINTS
        self.ckpt_root.mkdir(parents=True, exist_ok=True)

        torch.manual_seed(cfg.seed)  # the drafter's initial weights: the same on every rank and every try
        self.store = open_run_store(cfg)  # the run's samples (a shared store holds other runs' too)
        mapping, _ = load_mapping(cfg.run_dir / MAPPING_DIR)
        self.draft_ids = torch.as_tensor(mapping.draft_ids, device=self.device)
        self.t2d = torch.as_tensor(mapping.t2d(cfg.target.vocab_size), device=self.device)
        self.target_lm_head = load_target_tensor(cfg.target.model_path, LM_HEAD_KEYS).float().to(self.device)
        draft = build_draft_model(
            cfg.target.model_path, cfg.vocab.draft_vocab_size, cfg.resolved_aux_layers(), cfg.drafter.model_dump()
        )
        self.draft = draft.to(self.device)
        self.objective = TTTObjective(self.draft, cfg.train.ttt_length, cfg.train.objective, cfg.train.lk_kl_decay)
        self.ddp = nn.parallel.DistributedDataParallel(self.objective) if self.distributed else self.objective

        lengths = {sid: loc.end - loc.start for sid, loc in self.store.locations.items()}
        # The split by user turn (eagle3.stages.split): training, validation (the best checkpoint) and
        # evaluation are disjoint, and the lineage's pinned evaluation set is in evaluation, whatever this run's split
        # says.
        split = run_split(cfg)
        parts = split.parts(lengths)
        self.train_ids = [(s, lengths[s]) for s in parts[TRAINING]]
        self.val_ids = [(s, lengths[s]) for s in parts[VALIDATION]]
        if self.rank == 0:
            log.info(
                "train: %d training samples, %d validation; %d held out for evaluation (%d of them by the "
                "lineage's pinned evaluation set)",
                len(self.train_ids),
                len(self.val_ids),
                len(parts[EVALUATION]),
                split.pinned_out(parts[EVALUATION]),
            )
        # Packing depends on the shuffle, so each epoch has its own number of steps (the same on every rank:
        # a tail of fewer than `world` batches is dropped).
        self.epoch_steps = [len(self.plan(epoch)) // self.world for epoch in range(cfg.train.epochs)]
        self.total_steps = sum(self.epoch_steps)
        if self.total_steps == 0:
            raise ValueError(f"{cfg.store_dir}: too few training samples for {self.world} rank(s)")

        params = [p for p in self.draft.parameters() if p.requires_grad]
        # foreach: CUDA's default; on CPU bit-identical to the per-tensor loop it replaces, in half the time
        self.optimizer = torch.optim.AdamW(params, lr=cfg.train.learning_rate, weight_decay=0.0, foreach=True)
        warmup = max(1, int(cfg.train.warmup_ratio * self.total_steps))

        def lr_factor(step: int) -> float:  # linear warmup, then cosine to zero
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, self.total_steps - warmup)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.step, self.best = 0, {"step": None, "accept_length": -1.0}

    def plan(self, epoch: int) -> list[list[str]]:
        return plan_epoch(self.train_ids, self.cfg.train.batch_tokens, self.cfg.seed, epoch)

    def batches_from(self, step: int):
        """(step, this rank's batch) from global step `step` on: the data position is the step itself."""
        first = 0
        for epoch, steps in enumerate(self.epoch_steps):
            if step < first + steps:
                plan = self.plan(epoch)
                for index in range(step - first, steps):
                    yield step, plan[index * self.world + self.rank]
                    step += 1
            first += steps

    def resume(self) -> None:
        checkpoints = checkpoint_dirs(self.ckpt_root)
        if not checkpoints:
            return
        written_by = read_meta(checkpoints[-1]).get("world_size", self.world)
        if written_by != self.world:  # checked before the (large) state is read
            raise ConfigError(
                checkpoints[-1],
                f"written by {written_by} rank(s), this run has {self.world}: resuming would change the data order "
                "and the schedule",
                f"set train.gpus (or train.nproc_per_node) back to {written_by} ranks, or start a new run",
            )
        state = load_checkpoint(checkpoints[-1])
        missing, unexpected = self.draft.load_state_dict(state["model"], strict=False)
        if missing != ["embed_tokens.weight"] or unexpected:
            raise RuntimeError(f"{checkpoints[-1]}: not a checkpoint of this drafter ({missing}, {unexpected})")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.step, self.best = state["step"], state["best"]
        metrics_file = self.cfg.run_dir / TRAIN_METRICS
        if self.rank == 0 and metrics_file.exists():  # drop what the killed run logged past its checkpoint
            kept = [line for line in metrics_file.read_text().splitlines() if json.loads(line)["step"] <= self.step]
            atomic_write_text(metrics_file, "".join(line + "\n" for line in kept))
        log.info("train: resumed from %s (step %d/%d)", checkpoints[-1], self.step, self.total_steps)

    def warm_start(self) -> None:
        """Start from the lineage's promoted drafter, as pinned by the run's first try (pin_initial_weights)."""
        from safetensors.torch import load_file

        if self.rank == 0:
            pin_initial_weights(self.cfg)
        if self.distributed:
            dist.barrier()
        init_dir = self.cfg.run_dir / TRAIN_INIT
        record = json.loads((init_dir / INIT_RECORD).read_text())
        if record["version"] is None:
            log.info("train: train.init_from current, but the lineage has no promoted drafter yet: from scratch")
            return
        taken = load_warm_start(self.draft, load_file(init_dir / WEIGHTS), self.draft_ids)
        log.info(
            "train: warm start from the lineage's drafter %s (%d of %d draft-vocab rows by token)",
            record["version"],
            taken,
            len(self.draft_ids),
        )

    def autocast(self):
        """bf16 matmuls on GPU over fp32 master weights (the loss itself is taken in fp32); fp32 on CPU,
        where bf16 is slow and the exact-resume tests run."""
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def trainable_state(self) -> dict:
        return {k: v for k, v in self.draft.state_dict().items() if k != "embed_tokens.weight"}

    def teachers(self, batch) -> Teachers:
        return make_teachers(
            batch["input_ids"],
            batch["loss_mask"],
            batch["last_hidden_state"],
            self.target_lm_head,
            self.draft_ids,
            self.t2d,
            batch["lengths"],
            self.cfg.train.first_draft_position,
            only_read=True,
        )

    def train_step(self, sample_ids) -> tuple[float, list[float], list[float], int]:
        batch = self.store.batch(sample_ids, self.device)
        teachers = self.teachers(batch)
        with self.autocast():
            loss, plosses, accs, _ = self.ddp(batch["aux_hidden_states"], teachers, self.draft_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.objective.parameters(), self.cfg.train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), plosses.tolist(), accs.tolist(), int(batch["loss_mask"].numel())

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss and per-step accuracy on the validation split, and the offline acceptance length per k of
        evaluate.draft_lengths: greedy decoding replayed on the stored states (eagle3.model.acceptance.replay);
        the first k's picks the best checkpoint. Every rank validates its share of the batches and the sums are
        gathered: no rank waits idle in a collective while another validates (NCCL's watchdog ends a collective after 10
        minutes).

        The figures are those of the validation split cut into training's batches (the loss and accuracies are
        per-batch means), but batches of about one length are computed together, up to VAL_BATCH_TOKENS padded
        tokens: without backward a row needs nothing of its batch, and a few large passes cost far less than many
        small ones (the demo's validation took 189 passes)."""
        steps, ks = self.cfg.train.ttt_length, self.cfg.evaluate.draft_lengths
        loss_sum, batch_count, count, hits = 0.0, 0, 0, [0.0] * steps
        cycles = {k: ([], []) for k in ks}  # per k: drafts accepted per cycle, and those of first cycles
        committed = 0  # tokens the cycles of any k commit: every answer token but each turn's first
        batches = plan_epoch(self.val_ids, self.cfg.train.batch_tokens, self.cfg.seed, epoch=0)
        lengths = dict(self.val_ids)
        mine = sorted(batches[self.rank :: self.world], key=lambda ids: max(lengths[sid] for sid in ids))
        for together in merge_batches(mine, lengths, VAL_BATCH_TOKENS):  # (by length: little padding)
            batch = self.store.batch([sid for sample_ids in together for sid in sample_ids], self.device)
            group = torch.tensor([g for g, sample_ids in enumerate(together) for _ in sample_ids], device=self.device)
            padded = torch.tensor(
                [len(ids) * max(lengths[sid] for sid in ids) for ids in together],
                dtype=torch.float32,
                device=self.device,
            )
            t = self.teachers(batch)
            replayed = decoding_masks(batch["loss_mask"], batch["lengths"], steps)  # what replay reads of agrees
            with self.autocast():
                losses, _, accs, agrees = self.objective(
                    batch["aux_hidden_states"], t, self.draft_ids, replayed, (group, padded)
                )
            weights = torch.zeros(len(together), dtype=torch.long, device=self.device).index_add(
                0, group, t.loss_mask.sum(1)
            )
            for loss, batch_accs, weight in zip(losses.tolist(), accs.T.tolist(), weights.tolist()):
                hits = [hit + acc * weight for hit, acc in zip(hits, batch_accs)]
                count, loss_sum, batch_count = count + weight, loss_sum + loss, batch_count + 1
            agrees, answers = agrees.cpu().numpy(), batch["loss_mask"].bool().cpu().numpy()
            for row, length in enumerate(batch["lengths"].tolist()):
                committed += committed_tokens(answers[row, :length])
                for k, (all_cycles, first_cycles) in cycles.items():
                    these, firsts = replay(agrees[:, row, :length], answers[row, :length], k)
                    all_cycles += these
                    first_cycles += firsts
        share = {"loss": loss_sum, "batches": batch_count, "hits": hits, "count": count, "cycles": cycles}
        shares = [{**share, "committed": committed}]
        if self.distributed:
            mine, shares = shares[0], [None] * self.world
            dist.all_gather_object(shares, mine)
        count = sum(s["count"] for s in shares)
        offline = {
            str(k): acceptance_figures(
                [c for s in shares for c in s["cycles"][k][0]],
                [c for s in shares for c in s["cycles"][k][1]],
                min(k, steps),
                sum(s["committed"] for s in shares),
            )
            for k in ks
        }
        return {
            "val_loss": sum(s["loss"] for s in shares) / max(sum(s["batches"] for s in shares), 1),
            "val_acc": [sum(s["hits"][i] for s in shares) / max(count, 1) for i in range(steps)] if count else [],
            "val_offline": offline,
            BEST_BY: offline[str(ks[0])]["accept_length"],
        }

    def log_metrics(self, metrics_file: Path, record: dict) -> None:
        """One record to metrics.jsonl and to TensorBoard (rank 0 only): lists by position, dicts by key."""
        with open(metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")

        def scalars(tag: str, value):
            if isinstance(value, dict):
                for key, inner in value.items():
                    yield from scalars(f"{tag}/{key}", inner)
            elif isinstance(value, list):
                for i, inner in enumerate(value):
                    yield from scalars(f"{tag}/position_{i}", inner)
            elif value is not None:
                yield tag, value

        for key, value in record.items():
            if key != "step":
                for tag, scalar in scalars(key, value):
                    self.tensorboard.add_scalar(tag, scalar, record["step"])
        self.tensorboard.flush()

    def save(self, metrics_file: Path, val: dict) -> None:
        """Record the validation `val` and write a checkpoint (rank 0)."""
        if val[BEST_BY] > self.best["accept_length"]:
            self.best = {"step": self.step, "accept_length": val[BEST_BY]}
        self.log_metrics(metrics_file, {"step": self.step, **val})
        state = {
            "model": self.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.step,
            "best": self.best,
        }
        meta = {
            "step": self.step,
            "total_steps": self.total_steps,
            "world_size": self.world,
            **val,
            "draft_config": self.draft.cfg.to_json(),
        }
        started = time.monotonic()
        path = save_checkpoint(self.ckpt_root, state, meta, self.cfg.train.keep_last, self.best["step"])
        offline = ", ".join(
            f"k={k} {figures['accept_length']:.3f} (first cycle {figures['first_cycle_accept_length']:.3f})"
            for k, figures in val["val_offline"].items()
        )
        log.info(
            "train: step %d: val acc %s; offline acceptance length (decoding replayed on the validation split) "
            "%s; saved %s in %.2fs",
            self.step,
            [round(a, 3) for a in val["val_acc"]],
            offline,
            path,
            time.monotonic() - started,
        )

    def run(self) -> dict:
        from torch.utils.tensorboard import SummaryWriter

        self.resume()
        if self.step == 0 and self.cfg.train.init_from == "current":
            self.warm_start()
        metrics_file = self.cfg.run_dir / TRAIN_METRICS
        if self.rank == 0:  # purge_step: a resumed run replaces what its killed predecessor logged past here
            self.tensorboard = SummaryWriter(self.cfg.run_dir / TRAIN_TENSORBOARD, purge_step=self.step or None)
        started = last_log = time.monotonic()
        tokens = steps_here = 0
        for step, sample_ids in self.batches_from(self.step):
            loss, plosses, accs, batch_tokens = self.train_step(sample_ids)
            self.step, tokens, steps_here = step + 1, tokens + batch_tokens * self.world, steps_here + 1
            if self.rank == 0:  # (a hung rank stalls rank 0 in the next all-reduce, so its beats stop too)
                beat(f"train: step {self.step}/{self.total_steps}")
            now = time.monotonic()
            if self.rank == 0 and (now - last_log >= self.cfg.train.progress_interval_s or steps_here == 1):
                last_log, rate = now, tokens / (now - started)
                eta = human_duration((self.total_steps - self.step) * (now - started) / steps_here)
                log.info(
                    "train: step %d/%d, %.0f tokens/s, loss %.4f, acc_0 %.3f, ETA %s",
                    self.step,
                    self.total_steps,
                    rate,
                    loss,
                    accs[0],
                    eta,
                )
                self.log_metrics(
                    metrics_file,
                    {
                        "step": self.step,
                        "loss": loss,
                        "ploss": plosses,
                        "acc": accs,
                        "tokens_per_s": rate,
                        "lr": self.scheduler.get_last_lr()[0],
                    },
                )
            if self.step % self.cfg.train.save_every_steps == 0 or self.step == self.total_steps:
                val = self.validate()  # every rank validates a share
                if self.rank == 0:
                    self.save(metrics_file, val)
                if self.distributed:
                    dist.barrier()
        if self.rank == 0:
            self.tensorboard.close()
            plot_metrics(metrics_file, self.cfg.run_dir / LOSS_PLOT, self.cfg.run_dir / ACCURACY_PLOT)
            summary = {
                "steps": self.step,
                "best": self.best,
                "seconds": round(time.monotonic() - started, 1),
                "checkpoint": str(checkpoint_dirs(self.ckpt_root)[-1]),
                "started_from": started_from(self.cfg),
            }
            atomic_write_text(self.cfg.run_dir / TRAIN_SUMMARY, json.dumps(summary, indent=2) + "\n")
        if self.distributed:
            dist.destroy_process_group()
        return summary if self.rank == 0 else {}


def plot_metrics(metrics_file: Path, loss_png: Path, accuracy_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_acc" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
    ax.set(xlabel="step", ylabel="TTT loss", title="EAGLE-3 drafter loss")
    ax.legend()
    fig.savefig(loss_png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    if val:
        fig, (accuracy, acceptance) = plt.subplots(1, 2, figsize=(12, 4))
        steps, accs = [r["step"] for r in val], np.array([r["val_acc"] for r in val])
        for i in range(accs.shape[1]):
            accuracy.plot(steps, accs[:, i], marker="o", label=f"position {i}")
        accuracy.set(xlabel="step", ylabel="validation accuracy", ylim=(0, 1), title="per-position accuracy")
        accuracy.legend(fontsize=8)
        for k in val[-1].get("val_offline") or {}:
            acceptance.plot(
                steps,
                [(r.get("val_offline") or {}).get(k, {}).get("accept_length") for r in val],
                marker="o",
                label=f"k={k}",
            )
        acceptance.set(
            xlabel="step",
            ylabel="tokens per verify step",
            title="offline acceptance length (decoding replayed on the validation split)",
        )
        acceptance.legend(fontsize=8)
        fig.savefig(accuracy_png, dpi=120, bbox_inches="tight")
        plt.close(fig)


def launch_command(cfg: RunConfig, config_path) -> tuple[list[str], dict[str, str]] | None:
    """The torchrun command (and environment) for a multi-rank run, or None when this process should
    train by itself (one rank, or already a torchrun worker)."""
    import sys

    if cfg.train.ranks == 1 or "WORLD_SIZE" in os.environ:
        return None
    env = dict(os.environ)
    if cfg.train.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.train.gpus))
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(cfg.train.ranks),
        "-m",
        "eagle3",
        "train",
        "--config",
        str(config_path),
    ]
    return argv, env


def run_train(cfg: RunConfig) -> dict:
    return Trainer(cfg).run()
