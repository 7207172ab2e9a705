"""Regenerate the assistant turns of the data with the target itself, through an OpenAI-compatible server.

    python -m eagle3 generate --config RUN_DIR/config.json

Every assistant turn of data.path is asked again in order, each conditioned on the regenerated turns before it, with
POST {endpoint}/chat/completions (SGLang's or vLLM's server; generate.launch_server starts server.engine on the box
for the stage: eagle3.engines.server). Tool turns stay; a regenerated turn that calls other tools than the original ends
the conversation there, since the results after it answered the original calls. generate.backend "hf" runs the target in
this process with transformers, batched: for small targets, with no reasoning or tool-call parsing.

Requests run concurrently (generate.concurrency); connection errors, timeouts, 429 and 5xx are retried with backoff
(generate.max_retries). A conversation that still fails is recorded with its error and left out; a rerun asks again.
The stage stops once more than generate.max_failure_rate of the conversations tried fail (checked after 20). Each
attempt has one deadline (generate.request_timeout_s), an answer has a size cap, and a malformed one fails its row,
never the stage. The key named by generate.api_key_env goes only into the Bearer header; only {endpoint}/models and
{endpoint}/chat/completions are called, and no redirect is followed.

Output in RUN_DIR/generate/:
  parts/part-NNNNN.jsonl  finished rows, each file written atomically: {"source_id", "line_no", "status": "ok" |
                          "failed", "messages" | "error", ...}; a turn cut at generate.max_tokens carries
                          "finish_reason": "length", its row "truncated": true. A rerun skips every "ok" row.
                          `parts` links to {workdir}/generated/<key>/ (eagle3.data.identity.generation_fields), shared
                          by runs with the same target and generation settings; one writer at a time (exit 1 else).
  conversations.jsonl     the "ok" rows in input order as {"messages": [...]}: what extract reads
  stats.json              the counts; failure_reasons: timeout, connection, http NNN, oversize, malformed, empty
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from eagle3.config import ConfigError, RunConfig, redact_url
from eagle3.data.identity import attach_generated
from eagle3.data.samples import Conversation, SampleTokenizer, read_conversations
from eagle3.disk.fsutil import atomic_write_text, try_exclusive_lock
from eagle3.engines.server import serving
from eagle3.jobs.progress import ProgressLog

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the progress lines

MIN_TRIED_BEFORE_ABORT = 20  # the failure rate means little over fewer conversations
PART_ROWS = 256  # rows per part file at most, and one part per progress interval while rows finish
PROBE_TIMEOUT_S = 10.0  # the whole GET {endpoint}/models: a live server answers it at once, even under load
ERROR_BODY_BYTES = 1024  # of an error answer's body, read for its message (and no more)

# A real answer is at most max_tokens tokens of text in a small JSON envelope (id, model, usage). A token is a
# few characters, and JSON escaping (\uXXXX per non-ASCII character, and once more inside tool-call arguments)
# makes that some tens of bytes at worst: 256 bytes a token is several times what any answer can need, and
# 1 MiB covers the envelope. A body past the cap is no answer to our request, so it is refused, not retried.
RESPONSE_BASE_BYTES = 1 << 20
RESPONSE_BYTES_PER_TOKEN = 256


def response_cap(max_tokens: int) -> int:
    """The most bytes an answer to a request for at most `max_tokens` tokens may take."""
    return RESPONSE_BASE_BYTES + RESPONSE_BYTES_PER_TOKEN * max_tokens


class GenerateAborted(RuntimeError):
    """Too many conversations failed: the server is down or refusing; the message says what it answered."""


class GenerateBusy(GenerateAborted):
    """Another run writes the same cache of answers right now; a retry (exit 1) finds its answers there."""


class RowFailed(Exception):
    """A request that failed for good: the conversation's row is failed with this message, counted under
    `reason` (timeout, connection, http NNN, oversize, malformed, empty) in stats.json's failure_reasons."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Transient(RowFailed):
    """A failure that retrying may fix: the connection failed, the deadline passed, or the server is overloaded
    or restarting (429, 5xx). Once the retries are spent it fails the row as any RowFailed does."""


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def one_line(text: str, limit: int = 200) -> str:
    """Server text as it may go into a message: one line, short."""
    return " ".join(text.split())[:limit]


