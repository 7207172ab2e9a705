"""Training: the objective's shifts and metrics by hand, then a real run on the tiny target's store. The kill -9
and resume drills (one process, and 2 gloo ranks under torchrun) are in tests/faults/."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import eagle3.stages.train as train
from eagle3.model.drafter import DraftConfig
from eagle3.records.checkpoint import load_checkpoint
from eagle3.stages.train import make_teachers
from tests.conftest import TRAIN_SETTINGS, run_eagle3
from tests.test_model import SMALL

# A drafter small enough to compare whole computations with: the objective's and validation's tests.
SMALL_DRAFT = dataclasses.replace(
    SMALL, max_position_embeddings=256, target_vocab_size=60, draft_vocab_size=30, aux_layer_ids=(1, 2, 3)
)


def perfect_target(input_ids: torch.Tensor, vocab: int):
    """A target whose final state at t predicts exactly the next token of the data (one-hot lm_head)."""
    next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    return torch.nn.functional.one_hot(next_ids, vocab).float() * 10, torch.eye(vocab)


def test_targets_are_shifted_exactly_once():
    """At position t the drafter reads token t+1 and must predict what the target predicts after it:
    token t+2. One shift too many (SpecForge once shipped that) or too few fails here."""
    ids = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8]])
    last, lm_head = perfect_target(ids, 10)
    t = make_teachers(ids, torch.ones_like(ids), last, lm_head, torch.arange(10), torch.ones(10, dtype=torch.bool))
    assert t.input_ids[0, :7].tolist() == ids[0, 1:].tolist()  # token t+1
    assert t.teacher[0, :6].tolist() == ids[0, 2:].tolist()  # token t+2
    assert t.loss_mask[0].tolist() == [True] * 7 + [False]  # not shifted; last position off


def test_each_sample_loses_its_own_last_position_not_the_batch_column():
    """A sample shorter than the batch must not keep a teacher taken from the padding after it."""
    ids = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8], [5, 2, 6, 1, 0, 0, 0, 0]])
    last, lm_head = perfect_target(ids, 10)
    mask = torch.tensor([[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]])
    t = make_teachers(
        ids, mask, last, lm_head, torch.arange(10), torch.ones(10, dtype=torch.bool), lengths=torch.tensor([8, 4])
    )
    assert t.loss_mask.tolist() == [[True] * 7 + [False], [True, True, True] + [False] * 5]


def test_first_draft_trains_the_drafts_decoding_makes_and_none_past_the_end_of_turn():
    """Decoding drafts from position t once tokens t+1 and t+2 are the answer's: first from the prompt's last
    token (prefill gave the answer's first token; the draft is its second), never for a token after the end of
    turn. Without first_draft the mask is SpecForge's: every answer token's position, two of each answer's
    targets lying after its end of turn."""
    ids = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8, 5, 1]])
    last, lm_head = perfect_target(ids, 10)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0]])  # two answers: tokens 2-3 and 6-8 (3 and 8 end a turn)
    args = (ids, mask, last, lm_head, torch.arange(10), torch.ones(10, dtype=torch.bool))
    assert make_teachers(*args).loss_mask[0].nonzero().flatten().tolist() == [2, 3, 6, 7, 8]
    first = make_teachers(*args, first_draft=True)
    assert first.loss_mask[0].nonzero().flatten().tolist() == [1, 5, 6]
    assert first.teacher[0, 1] == ids[0, 3]  # from the prompt's last token, the answer's second token
    assert first.teacher[0, 6] == ids[0, 8]  # the last draft: the end of turn itself


def test_each_ttt_step_trains_only_chains_that_stay_in_the_answer():
    """Step i at position t targets token t+2+i: trained only while tokens t+1..t+2+i are all the answer's (with
    first_draft), where SpecForge's mask shifts along and trains targets after the turn and in the next one."""
    from eagle3.model.drafter import Eagle3Draft

    ids = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8, 5, 1, 2, 3]])
    last, lm_head = perfect_target(ids, 10)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0]])  # answers: tokens 1-4 and 7-9
    cfg = DraftConfig(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        target_vocab_size=10,
        draft_vocab_size=10,
        aux_layer_ids=(1, 2, 3),
    )
    objective = train.TTTObjective(Eagle3Draft(cfg), ttt_length=3)
    trained = {}
    for first_draft in (True, False):
        teachers = make_teachers(
            ids, mask, last, lm_head, torch.arange(10), torch.ones(10, dtype=torch.bool), first_draft=first_draft
        )
        trained[first_draft] = [m[0].nonzero().flatten().tolist() for m in train.step_masks(teachers, 3)]
        _, _, accs, agrees = objective(torch.randn(1, 12, 24), teachers, torch.arange(10))
        assert agrees.shape == (3, 1, 12) and accs.shape == (3,)
    assert trained[True] == [[0, 1, 2, 6, 7], [0, 1, 6], [0]]  # t + 2 + i never past tokens 4 and 9
    assert trained[False] == [[1, 2, 3, 4, 7, 8, 9], [0, 1, 2, 3, 6, 7, 8], [0, 1, 2, 5, 6, 7]]


