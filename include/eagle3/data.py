"""Conversations in, token ids and loss masks out: exactly what the target sees when it serves them.

Input: JSONL, one conversation per line, in either of the two forms people have:
  ShareGPT  {"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": "..."}]}  ("role"/"content" read too)
  OpenAI    {"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": "..."}], "tools": [...]}
Assistant turns may carry `reasoning_content` (a thinking model's reasoning, as SGLang's --reasoning-parser
returns it) and OpenAI `tool_calls` (then their content may be empty); `tool` turns carry a tool's result
(`tool_call_id`, `name` kept). A record's `tools` list goes to the chat template. Each line is normalised
to that message form; its sample id is a hash of the normalised conversation, so the same conversation has
the same id whatever file, line or form it came from. That id is what the hidden-state store, resume,
sharding and the train/val split key on. Blank lines are ignored (as HF datasets does).

Bad lines (invalid JSON, not UTF-8, longer than MAX_LINE_BYTES, no assistant turn, unknown role, empty) are
never dropped silently: by default they stop the stage with their line numbers; with data.on_bad_record = "skip"
they are skipped and counted in the stats. The file is read as bytes, one line at a time and never more than
MAX_LINE_BYTES of a line, so a runaway line costs bounded memory; only a regular file is read (a FIFO would block
the stage, /dev/zero would fill the memory). Values echoed in a reason are cut to SHOWN_CHARS characters.

Token ids: the whole conversation rendered by the target's chat template and tokenised in one piece, so
the stored ids equal `tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)` token for token.

What is trained (the loss mask) is found without searching for message contents in the rendered text:
for assistant turn i, the template renders the conversation up to turn i with the generation prompt
(`before`, what the target was given) and through turn i (`through`); the characters between the two are
what the target generated: reasoning, content, tool calls and its end-of-turn token. data.loss_mask:
  assistant_turn  (default, SpecForge's) that generated text through the end-of-turn token: end-of-turn
                  and `</think>`-style tokens enter the draft vocab and can be drafted
  content         only the characters of the content and reasoning_content (the mask before there was a
                  choice; tool calls and end-of-turn tokens are then not trained)
Template separators after the end-of-turn token (the newline after `<|im_end|>`) are never trained: the
target never generates them (SpecForge's qwen entry trains that newline too; its other entries do not).

Thinking models: templates such as Qwen3's and Kimi-K2.5's drop the reasoning of earlier assistant turns,
so the whole conversation's rendering is not what the target saw when it produced those turns. Policy:
every assistant turn is trained exactly once, in the rendering the target served it in. Turns the whole
rendering shows as generated (`through` is a prefix of it) are trained there; every other turn gets a
sample of its own, the conversation rendered through that turn (earlier turns as the template shows
them then, untrained context), with sample id "<conversation id>.<turn index>". Tool results are never
trained; neither is an assistant turn with nothing before it (nothing prompted it). A template that never
renders a turn as generated (Kimi-K2.5's blanks the final answer's reasoning too) needs
data.generation_chat_template: see renderings_as_generated.

Chat templates are code from the target's files or the run config, run in jinja's sandbox (transformers').
A template the sandbox refuses, that fails, or that does not finish rendering a two-message conversation
within PROBE_TIME_LIMIT_S is refused when the stage starts (SampleTokenizer.check_templates), naming its file;
one that fails later, on some conversation of the data, stops the stage the same way. Only the template's own
raise_exception() is a verdict on a conversation: that conversation is skipped with the template's reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import jinja2

from eagle3.config import ConfigError

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
}
LossMaskPolicy = Literal["assistant_turn", "content"]
TOKENIZING_VERSION = 2  # bump when the samples a conversation gives change (cached token counts key on it)
# Kept on a message beside role and content when present (OpenAI's names).
ASSISTANT_EXTRAS = ("reasoning_content", "tool_calls")
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
        extras = {k: m[k] for k in ("tool_calls", *TOOL_EXTRAS) if k in m}
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
        raise DataError(f"{path}: cannot open the conversations file ({err.strerror}); check data.path and the "
                        "file's permissions") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "not a regular file")
        what = "data.path must name" if "data.path" in missing_hint else "conversations are read from"
        raise DataError(f"{path}: is {kind}, not a regular file; {what} a JSONL file of conversations (one per "
                        "line)")
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


def read_conversations(path: str | Path, on_bad_record: str = "error", max_samples: int | None = None,
                       missing_hint: str = "data.path: {path} does not exist"):
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
                stats.bad[line_no] = (f"longer than {MAX_LINE_BYTES:,} bytes, the most one conversation may take "
                                      "(eagle3.data.MAX_LINE_BYTES); split or shorten it")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                stats.lines += 1
                stats.bad[line_no] = (f"not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the "
                                      "line); save the file as UTF-8")
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


# -- rendering: which characters of the template's text the target generated ---------------------------------


class TemplateFailed(Exception):
    """A chat template failed while rendering: jinja's sandbox refused it, or it broke (an undefined name, a
    recursion without end, a range past the sandbox's limit, arithmetic on the wrong types). Not a ValueError:
    SampleTokenizer.iter skips the conversation for those, and a broken template is no one conversation's
    fault. SampleTokenizer turns it into a ChatTemplateError naming the template's file."""

    def __init__(self, error: BaseException, generation_template: bool):
        super().__init__(one_line(error))
        self.generation_template = generation_template  # data.generation_chat_template, not the target's