def endpoint_url(base_url: str, route: str) -> httpx.URL:
    """{endpoint}/{route}, built from the endpoint's scheme, host, port and path only: whatever else the
    endpoint holds (user:password, a ?query or #fragment, which the config refuses anyway) cannot ride along
    or move the route out of the path."""
    base = httpx.URL(base_url)
    return base.copy_with(path=base.path.rstrip("/") + "/" + route, userinfo=b"", query=None, fragment=None)


def api_key_from_env(gen) -> str | None:
    """The key in the variable generate.api_key_env names, read on the box at stage start (None: not set).
    The key itself is kept out of every message: only the variable's name is ever shown."""
    name = gen.api_key_env
    if name is None:
        return None
    key = os.environ.get(name, "").strip()
    if not key:
        raise ConfigError(
            "generate.api_key_env",
            f"the variable {name} is not set in the box's environment",
            "export it (the server's API key) where the stage runs, or clear generate.api_key_env if the server "
            "needs no key",
        )
    if not (key.isascii() and key.isprintable()) or " " in key:  # it could not travel in an HTTP header
        raise ConfigError(
            "generate.api_key_env",
            f"the value of {name} is not a usable API key (it holds spaces or characters outside printable ASCII)",
            "set it to the key alone",
        )
    return key


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def read_capped(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """At most `limit` bytes of the body, and whether there was more; the rest is never read. Raw bytes: a
    content decoder could turn one small compressed chunk into gigabytes before the count saw them."""
    body = bytearray()
    async for chunk in response.aiter_raw():
        room = limit - len(body)
        body += chunk[:room]
        if len(chunk) > room:
            return bytes(body), True
    return bytes(body), False


# -- the client ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None
    completion_tokens: int
    finish_reason: str
    tool_calls: list[dict] | None = None


def json_kind(value: object) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf, which no JSON writer can write back
        raise ValueError("a number beyond ±1.8e308")
    return value


def _is_tool_call(call: object) -> bool:
    """OpenAI's shape, which Regeneration and the chat templates rely on: {"id"?, "function": {"name",
    "arguments"?: a JSON string}}."""
    function = call.get("function") if isinstance(call, dict) else None
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments", ""), str)
        and isinstance(call.get("id", ""), str)
    )