def test_teachers_outside_the_draft_vocab_are_masked_from_the_loss():
    ids = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8]])
    last, lm_head = perfect_target(ids, 10)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 9]] = True
    t = make_teachers(ids, torch.ones_like(ids), last, lm_head, torch.tensor([1, 4, 9]), t2d)
    assert t.position_mask[0].tolist() == [True, True, True, False, False, False, False, False]
    assert t.p.shape == (1, 8, 3)  # only the draft vocab's columns
    assert torch.allclose(t.p.sum(-1), torch.ones(1, 8))


def test_full_vocab_argmax_in_chunks_equals_the_whole(monkeypatch):
    torch.manual_seed(0)
    ids, last, lm_head = torch.randint(0, 50, (2, 9)), torch.randn(2, 9, 16), torch.randn(50, 16)
    args = (ids, torch.ones_like(ids), last, lm_head, torch.arange(0, 50, 2), torch.ones(50, dtype=torch.bool))
    whole = make_teachers(*args)
    monkeypatch.setattr(train, "LOGIT_CHUNK", 4)
    assert torch.equal(make_teachers(*args).teacher, whole.teacher)


@pytest.mark.slow
def test_a_short_run_learns_and_leaves_checkpoints_metrics_and_plots(trained_run):
    workdir, summary = trained_run
    out = workdir / "runs" / "train" / "train"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r for r in records if "val_acc" in r]
    assert losses[-1] < losses[0] * 0.7
    # an untrained drafter: 1.0; 1.25 measured on the tiny target that answers its prompts (2026-12-07)
    assert len(val[-1]["val_acc"]) == 7 and val[-1]["val_offline_accept_length"] > 1.15
    assert set(val[-1]["val_offline"]) == {"3", "7"}  # evaluate.draft_lengths
    assert (out / "loss.png").stat().st_size > 10_000 and (out / "accuracy.png").stat().st_size > 10_000
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    best = f"step-{summary['best']['step']:06d}"
    assert best in kept and len(kept) <= 3  # keep_last 2, plus the best
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    state = load_checkpoint(sorted((out / "checkpoints").glob("step-*"))[-1])
    assert "embed_tokens.weight" not in state["model"] and state["step"] == summary["steps"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {
        "loss",
        "ploss/position_6",
        "acc/position_0",
        "acc/position_6",
        "val_offline_accept_length",
        "val_offline/3/accept_length",
        "lr",
    } <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses)


@pytest.mark.slow
def test_resume_with_another_number_of_ranks_is_refused(train_config):
    """The data order and the schedule depend on the world size: a checkpoint written by 2 ranks must not be
    continued by 1. The refusal comes before the checkpoint's state is read, so its meta.json is all this
    stand-in checkpoint needs (tests/faults resumes real torchrun ranks)."""
    newest = train_config.run_dir / "train" / "checkpoints" / "step-000004"
    newest.mkdir(parents=True)
    (newest / "meta.json").write_text(json.dumps({"step": 4, "world_size": 2}))
    proc = run_eagle3("train", "--config", str(train_config.config_path), check=False)
    assert proc.returncode == 2
    assert "written by 2 rank(s), this run has 1" in proc.stderr and "train.gpus" in proc.stderr


