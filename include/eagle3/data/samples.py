"""Conversations in, token ids and loss masks out: exactly what the target sees when it serves them.

Input: JSONL, one conversation per line, in either form:
  ShareGPT  {"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": "..."}]}  ("role"/"content" read too)
  OpenAI    {"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": "..."}], "tools": [...]}
Assistant turns may carry `reasoning_content`, OpenAI `tool_calls`, and "finish_reason": "length" (generate marks a
turn cut at generate.max_tokens so: no end-of-turn token is trained for it); `tool` turns keep `tool_call_id` and
`name`; a record's `tools` go to the chat template. The sample id is a hash of the normalised conversation: the same
conversation has the same id from any file, line or form, and the store, resume, sharding and the split key on it.

Bad lines (invalid JSON, not UTF-8, longer than MAX_LINE_BYTES, no assistant turn, unknown role, empty) stop the
stage with their line numbers; with data.on_bad_record "skip" they are skipped and counted. Only a regular file is
read, a line at a time and never more than MAX_LINE_BYTES of one; blank lines are ignored.

Samples: every prompted assistant turn is trained once, as the target generated it after the prompt it was served
(eagle3.data.turns places it). Turns the whole conversation's rendering shows so are one sample whose ids are, token for
token, `apply_chat_template(messages, tools=tools, tokenize=True)`; every other turn is a sample of its own,
"<conversation id>.<turn index>". data.loss_mask "assistant_turn" (default, SpecForge's) trains the generated text
through its end-of-turn token, "content" only the content and reasoning characters; the template's separator after the
end-of-turn token is never trained. data.max_length cuts nothing trained: a turn past it gets a sample of its own with
as much context as fits. Cuts and dropped turns are counted (TokenizeStats); extract refuses a run that loses more than
data.max_untrained_fraction (untrained_refusal). Chat templates run in jinja's sandbox and are probed when the stage
starts (SampleTokenizer.check_templates); only a template's own raise_exception() skips a conversation, with its reason.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import re
import signal
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle3.config import ConfigError, RunConfig
from eagle3.data.turns import (
    NO_TRAINED_TOKEN,
    REASONING_NOT_RENDERED,
    TEMPLATE_REFUSED,
    Plan,
    Rendering,
    TemplateFailed,
    TemplateRefused,
    TurnNotPlaced,
    markup_pattern,
    plan_renderings,
    render,
    renderings_as_generated,
)
from eagle3.disk.fsutil import UnsafeFile, read_small_file

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
}
LossMaskPolicy = Literal["assistant_turn", "content"]
TOKENIZING_VERSION = 4  # bump when the samples a conversation gives change (cached token counts key on it)
# Kept on a message beside role and content when present (OpenAI's names).
ASSISTANT_EXTRAS = ("reasoning_content", "tool_calls", "finish_reason")
TOOL_EXTRAS = ("tool_call_id", "name")
# One line of the data is one conversation. The longest real ones (a 1M-token context, with reasoning and tool
# results) are a few MB of JSON; 64 MiB is many times that, and still bounds what one line can cost: its bytes,
# its decoded text and its parsed objects, a few hundred MB at most. A longer line is a bad record, and is
# skipped over without being held in memory.
MAX_LINE_BYTES = 64 << 20
SKIP_BLOCK_BYTES = 64 << 10  # how much of an over-long line is read at a time while skipping it
SHOWN_CHARS = 80  # of a value from the data echoed in a reason (an unknown role, ...)


class DataError(ValueError):
    """Input data a stage cannot use; the message names the file, the lines and the fix."""


class ChatTemplateError(ConfigError):
    """A chat template that fails, or does not finish, in jinja's sandbox; the message names its file."""


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    messages: tuple[dict, ...]
    line_no: int
    tools: tuple[dict, ...] | None = None  # the record's tool definitions, for the chat template


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


def sample_id_of(messages: list[dict], tools=None) -> str:
    """Stable id: sha256 of the normalised conversation, first 16 hex digits (64 bits). Plain chat hashes
    as it always did; tool calls, tool-call ids and a tools list are part of the content when present."""

    def canonical(m: dict) -> list:
        row = [m["role"], m["content"], *([m["reasoning_content"]] if "reasoning_content" in m else [])]
        extras = {k: m[k] for k in ("tool_calls", "finish_reason", *TOOL_EXTRAS) if k in m}
        return row + [extras] if extras else row

    rows = [canonical(m) for m in messages] + ([["tools", list(tools)]] if tools else [])
    text = json.dumps(rows, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def conversation_id_of(sample_id: str) -> str:
    """The conversation a sample belongs to: a per-turn sample "<id>.<turn>" belongs to "<id>"."""
    return sample_id.split(".", 1)[0]


def shard_of(sample_id: str, num_shards: int) -> int:
    return int(conversation_id_of(sample_id), 16) % num_shards


def _tool_calls(value: object, i: int) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"turn {i} (assistant): tool_calls must be a non-empty list of calls")
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f'turn {i} (assistant): each tool call needs {{"function": {{"name", "arguments"}}}}')
    return value


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A value from the data as a reason may echo it: its repr, cut to `limit` characters with the length said."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value)
    return f"{text[:limit]!r}... ({len(text)} chars)"