def parse_reply(body: bytes, keep_reasoning: bool = True) -> Reply:
    """The Reply in a chat completion's body. Whatever the body is, this returns a Reply that can be stored as
    JSON text or raises RowFailed with a one-line reason ("malformed", or "empty" for an empty message)."""

    def malformed(what: str) -> RowFailed:
        return RowFailed("malformed", f"malformed answer: {what}")

    try:
        answer = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise malformed("nested too deeply to read") from None
    except ValueError as err:  # not JSON, not UTF-8, NaN or Infinity, a number out of range, too many digits
        raise malformed(f"not readable JSON ({one_line(str(err))})") from None
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed("no choices[0] object")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise malformed(f"choices[0].message is {json_kind(message)}, not an object")
    content = "" if message.get("content") is None else message["content"]  # null: a turn of tool calls only
    reasoning = message.get("reasoning_content") or None
    tool_calls = message.get("tool_calls") or None
    finish_reason = choice.get("finish_reason") or ""
    usage = answer.get("usage") or {}
    if not isinstance(usage, dict):
        raise malformed(f"usage is {json_kind(usage)}, not an object")
    tokens = usage.get("completion_tokens") or 0
    for field, value, ok, expected in (
        ("message.content", content, isinstance(content, str), "a string or null"),
        ("message.reasoning_content", reasoning, reasoning is None or isinstance(reasoning, str), "a string"),
        (
            "message.tool_calls",
            tool_calls,
            tool_calls is None or (isinstance(tool_calls, list) and all(map(_is_tool_call, tool_calls))),
            'a list of {"id", "function": {"name", "arguments"}} calls',
        ),
        ("choices[0].finish_reason", finish_reason, isinstance(finish_reason, str), "a string"),
        # Past 2^32 no answer's count, and past 1e308 one that would break the stats' float arithmetic.
        ("usage.completion_tokens", tokens, type(tokens) is int and 0 <= tokens < 1 << 32, "a count"),
    ):
        if not ok:
            raise malformed(f"{field} is {json_kind(value)}, not {expected}")
    try:  # all of it goes into a part file as UTF-8: a lone surrogate (\ud800) would fail that write
        json.dumps([content, reasoning, tool_calls], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise malformed("a string in the message is not valid Unicode (a lone surrogate)") from None
    if not content.strip() and not tool_calls:
        raise RowFailed("empty", "the server answered with an empty message")
    return Reply(content, reasoning if keep_reasoning else None, tokens, finish_reason, tool_calls)


class ChatClient:
    """POST {endpoint}/chat/completions with retries; one Reply per request."""

    def __init__(self, cfg: RunConfig, base_url: str, api_key: str | None = None):
        gen = cfg.generate
        self.url = endpoint_url(base_url, "chat/completions")
        self.shown_url = redact_url(str(self.url))
        self.body = {
            "model": gen.model or cfg.target.model_path,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            **({"top_k": gen.top_k} if gen.top_k else {}),  # (SGLang's and vLLM's extension of the API)
            "max_tokens": gen.max_tokens,
            **({"chat_template_kwargs": cfg.data.chat_template_kwargs} if cfg.data.chat_template_kwargs else {}),
        }
        self.keep_reasoning = gen.reasoning == "keep"
        self.attempts = gen.max_retries + 1
        self.deadline_s = gen.request_timeout_s
        self.max_bytes = response_cap(gen.max_tokens)
        self.api_key = api_key
        self.http = httpx.AsyncClient(
            # httpx's timeouts are per phase and per read; the attempt's deadline (see _attempt) bounds the sum.
            timeout=httpx.Timeout(gen.request_timeout_s, connect=min(30.0, gen.request_timeout_s)),
            limits=httpx.Limits(max_connections=gen.concurrency, max_keepalive_connections=gen.concurrency),
            # Identity: the body's bytes are counted against the cap as they arrive, not after decompression.
            headers={"Accept-Encoding": "identity", **auth_headers(api_key)},
            # A redirect would send the request, and the key, somewhere other than {endpoint}/chat/completions:
            # it fails the row instead (httpx's default; stated because it matters).
            follow_redirects=False,
        )
        self.retries = 0

    async def reply(self, messages: list[dict], tools=None) -> Reply:
        body = {**self.body, "messages": messages, **({"tools": list(tools)} if tools else {})}
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Transient),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(multiplier=0.5, jitter=0.5, max=30.0),
            reraise=True,
            before_sleep=self._count_retry,
        ):
            with attempt:
                answer = await self._attempt(body)
        return parse_reply(answer, self.keep_reasoning)

    async def _attempt(self, body: dict) -> bytes:
        """One POST, its body read to the end, all within the deadline (httpx has no total timeout)."""
        try:
            async with asyncio.timeout(self.deadline_s):
                async with self.http.stream("POST", self.url, json=body) as response:
                    return await self._body_of(response)
        except TimeoutError:
            raise Transient(
                "timeout",
                f"no whole answer from {self.shown_url} within generate.request_timeout_s ({self.deadline_s:g} s)",
            ) from None
        except httpx.TransportError as err:
            reason = "timeout" if isinstance(err, httpx.TimeoutException) else "connection"
            raise Transient(reason, f"{self.shown_url}: {describe(err)}") from None

    async def _body_of(self, response: httpx.Response) -> bytes:
        status = response.status_code
        if response.is_redirect:
            raise RowFailed(
                f"http {status}",
                f"HTTP {status}: a redirect, not followed: the stage calls {self.shown_url} and nothing else",
            )
        if not response.is_success:
            text = (await read_capped(response, ERROR_BODY_BYTES))[0].decode("utf-8", "replace")
            if self.api_key:  # a proxy that echoes the request's headers back must not put the key in a row
                text = text.replace(self.api_key, "[key]")
            error = Transient if status == 429 or status >= 500 else RowFailed
            raise error(f"http {status}", f"HTTP {status}: {one_line(text)}")
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        if encoding != "identity":
            raise RowFailed(
                "malformed",
                f"malformed answer: compressed ({one_line(encoding, 40)}) though the "
                "request asked for none (Accept-Encoding: identity)",
            )
        answer, more = await read_capped(response, self.max_bytes)
        if more:
            raise RowFailed(
                "oversize",
                f"response over {self.max_bytes} bytes, more than an answer of "
                f"generate.max_tokens ({self.body['max_tokens']}) tokens can take; not "
                "read further",
            )
        return answer

    def _count_retry(self, retry_state) -> None:
        self.retries += 1

    async def close(self) -> None:
        await self.http.aclose()