def test_without_a_token_budget_every_step_is_one_sample():
    """train.batch_tokens empty (the default): SpecForge's one sample per rank per step, in a seeded order."""
    samples = [(f"{i:016x}", n) for i, n in enumerate([5, 40, 7, 300])]
    plan = train.plan_epoch(samples, None, seed=0, epoch=0)
    assert sorted(b[0] for b in plan) == sorted(s for s, _ in samples) and all(len(b) == 1 for b in plan)
    assert plan == train.plan_epoch(samples, None, seed=0, epoch=0) != train.plan_epoch(samples, None, 0, 1)
    assert [len(b) for b in train.plan_epoch(samples, 100, seed=0, epoch=0)] != [1, 1, 1, 1]  # a budget packs


def stored_again(store_dir, out_dir, state_dtype: str) -> None:
    """The store's samples written into `out_dir` with another state dtype, shard by shard and one sample a batch
    (the states as the bf16 store holds them: what the capture handed over)."""
    from eagle3.capture import CapturedStates
    from eagle3.data.samples import TokenizedSample
    from eagle3.data.store import HiddenStateStore, ShardWriter, StoreMeta

    store = HiddenStateStore(store_dir)
    meta = StoreMeta(store.meta.hidden_size, store.meta.aux_layers, state_dtype)
    for shard in store.chunks:
        writer = ShardWriter(out_dir, shard, meta)
        for sample_id, s in store.iter_shard(shard):
            sample = TokenizedSample(sample_id, s["input_ids"].tolist(), s["loss_mask"].tolist(), False)
            writer.add_batch([sample], [CapturedStates(s["aux_hidden_states"], s["last_hidden_state"])])
        writer.close()


@pytest.mark.slow
def test_the_trainer_reads_an_fp8_store_as_it_reads_a_bf16_one(trained_config):
    """The trained drafter on its own store and on the same samples stored as fp8 (extract.state_dtype fp8_e4m3):
    the store's batches hold the same ids, masks and lengths, float32 states within fp8's half step of each token
    layer's amax, the validation accuracy per position moves by less than 2 points, and a training step runs."""
    cfg = trained_config
    bf16 = train.Trainer(cfg)
    bf16.resume()
    val_ids = [sid for sid, _ in bf16.val_ids]
    bf16_batch, bf16_val = bf16.store.batch(val_ids, "cpu"), bf16.validate()

    bf16_dir = cfg.store_dir.resolve()  # (the run's link into {workdir}/stores/)
    fp8_dir = bf16_dir.with_name(bf16_dir.name + "-fp8")
    stored_again(bf16_dir, fp8_dir, "fp8_e4m3")
    cfg.store_dir.unlink()
    cfg.store_dir.symlink_to(fp8_dir)
    fp8 = train.Trainer(cfg)
    assert fp8.store.meta.state_dtype == "fp8_e4m3" and fp8.val_ids == bf16.val_ids
    fp8.resume()
    fp8_batch = fp8.store.batch(val_ids, "cpu")
    for name in ("input_ids", "loss_mask", "lengths"):
        assert torch.equal(fp8_batch[name], bf16_batch[name]), name
    hidden = cfg.target.hidden_size
    for name in ("aux_hidden_states", "last_hidden_state"):
        assert fp8_batch[name].dtype == bf16_batch[name].dtype == torch.float32
        want = bf16_batch[name].reshape(*bf16_batch[name].shape[:2], -1, hidden)
        error = (fp8_batch[name].reshape(want.shape) - want).abs().amax(-1)
        assert torch.all(error <= want.abs().amax(-1) / 28 * (1 + 1e-5)), name  # (a tie lands on the bound)
        assert error.max() > 0, "the fp8 store holds the bf16 states unchanged: it did not quantise"
    # The batch carries the states to the device as stored and converts them there: the same bits as each sample
    # dequantized on its own, zeros where it is padded.
    from eagle3.data.store import HiddenStateStore

    for store, batch in ((fp8.store, fp8_batch), (HiddenStateStore(bf16_dir), bf16_batch)):
        for row, sid in enumerate(val_ids):
            sample, m = store[sid], int(batch["lengths"][row])
            for name in ("aux_hidden_states", "last_hidden_state"):
                assert torch.equal(batch[name][row, :m], sample[name].float()), (sid, name)
                assert not batch[name][row, m:].any(), (sid, name)
    fp8_val = fp8.validate()
    assert len(fp8_val["val_acc"]) == len(bf16_val["val_acc"]) == cfg.train.ttt_length
    assert max(abs(a - b) for a, b in zip(fp8_val["val_acc"], bf16_val["val_acc"])) < 0.02, (fp8_val, bf16_val)
    loss, *_ = fp8.train_step(val_ids[:4])
    assert math.isfinite(loss)