class TemplateRefused(ValueError):
    """The template's own raise_exception(): its verdict on one conversation (e.g. "roles must alternate"), so
    a ValueError, which SampleTokenizer.iter records as that conversation's reason to be skipped."""


def one_line(error: BaseException) -> str:
    """A jinja error for a message: its type, where a syntax error is, and its text on one line."""
    where = f" at line {error.lineno} of the template" if isinstance(error, jinja2.TemplateSyntaxError) else ""
    text = " ".join(str(error).split()).rstrip(".")
    return f"{type(error).__name__}{where}: {text[:300]}" if text else f"{type(error).__name__}{where}"


def render(tokenizer, messages, tools=None, add_generation_prompt: bool = False, template_kwargs=None,
           chat_template: str | None = None) -> str:
    """The chat template's text (the tokenizer's own, or `chat_template` given as a template string)."""
    try:
        return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                                             **(template_kwargs or {}))
    except jinja2.TemplateError as err:
        if type(err) is jinja2.TemplateError:  # the template's own raise_exception(): it refuses this conversation
            reason = " ".join(str(err).split())
            raise TemplateRefused(f"the chat template refuses this conversation: {reason}") from None
        raise TemplateFailed(err, chat_template is not None) from None
    except (RecursionError, ArithmeticError, TypeError) as err:  # OverflowError (range) is an ArithmeticError
        raise TemplateFailed(err, chat_template is not None) from None


@dataclass(frozen=True)
class Rendering:
    """One sample's text and the character spans in it that are trained."""

    sample_id: str
    text: str
    spans: tuple[tuple[int, int], ...]
    reasoning_not_rendered: int = 0  # turns of its conversation whose reasoning the template leaves out


def end_of_turn(text: str, start: int, end: int, end_tokens: tuple[str, ...]) -> int:
    """Where the generated text of a turn that the template renders as text[start:end] ends: just after its
    first end-of-turn token; or, when it renders none inside, after one that directly follows (Kimi's
    template closes a turn only once another message follows it); else `end`. What follows that token is
    the template's separator (the newline after <|im_end|>), which the target never generates."""
    found = [i + len(token) for token in end_tokens if (i := text.find(token, start, end)) >= 0]
    if found:
        return min(found)
    return next((end + len(token) for token in end_tokens if text.startswith(token, end)), end)


PLACEHOLDER = "\u27e6eagle3:{}\u27e7"  # marks a field in a rendering; no template or text has it