class Regeneration:
    """One conversation asked again: `next_request()` gives the history the next assistant turn answers (the
    regenerated turns before it, tool and user turns as they were), `answer(reply)` takes the new turn; None
    when done. Trailing user turns are dropped."""

    def __init__(self, conversation: Conversation):
        self.conversation = conversation
        last_answer = max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
        self.turns = conversation.messages[: last_answer + 1]
        self.history: list[dict] = []
        self.index = 0
        self.tokens, self.truncated, self.cut_short = 0, False, False
        self.failed: str | None = None  # why the conversation cannot be kept (the server path raises instead)
        self.call_ids: dict[str, str] = {}  # the data's tool-call id -> the one the target wrote for that call

    def next_request(self) -> list[dict] | None:
        if self.cut_short or self.failed:
            return None
        while self.index < len(self.turns) and self.turns[self.index]["role"] != "assistant":
            turn = dict(self.turns[self.index])
            if turn.get("tool_call_id") in self.call_ids:  # the result answers the call as the target made it
                turn["tool_call_id"] = self.call_ids[turn["tool_call_id"]]
            self.history.append(turn)
            self.index += 1
        if self.index >= len(self.turns):
            return None
        # The cut mark is this stage's own note for extract: servers know no such message field.
        return [{k: v for k, v in m.items() if k != "finish_reason"} for m in self.history]

    def answer(self, reply: Reply) -> None:
        if not reply.content.strip() and not reply.tool_calls:
            self.failed = "the target answered with an empty message"
            return
        original = self.turns[self.index]
        message = {
            "role": "assistant",
            "content": reply.content,
            **({"reasoning_content": reply.reasoning} if reply.reasoning else {}),
        }
        old_calls, new_calls = original.get("tool_calls") or [], reply.tool_calls or []
        if [c["function"]["name"] for c in old_calls] != [c["function"]["name"] for c in new_calls]:
            self.cut_short = bool(old_calls)  # what follows answered calls this turn no longer makes
        elif new_calls:
            # The same tools: the calls stay as the target wrote them, ids included (a drafter trained on the
            # data's ids would learn tokens the target never writes), and the tool results that follow are
            # pointed at the target's ids. A call the target gave no id keeps the data's.
            for old, new in zip(old_calls, new_calls):
                if "id" in old and "id" in new:
                    self.call_ids[old["id"]] = new["id"]
            new_calls = [
                {**new, **({"id": old["id"]} if "id" in old and "id" not in new else {})}
                for old, new in zip(old_calls, new_calls)
            ]
        if new_calls:
            message["tool_calls"] = new_calls
        if reply.finish_reason == "length":  # cut at generate.max_tokens: extract trains no end of turn for it
            message["finish_reason"] = "length"
        self.history.append(message)
        self.index += 1
        self.tokens += reply.completion_tokens
        self.truncated |= reply.finish_reason == "length"

    def result(self) -> dict:
        return {
            "messages": self.history,
            **({"tools": list(self.conversation.tools)} if self.conversation.tools else {}),
            "completion_tokens": self.tokens,
            "truncated": self.truncated,
            "cut_at_tool_call": self.cut_short,
        }


async def regenerate(client: ChatClient, conversation: Conversation) -> dict:
    """Every assistant turn again, in order, each after the regenerated ones (see Regeneration)."""
    walk = Regeneration(conversation)
    while (history := walk.next_request()) is not None:
        walk.answer(await client.reply(history, conversation.tools))
    return walk.result()