@pytest.mark.slow
def test_no_question_held_out_for_validation_or_evaluation_is_trained_on(make_config, tmp_path):
    """Questions asked by several conversations (spelled and answered differently, some with a system prompt or a
    later turn, one asked as a later turn): no conversation that trains asks a question whose bucket is validation or
    evaluation, and the turn each evaluated prompt ends at is asked by no conversation that trains or validates."""
    from eagle3.data.samples import SampleTokenizer, conversation_id_of, read_conversations
    from eagle3.stages.evaluate.prompts import held_out
    from eagle3.stages.extract import run_extract
    from eagle3.stages.split import TRAINING, part_of_key, prompt_key
    from eagle3.stages.vocab import run_vocab
    from tests.test_split import shared_questions, write_jsonl

    rows, _ = shared_questions()
    data = tmp_path / "shared.jsonl"
    write_jsonl(data, rows)
    cfg = make_config(
        data={"path": str(data), "max_samples": None},
        train={**TRAIN_SETTINGS, "val_fraction": 0.5},
        evaluate={"num_prompts": 64},
    )
    run_extract(cfg)
    run_vocab(cfg)
    conversations, _ = read_conversations(data)
    questions = {
        c.sample_id: {prompt_key(m["content"]) for m in c.messages if m["role"] == "user"} for c in conversations
    }
    trainer = train.Trainer(cfg)

    def asked(ids) -> set[str]:
        return {key for s in ids for key in questions[conversation_id_of(s)]}

    trained, validated = asked(s for s, _ in trainer.train_ids), asked(s for s, _ in trainer.val_ids)
    assert trained and validated
    assert {part_of_key(key, 0.5) for key in trained} == {TRAINING}
    evaluated = held_out(cfg, SampleTokenizer.for_run(cfg))
    assert evaluated and not {h.keys[-1] for h in evaluated} & (trained | validated)