def normalize_record(record: object) -> tuple[list[dict], list[dict] | None]:
    """Turn one parsed JSONL record into (messages, tools); raise ValueError with the reason."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        raise ValueError('no "conversations" or "messages" key')
    if not isinstance(turns, list) or not turns:
        raise ValueError("empty conversation")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError('"tools" must be a list of tool definitions (objects)')
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {i} is not an object")
        raw_role = turn.get("role", turn.get("from"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise ValueError(f"turn {i} has unknown role {shown(raw_role)} (known: {', '.join(sorted(ROLE_ALIASES))})")
        content = turn.get("content", turn.get("value"))
        tool_calls = _tool_calls(turn["tool_calls"], i) if role == "assistant" and turn.get("tool_calls") else None
        if content is None and tool_calls:
            content = ""  # OpenAI: an assistant turn that only calls tools has content null
        if not isinstance(content, str):
            raise ValueError(f"turn {i} ({role}) has no text content")
        if role == "assistant" and not content.strip() and not tool_calls:
            raise ValueError(f"turn {i} (assistant) is empty")
        message = {"role": role, "content": content}
        if role == "assistant":
            reasoning = turn.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning.strip():
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            if turn.get("finish_reason") == "length":  # cut at generate.max_tokens: it never ended
                message["finish_reason"] = "length"
        if role == "tool":
            message |= {k: turn[k] for k in TOOL_EXTRAS if isinstance(turn.get(k), str)}
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn")
    return messages, tools or None


def open_data_file(path: Path, missing_hint: str):
    """`path` opened for reading bytes, if it is a regular file (a link to one is fine). Opened before it is
    checked, and without blocking, so that a FIFO swapped in between cannot hang the stage."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DataError(missing_hint.format(path=path)) from None
    except OSError as err:
        raise DataError(
            f"{path}: cannot open the conversations file ({err.strerror}); check data.path and the file's permissions"
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "not a regular file"
        )
        what = "data.path must name" if "data.path" in missing_hint else "conversations are read from"
        raise DataError(f"{path}: is {kind}, not a regular file; {what} a JSONL file of conversations (one per line)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_lines(handle, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line's bytes) for each line of a binary file; None for a line longer than `max_bytes`,
    which is read through in blocks and never held whole."""
    for line_no in itertools.count(1):
        line = handle.readline(max_bytes + 1)
        if not line:
            return
        if len(line) > max_bytes and not line.endswith(b"\n"):
            del line
            while (rest := handle.readline(SKIP_BLOCK_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield line_no, None
            continue
        yield line_no, line


def read_conversations(
    path: str | Path,
    on_bad_record: str = "error",
    max_samples: int | None = None,
    missing_hint: str = "data.path: {path} does not exist",
):
    """Read and validate a JSONL file. Returns (conversations in file order, ReadStats)."""
    path = Path(path)
    stats = ReadStats()
    conversations: list[Conversation] = []
    seen: set[str] = set()
    with open_data_file(path, missing_hint) as handle:
        for line_no, raw in read_lines(handle, MAX_LINE_BYTES):
            if max_samples is not None and stats.conversations >= max_samples:
                break
            if raw is None:
                stats.lines += 1
                stats.bad[line_no] = (
                    f"longer than {MAX_LINE_BYTES:,} bytes, the most one conversation may take "
                    "(eagle3.data.samples.MAX_LINE_BYTES); split or shorten it"
                )
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                stats.lines += 1
                stats.bad[line_no] = (
                    f"not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the "
                    "line); save the file as UTF-8"
                )
                continue
            if not line.strip():
                continue
            stats.lines += 1
            try:
                messages, tools = normalize_record(json.loads(line))
            except json.JSONDecodeError as err:
                stats.bad[line_no] = f"invalid JSON ({err.msg} at column {err.colno})"
                continue
            except RecursionError:  # a line of 100,000 nested brackets: json's recursion ends in no useful record
                stats.bad[line_no] = "invalid JSON (nested too deeply)"
                continue
            except ValueError as err:
                stats.bad[line_no] = str(err)
                continue
            sample_id = sample_id_of(messages, tools)
            if sample_id in seen:
                stats.duplicates += 1
                continue
            seen.add(sample_id)
            conversations.append(Conversation(sample_id, tuple(messages), line_no, tuple(tools) if tools else None))
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


# -- tokenising: a rendering's text, the spans mapped onto its tokens --------------------------------------------


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def token_boundaries(tokenizer, text: str, ids: list[int], cuts: list[int]) -> dict[int, int]:
    """For each character position in `cuts`, the number of the text's tokens before it.

    Fast path: tokenise the pieces between the cuts; if they concatenate to the whole text's ids, every cut
    is a token boundary and the counts add up. Otherwise (a token merges across a cut, e.g. whitespace
    after a generation prompt that ends in a newline) each cut costs a tokenised prefix: its count is where
    the prefix's ids stop agreeing with the whole text's, so a token straddling a cut counts as after it."""
    cuts = sorted(set(cuts))
    pieces = [encode(tokenizer, text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
    if [t for piece in pieces for t in piece] == ids:
        counts, n = {}, 0
        for cut, piece in zip(cuts, pieces):
            n += len(piece)
            counts[cut] = n
        return counts
    counts = {}
    for cut in cuts:
        prefix = encode(tokenizer, text[:cut])
        agree = next((k for k, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
        counts[cut] = agree
    return counts


def encode_rendering(tokenizer, rendering: Rendering) -> tuple[list[int], dict[int, int]]:
    """The rendering's ids, and the number of tokens before each character position its spans start or end at.
    The whole text in one piece (the ids apply_chat_template gives); a derived turn's in two: the served prompt
    as the server tokenises it, then the generated text."""
    cuts = [c for span in rendering.spans for c in span]
    split = rendering.prompt_end
    if split is None:
        ids = encode(tokenizer, rendering.text)
        return ids, token_boundaries(tokenizer, rendering.text, ids, cuts)
    prompt, generated = encode(tokenizer, rendering.text[:split]), encode(tokenizer, rendering.text[split:])
    at = token_boundaries(tokenizer, rendering.text[split:], generated, [c - split for c in cuts])
    return prompt + generated, {c + split: n + len(prompt) for c, n in at.items()}


def window_of_turn(length: int, first: int, last: int, max_length: int) -> int:
    """Where the max_length-token window of a turn's own sample starts, the turn's trained tokens being
    [first, last) of `length`: the turn whole with as much context before it as fits (the context cut from the
    left), the sample's end kept when it fits too; a turn longer than the window keeps its start, after half a
    window of context."""
    if length - max_length <= first:
        return max(0, length - max_length)
    if last - first <= max_length:
        return last - max_length
    return max(0, first - max_length // 2)


def end_of_turn_tokens(tokenizer, model_dir: str | Path | None = None) -> tuple[str, ...]:
    """The text of the tokens that end a turn: the tokenizer's eos and the model's own stop tokens (its
    generation_config.json or config.json eos_token_id: chat models stop on <|im_end|>, <|eot_id|>, ...)."""
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    for name in ("generation_config.json", "config.json") if model_dir else ():
        try:
            config = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        eos = (config.get("text_config") or config).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(t for t in tokenizer.convert_ids_to_tokens(sorted(ids)) if t)


@dataclass
class TokenizeStats:
    """What tokenising a set of conversations gave, for the extract stats (as_dict)."""

    conversations: int = 0
    samples: int = 0
    turn_samples: int = 0  # samples of one assistant turn the whole rendering does not show as generated
    # Assistant turns something prompted (a turn with nothing before it is never trained), and the tokens of
    # their own text (reasoning, content, tool calls' names and arguments): the measure of what is lost.
    assistant_turns: int = 0
    turn_tokens: int = 0
    trained_turns: int = 0
    derived_turns: int = 0  # of those, derived: the template does not render them as generated (eagle3.data.turns)
    trained_tokens: int = 0  # under the loss mask
    reasoning_tokens: int = 0  # of the trained turns' reasoning_content, trained with them
    turns_dropped: Counter = field(default_factory=Counter)  # reason (eagle3.data.turns) -> turns not trained
    tokens_dropped: Counter = field(default_factory=Counter)  # reason -> those turns' own text's tokens
    cut_at_max_tokens: int = 0  # turns generate cut at generate.max_tokens: trained without an end of turn
    context_cut_samples: int = 0  # samples of one turn whose context data.max_length cut from the left
    context_cut_tokens: int = 0
    turn_cut_samples: int = 0  # samples whose trained turn is longer than data.max_length: its end cut
    turn_cut_tokens: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # sample or conversation id -> why it is not trained

    @property
    def reasoning_not_rendered(self) -> int:
        """Turns dropped because the template never writes their reasoning (and leaves no place for it)."""
        return self.turns_dropped[REASONING_NOT_RENDERED]

    def drop(self, sample_id: str, reason: str, why: str, tokens: int) -> None:
        self.turns_dropped[reason] += 1
        self.tokens_dropped[reason] += tokens
        if len(self.skipped) < MAX_SKIPPED_SHOWN:
            self.skipped[sample_id] = why

    def as_dict(self) -> dict:
        """The turn counts as the extract stats write them."""
        dropped_turns, dropped_tokens = sum(self.turns_dropped.values()), sum(self.tokens_dropped.values())
        return {
            "assistant_turns": self.assistant_turns,
            "turns_trained": self.trained_turns,
            "turns_derived": self.derived_turns,
            "turns_dropped": dict(sorted(self.turns_dropped.items())),
            "turn_tokens": self.turn_tokens,
            "turn_tokens_dropped": dict(sorted(self.tokens_dropped.items())),
            "untrained_fraction": {
                "turns": round(dropped_turns / max(self.assistant_turns, 1), 6),
                "tokens": round(dropped_tokens / max(self.turn_tokens, 1), 6),
            },
            "trained_tokens": self.trained_tokens,
            "reasoning_tokens_trained": self.reasoning_tokens,
            "turns_cut_at_max_tokens": self.cut_at_max_tokens,
            "context_cut": {"samples": self.context_cut_samples, "tokens": self.context_cut_tokens},
            "turn_cut": {"samples": self.turn_cut_samples, "tokens": self.turn_cut_tokens},
        }


MAX_SKIPPED_SHOWN = 1000  # ids with their reasons kept in TokenizeStats.skipped (the counts are always whole)


def prompted_turns(conversation: Conversation) -> list[int]:
    """The assistant turns that something prompted: the ones a sample may train."""
    return [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant" and i > 0]


def untrained_refusal(
    stats: TokenizeStats, max_fraction: float, template: str, total_turns: int | None = None, where: str = ""
) -> DataError | None:
    """The error that refuses a run when more than `max_fraction` of its assistant turns, or of their tokens,
    cannot be trained as generated (data.max_untrained_fraction); None when within it. With `total_turns` (the
    assistant turns of all the data, some not tokenised yet), decided on turns alone as soon as it is certain."""
    dropped_turns, dropped_tokens = sum(stats.turns_dropped.values()), sum(stats.tokens_dropped.values())
    turns = stats.assistant_turns if total_turns is None else total_turns
    over_turns = dropped_turns > max_fraction * turns
    over_tokens = total_turns is None and dropped_tokens > max_fraction * stats.turn_tokens
    if not (over_turns or over_tokens):
        return None
    reasons = ", ".join(
        f"{reason}: {n} turns / {stats.tokens_dropped[reason]:,} tokens"
        for reason, n in sorted(stats.turns_dropped.items())
    )
    share = f"({dropped_turns / max(turns, 1):.1%})"
    if total_turns is None:
        counts = (
            f"{dropped_turns} of {turns} assistant turns {share} and {dropped_tokens:,} of their "
            f"{stats.turn_tokens:,} tokens ({dropped_tokens / max(stats.turn_tokens, 1):.1%})"
        )
    else:
        counts = f"{dropped_turns} of the {turns} assistant turns {share} already"
    first = next(iter(stats.skipped.values()), "")
    return DataError(
        f"{where}{counts} cannot be trained as the target generated them, more than "
        f"data.max_untrained_fraction ({max_fraction:g}) allows ({reasons}; first: {first}). The chat template is "
        f"{template}. Fix: set data.generation_chat_template to a template that renders every assistant turn as "
        "generated (for a template that blanks reasoning: the same one with its history branch emptied), or pass "
        "the template's option that keeps reasoning in data.chat_template_kwargs; or raise "
        "data.max_untrained_fraction to train without those turns."
    )


def turn_text_tokens(tokenizer, message: dict) -> tuple[int, int]:
    """The tokens of an assistant turn's own text (reasoning, content, tool calls' names and arguments), and of
    its reasoning alone: what counts toward data.max_untrained_fraction, however the template renders it."""
    reasoning = len(encode(tokenizer, message["reasoning_content"])) if message.get("reasoning_content") else 0
    calls = "".join(
        c["function"]["name"] + str(c["function"].get("arguments", "")) for c in message.get("tool_calls") or ()
    )
    rest = "".join(part for part in (message.get("content"), calls) if part)
    return reasoning + (len(encode(tokenizer, rest)) if rest else 0), reasoning


# The probe every template renders at load: the simplest conversation there is, so that a template that fails
# or does not finish on it is refused before a stage starts, with its file named, instead of mid-stage.
PROBE_CONVERSATION = ({"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."})
PROBE_TIME_LIMIT_S = 5.0  # real templates take milliseconds; a loop of 10^10 steps takes hours


@dataclass(frozen=True)
class TemplateOrigin:
    """Where a chat template comes from, for the errors that name it: its file, with the field that points
    there, and what to do when it fails."""

    where: str
    fix: str


TOKENIZER_TEMPLATE = TemplateOrigin("the tokenizer's chat template", "fix the tokenizer's chat template")
GENERATION_TEMPLATE = TemplateOrigin("data.generation_chat_template", "fix data.generation_chat_template")


def chat_template_file(tokenizer_dir: str | Path) -> str:
    """Where a tokenizer directory keeps its chat template: chat_template.jinja, which transformers reads
    first, or else the chat_template field of tokenizer_config.json."""
    directory = Path(tokenizer_dir)
    if (directory / "chat_template.jinja").exists():
        return str(directory / "chat_template.jinja")
    return f"{directory / 'tokenizer_config.json'} (its chat_template field)"


# A chat template is a few KB; the cap keeps a file that never ends (/proc/self/pagemap, should the /proc check
# be got round) or a wrong one (the weights) from hanging a stage or filling its memory.
MAX_TEMPLATE_BYTES = 1 << 20  # 1 MiB


def template_file_bytes(path: str, field_name: str = "data.generation_chat_template") -> bytes:
    """The bytes of the chat template file that config field `field_name` names: a regular file, not a link,
    outside /proc and /sys, of at most MAX_TEMPLATE_BYTES (fsutil.read_small_file). Raises DataError naming the
    field, the file and the fix. (What a digest of the template is taken of.)"""
    fix = (
        f"point {field_name} at the jinja chat template file itself: a regular file on the box (not a link, "
        f"nothing in /proc or /sys) of at most {MAX_TEMPLATE_BYTES >> 20} MiB"
    )
    try:
        return read_small_file(path, MAX_TEMPLATE_BYTES)
    except UnsafeFile as err:
        raise DataError(f"{field_name}: {err}; {fix}") from None
    except OSError as err:
        raise DataError(f"{field_name}: cannot read {path} ({err.strerror}); {fix}") from None


def read_template_file(path: str, field_name: str = "data.generation_chat_template") -> str:
    """The text of that file (template_file_bytes), as a file read as text gives it: UTF-8, universal newlines.
    Raises DataError as template_file_bytes does, and ChatTemplateError for bytes that are not UTF-8."""
    try:
        text = template_file_bytes(path, field_name).decode("utf-8")
    except UnicodeDecodeError:
        raise ChatTemplateError(
            field_name, f"{path} is not UTF-8 text", "point it at a jinja chat template file"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


class _Expired(BaseException):
    """The probe's time is up. A BaseException, so that no `except Exception` on the way can swallow it."""