def content_spans(tokenizer, messages, i: int, tools, host: str, start: int, template_kwargs=None,
                  chat_template: str | None = None):
    """data.loss_mask "content": where the reasoning and content of assistant turn i stand in `host` (whose
    turn i's generated text begins at `start`). The turn is rendered once more with a unique placeholder in
    place of each field; the template's own text between them must then equal `host`'s, and each field must
    stand verbatim where its placeholder stood. No search: a content that also occurs in the reasoning, a
    tool call or the end-of-turn token is still placed right."""
    message = messages[i]
    fields = [key for key in ("reasoning_content", "content") if message.get(key)]
    marked = render(tokenizer, [*messages[:i], {**message, **{k: PLACEHOLDER.format(k) for k in fields}}], tools,
                    template_kwargs=template_kwargs, chat_template=chat_template)
    spans, at, cursor = [], start, start  # at: position in host; cursor: in the marked rendering
    for key in sorted(fields, key=lambda k: marked.find(PLACEHOLDER.format(k), start)):
        where = marked.find(PLACEHOLDER.format(key), cursor)
        literal = marked[cursor:where]
        if where < 0 or not host.startswith(literal, at) or not host.startswith(message[key], at + len(literal)):
            raise ValueError(f"turn {i} (assistant): the chat template does not render its {key} verbatim (it "
                             "rewrites or drops it), so the content-only mask cannot be placed; use data.loss_mask "
                             "'assistant_turn'")
        at += len(literal)
        spans.append((at, at + len(message[key])))
        at, cursor = at + len(message[key]), where + len(PLACEHOLDER.format(key))
    return spans


def plan_renderings(tokenizer, conversation: Conversation, loss_mask: LossMaskPolicy = "assistant_turn",
                    end_tokens: tuple[str, ...] = (), template_kwargs=None) -> list[Rendering]:
    """The samples of one conversation (see the module docstring): the whole conversation with the turns it
    shows as generated, then one rendering for each other assistant turn."""
    messages, tools = conversation.messages, conversation.tools

    def text(upto: int, add_generation_prompt: bool = False) -> str:
        return render(tokenizer, messages[:upto], tools, add_generation_prompt, template_kwargs)

    whole = text(len(messages))
    in_whole: list[tuple[int, int]] = []
    own: list[Rendering] = []
    reasoning_not_rendered = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        before, through = text(i, add_generation_prompt=True), text(i + 1)
        if not through.startswith(before):
            raise ValueError(
                f"turn {i} (assistant): the chat template renders this turn with another prefix than the "
                "generation prompt it is served with, so what the target generated cannot be placed"
            )
        host = whole if whole.startswith(through) else through  # where the turn is shown as generated
        start, end = len(before), end_of_turn(host, len(before), len(through), end_tokens)
        reasoning_not_rendered += bool(message.get("reasoning_content")) and \
            message["reasoning_content"] not in host[start:end]
        spans = [(start, end)] if loss_mask == "assistant_turn" else \
            content_spans(tokenizer, messages, i, tools, host, start, template_kwargs)
        if host is whole:
            in_whole += spans
        else:
            own.append(Rendering(f"{conversation.sample_id}.{i}", through, tuple(spans)))
    renderings = ([Rendering(conversation.sample_id, whole, tuple(in_whole))] if in_whole else []) + own
    if renderings and reasoning_not_rendered:
        renderings[0] = dataclasses.replace(renderings[0], reasoning_not_rendered=reasoning_not_rendered)
    return renderings


def renderings_as_generated(tokenizer, conversation: Conversation, loss_mask: LossMaskPolicy,
                            end_tokens: tuple[str, ...], template_kwargs, generation_template: str) -> list[Rendering]:
    """data.generation_chat_template: for targets whose template never renders a turn's reasoning as it was
    generated (Kimi-K2.5's blanks it up to the last final answer, that answer included, and so also re-renders
    a tool chain once its answer follows). Each assistant turn is a sample of its own: its prompt as the
    target's template renders it (what the target was served), then the turn as the generation template
    renders it (what the target wrote), through the end-of-turn token. The last turn's sample carries the
    conversation's id, earlier ones "<id>.<turn>"."""
    messages, tools = conversation.messages, conversation.tools
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    renderings = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prompt = render(tokenizer, messages[:i], tools, True, template_kwargs)
        before = render(tokenizer, messages[:i], tools, True, template_kwargs, generation_template)
        through = render(tokenizer, messages[: i + 1], tools, False, template_kwargs, generation_template)
        if not through.startswith(before):
            raise ValueError(f"turn {i} (assistant): data.generation_chat_template renders this turn with another "
                             "prefix than its generation prompt; it must render every turn as generated (append-only)")
        end = end_of_turn(through, len(before), len(through), end_tokens)
        text = prompt + through[len(before) : end]
        shift = len(prompt) - len(before)
        spans = [(len(prompt), len(text))] if loss_mask == "assistant_turn" else [
            (a + shift, b + shift)
            for a, b in content_spans(tokenizer, messages, i, tools, through, len(before), template_kwargs,
                                      generation_template)]
        renderings.append(Rendering(conversation.sample_id if i == last else f"{conversation.sample_id}.{i}", text,
                                    tuple(spans)))
    return renderings