@pytest.mark.slow
def test_the_ttt_objective_with_the_linear_memory_kernel_equals_the_dense_attentions():
    """SpecForge's objective, 7 TTT steps, a padded batch of 2: with eagle3/model/ttt_attention.py's kernel the loss of
    each TTT position is the dense [T, T] attention's within 1e-5 (fp32), and so are the gradients of every
    trained weight (to 1e-5 of the largest)."""
    from eagle3.model.drafter import Eagle3Draft
    from eagle3.model.ttt_attention import dense_ttt_attention

    cfg = SMALL_DRAFT
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    ids, aux, last = torch.randint(0, 60, (2, 97)), torch.randn(2, 97, 96), torch.randn(2, 97, 32)
    draft_ids = torch.arange(0, 60, 2)
    t2d = torch.zeros(60, dtype=torch.bool)
    t2d[draft_ids] = True
    teachers = make_teachers(
        ids,
        torch.ones_like(ids),
        last,
        torch.randn(60, 32),
        draft_ids,
        t2d,
        lengths=torch.tensor([97, 70]),
        first_draft=True,
    )
    objective = train.TTTObjective(draft, ttt_length=7)

    def loss_and_grads():
        draft.zero_grad(set_to_none=True)
        loss, plosses, *_ = objective(aux, teachers, draft_ids)
        loss.backward()
        return plosses.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}

    plosses, grads = loss_and_grads()
    draft.midlayer.self_attn.attention = dense_ttt_attention
    dense_plosses, dense_grads = loss_and_grads()
    assert (plosses - dense_plosses).abs().max() <= 1e-5, (plosses, dense_plosses)
    for name, grad in grads.items():
        scale = dense_grads[name].abs().max()
        torch.testing.assert_close(
            grad, dense_grads[name], rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_lk_objectives_are_the_expected_acceptance_losses_of_the_target_full_distribution():
    """train.objective lk_lambda / lk_alpha (LK losses, SpecForge's lk_loss_type): one TTT step's loss, taken apart
    by hand from the target's FULL-vocab softmax (the drafter cannot propose the rest, so its acceptance is
    sum over the draft vocab of min(p_full, q), never renormalised): lk_alpha = -mean log acceptance, lk_lambda =
    w * KL + (1 - w) * (1 - mean acceptance) with w = exp(-decay * mean acceptance). kl stays SpecForge's
    cross-entropy, whatever the LK fields say."""
    from eagle3.model.drafter import Eagle3Draft

    cfg = SMALL_DRAFT
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    ids, aux, last, lm_head = (
        torch.randint(0, 60, (2, 17)),
        torch.randn(2, 17, 96),
        torch.randn(2, 17, 32),
        torch.randn(60, 32),
    )
    draft_ids = torch.arange(0, 60, 2)
    t2d = torch.zeros(60, dtype=torch.bool)
    t2d[draft_ids] = True
    teachers = make_teachers(ids, torch.ones_like(ids), last, lm_head, draft_ids, t2d, lengths=torch.tensor([17, 11]))

    positions = torch.arange(17)[None].expand(2, 17)
    logits, _ = draft.step(teachers.input_ids, draft.fc(aux), positions, [])
    q = logits.softmax(-1)
    p_full = (train.shift_left(last) @ lm_head.T).softmax(-1)[..., draft_ids]
    counted = teachers.in_draft_vocab & teachers.loss_mask
    alpha = torch.minimum(p_full, q).sum(-1)[counted]
    kl = -(counted[..., None] * (p_full / p_full.sum(-1, keepdim=True)) * q.log()).sum() / (2 * 17)
    weight = math.exp(-2.5 * alpha.mean().item())
    expected = {"kl": kl, "lk_alpha": -alpha.log().mean(), "lk_lambda": weight * kl + (1 - weight) * (1 - alpha.mean())}
    for objective, want in expected.items():
        loss, plosses, *_ = train.TTTObjective(draft, 1, objective, lk_kl_decay=2.5)(aux, teachers, draft_ids)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=lambda m, o=objective: f"{o}: {m}")
        torch.testing.assert_close(plosses[0], kl, rtol=1e-5, atol=1e-6)  # the curves plot the cross-entropy
    assert 0 < alpha.min() and alpha.max() < 1 and kl > 0


