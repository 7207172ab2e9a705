"""Which text of a chat template's rendering the target generated: each assistant turn placed after the prompt it
was served, without searching for message contents in the rendered text.

For assistant turn i the template renders the conversation before it with the generation prompt (`served`: what the
server gives the target) and through it. Where the second starts with `served`, the characters between are what the
target generated, through its end-of-turn token (placed_as_rendered). Where a thinking model's template breaks
that, derived_turn derives the turn from renderings of the template alone, on copies of the turn whose fields are
PLACEHOLDER (align_generation_prompt, reasoning_slot). The sample is `served` followed by that text, tokenised apart
(data.SampleTokenizer).

A turn that cannot be placed raises TurnNotPlaced; it is dropped and counted by reason (extract's turns_dropped):
  NOT_PLACED              the generation prompt cannot be laid over the turn's opening
  REASONING_NOT_RENDERED  the template writes the turn's reasoning nowhere, and the generation prompt opens nothing
  NOT_VERBATIM            the content mask, or a cut turn's end, needs the fields verbatim and the template
                          rewrites them
It can place wrongly without knowing: whitespace a template lays out inside a turn is trained as generated, and a
generation prompt that differs from the turn in more than a block it opens is resumed after its longest matching start.
data.generation_chat_template overrides all of it: a template that renders every turn as generated
(renderings_as_generated). Why: docs/decisions/2026-12-04-thinking-turns-derived.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jinja2

# Why an assistant turn is not trained: the keys of the extract stats' turns_dropped.
NOT_PLACED = "not_placed"  # the served prompt cannot be laid over the turn's rendering
REASONING_NOT_RENDERED = "reasoning_not_rendered"  # the template never writes the turn's reasoning
NOT_VERBATIM = "not_verbatim"  # the content mask or a cut turn's end needs the fields verbatim
TEMPLATE_REFUSED = "template_refused"  # the template's raise_exception(): the whole conversation
NO_TRAINED_TOKEN = "no_trained_token"

PLACEHOLDER = "\u27e6eagle3:{}\u27e7"  # marks a field in a rendering; no template or text has it
# A tool call given to a turn without one, to see how the template writes the turn's reasoning when it writes it.
PROBE_CALL = {"id": "eagle3_probe:0", "type": "function", "function": {"name": "eagle3_probe", "arguments": "{}"}}
# Pieces of markup the generation prompt is matched by: tags (<think>, <｜Assistant｜>, <|im_start|>), words,
# single other characters; whitespace runs separate them. The tokenizer's own special tokens go first.
MARKUP_PIECES = r"(?P<tag><[^<>\s]{1,80}>)|\w+|\S"


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


class TurnNotPlaced(ValueError):
    """An assistant turn that cannot be trained as the target generated it; `reason` is its key in the stats."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def one_line(error: BaseException) -> str:
    """A jinja error for a message: its type, where a syntax error is, and its text on one line."""
    where = f" at line {error.lineno} of the template" if isinstance(error, jinja2.TemplateSyntaxError) else ""
    text = " ".join(str(error).split()).rstrip(".")
    return f"{type(error).__name__}{where}: {text[:300]}" if text else f"{type(error).__name__}{where}"


def render(
    tokenizer,
    messages,
    tools=None,
    add_generation_prompt: bool = False,
    template_kwargs=None,
    chat_template: str | None = None,
) -> str:
    """The chat template's text (the tokenizer's own, or `chat_template` given as a template string)."""
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **(template_kwargs or {}),
        )
    except jinja2.TemplateError as err:
        if type(err) is jinja2.TemplateError:  # the template's own raise_exception(): it refuses this conversation
            reason = " ".join(str(err).split())
            raise TemplateRefused(f"the chat template refuses this conversation: {reason}") from None
        raise TemplateFailed(err, chat_template is not None) from None
    except (RecursionError, ArithmeticError, TypeError) as err:  # OverflowError (range) is an ArithmeticError
        raise TemplateFailed(err, chat_template is not None) from None


@dataclass(frozen=True)
class PlacedTurn:
    """One assistant turn as it is trained: `text` is a sample of its own holding it (the served prompt and the
    generated text, or the conversation rendered through it), `spans` the trained characters there."""

    index: int  # of the message
    text: str
    spans: tuple[tuple[int, int], ...]
    prompt_end: int | None = None  # text[:prompt_end] is the served prompt, tokenised on its own (a derived turn)
    in_whole: bool = False  # the whole conversation's rendering starts with `text`: trained there, same spans
    derived: bool = False  # placed by derived_turn (the template does not render it as generated)


