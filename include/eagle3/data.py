"""Conversations in, token ids and loss masks out.

Input: JSONL, one conversation per line, in either of the two forms people have:
  ShareGPT  {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}  ("role"/"content" also read)
  OpenAI    {"messages": [{"role": "user"|"assistant"|"system", "content": "..."}]}
Each line is normalised to [{"role", "content"}]; its sample id is a hash of that normalised form, so
the same conversation has the same id whatever file, line or form it came from. That id is what the
hidden-state store, resume, sharding and the train/val split key on.

Bad lines (invalid JSON, no assistant turn, unknown role, empty) are never dropped silently: by default
they stop the stage with their line numbers; with data.on_bad_record = "skip" they are skipped and
counted in the stats.

Loss mask: 1 exactly on the tokens of assistant contents (and reasoning_content, if any). The rendered chat
template is split into segments at the message contents and each segment is tokenised on its own, so the mask is
exact by construction for any tokenizer (fast, slow or tiktoken-based like Kimi's): no offset mapping needed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}


class DataError(ValueError):
    """Input data a stage cannot use; the message names the file, the lines and the fix."""


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    messages: tuple[dict, ...]
    line_no: int


@dataclass
class ReadStats:
    lines: int = 0
    conversations: int = 0
    duplicates: int = 0
    bad: dict[int, str] = field(default_factory=dict)  # line number -> reason


@dataclass(frozen=True)
class TokenizedSample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def sample_id_of(messages: list[dict]) -> str:
    """Stable id: sha256 of the normalised conversation, first 16 hex digits (64 bits)."""
    canonical = json.dumps(
        [[m["role"], m["content"], *([m["reasoning_content"]] if "reasoning_content" in m else [])] for m in messages],
        ensure_ascii=False, separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def shard_of(sample_id: str, num_shards: int) -> int:
    return int(sample_id, 16) % num_shards


def normalize_record(record: object) -> list[dict]:
    """Turn one parsed JSONL record into [{"role", "content"}]; raise ValueError with the reason."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        raise ValueError('no "conversations" or "messages" key')
    if not isinstance(turns, list) or not turns:
        raise ValueError("empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {i} is not an object")
        raw_role = turn.get("role", turn.get("from"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise ValueError(f"turn {i} has unknown role {raw_role!r} (known: {', '.join(sorted(ROLE_ALIASES))})")
        content = turn.get("content", turn.get("value"))
        if not isinstance(content, str):
            raise ValueError(f"turn {i} ({role}) has no text content")
        if role == "assistant" and not content.strip():
            raise ValueError(f"turn {i} (assistant) is empty")
        message = {"role": role, "content": content}
        # A thinking model's reasoning (SGLang --reasoning-parser returns it apart from the content): the chat
        # template renders it, and the drafter learns it like the content.
        reasoning = turn.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            message["reasoning_content"] = reasoning
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn")
    return messages


def read_conversations(path: str | Path, on_bad_record: str = "error", max_samples: int | None = None,
                       missing_hint: str = "data.path: {path} does not exist"):
    """Read and validate a JSONL file. Returns (conversations in file order, ReadStats)."""
    path = Path(path)
    stats = ReadStats()
    conversations: list[Conversation] = []
    seen: set[str] = set()
    try:
        handle = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise DataError(missing_hint.format(path=path)) from None
    with handle:
        for line_no, line in enumerate(handle, start=1):
            if max_samples is not None and stats.conversations >= max_samples:
                break
            stats.lines += 1
            if not line.strip():
                stats.bad[line_no] = "empty line"
                continue
            try:
                messages = normalize_record(json.loads(line))
            except json.JSONDecodeError as err:
                stats.bad[line_no] = f"invalid JSON ({err.msg} at column {err.colno})"
                continue
            except ValueError as err:
                stats.bad[line_no] = str(err)
                continue
            sample_id = sample_id_of(messages)
            if sample_id in seen:
                stats.duplicates += 1
                continue
            seen.add(sample_id)
            conversations.append(Conversation(sample_id, tuple(messages), line_no))
            stats.conversations += 1
    if stats.bad and on_bad_record == "error":
        shown = list(stats.bad.items())[:20]
        details = "\n  ".join(f"line {n}: {reason}" for n, reason in shown)
        more = f"\n  ... and {len(stats.bad) - len(shown)} more" if len(stats.bad) > len(shown) else ""
        raise DataError(
            f"{path}: {len(stats.bad)} bad record(s):\n  {details}{more}\n"
            "Fix those lines, or set data.on_bad_record to 'skip' to skip them (they are counted in the stats)."
        )
    return conversations, stats


def render_segments(tokenizer, messages) -> list[tuple[str, bool]]:
    """Split the rendered chat template into (text, is_assistant_content) segments, in order."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for i, message in enumerate(messages):
        parts = [("reasoning_content", message["reasoning_content"])] if "reasoning_content" in message else []
        for key, part in [*parts, ("content", message["content"])]:
            start = text.find(part, cursor)
            if start < 0:
                raise ValueError(
                    f"turn {i} ({message['role']}): its {key} does not appear verbatim in the rendered chat "
                    "template (the template rewrites or drops it), so its loss mask cannot be placed"
                )
            end = start + len(part)
            segments.append((text[cursor:start], False))
            segments.append((text[start:end], message["role"] == "assistant"))
            cursor = end
    segments.append((text[cursor:], False))
    return [(s, a) for s, a in segments if s]


def tokenize_conversation(tokenizer, conversation: Conversation, max_length: int) -> TokenizedSample:
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for text, is_assistant in render_segments(tokenizer, conversation.messages):
        ids = tokenizer.encode(text, add_special_tokens=False)
        input_ids.extend(ids)
        loss_mask.extend([int(is_assistant)] * len(ids))
    truncated = len(input_ids) > max_length
    return TokenizedSample(conversation.sample_id, input_ids[:max_length], loss_mask[:max_length], truncated)


def iter_tokenized(tokenizer, conversations, max_length: int, skipped: dict[str, str]) -> Iterator[TokenizedSample]:
    """Tokenise lazily; samples left with no assistant token (template rewrote them, or truncation cut
    every assistant token) are recorded in `skipped` (sample id -> reason) rather than yielded."""
    for conversation in conversations:
        try:
            sample = tokenize_conversation(tokenizer, conversation, max_length)
        except ValueError as err:
            skipped[conversation.sample_id] = f"line {conversation.line_no}: {err}"
            continue
        if not any(sample.loss_mask):
            skipped[conversation.sample_id] = f"line {conversation.line_no}: no assistant token within max_length"
            continue
        yield sample