# -- tokenising: the whole text in one piece, the spans mapped onto its tokens ---------------------------------


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


def tokenize_rendering(tokenizer, rendering: Rendering, max_length: int) -> TokenizedSample:
    ids = encode(tokenizer, rendering.text)
    at = token_boundaries(tokenizer, rendering.text, ids, [c for span in rendering.spans for c in span])
    mask = [0] * len(ids)
    for start, end in rendering.spans:
        mask[at[start] : at[end]] = [1] * (at[end] - at[start])
    truncated = len(ids) > max_length
    return TokenizedSample(rendering.sample_id, ids[:max_length], mask[:max_length], truncated)


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
    """What tokenising a set of conversations gave, for the extract stats."""

    conversations: int = 0
    samples: int = 0
    turn_samples: int = 0  # samples of an assistant turn the whole rendering does not show as generated
    # Turns with reasoning_content that the template renders without it even as the turn just generated: the
    # drafter then never sees the reasoning the target produced (a template option may keep it, see
    # data.chat_template_kwargs; or data.generation_chat_template).
    reasoning_not_rendered: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # sample or conversation id -> reason


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


TOKENIZER_TEMPLATE = TemplateOrigin("the tokenizer's chat template", "Fix the tokenizer's chat template.")
GENERATION_TEMPLATE = TemplateOrigin("data.generation_chat_template", "Fix data.generation_chat_template.")