@dataclass(frozen=True)
class Rendering:
    """One sample's text, the character spans in it that are trained, and the turns they belong to."""

    sample_id: str
    text: str
    spans: tuple[tuple[int, int], ...]
    turns: tuple[PlacedTurn, ...] = ()
    prompt_end: int | None = None  # text[:prompt_end] is the served prompt, tokenised on its own


@dataclass(frozen=True)
class Plan:
    """A conversation's samples, and the assistant turns that could not be placed (message index -> why)."""

    renderings: list[Rendering]
    dropped: dict[int, TurnNotPlaced]


def end_of_turn_span(text: str, start: int, end: int, end_tokens: tuple[str, ...]) -> tuple[int, int]:
    """Where the end-of-turn token of a turn that the template renders as text[start:end] stands: its first
    one inside; or, when it renders none inside, one that directly follows (Kimi's template closes a turn
    only once another message follows it); else (end, end). What follows that token is the template's
    separator (the newline after <|im_end|>), which the target never generates."""
    found = [(i, i + len(token)) for token in end_tokens if (i := text.find(token, start, end)) >= 0]
    if found:
        return min(found, key=lambda span: span[1])
    return next(((end, end + len(token)) for token in end_tokens if text.startswith(token, end)), (end, end))


def end_of_turn(text: str, start: int, end: int, end_tokens: tuple[str, ...]) -> int:
    """Where the generated text of a turn rendered as text[start:end] ends: after its end-of-turn token."""
    return end_of_turn_span(text, start, end, end_tokens)[1]


def content_spans(
    tokenizer,
    messages,
    i: int,
    tools,
    host: str,
    start: int,
    template_kwargs=None,
    chat_template: str | None = None,
    fields=None,
):
    """Where the reasoning and content of assistant turn i stand in `host` (whose turn i's generated text begins
    at `start`); only those of `fields` when given. The turn is rendered once more with a unique placeholder in
    place of each field; the template's own text between them must then equal `host`'s, and each field must
    stand verbatim where its placeholder stood. No search: a content that also occurs in the reasoning, a tool
    call or the end-of-turn token is still placed right."""
    message = messages[i]
    fields = [key for key in (fields or ("reasoning_content", "content")) if message.get(key)]
    marked = render(
        tokenizer,
        [*messages[:i], {**message, **{k: PLACEHOLDER.format(k) for k in fields}}],
        tools,
        template_kwargs=template_kwargs,
        chat_template=chat_template,
    )
    spans, at, cursor = [], start, start  # at: position in host; cursor: in the marked rendering
    for key in sorted(fields, key=lambda k: marked.find(PLACEHOLDER.format(k), start)):
        where = marked.find(PLACEHOLDER.format(key), cursor)
        literal = marked[cursor:where]
        if where < 0 or not host.startswith(literal, at) or not host.startswith(message[key], at + len(literal)):
            raise TurnNotPlaced(
                NOT_VERBATIM,
                f"turn {i} (assistant): the chat template does not render its {key} "
                "verbatim (it rewrites or drops it), so the content-only mask cannot be placed; use "
                "data.loss_mask 'assistant_turn'",
            )
        at += len(literal)
        spans.append((at, at + len(message[key])))
        at, cursor = at + len(message[key]), where + len(PLACEHOLDER.format(key))
    return spans


def cut_end(
    tokenizer,
    messages,
    i: int,
    tools,
    host: str,
    start: int,
    eot_start: int,
    template_kwargs=None,
    chat_template: str | None = None,
) -> int:
    """Where a turn cut at generate.max_tokens ends in `host`: after its last field (content, else reasoning),
    or before its end-of-turn token when it calls tools; the template's closing text after it, and the
    end-of-turn token, were never generated."""
    if messages[i].get("tool_calls"):
        return eot_start
    try:
        spans = content_spans(tokenizer, messages, i, tools, host, start, template_kwargs, chat_template)
    except TurnNotPlaced:
        raise TurnNotPlaced(
            NOT_VERBATIM,
            f"turn {i} (assistant): cut at generate.max_tokens, and the chat template "
            "does not render its text verbatim, so where the target stopped cannot be placed",
        ) from None
    return max(end for _, end in spans)


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid)
    return low


def markup_pattern(tokenizer) -> re.Pattern:
    """MARKUP_PIECES, the tokenizer's special and added tokens first (longest first): a piece is never half a
    token the tokenizer keeps whole."""
    specials = set(getattr(tokenizer, "all_special_tokens", None) or ())
    try:
        specials |= {str(token) for token in tokenizer.get_added_vocab()}
    except (AttributeError, NotImplementedError):
        pass
    alternatives = [re.escape(s) for s in sorted((s for s in specials if s.strip()), key=len, reverse=True)]
    return re.compile(
        "|".join([*(["(?P<special>" + "|".join(alternatives) + ")"] if alternatives else []), MARKUP_PIECES])
    )