def chunking_workload(objective: str = "kl", steps: int = 7, t: int = 97, vocab: int = 60):
    """A padded batch of 2 for the 7-step objective, seeded: (draft, teachers, aux, draft_ids)."""
    from eagle3.model.drafter import Eagle3Draft

    cfg = dataclasses.replace(
        SMALL_DRAFT, max_position_embeddings=1024, target_vocab_size=2 * vocab, draft_vocab_size=vocab
    )
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    ids, aux, last = torch.randint(0, 2 * vocab, (2, t)), torch.randn(2, t, 96), torch.randn(2, t, 32)
    draft_ids = torch.arange(0, 2 * vocab, 2)
    t2d = torch.zeros(2 * vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    teachers = make_teachers(
        ids,
        torch.ones_like(ids),
        last,
        torch.randn(2 * vocab, 32),
        draft_ids,
        t2d,
        lengths=torch.tensor([t, t * 2 // 3]),
        first_draft=True,
    )
    return draft, teachers, aux, draft_ids


@pytest.mark.slow
@pytest.mark.parametrize("objective", train.OBJECTIVES)
def test_the_loss_in_chunks_of_positions_equals_the_whole_steps(objective):
    """TTTObjective takes each step's logits, loss terms and accuracy a chunk of positions at a time (checkpointed:
    backward recomputes the chunk's logits). For SpecForge's objective and both LK ones: the loss, every TTT
    position's cross-entropy and accuracy, and the gradient of every trained weight equal the whole step's (one
    chunk, the unchunked computation) within fp32 rounding, with chunks that do not divide T."""
    draft, teachers, aux, draft_ids = chunking_workload(objective)

    def run(chunk):
        draft.zero_grad(set_to_none=True)
        loss, plosses, accs, agrees = train.TTTObjective(draft, 7, objective, logit_chunk=chunk)(
            aux, teachers, draft_ids
        )
        loss.backward()
        return loss.detach(), plosses, accs, agrees, {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}

    whole = run(97)
    for chunk in (13, 40):
        loss, plosses, accs, agrees, grads = run(chunk)
        torch.testing.assert_close(loss, whole[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(plosses, whole[1], rtol=1e-6, atol=1e-7)
        assert torch.equal(accs, whole[2]) and torch.equal(agrees, whole[3])
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad,
                whole[4][name],
                rtol=0,
                atol=1e-5 * whole[4][name].abs().max(),
                msg=lambda m, n=name, c=chunk: f"chunk {c}, {n}: {m}",
            )


@pytest.mark.slow
def test_no_ttt_step_keeps_its_logits_for_backward():
    """The memory item 1 of issue 42 is about: autograd kept every step's [B, T, draft vocab] log-probabilities
    and teacher product (7 x 2 x 4 GB at Kimi's drafter, T = 32k). Counted with saved_tensors_hooks over forward
    (the checkpoints' own inputs included): in chunks, besides the teacher p that make_teachers built (one tensor,
    all steps read it), no kept tensor holds more than a chunk's draft-vocab rows; the unchunked run, the control
    (what the code kept before), keeps two tensors of the step's logits' size a step more (a step's logits are its
    trained positions'), 14 in all."""
    draft, teachers, aux, draft_ids = chunking_workload(t=256, vocab=512)
    b, t, vocab, chunk = 2, 256, 512, 16
    teacher_p = teachers.p.untyped_storage().data_ptr()

    def kept(logit_chunk: int) -> tuple[int, int]:
        """(bytes of the distinct storages autograd keeps besides the teacher p, the most draft-vocab rows in one)"""
        storages, rows = {}, [0]

        def pack(x):
            if x.untyped_storage().data_ptr() != teacher_p:
                storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
                if x.dim() >= 2 and x.shape[-1] == vocab:
                    rows[0] = max(rows[0], x.numel() // vocab)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            train.TTTObjective(draft, 7, logit_chunk=logit_chunk)(aux, teachers, draft_ids)
        return sum(storages.values()), rows[0]

    trained = [int(mask.sum()) for mask in train.step_masks(teachers, 7)]  # each step's logits' rows
    chunked, chunked_rows = kept(chunk)
    whole, whole_rows = kept(t)
    assert chunked_rows <= b * chunk and whole_rows == trained[0] > b * chunk
    assert whole - chunked >= 2 * sum(trained) * vocab * 4, (chunked, whole, trained)


def dense_objective(draft, teachers, aux, draft_ids, steps: int, objective: str, kl_decay: float = 3.0):
    """The objective as it was computed before it ran only where the loss reads (issue 52): every TTT step over the
    whole padded batch, its loss over [B, T, draft vocab] tensors, the teachers shifted along by copies. The
    reference TTTObjective is compared with. Returns (loss, plosses, accs, agrees [steps, B, T])."""
    b, n = teachers.input_ids.shape
    positions = torch.arange(n)[None].expand(b, n)
    hidden, cache, loss, plosses, accs, agrees = draft.fc(aux), [], 0.0, [], [], []
    ids, teacher, in_vocab, p, mass = (
        teachers.input_ids,
        teachers.teacher,
        teachers.in_draft_vocab,
        teachers.p,
        teachers.draft_mass,
    )
    for i, mask in enumerate(train.step_masks(teachers, steps)):
        logits, hidden = draft.step(ids, hidden, positions + i, cache)
        logp = torch.nn.functional.log_softmax(logits.float(), dim=-1)
        counted = in_vocab & mask
        ploss = -(counted[..., None] * p * logp).sum() / (b * n)
        alpha = train.expected_acceptance(p * mass[..., None], logp.exp()) if objective != "kl" else None
        agree = draft_ids[logits.argmax(-1)] == teacher
        accs.append((agree & mask).sum() / mask.sum().clamp(min=1))
        plosses.append(ploss.detach())
        agrees.append(agree)
        loss = loss + train.STEP_DECAY**i * train.step_loss(objective, ploss, alpha, counted, kl_decay)
        ids, teacher, in_vocab, p, mass = (train.shift_left(x) for x in (ids, teacher, in_vocab, p, mass))
    return loss, torch.stack(plosses), torch.stack(accs), torch.stack(agrees)


def padded_workload(first_draft: bool, seed: int = 0):
    """A padded batch of 3 samples of the tiny shapes, with prompts and two answers each (draft, aux, draft_ids,
    make_teachers' arguments)."""
    from eagle3.model.drafter import Eagle3Draft

    cfg = SMALL_DRAFT
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    b, t = 3, 41
    ids, aux, last, lm_head = (
        torch.randint(0, 60, (b, t)),
        torch.randn(b, t, 96),
        torch.randn(b, t, 32),
        torch.randn(60, 32),
    )
    mask = torch.zeros(b, t, dtype=torch.long)
    for row, (start, end, start2, end2) in enumerate([(5, 14, 20, 41), (3, 9, 15, 30), (8, 12, 17, 25)]):
        mask[row, start:end], mask[row, start2:end2] = 1, 1
    draft_ids = torch.arange(0, 60, 2)
    t2d = torch.zeros(60, dtype=torch.bool)
    t2d[draft_ids] = True
    args = (ids, mask, last, lm_head, draft_ids, t2d, torch.tensor([41, 33, 27]), first_draft)
    return draft, aux, draft_ids, args


@pytest.mark.parametrize("objective", train.OBJECTIVES)
@pytest.mark.parametrize("first_draft", [True, False], ids=["first-draft", "specforge-mask"])
def test_the_objective_computed_where_the_loss_reads_equals_the_whole_batchs(objective, first_draft):
    """TTTObjective runs each TTT step only at the positions it or a later step trains, with teachers made only
    where a step reads them (make_teachers only_read, as the trainer makes them): the loss, each step's cross-entropy
    and accuracy, and the gradient of every trained weight equal the whole padded batch's computation (the code
    before issue 52) within fp32 rounding, for both masks and every objective; and the agreements are the same at
    every position a step trains, and at every position decoding drafts from when validation asks for those too
    (what the offline replay reads), whatever the mask."""
    draft, aux, draft_ids, args = padded_workload(first_draft)
    steps = 7

    def run(compute):
        draft.zero_grad(set_to_none=True)
        loss, plosses, accs, agrees = compute()
        loss.backward()
        return (
            loss.detach(),
            plosses,
            accs,
            agrees,
            {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad},
        )

    whole = run(lambda: dense_objective(draft, make_teachers(*args), aux, draft_ids, steps, objective))
    teachers = make_teachers(*args, only_read=True)
    replayed = train.decoding_masks(args[1], args[6], steps)
    got = run(lambda: train.TTTObjective(draft, steps, objective)(aux, teachers, draft_ids, replayed))
    torch.testing.assert_close(got[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], whole[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], whole[2])
    masks = train.step_masks(teachers, steps)
    for i, (mask, drafted) in enumerate(zip(masks, replayed)):
        assert mask.any() and drafted.any()
        wanted = mask | drafted
        assert torch.equal(got[3][i][wanted], whole[3][i][wanted]) and not got[3][i][~wanted].any(), i
    for name, grad in got[4].items():
        torch.testing.assert_close(
            grad, whole[4][name], rtol=0, atol=1e-5 * whole[4][name].abs().max(), msg=lambda m, n=name: f"{n}: {m}"
        )


def test_teachers_made_only_where_a_step_reads_them_are_the_whole_batchs_there():
    """make_teachers only_read: the target's distribution, token and draft-vocab mass where a TTT step reads them
    (step 0's trained positions and decoding's first drafts, which every later step's reads fall in), the same as
    computed at every position; zero elsewhere; the masks and ids untouched."""
    for first_draft in (True, False):
        _, _, _, args = padded_workload(first_draft)
        whole, read = make_teachers(*args), make_teachers(*args, only_read=True)
        answer = args[1].bool() & (torch.arange(41)[None] < args[6][:, None])
        at = read.loss_mask | train.drafted(answer)
        assert 0 < at.sum() < at.numel() - 20  # prompts and padding are left out
        for name in ("p", "teacher", "in_draft_vocab", "draft_mass"):
            got, want = getattr(read, name), getattr(whole, name)
            torch.testing.assert_close(got[at], want[at], rtol=1e-6, atol=1e-7, msg=name)
        assert not read.p[~at].any() and not read.draft_mass[~at].any()
        for name in ("input_ids", "loss_mask"):
            assert torch.equal(getattr(read, name), getattr(whole, name))


@pytest.mark.parametrize("objective", train.OBJECTIVES)
def test_batches_computed_together_give_each_batchs_own_figures(objective):
    """Validation computes several of training's batches in one pass (TTTObjective's groups): each batch's loss,
    cross-entropies and accuracies equal those of the batch computed alone, padded to its own length, within fp32
    rounding; the LK losses, whose weights are means over the batch, included."""
    draft, aux, draft_ids, args = padded_workload(True)
    ids, mask, last, lm_head, _, t2d, lengths, _ = args
    objective_ = train.TTTObjective(draft, 7, objective)
    batches = [[0, 2], [1]]
    with torch.no_grad():
        alone = []
        for rows in batches:
            n = int(lengths[rows].max())
            part = (ids[rows, :n], mask[rows, :n], last[rows, :n], lm_head, draft_ids, t2d, lengths[rows], True)
            alone.append(objective_(aux[rows, :n], make_teachers(*part, only_read=True), draft_ids)[:3])
        order = [row for rows in batches for row in rows]
        group = torch.tensor([g for g, rows in enumerate(batches) for _ in rows])
        padded = torch.tensor([len(rows) * float(lengths[rows].max()) for rows in batches])
        together = (ids[order], mask[order], last[order], lm_head, draft_ids, t2d, lengths[order], True)
        loss, plosses, accs, _ = objective_(
            aux[order], make_teachers(*together, only_read=True), draft_ids, groups=(group, padded)
        )
    for g, (want_loss, want_plosses, want_accs) in enumerate(alone):
        torch.testing.assert_close(loss[g], want_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plosses[:, g], want_plosses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(accs[:, g], want_accs, rtol=0, atol=1e-7)


@pytest.mark.slow
def test_validation_in_passes_of_several_batches_gives_the_figures_of_a_pass_a_batch(trained_config, monkeypatch):
    """Trainer.validate computes several of training's batches a pass (VAL_BATCH_TOKENS, by length): its loss,
    accuracies and offline acceptance are those of one pass a batch (what validation did before), the cycles
    replayed exactly, the means to fp32 rounding."""
    trainer = train.Trainer(trained_config)
    trainer.resume()
    # batches of one or two of its few validation samples
    trainer.cfg = trained_config.model_copy(
        update={"train": trained_config.train.model_copy(update={"batch_tokens": 64})}
    )
    batches = train.plan_epoch(trainer.val_ids, 64, trained_config.seed, 0)
    assert len(train.merge_batches(batches, dict(trainer.val_ids), train.VAL_BATCH_TOKENS)) == 1 < len(batches)
    together = trainer.validate()
    monkeypatch.setattr(train, "VAL_BATCH_TOKENS", 1)  # each batch a pass of its own
    alone = trainer.validate()
    assert together["val_offline"] == alone["val_offline"]
    assert together["val_loss"] == pytest.approx(alone["val_loss"], rel=1e-6)
    assert together["val_acc"] == pytest.approx(alone["val_acc"], rel=1e-6)


def test_a_batch_with_nothing_to_train_gives_every_weight_a_zero_gradient():
    """No position trained (one-token answers: nothing drafted after them): every TTT step runs on no position at all,
    and the loss is 0 with a gradient, zero, for every trained weight: DDP's ranks all-reduce every weight's each
    step."""
    draft, aux, draft_ids, args = padded_workload(True)
    mask = torch.zeros_like(args[1])
    mask[0, 40] = 1
    for first_draft in (True, False):
        teachers = make_teachers(args[0], mask, *args[2:7], first_draft, only_read=True)
        draft.zero_grad(set_to_none=True)
        loss, _, accs, agrees = train.TTTObjective(draft, 7)(
            aux, teachers, draft_ids, train.decoding_masks(mask, args[6], 7)
        )
        loss.backward()
        assert loss.item() == 0 and not accs.any() and not agrees.any()
        assert all(p.grad is not None and not p.grad.any() for p in draft.parameters() if p.requires_grad)