def chat_template_file(tokenizer_dir: str | Path) -> str:
    """Where a tokenizer directory keeps its chat template: chat_template.jinja, which transformers reads
    first, or else the chat_template field of tokenizer_config.json."""
    directory = Path(tokenizer_dir)
    if (directory / "chat_template.jinja").exists():
        return str(directory / "chat_template.jinja")
    return f"{directory / 'tokenizer_config.json'} (its chat_template field)"


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

    @classmethod
    def for_run(cls, cfg) -> SampleTokenizer:
        """The run's SampleTokenizer, its templates checked (check_templates): a stage refuses a broken one
        before it starts."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir, trust_remote_code=cfg.target.trust_remote_code)
        field_name = "target.tokenizer_path" if cfg.target.tokenizer_path else "target.model_path"
        template_origin = TemplateOrigin(
            f"{chat_template_file(cfg.tokenizer_dir)}, the chat template of {field_name}",
            "Fix the template there, or set target.tokenizer_path to a tokenizer whose chat template renders.")
        generation_template, generation_origin, path = None, GENERATION_TEMPLATE, cfg.data.generation_chat_template
        if path:
            generation_origin = TemplateOrigin(
                f"data.generation_chat_template {path}",
                "Fix that file, or point data.generation_chat_template at one that renders.")
            try:
                generation_template = Path(path).read_text(encoding="utf-8")
            except OSError as err:
                raise DataError(f"data.generation_chat_template: cannot read {path} "
                                f"({err.strerror}); point it at a jinja chat template file on the box") from None
            except UnicodeDecodeError:
                raise ChatTemplateError(f"data.generation_chat_template {path}: not UTF-8 text; point it at a "
                                        "jinja chat template file") from None
        tokenizing = cls(tokenizer, cfg.data.max_length, cfg.data.loss_mask,
                         end_of_turn_tokens(tokenizer, cfg.target.model_path), dict(cfg.data.chat_template_kwargs),
                         generation_template, template_origin, generation_origin)
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
                raise ChatTemplateError(f"{origin.where}: there is none, so what the target is served is unknown. "
                                        f"{origin.fix}")

            def probe(template=template):
                for upto, prompt in ((1, True), (2, False)):  # a generation prompt, and a whole conversation
                    render(self.tokenizer, PROBE_CONVERSATION[:upto], None, prompt, self.template_kwargs, template)

            try:
                finished = run_with_time_limit(probe, limit)
            except TemplateFailed as err:
                raise ChatTemplateError(f"{origin.where}: fails in jinja's sandbox on a two-message conversation "
                                        f"({err}). {origin.fix}") from None
            except Exception as err:  # noqa: BLE001 - whatever stops the simplest conversation condemns the template
                raise ChatTemplateError(f"{origin.where}: cannot render a two-message conversation "
                                        f"({' '.join(str(err).split())[:300]}). {origin.fix}") from None
            if not finished:
                raise ChatTemplateError(f"{origin.where}: took longer than {limit:g} s to render a two-message "
                                        f"conversation (a loop or a recursion without end?). {origin.fix}")

    def _refused(self, err: TemplateFailed, what: str) -> ChatTemplateError:
        origin = self.generation_template_origin if err.generation_template else self.template_origin
        return ChatTemplateError(f"{origin.where}: fails in jinja's sandbox rendering {what} ({err}). {origin.fix}")

    def renderings(self, conversation: Conversation) -> list[Rendering]:
        try:
            if self.generation_template is not None:
                return renderings_as_generated(self.tokenizer, conversation, self.loss_mask, self.end_tokens,
                                               self.template_kwargs, self.generation_template)
            return plan_renderings(self.tokenizer, conversation, self.loss_mask, self.end_tokens, self.template_kwargs)
        except TemplateFailed as err:
            raise self._refused(err, f"the conversation on line {conversation.line_no} of the data") from None

    def samples(self, conversation: Conversation) -> list[TokenizedSample]:
        """The conversation's samples (one, or more for a thinking model's multi-turn conversation)."""
        return [tokenize_rendering(self.tokenizer, r, self.max_length) for r in self.renderings(conversation)]

    def prompt_ids(self, messages, tools=None) -> list[int]:
        """The ids the target is served for the next assistant turn after `messages`."""
        try:
            return encode(self.tokenizer, render(self.tokenizer, messages, tools, True, self.template_kwargs))
        except TemplateFailed as err:
            raise self._refused(err, "a generation prompt") from None
        except TemplateRefused as err:
            last = str(messages[-1].get("content") or "")[:60] if messages else ""
            raise DataError(f"{self.template_origin.where}: {err} (the one whose last message begins {last!r}); "
                            "fix or drop that conversation in the data") from None

    def iter(self, conversations, stats: TokenizeStats | None = None) -> Iterator[TokenizedSample]:
        """Tokenise lazily, a conversation's samples together. A conversation the template cannot be placed
        in or refuses (its raise_exception), and a sample left with no trained token (truncation cut them all),
        are recorded in `stats.skipped` (id -> reason) rather than yielded. A template that fails otherwise
        stops it (ChatTemplateError)."""
        stats = stats if stats is not None else TokenizeStats()
        for conversation in conversations:
            stats.conversations += 1
            try:
                renderings = self.renderings(conversation)
            except ChatTemplateError:
                raise  # the template is broken, not this conversation: stop the stage
            except ValueError as err:
                stats.skipped[conversation.sample_id] = f"line {conversation.line_no}: {err}"
                continue
            if not renderings:
                stats.skipped[conversation.sample_id] = f"line {conversation.line_no}: no assistant turn to train"
            stats.reasoning_not_rendered += sum(r.reasoning_not_rendered for r in renderings)
            for sample in (tokenize_rendering(self.tokenizer, r, self.max_length) for r in renderings):
                if not any(sample.loss_mask):
                    stats.skipped[sample.sample_id] = f"line {conversation.line_no}: no trained token within max_length"
                    continue
                stats.samples += 1
                stats.turn_samples += sample.sample_id != conversation.sample_id
                yield sample
