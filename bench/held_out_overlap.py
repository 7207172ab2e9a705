"""How much of the held-out set training saw: first prompts on both sides of the split, before and after issue 37.

Before, the split keyed on the conversation id (a hash of the whole conversation), so conversations that open with
the same prompt could land on both sides; since, it keys on the normalised first user prompt (eagle3.stages.split). For
a conversations file (the tiny target's prompts by default: the demo's data, whose 5387 distinct conversations generate
answers again) and a train.val_fraction (0.05 when this was written; the demo's is 0.3 since), prints the conversations
that share a first prompt, and the held-out first prompts that also open a training conversation under each rule (the
contract: none after). Needs no model: it reads the file only.

    .venv/bin/python bench/held_out_overlap.py [CONVERSATIONS.jsonl] [--val-fraction 0.05]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from eagle3.data.samples import read_conversations
from eagle3.stages.split import BUCKETS, TRAINING, part_of_key, prompt_key, split_key

REPO = Path(__file__).resolve().parents[1]


def held_out_by_conversation_id(conversation_id: str, val_fraction: float) -> bool:
    """The rule before issue 37 (eagle3.stages.train.is_validation then)."""
    return int(conversation_id, 16) % BUCKETS < val_fraction * BUCKETS


def on_both_sides(conversations, keys: dict[str, str], held: dict[str, bool]) -> tuple[int, int]:
    """(held-out first prompts, those of them that also open a training conversation)."""
    sides: dict[str, set[bool]] = {}
    for c in conversations:
        sides.setdefault(keys[c.sample_id], set()).add(held[c.sample_id])
    held_out = [s for s in sides.values() if True in s]
    return len(held_out), sum(s == {True, False} for s in held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("conversations", nargs="?", default=REPO / ".cache" / "tiny-target" / "prompts.jsonl")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    args = parser.parse_args()
    conversations, _ = read_conversations(args.conversations, "skip")
    keys = {c.sample_id: split_key(c) for c in conversations}
    opened = Counter(keys.values())
    sharing = [k for k, n in opened.items() if n > 1]
    n, in_groups, repeats = len(conversations), sum(opened[k] for k in sharing), len(conversations) - len(opened)
    print(f"{args.conversations}: {n} conversations, {len(opened)} distinct first prompts (normalised)")
    print(
        f"  share a first prompt: {in_groups} conversations ({in_groups / n:.1%}) in {len(sharing)} groups (largest "
        f"{max(opened.values())}); {repeats} ({repeats / n:.1%}) repeat a first prompt an earlier one opened with"
    )
    before = {c.sample_id: held_out_by_conversation_id(c.sample_id, args.val_fraction) for c in conversations}
    after = {sid: part_of_key(key, args.val_fraction) != TRAINING for sid, key in keys.items()}
    for name, held in (("before (by conversation id)", before), ("after (by first prompt)", after)):
        count, both = on_both_sides(conversations, keys, held)
        print(
            f"  {name}: {sum(held.values())} conversations held out at val_fraction {args.val_fraction}, "
            f"{count} first prompts; {both} of them also open a training conversation"
        )
    # Later user turns of held-out conversations that ask what a training conversation opens with: evaluate leaves
    # them out (eagle3.stages.evaluate.prompts.held_out), the split alone cannot.
    trained_openings = {key for sid, key in keys.items() if not after[sid]}
    later = [
        prompt_key(c.messages[i - 1]["content"])
        for c in conversations
        if after[c.sample_id]
        for i in range(1, len(c.messages))
        if c.messages[i]["role"] == "assistant"
        and c.messages[i - 1]["role"] == "user"
        and any(m["role"] == "assistant" for m in c.messages[: i - 1])
    ]
    print(
        f"  later user turns held out: {len(later)}; {sum(k in trained_openings for k in later)} of them ask what a "
        "training conversation opens with (evaluate does not take those)"
    )


if __name__ == "__main__":
    main()
