"""Which prompts evaluate measures: the evaluation part of the run's split by user turn, at first and later user
turns (held_out), and the record a lineage pins of them (eval_set_record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from eagle3.data.overlap import overlap
from eagle3.data.samples import read_conversations
from eagle3.stages.split import EVALUATION, SPLIT_RULE, TRAINING, prompt_key, run_split

if TYPE_CHECKING:
    from eagle3.config import RunConfig


LATER_TURN_SHARE = 0.5  # of evaluate.num_prompts, at most: prompts that end at a later user turn


@dataclass(frozen=True)
class HeldOutPrompt:
    conversation_id: str
    turn: int  # the assistant message it prompts: the prompt is the conversation's messages before it
    kind: str  # "first" (the first user turn) or "later"
    keys: tuple[str, ...]  # split keys (eagle3.stages.split) a drafter must never have trained on for it to be held out
    prompt: list[int]  # token ids: those messages through the chat template, generation prompt added


def held_out(cfg: RunConfig, tokenizing, limit: int | None = None) -> list[HeldOutPrompt]:
    """Prompts training never saw, from the conversations of the evaluation part of the run's split
    (eagle3.stages.split: no conversation that asks one of their user turns trains or validates): up to `limit`
    (evaluate.num_prompts), each the conversation up to a user turn that an assistant turn answers, rendered with the
    generation prompt. At most LATER_TURN_SHARE of them end at a later user turn (the conversation before it as
    context, as the server is sent it), the rest at the first; when one kind runs short the other fills in. A turn
    that a training or validation conversation also asks is left out (its conversation is held out for another of
    its turns). Deterministic, and independent of the file's order: first turns by (first key, conversation id),
    later ones by (which user turn, first key, conversation id). `tokenizing` is the run's
    eagle3.data.samples.SampleTokenizer."""
    # The conversations training split on (the regenerated ones, with generate on).
    conversations, _ = read_conversations(cfg.conversations_path, "skip", None, cfg.conversations_missing_hint)
    split = run_split(cfg, conversations)
    seen_outside = {
        key for cid, keys in split.keys.items() if split.part_of_conversation(cid) != EVALUATION for key in keys
    }
    firsts, laters = [], []
    for conversation in conversations:
        if split.part_of_conversation(conversation.sample_id) != EVALUATION:
            continue
        opening, messages, asked = split.keys[conversation.sample_id][0], conversation.messages, []
        for i in range(1, len(messages)):
            if messages[i]["role"] != "assistant" or messages[i - 1]["role"] != "user":
                continue  # (an answer to a tool result, or an assistant turn right after another)
            asked.append(prompt_key(messages[i - 1]["content"]))
            if asked[-1] in seen_outside:
                continue
            if len(asked) == 1:  # the first user turn that is answered: what opens the conversation
                firsts.append(((opening, conversation.sample_id), conversation, i, tuple(asked)))
            else:
                laters.append(((len(asked) - 1, opening, conversation.sample_id), conversation, i, tuple(asked)))
    wanted = limit or cfg.evaluate.num_prompts
    later = min(len(laters), int(wanted * LATER_TURN_SHARE))
    first = min(len(firsts), wanted - later)
    later = min(len(laters), wanted - first)
    chosen = [("first", c) for c in sorted(firsts, key=lambda c: c[0])[:first]] + [
        ("later", c) for c in sorted(laters, key=lambda c: c[0])[:later]
    ]
    return [
        HeldOutPrompt(
            conversation.sample_id,
            turn,
            kind,
            keys,
            tokenizing.prompt_ids(conversation.messages[:turn], conversation.tools),
        )
        for kind, (_, conversation, turn, keys) in chosen
    ]


def held_out_prompts(cfg: RunConfig, tokenizing, limit: int | None = None) -> list[list[int]]:
    return [held.prompt for held in held_out(cfg, tokenizing, limit)]


def eval_set_record(chosen: list[HeldOutPrompt]) -> dict:
    """The evaluation set a lineage pins (eagle3.records.lineage.EVAL_SET_FIELDS) from held_out's prompts."""
    return {
        "format": 2,
        "split": SPLIT_RULE,
        "conversation_ids": [h.conversation_id for h in chosen],
        "turns": [h.turn for h in chosen],
        "kinds": [h.kind for h in chosen],
        "split_keys": sorted({key for h in chosen for key in h.keys}),
        "prompts": [h.prompt for h in chosen],
    }


def answers_seen_in_training(cfg: RunConfig, pinned: dict) -> dict:
    """The pinned prompts' answers in this run's conversations, against the answers of its training part: how many
    training holds verbatim, and how many more as near-duplicates (eagle3.data.overlap)."""
    conversations, _ = read_conversations(cfg.conversations_path, "skip", None, cfg.conversations_missing_hint)
    split = run_split(cfg, conversations)
    by_id = {c.sample_id: c for c in conversations}
    held = [
        by_id[cid].messages[turn].get("content") or ""
        for cid, turn in zip(pinned["conversation_ids"], pinned["turns"])
        if cid in by_id
    ]
    trained = [
        m.get("content") or ""
        for c in conversations
        if split.part_of_conversation(c.sample_id) == TRAINING
        for m in c.messages
        if m["role"] == "assistant"
    ]
    return overlap(held, trained)


@dataclass
class HeldOutSet:
    """The pinned held-out prompts, and the target's answer to each without a drafter (greedy, or sampled)."""

    prompts: list[list[int]]
    baseline: list[list[int]] | None = None