def _pieces(pattern: re.Pattern, text: str, start: int = 0, end: int | None = None) -> list[tuple[str, int, int]]:
    return [(m.group(), m.start(), m.end()) for m in pattern.finditer(text, start, len(text) if end is None else end)]


def _is_markup(pattern: re.Pattern, piece: str) -> bool:
    """A special token or a <tag>: what a generation prompt may open that the rendered turn does not show."""
    match = pattern.fullmatch(piece)
    return match is not None and (match.group("tag") is not None or match.groupdict().get("special") is not None)


def _whitespace_run(text: str, at: int, limit: int) -> int:
    end = at
    while end < limit and text[end].isspace():
        end += 1
    return end - at


def align_generation_prompt(tail: str, turn: str, low: int, high: int, pattern: re.Pattern, i: int) -> tuple[int, bool]:
    """Where the generated text begins in `turn`, whose turn opening lies in turn[low:high]: after what the
    generation prompt's own text `tail` covers of it. Returns that position and whether `tail` has markup the
    turn does not show (it opened something: DeepSeek-V3.1's `<think>`)."""
    served = _pieces(pattern, tail)
    if not served:
        return low, False  # the generation prompt adds nothing: the turn's text is generated from its start
    opening = _pieces(pattern, turn, low, high)
    texts = [piece for piece, _, _ in opening]
    anchors = [j for j, piece in enumerate(texts) if piece == served[0][0]]
    if not anchors:
        raise TurnNotPlaced(
            NOT_PLACED,
            f"turn {i} (assistant): the chat template renders this turn with another "
            f"opening than the generation prompt it is served with ({tail.strip()[:60]!r}), so what "
            "the target generated cannot be placed",
        )
    j = anchors[-1]
    k = 1
    while k < len(served) and j + k < len(texts) and texts[j + k] == served[k][0]:
        k += 1
    # Layout differs where the whitespace before a matched piece does (an indented generation prompt).
    before_first = opening[j][1]
    while before_first > low and turn[before_first - 1].isspace():
        before_first -= 1
    relaid = any(
        tail[served[m - 1][2] if m else 0 : served[m][1]]
        != turn[opening[j + m - 1][2] if m else before_first : opening[j + m][1]]
        for m in range(k)
    )
    position, rest = opening[j + k - 1][2], tail[served[k - 1][2] :]
    run = _whitespace_run(turn, position, high)
    if not all(_is_markup(pattern, piece) for piece, _, _ in served[k:]):
        raise TurnNotPlaced(
            NOT_PLACED,
            f"turn {i} (assistant): the chat template renders this turn with another "
            f"opening than the generation prompt it is served with ({tail.strip()[:60]!r} where the "
            f"turn shows {turn[opening[j][1] : high].strip()[:60]!r}), so what the target generated "
            "cannot be placed",
        )
    if k < len(served) or relaid:
        return position + run, k < len(served)  # the turn's layout whitespace there is the template's, not generated
    if rest and turn.startswith(rest, position) and position + len(rest) <= high:
        return position + len(rest), False  # the generation prompt's own trailing whitespace, exactly
    return position + (run if rest else 0), False


def reasoning_slot(tokenizer, context, marked_message, marked: str, start: int, tools, template_kwargs) -> int | None:
    """Where, in `marked` (the turn rendered with placeholders; the template leaves its reasoning out), the
    reasoning belongs: where the template writes the reasoning of the same turn given a tool call, when the
    turn's text from `start` to there and the text after it up to the content are the same in both. None when
    no such place is found."""
    reasoning_mark, content_mark = PLACEHOLDER.format("reasoning_content"), PLACEHOLDER.format("content")
    if marked_message.get("tool_calls"):
        return None  # as rendered already: a tool-calling turn the template still blanks shows nothing more
    try:
        probe = render(
            tokenizer, [*context, {**marked_message, "tool_calls": [PROBE_CALL]}], tools, False, template_kwargs
        )
    except (TemplateRefused, TemplateFailed):
        return None  # the template will not take the made-up call: nothing learnt
    at, content = probe.find(reasoning_mark), probe.find(content_mark)
    turn_content = marked.find(content_mark, start)
    if at < 0 or content < at or turn_content < 0:
        return None
    between = probe[at + len(reasoning_mark) : content]
    slot = turn_content - len(between)
    if slot < 0 or marked[slot:turn_content] != between:
        return None
    if slot >= start and not probe[:at].endswith(marked[start:slot]):
        return None
    return slot