class HfChat:
    """generate.backend "hf": the target in transformers on this process's device, batched, left-padded."""

    def __init__(self, cfg: RunConfig):
        # Imported here: only this backend loads torch and transformers; a server-backed generate never does.
        import torch
        from transformers import AutoModelForCausalLM

        from eagle3.capture.hf import pick_device

        self.torch, self.gen = torch, cfg.generate
        self.device = pick_device(cfg.extract.device)
        self.tokenizing = SampleTokenizer.for_run(cfg)
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                cfg.target.model_path,
                dtype=getattr(torch, cfg.target.dtype),
                trust_remote_code=cfg.target.trust_remote_code,
            )
            .to(self.device)
            .eval()
        )
        eos = self.model.generation_config.eos_token_id or self.model.config.eos_token_id
        self.eos = eos if isinstance(eos, list) else [eos]
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else self.eos[0]
        log.info(
            "generate: %s in transformers on %s, %d conversations at a time",
            cfg.target.model_path,
            self.device,
            self.gen.concurrency,
        )

    def replies(self, requests: list[tuple[list[dict], tuple | None]]) -> list[Reply]:
        """One reply per (history, tools), generated together."""
        torch = self.torch
        prompts = [self.tokenizing.prompt_ids(history, tools) for history, tools in requests]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.as_tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        # top_k 0: transformers' "no limit" (its own default would be 50, which the server path never applies)
        sampling = (
            {
                "do_sample": True,
                "temperature": self.gen.temperature,
                "top_p": self.gen.top_p,
                "top_k": self.gen.top_k or 0,
            }
            if self.gen.temperature > 0
            else {"do_sample": False}
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=attention.to(self.device),
                max_new_tokens=self.gen.max_tokens,
                eos_token_id=self.eos,
                pad_token_id=self.pad_id,
                **sampling,
            )
        replies = []
        for new in out[:, width:].tolist():
            stop = next((i for i, token in enumerate(new) if token in self.eos), None)
            new = new[: stop + 1] if stop is not None else new
            text = self.tokenizing.tokenizer.decode(new, skip_special_tokens=True)
            replies.append(Reply(text, None, len(new), "stop" if stop is not None else "length"))
        return replies


def regenerate_with_hf(cfg: RunConfig, todo: list[Conversation], writer: PartWriter, progress: ProgressLog) -> dict:
    """generate.backend "hf": generate.concurrency conversations at a time, turn by turn; rows as the server
    path writes them (a model error is a bug here, not a row's failure)."""
    chat = HfChat(cfg)
    truncated = 0
    # Similar lengths together: less padding per batch.
    todo = sorted(todo, key=lambda c: sum(len(m["content"]) for m in c.messages))
    try:
        for start in range(0, len(todo), cfg.generate.concurrency):
            walks = [Regeneration(c) for c in todo[start : start + cfg.generate.concurrency]]
            while asking := [(walk, history) for walk in walks if (history := walk.next_request()) is not None]:
                replies = chat.replies([(history, walk.conversation.tools) for walk, history in asking])
                for (walk, _), reply in zip(asking, replies, strict=True):
                    walk.answer(reply)
            for walk in walks:
                row = {"source_id": walk.conversation.sample_id, "line_no": walk.conversation.line_no}
                if walk.failed:  # left out of the data and counted, as a failed request is on the server path
                    writer.add({**row, "status": "failed", "reason": "empty", "error": walk.failed})
                    progress.update(0, 0, failed=1)
                    continue
                result = walk.result()
                truncated += result["truncated"]
                writer.add({**row, "status": "ok", **result})
                progress.update(1, result["completion_tokens"])
    finally:
        writer.flush()
    return {"retries": 0, "truncated": truncated}


# -- rows on disk ----------------------------------------------------------------------------------------------


class PartWriter:
    """Finished rows, in batches, each batch one new part file written atomically. Holds the directory's lock:
    the parts are a cache runs share (eagle3.data.identity.attach_generated), and two writers would pick one
    name."""

    def __init__(self, parts_dir: Path, interval_s: float):
        self.dir, self.interval_s = parts_dir, interval_s
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = try_exclusive_lock(self.dir / ".lock")
        if self._lock is None:
            raise GenerateBusy(
                f"{self.dir}: another run is generating into this cache of answers now; the retry "
                "finds its answers there"
            ) from None
        existing = [int(p.stem.split("-")[1]) for p in self.dir.glob("part-*.jsonl")]
        self.next_index = max(existing, default=-1) + 1
        self.rows: list[dict] = []
        self.last_flush = time.monotonic()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= PART_ROWS or time.monotonic() - self.last_flush >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.rows:
            return
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows)
        atomic_write_text(self.dir / f"part-{self.next_index:05d}.jsonl", text)
        self.next_index += 1
        self.rows = []

    def release(self) -> None:
        self.flush()
        self._lock.close()


