"""How much of the held-out set training saw, under three split rules: by conversation id, by first user prompt, and by
every user turn (eagle3.stages.split today).

For a conversations file (the tiny target's prompts by default: the demo's data) and a train.val_fraction (the
demo's, 0.3, by default), prints how many conversations share a user turn, and for each rule the held-out
conversations, their distinct user turns, and how many of those a training conversation also asks: evaluate leaves
such turns out (eagle3.stages.evaluate.prompts.held_out), so they cost held-out prompts; a turn whose own bucket is
evaluation is never among them under today's rule. Needs no model: it reads the file only.

    .venv/bin/python bench/held_out_overlap.py [CONVERSATIONS.jsonl] [--val-fraction 0.3]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from eagle3.data.samples import read_conversations
from eagle3.stages.split import BUCKETS, TRAINING, part_of_key, part_of_keys, prompt_key, split_keys

REPO = Path(__file__).resolve().parents[1]


def user_turns(conversation) -> set[str]:
    return {prompt_key(m["content"]) for m in conversation.messages if m["role"] == "user"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("conversations", nargs="?", default=REPO / ".cache" / "tiny-target" / "prompts.jsonl")
    parser.add_argument("--val-fraction", type=float, default=0.3)
    args = parser.parse_args()
    conversations, _ = read_conversations(args.conversations, "skip")
    keys = {c.sample_id: split_keys(c) for c in conversations}
    asked = Counter(key for c in conversations for key in user_turns(c))
    sharing = sum(any(asked[key] > 1 for key in user_turns(c)) for c in conversations)
    print(
        f"{args.conversations}: {len(conversations)} conversations, {len(asked)} distinct user turns (normalised); "
        f"{sharing} conversations share a user turn with another"
    )
    vf = args.val_fraction
    rules = {
        "by conversation id": lambda c: int(c.sample_id, 16) % BUCKETS < vf * BUCKETS,
        "by first user prompt": lambda c: part_of_key(keys[c.sample_id][0], vf) != TRAINING,
        "by every user turn": lambda c: part_of_keys(keys[c.sample_id], vf) != TRAINING,
    }
    for name, held_out in rules.items():
        held = [c for c in conversations if held_out(c)]
        trained = {key for c in conversations if not held_out(c) for key in user_turns(c)}
        turns = {key for c in held for key in user_turns(c)}
        print(
            f"  {name}: {len(held)} conversations held out at val_fraction {vf}, {len(turns)} distinct user turns; "
            f"{len(turns & trained)} of them also asked by a training conversation"
        )


if __name__ == "__main__":
    main()