def placed_as_rendered(
    tokenizer,
    messages,
    i: int,
    tools,
    whole: str,
    served: str,
    through: str,
    loss_mask: str,
    end_tokens,
    template_kwargs=None,
) -> PlacedTurn | None:
    """Turn i placed where the template renders it as generated: `through` (the conversation rendered through
    it) starts with `served` (rendered before it with the generation prompt) and holds the turn's reasoning.
    None when it does not."""
    message = messages[i]
    if not through.startswith(served):
        return None
    in_whole = whole.startswith(through)
    host = whole if in_whole else through  # where the turn is shown as generated
    start = len(served)
    eot_start, end = end_of_turn_span(host, start, len(through), end_tokens)
    if message.get("reasoning_content") and message["reasoning_content"].strip() not in host[start:end]:
        return None  # (a template may trim the reasoning's newlines: Qwen3's does)
    if message.get("finish_reason") == "length":
        end = cut_end(tokenizer, messages, i, tools, host, start, eot_start, template_kwargs)
    spans = (
        [(start, end)]
        if loss_mask == "assistant_turn"
        else content_spans(tokenizer, messages, i, tools, host, start, template_kwargs)
    )
    return PlacedTurn(i, host[: max(len(through), end)], tuple(spans), in_whole=in_whole)


def derived_turn(
    tokenizer,
    messages,
    i: int,
    tools,
    served: str,
    turn: str,
    loss_mask: str,
    end_tokens,
    template_kwargs,
    pattern: re.Pattern,
) -> PlacedTurn:
    """Turn i as the target generated it, for a template that does not render it so
    (docs/decisions/2026-12-04-thinking-turns-derived.md): `served` (the prompt with the generation prompt), then
    the generated text, found in `turn` (the conversation rendered through turn i). Raises TurnNotPlaced."""
    context, message = list(messages[:i]), messages[i]

    def text(upto_messages) -> str:
        return render(tokenizer, upto_messages, tools, False, template_kwargs)

    reasoning = message.get("reasoning_content") or ""
    marked_message = {
        **message,
        "content": PLACEHOLDER.format("content"),
        **({"reasoning_content": PLACEHOLDER.format("reasoning_content")} if reasoning else {}),
    }
    alone, marked = text(context), text([*context, marked_message])
    first_field = common_prefix(turn, marked)
    low = min(common_prefix(turn, alone), first_field)
    tail = served[common_prefix(served, alone) :]
    start, opened = align_generation_prompt(tail, turn, low, first_field, pattern, i)
    eot_start, end = end_of_turn_span(turn, start, len(turn), end_tokens)
    if eot_start == end == len(turn):  # no end-of-turn token: the template may write it once a message follows
        followed = text([*context, message, {"role": "user", "content": PLACEHOLDER.format("next")}])
        if followed.startswith(turn):
            eot_start, end = end_of_turn_span(followed, start, len(turn), end_tokens)
            turn = followed[:end]
    insert = None  # where the reasoning the template leaves out goes in turn's text
    if reasoning and PLACEHOLDER.format("reasoning_content") not in marked:
        insert = reasoning_slot(tokenizer, context, marked_message, marked, start, tools, template_kwargs)
        if insert is None and opened:
            insert = start  # the generation prompt opened the reasoning: the target writes it first
        if insert is None or insert < start or insert > end:
            raise TurnNotPlaced(
                REASONING_NOT_RENDERED,
                f"turn {i} (assistant): the chat template never renders "
                "its reasoning_content, and leaves no place after the generation prompt to put it",
            )
    kept = ("content",) if insert is not None else None  # the fields the template writes
    if message.get("finish_reason") == "length":
        end = (
            cut_end(tokenizer, messages, i, tools, turn, start, eot_start, template_kwargs)
            if kept is None
            else eot_start
            if message.get("tool_calls")
            else max(
                b for _, b in content_spans(tokenizer, messages, i, tools, turn, start, template_kwargs, fields=kept)
            )
        )

    def moved(position: int) -> int:  # a position in turn -> in the sample's text
        return len(served) + position - start + (len(reasoning) if insert is not None and position >= insert else 0)

    generated = turn[start:end] if insert is None else turn[start:insert] + reasoning + turn[insert:end]
    sample = served + generated
    if loss_mask == "assistant_turn":
        spans = [(len(served), len(sample))]
    else:
        spans = [
            (moved(a), moved(b))
            for a, b in content_spans(tokenizer, messages, i, tools, turn, start, template_kwargs, fields=kept)
        ]
        if insert is not None:
            spans = sorted([*spans, (moved(insert) - len(reasoning), moved(insert))])
    return PlacedTurn(i, sample, tuple(spans), prompt_end=len(served), derived=True)