def read_rows(parts_dir: Path) -> dict[str, dict]:
    """The latest row of each conversation over all part files (an "ok" row is never replaced by a later try)."""
    rows: dict[str, dict] = {}
    for part in sorted(parts_dir.glob("part-*.jsonl")):
        for line in part.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if rows.get(row["source_id"], {}).get("status") != "ok":
                rows[row["source_id"]] = row
    return rows


# -- the stage -------------------------------------------------------------------------------------------------


async def regenerate_all(
    cfg: RunConfig,
    base_url: str,
    todo: list[Conversation],
    writer: PartWriter,
    progress: ProgressLog,
    api_key: str | None = None,
) -> dict:
    """Run the conversations through `concurrency` workers, counting into `progress` (done_here: regenerated,
    failed, tokens). Returns {"retries": retried requests, "truncated": answers cut at max_tokens}."""
    gen = cfg.generate
    client = ChatClient(cfg, base_url, api_key)
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conversation in todo:
        queue.put_nowait(conversation)
    abort: list[str] = []
    truncated = 0

    async def worker() -> None:
        nonlocal truncated
        while not abort and not queue.empty():
            conversation = queue.get_nowait()
            row = {"source_id": conversation.sample_id, "line_no": conversation.line_no}
            try:
                result = await regenerate(client, conversation)
            except RowFailed as err:  # whatever the server did, or did not, answer
                writer.add({**row, "status": "failed", "reason": err.reason, "error": str(err)})
                progress.update(0, 0, failed=1)
                tried = progress.done_here + progress.failed
                if tried >= min(MIN_TRIED_BEFORE_ABORT, len(todo)) and progress.failed > gen.max_failure_rate * tried:
                    abort.append(
                        f"{progress.failed} of the {tried} conversations tried failed "
                        f"(generate.max_failure_rate {gen.max_failure_rate:.0%}); last error: {err}"
                    )
                continue
            truncated += result["truncated"]
            writer.add({**row, "status": "ok", **result})
            progress.update(1, result["completion_tokens"])

    try:
        await asyncio.gather(*(worker() for _ in range(min(gen.concurrency, len(todo)))))
    finally:
        writer.flush()
        await client.close()
    if abort:
        raise GenerateAborted(
            f"generate stopped early: {abort[0]}. Is the server at {redact_url(base_url)} up and serving "
            f"{cfg.generate.model or cfg.target.model_path}? Rows done so far are kept; run the stage again to go on."
        )
    return {"retries": client.retries, "truncated": truncated}


async def check_endpoint(base_url: str, api_key: str | None = None) -> None:
    """Fail in seconds, not after a dataset's worth of retries, when nothing listens at the endpoint or it
    refuses the key. Only the status line and headers are read, within PROBE_TIMEOUT_S all told."""
    shown = redact_url(base_url)
    try:
        async with (
            asyncio.timeout(PROBE_TIMEOUT_S),
            httpx.AsyncClient(headers=auth_headers(api_key), timeout=PROBE_TIMEOUT_S, follow_redirects=False) as http,
        ):
            async with http.stream("GET", endpoint_url(base_url, "models")) as response:
                status = response.status_code
    except (TimeoutError, httpx.TransportError) as err:
        why = f"no answer within {PROBE_TIMEOUT_S:g} s" if isinstance(err, TimeoutError) else describe(err)
        raise GenerateAborted(
            f"generate.endpoint: cannot reach {shown} ({why}); start the target's server there, or set "
            "generate.launch_server to have the stage start it"
        ) from None
    if status in (401, 403):
        raise GenerateAborted(
            f"generate.endpoint: {shown}/models answered HTTP {status}: the server wants an API key"
            + (" and refused the one sent" if api_key else "")
            + "; name the variable on the box that holds it "
            "in generate.api_key_env"
        )