def run_with_time_limit(work: Callable[[], object], seconds: float) -> bool:
    """Run `work`; True if it finished within `seconds`, False if it was stopped or abandoned.

    On the main thread, with SIGALRM free, a timer interrupts it: jinja's templates run as Python code, so
    the signal's handler gets to raise between two steps of any loop or recursion. Elsewhere (Python runs
    signal handlers on the main thread only), or while another timer holds SIGALRM, it runs in a daemon thread
    that is abandoned when the time is up: it spins on until the process exits, which the caller's refusal
    brings soon (a stage exits 2)."""
    if threading.current_thread() is threading.main_thread() and signal.getitimer(signal.ITIMER_REAL)[0] == 0:

        def expire(signum, frame):
            raise _Expired

        previous = signal.signal(signal.SIGALRM, expire)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, seconds)
                work()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Expired:
            return False
        finally:
            signal.signal(signal.SIGALRM, previous)
        return True
    failure: list[BaseException] = []

    def guarded():
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread below
            failure.append(err)

    worker = threading.Thread(target=guarded, name="chat-template-probe", daemon=True)
    worker.start()
    worker.join(seconds)
    if failure:
        raise failure[0]
    return not worker.is_alive()


@dataclass
class SampleTokenizer:
    """How a run turns conversations into samples: its tokenizer, data.max_length, data.loss_mask and the
    target's end-of-turn tokens. `for_run(cfg)` builds it the one way every stage must agree on."""

    tokenizer: object
    max_length: int
    loss_mask: LossMaskPolicy = "assistant_turn"
    end_tokens: tuple[str, ...] = ()
    template_kwargs: dict = field(default_factory=dict)  # data.chat_template_kwargs
    generation_template: str | None = None  # data.generation_chat_template's text
    template_origin: TemplateOrigin = TOKENIZER_TEMPLATE
    generation_template_origin: TemplateOrigin = GENERATION_TEMPLATE
    _pattern: re.Pattern | None = field(default=None, init=False, repr=False)  # eagle3.data.turns.markup_pattern

    @classmethod
    def for_run(cls, cfg: RunConfig) -> SampleTokenizer:
        """The run's SampleTokenizer, its templates checked (check_templates): a stage refuses a broken one
        before it starts."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir, trust_remote_code=cfg.target.trust_remote_code)
        field_name = "target.tokenizer_path" if cfg.target.tokenizer_path else "target.model_path"
        template_origin = TemplateOrigin(
            f"{chat_template_file(cfg.tokenizer_dir)}, the chat template of {field_name}",
            "fix the template there, or set target.tokenizer_path to a tokenizer whose chat template renders",
        )
        generation_template, generation_origin, path = None, GENERATION_TEMPLATE, cfg.data.generation_chat_template
        if path:
            generation_origin = TemplateOrigin(
                f"data.generation_chat_template {path}",
                "fix that file, or point data.generation_chat_template at one that renders",
            )
            generation_template = read_template_file(path)
        tokenizing = cls(
            tokenizer,
            cfg.data.max_length,
            cfg.data.loss_mask,
            end_of_turn_tokens(tokenizer, cfg.target.model_path),
            dict(cfg.data.chat_template_kwargs),
            generation_template,
            template_origin,
            generation_origin,
        )
        tokenizing.check_templates()
        return tokenizing

    def check_templates(self, time_limit_s: float | None = None) -> None:
        """Render the probe conversation with each template, under a time limit (PROBE_TIME_LIMIT_S): one that
        jinja's sandbox refuses, that breaks or that does not finish is a ChatTemplateError naming its file.
        Costs a few milliseconds per stage; the renderings of the data then run unbounded."""
        limit = PROBE_TIME_LIMIT_S if time_limit_s is None else time_limit_s
        templates = [(None, self.template_origin)]
        if self.generation_template is not None:
            templates.append((self.generation_template, self.generation_template_origin))
        for template, origin in templates:
            if template is None and not getattr(self.tokenizer, "chat_template", None):
                raise ChatTemplateError(
                    origin.where, "there is none, so what the target is served is unknown", origin.fix
                )

            def probe(template=template):
                for upto, prompt in ((1, True), (2, False)):  # a generation prompt, and a whole conversation
                    render(self.tokenizer, PROBE_CONVERSATION[:upto], None, prompt, self.template_kwargs, template)

            try:
                finished = run_with_time_limit(probe, limit)
            except TemplateFailed as err:
                raise ChatTemplateError(
                    origin.where, f"fails in jinja's sandbox on a two-message conversation ({err})", origin.fix
                ) from None
            except Exception as err:  # noqa: BLE001 - whatever stops the simplest conversation condemns the template
                raise ChatTemplateError(
                    origin.where,
                    f"cannot render a two-message conversation ({' '.join(str(err).split())[:300]})",
                    origin.fix,
                ) from None
            if not finished:
                raise ChatTemplateError(
                    origin.where,
                    f"took longer than {limit:g} s to render a two-message conversation (a loop or a recursion "
                    "without end?)",
                    origin.fix,
                )

    @property
    def template_where(self) -> str:
        """The template files that decide the samples, for a message that names them."""
        if self.generation_template is None:
            return self.template_origin.where
        return f"{self.template_origin.where} (prompts) with {self.generation_template_origin.where} (turns)"

    def _refused(self, err: TemplateFailed, what: str) -> ChatTemplateError:
        origin = self.generation_template_origin if err.generation_template else self.template_origin
        return ChatTemplateError(origin.where, f"fails in jinja's sandbox rendering {what} ({err})", origin.fix)

    def plan(self, conversation: Conversation) -> Plan:
        """The conversation's renderings, and the assistant turns that cannot be placed (eagle3.data.turns)."""
        try:
            if self.generation_template is not None:
                return renderings_as_generated(
                    self.tokenizer,
                    conversation,
                    self.loss_mask,
                    self.end_tokens,
                    self.template_kwargs,
                    self.generation_template,
                )
            if self._pattern is None:
                self._pattern = markup_pattern(self.tokenizer)
            return plan_renderings(
                self.tokenizer, conversation, self.loss_mask, self.end_tokens, self.template_kwargs, self._pattern
            )
        except TemplateFailed as err:
            raise self._refused(err, f"the conversation on line {conversation.line_no} of the data") from None

    def renderings(self, conversation: Conversation) -> list[Rendering]:
        """The conversation's renderings; a turn that cannot be placed raises its TurnNotPlaced (iter counts it)."""
        plan = self.plan(conversation)
        if plan.dropped:
            raise next(iter(plan.dropped.values()))
        return plan.renderings

    def samples(self, conversation: Conversation) -> list[TokenizedSample]:
        """The conversation's samples (one, or more for a thinking model's multi-turn conversation, or for turns
        past max_length), each at most max_length tokens. A turn that cannot be placed raises (iter counts it)."""
        head = functools.cache(lambda: self.head_of(conversation))
        return [sample for rendering in self.renderings(conversation) for sample in self.fit(rendering, head=head)]

    def head_of(self, conversation: Conversation) -> str:
        """The text a cut context keeps ahead of its window: what the template renders for the conversation's
        leading system messages and its tool definitions (after the BOS it writes), '' for a conversation with
        neither or a template that renders them only with other messages."""
        system = list(itertools.takewhile(lambda m: m.get("role") == "system", conversation.messages))
        if not system and not conversation.tools:
            return ""
        try:
            return render(self.tokenizer, system, conversation.tools, False, self.template_kwargs)
        except (TemplateFailed, TemplateRefused, ValueError):
            return ""

    def kept_head(self, ids: list[int], text: str, head: str) -> int:
        """How many leading tokens of a sample whose context is cut stay ahead of the window: the head's (its
        system prompt and tools, which every answer in it was generated under), when the text starts with it as
        whole tokens and it takes at most a quarter of max_length; else the BOS token alone where the sample starts
        with one (a target's states after a missing BOS are not the ones it serves)."""
        if head and text.startswith(head):
            head_ids = encode(self.tokenizer, head)
            if len(head_ids) <= self.max_length // 4 and ids[: len(head_ids)] == head_ids:
                return len(head_ids)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return 1 if bos is not None and ids[:1] == [bos] and self.max_length >= 4 else 0

    def fit(
        self, rendering: Rendering, stats: TokenizeStats | None = None, head: Callable[[], str] = lambda: ""
    ) -> list[TokenizedSample]:
        """The rendering's samples within max_length tokens, every turn it trains kept. The whole conversation
        keeps its start and the turns that end within max_length; each other turn becomes a sample of its own
        ("<conversation id>.<turn>", its context cut from the left: window_of_turn), which keeps its conversation's
        head (`head()`: BOS, system prompt and tools; kept_head) ahead of the window. Cuts are counted in
        `stats`."""
        stats = stats if stats is not None else TokenizeStats()
        ids, at = encode_rendering(self.tokenizer, rendering)
        limit = self.max_length
        mask = [0] * len(ids)
        for start, end in rendering.spans:
            mask[at[start] : at[end]] = [1] * (at[end] - at[start])
        if len(ids) <= limit:
            return [TokenizedSample(rendering.sample_id, ids, mask, False)]
        if len(rendering.turns) == 1 and not rendering.turns[0].in_whole:  # a turn's own sample
            trained = [k for k, m in enumerate(mask) if m]
            if not trained:
                return [TokenizedSample(rendering.sample_id, ids[:limit], mask[:limit], True)]
            kept = self.kept_head(ids, rendering.text, head()) if len(ids) > limit else 0
            kept = kept if kept <= trained[0] else 0
            start = kept + window_of_turn(len(ids) - kept, trained[0] - kept, trained[-1] + 1 - kept, limit - kept)
            end = start + limit - kept
            cut_turn = sum(mask[end:])
            stats.context_cut_samples += start > kept
            stats.context_cut_tokens += start - kept
            stats.turn_cut_samples += cut_turn > 0
            stats.turn_cut_tokens += cut_turn
            return [
                TokenizedSample(rendering.sample_id, ids[:kept] + ids[start:end], mask[:kept] + mask[start:end], True)
            ]
        conversation_id = conversation_id_of(rendering.sample_id)
        fits = [turn for turn in rendering.turns if all(at[end] <= limit for _, end in turn.spans)]
        samples = []
        if fits:
            kept = [0] * limit
            for start, end in (span for turn in fits for span in turn.spans):
                kept[at[start] : at[end]] = [1] * (at[end] - at[start])
            samples.append(TokenizedSample(rendering.sample_id, ids[:limit], kept, True))
        for turn in rendering.turns:
            if turn not in fits:
                own = Rendering(
                    f"{conversation_id}.{turn.index}",
                    turn.text,
                    turn.spans,
                    (dataclasses.replace(turn, in_whole=False),),
                    turn.prompt_end,
                )
                samples += self.fit(own, stats, head)
        return samples

    def prompt_ids(self, messages, tools=None) -> list[int]:
        """The ids the target is served for the next assistant turn after `messages`."""
        try:
            return encode(self.tokenizer, render(self.tokenizer, messages, tools, True, self.template_kwargs))
        except TemplateFailed as err:
            raise self._refused(err, "a generation prompt") from None
        except TemplateRefused as err:
            last = str(messages[-1].get("content") or "")[:60] if messages else ""
            raise DataError(
                f"{self.template_origin.where}: {err} (the one whose last message begins {last!r}); "
                "fix or drop that conversation in the data"
            ) from None

    def iter(
        self, conversations, stats: TokenizeStats | None = None, check: Callable[[TokenizeStats], None] | None = None
    ) -> Iterator[TokenizedSample]:
        """Tokenise lazily, a conversation's samples together, counting every assistant turn in `stats`: trained,
        or dropped with its reason (a turn the template cannot be placed in, a conversation the template refuses,
        a sample left with no trained token) and recorded in `stats.skipped` (id -> reason) rather than yielded.
        `check(stats)` runs after each conversation (extract's refusal). A template that fails otherwise stops
        it (ChatTemplateError)."""
        stats = stats if stats is not None else TokenizeStats()
        for conversation in conversations:
            stats.conversations += 1
            yield from self._conversation_samples(conversation, stats)
            if check is not None:
                check(stats)

    def _conversation_samples(self, conversation: Conversation, stats: TokenizeStats) -> list[TokenizedSample]:
        messages, line = conversation.messages, f"line {conversation.line_no}"
        try:
            plan = self.plan(conversation)
        except ChatTemplateError:
            raise  # the template is broken, not this conversation: stop the stage
        except ValueError as err:  # the template refuses the conversation (its raise_exception())
            plan = Plan([], {i: TurnNotPlaced(TEMPLATE_REFUSED, str(err)) for i in prompted_turns(conversation)})
        placed = [t for r in plan.renderings for t in r.turns]
        # A turn with no text to train under data.loss_mask "content" (tool calls only) is no turn lost.
        empty = {t.index for t in placed if not any(end > start for start, end in t.spans)}
        sizes = {
            i: turn_text_tokens(self.tokenizer, messages[i]) for i in prompted_turns(conversation) if i not in empty
        }
        stats.assistant_turns += len(sizes)
        stats.turn_tokens += sum(total for total, _ in sizes.values())
        stats.cut_at_max_tokens += sum(messages[i].get("finish_reason") == "length" for i in sizes)
        for i, err in plan.dropped.items():
            stats.drop(
                conversation.sample_id if err.reason == TEMPLATE_REFUSED else f"{conversation.sample_id}.{i}",
                err.reason,
                f"{line}: {err}",
                sizes[i][0],
            )
        samples, lost = [], set()
        head = functools.cache(lambda: self.head_of(conversation))  # rendered only for a sample whose context is cut
        for rendering in plan.renderings:
            if all(t.index in empty for t in rendering.turns):
                continue
            for sample in self.fit(rendering, stats, head):
                if not any(sample.loss_mask):
                    turns = (
                        [int(sample.sample_id.split(".")[1])]
                        if "." in sample.sample_id
                        else [t.index for t in rendering.turns if t.index not in empty]
                    )
                    for i in turns:
                        lost.add(i)
                        stats.drop(
                            sample.sample_id,
                            NO_TRAINED_TOKEN,
                            f"{line}: no trained token within max_length",
                            sizes[i][0],
                        )
                    continue
                samples.append(sample)
                stats.samples += 1
                stats.turn_samples += sample.sample_id != conversation.sample_id
                stats.trained_tokens += sum(sample.loss_mask)
        trained = [t for t in placed if t.index in sizes and t.index not in lost]
        stats.trained_turns += len(trained)
        stats.derived_turns += sum(t.derived for t in trained)
        stats.reasoning_tokens += sum(sizes[t.index][1] for t in trained)
        return samples