def plan_renderings(
    tokenizer,
    conversation,
    loss_mask: str = "assistant_turn",
    end_tokens: tuple[str, ...] = (),
    template_kwargs=None,
    pattern: re.Pattern | None = None,
) -> Plan:
    """The samples of one conversation: the whole conversation with the turns it shows as generated, then one
    sample for each other assistant turn (rendered through it, or derived). Tool results are never trained;
    neither is an assistant turn with nothing before it (nothing prompted it)."""
    messages, tools = conversation.messages, conversation.tools
    pattern = pattern or markup_pattern(tokenizer)
    whole = render(tokenizer, messages, tools, False, template_kwargs)
    placed, dropped = [], {}
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        served = render(tokenizer, messages[:i], tools, True, template_kwargs)
        through = render(tokenizer, messages[: i + 1], tools, False, template_kwargs)
        try:
            turn = placed_as_rendered(
                tokenizer, messages, i, tools, whole, served, through, loss_mask, end_tokens, template_kwargs
            ) or derived_turn(
                tokenizer, messages, i, tools, served, through, loss_mask, end_tokens, template_kwargs, pattern
            )
        except TurnNotPlaced as err:
            dropped[i] = err
            continue
        placed.append(turn)
    return Plan(assemble(conversation.sample_id, whole, placed), dropped)


def assemble(conversation_id: str, whole: str, placed: list[PlacedTurn]) -> list[Rendering]:
    """The whole rendering with the turns it hosts (under the conversation's id), then a sample per other turn
    ("<conversation id>.<turn index>")."""
    hosted = tuple(t for t in placed if t.in_whole)
    renderings = (
        [Rendering(conversation_id, whole, tuple(s for t in hosted for s in t.spans), hosted)] if hosted else []
    )
    return renderings + [
        Rendering(f"{conversation_id}.{t.index}", t.text, t.spans, (t,), t.prompt_end) for t in placed if not t.in_whole
    ]


def renderings_as_generated(
    tokenizer, conversation, loss_mask: str, end_tokens: tuple[str, ...], template_kwargs, generation_template: str
) -> Plan:
    """data.generation_chat_template: for targets whose template never renders a turn's reasoning as it was
    generated, when the derivation above does not do (or to be explicit). Each assistant turn is a sample of
    its own: its prompt as the target's template renders it (what the target was served), then the turn as the
    generation template renders it (what the target wrote), through the end-of-turn token. The last turn's
    sample carries the conversation's id, earlier ones "<id>.<turn>"."""
    messages, tools = conversation.messages, conversation.tools
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    renderings, dropped = [], {}
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prompt = render(tokenizer, messages[:i], tools, True, template_kwargs)
        before = render(tokenizer, messages[:i], tools, True, template_kwargs, generation_template)
        through = render(tokenizer, messages[: i + 1], tools, False, template_kwargs, generation_template)
        try:
            if not through.startswith(before):
                raise TurnNotPlaced(
                    NOT_PLACED,
                    f"turn {i} (assistant): data.generation_chat_template renders this "
                    "turn with another prefix than its generation prompt; it must render every turn "
                    "as generated (append-only)",
                )
            eot_start, end = end_of_turn_span(through, len(before), len(through), end_tokens)
            if message.get("finish_reason") == "length":
                end = cut_end(
                    tokenizer, messages, i, tools, through, len(before), eot_start, template_kwargs, generation_template
                )
            text = prompt + through[len(before) : end]
            shift = len(prompt) - len(before)
            spans = (
                [(len(prompt), len(text))]
                if loss_mask == "assistant_turn"
                else [
                    (a + shift, b + shift)
                    for a, b in content_spans(
                        tokenizer, messages, i, tools, through, len(before), template_kwargs, generation_template
                    )
                ]
            )
        except TurnNotPlaced as err:
            dropped[i] = err
            continue
        turn = PlacedTurn(i, text, tuple(spans), prompt_end=len(prompt), derived=True)
        renderings.append(
            Rendering(
                conversation.sample_id if i == last else f"{conversation.sample_id}.{i}",
                text,
                tuple(spans),
                (turn,),
                len(prompt),
            )
        )
    return Plan(renderings, dropped)