def run_generate(cfg: RunConfig) -> dict:
    gen = cfg.generate  # its sampling as init resolved it (eagle3.target.serving_sampling)
    started = time.monotonic()
    # Read first, so that a missing key fails the stage before anything else. Sent whenever it is set, also to a
    # server the stage starts: that one needs no key, but a Bearer header is harmless to a server without
    # --api-key and needed by one given a key in server.extra_args. The hf backend has no server to send it to.
    api_key = api_key_from_env(gen) if gen.backend == "server" else None
    out = cfg.run_dir / "generate"
    limit = gen.num_samples or cfg.data.max_samples
    conversations, read_stats = read_conversations(cfg.data.path, cfg.data.on_bad_record, limit)
    cache = attach_generated(cfg)  # answers of earlier runs with the same target and settings are reused
    writer = PartWriter(out / "parts", gen.progress_interval_s)  # a kill -9 loses one interval's rows at most
    try:
        return _generate(cfg, out, conversations, read_stats, writer, cache.name, started, api_key)
    finally:
        writer.release()


def _generate(
    cfg: RunConfig,
    out: Path,
    conversations: list[Conversation],
    read_stats,
    writer: PartWriter,
    cache: str,
    started: float,
    api_key: str | None,
) -> dict:
    gen = cfg.generate
    rows = read_rows(writer.dir)
    todo = [c for c in conversations if rows.get(c.sample_id, {}).get("status") != "ok"]
    progress = ProgressLog(
        "generate",
        len(conversations),
        len(conversations) - len(todo),
        gen.progress_interval_s,
        log,
        unit="conversations",
        track_bytes=False,
        track_failures=True,
    )
    log.info(
        "generate: sampling at temperature %s, top_p %s, top_k %s (empty fields: the target's "
        "generation_config.json; greedy when it names no temperature)",
        gen.temperature,
        gen.top_p,
        gen.top_k or "unlimited",
    )
    log.info("generate: %d conversations, %d already regenerated, %d to go", progress.total, progress.done, len(todo))
    outcome = {"retries": 0, "truncated": 0}
    if todo:
        random.Random(cfg.seed).shuffle(todo)  # long and short conversations mixed: a steadier ETA
        if gen.backend == "hf":
            outcome = regenerate_with_hf(cfg, todo, writer, progress)
        elif gen.launch_server:
            with serving(cfg, out / "server.log") as server_url:
                outcome = asyncio.run(regenerate_all(cfg, server_url + "/v1", todo, writer, progress, api_key))
        else:
            asyncio.run(check_endpoint(gen.endpoint, api_key))
            outcome = asyncio.run(regenerate_all(cfg, gen.endpoint, todo, writer, progress, api_key))
        progress.emit()

    rows = read_rows(writer.dir)
    ok_rows = [rows[c.sample_id] for c in conversations if rows.get(c.sample_id, {}).get("status") == "ok"]
    failed_rows = {
        c.line_no: rows[c.sample_id] for c in conversations if rows.get(c.sample_id, {}).get("status") == "failed"
    }
    failed = {line_no: row["error"] for line_no, row in failed_rows.items()}
    records = [{"messages": r["messages"], **({"tools": r["tools"]} if r.get("tools") else {})} for r in ok_rows]
    atomic_write_text(
        out / "conversations.jsonl", "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    )
    elapsed = time.monotonic() - started
    stats = {
        "conversations": len(conversations),
        "regenerated": len(ok_rows),
        "regenerated_now": progress.done_here,
        "already_done": len(conversations) - len(todo),  # answered before: by an earlier try, or another run
        "answers_cache": cache,  # {workdir}/generated/<this>, shared by runs with the same target and settings
        "failed": len(failed),
        "failed_lines": dict(list(failed.items())[:50]),
        "failure_reasons": dict(Counter(row["reason"] for row in failed_rows.values())),
        "bad_records": len(read_stats.bad),
        "duplicates": read_stats.duplicates,
        "truncated_now": outcome["truncated"],
        "cut_at_tool_call": sum(bool(r.get("cut_at_tool_call")) for r in ok_rows),
        "retried_requests": outcome["retries"],
        "completion_tokens_now": progress.tokens,
        "tokens_per_s": round(progress.tokens / elapsed, 1),
        "seconds": round(elapsed, 1),
        "output": str(out / "conversations.jsonl"),
    }
    atomic_write_text(out / "stats.json", json.dumps(stats, indent=2) + "\n")
    if failed:
        log.warning(
            "generate: %d conversation(s) failed and are left out of the data (first: line %d: %s); "
            "run the stage again to retry them",
            len(failed),
            *next(iter(failed.items())),
        )
    return stats
