"""Regenerate the assistant turns of the data with the target itself, through an OpenAI-compatible server.

    python -m eagle3 generate --config RUN_DIR/config.json

EAGLE-3 drafters learn to predict the target's own next tokens, so training on the target's answers beats
training on someone else's. For each conversation of data.path (ShareGPT or OpenAI-messages JSONL), every
assistant turn is regenerated in order, each conditioned on the regenerated turns before it, with
POST {endpoint}/chat/completions (SGLang's OpenAI-compatible server; generate.launch_server starts one on the
box for the stage and stops it afterwards, see eagle3.server).

Tool turns stay as they are; only assistant turns are asked again (with the record's `tools` in the request).
A regenerated turn that calls other tools than the original did (other function names, or none) ends the
conversation there: the tool results that follow answered the original calls. Where the names agree the
original call ids are kept, so the results still refer to them.

generate.backend "hf" runs the target in the stage itself with transformers, batched (generate.concurrency
conversations at a time), for small targets such as the demo's: no server, no reasoning or tool-call parsing
(the answer is the decoded text). Its rows and resume are the server path's.

Requests run concurrently (generate.concurrency) from an async client; connection errors, timeouts, 429 and 5xx
are retried with exponential backoff and jitter (generate.max_retries). A conversation that still fails is
recorded as failed with its error, counted, and left out of the data; a rerun tries it again. When more than
generate.max_failure_rate of the conversations tried fail (checked after the first 20), the stage stops with
the last error: a dead server must not turn the whole dataset into errors.

Output in RUN_DIR/generate/:
  parts/part-NNNNN.jsonl  finished rows in batches, each file written atomically (temp, fsync, rename):
                          {"source_id", "line_no", "status": "ok"|"failed", "messages" | "error", ...}.
                          A rerun skips every conversation with an "ok" row: a kill -9 loses at most the
                          rows not yet in a part (they are redone), and duplicates none.
  conversations.jsonl     the "ok" rows in input order as {"messages": [...]}: what extract reads.
  stats.json              the counts and rates of the stage's last run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from eagle3.data import Conversation, read_conversations
from eagle3.fsutil import atomic_write_text
from eagle3.progress import ProgressLog

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the progress lines

MIN_TRIED_BEFORE_ABORT = 20  # the failure rate means little over fewer conversations
PART_ROWS = 256  # rows per part file at most, and one part per progress interval while rows finish


class GenerateAborted(RuntimeError):
    """Too many conversations failed: the server is down or refusing; the message says what it answered."""


class RowFailed(Exception):
    """A request that retrying will not fix (a 4xx, an empty or malformed answer)."""


def is_transient(err: BaseException) -> bool:
    """Worth retrying: the connection failed or timed out, or the server is overloaded or broken (429, 5xx)."""
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code == 429 or err.response.status_code >= 500
    return isinstance(err, httpx.TransportError)


def describe(err: BaseException) -> str:
    if isinstance(err, httpx.HTTPStatusError):
        return f"HTTP {err.response.status_code}: {err.response.text[:200]}"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


# -- the client ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None
    completion_tokens: int
    finish_reason: str
    tool_calls: list[dict] | None = None


class ChatClient:
    """POST /chat/completions with retries; one Reply per request."""

    def __init__(self, cfg, base_url: str):
        gen = cfg.generate
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.body = {"model": gen.model or cfg.target.model_path, "temperature": gen.temperature, "top_p": gen.top_p,
                     "max_tokens": gen.max_tokens,
                     **({"chat_template_kwargs": cfg.data.chat_template_kwargs} if cfg.data.chat_template_kwargs
                        else {})}
        self.keep_reasoning = gen.reasoning == "keep"
        self.attempts = gen.max_retries + 1
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(gen.request_timeout_s, connect=min(30.0, gen.request_timeout_s)),
            limits=httpx.Limits(max_connections=gen.concurrency, max_keepalive_connections=gen.concurrency),
        )
        self.retries = 0

    async def reply(self, messages: list[dict], tools=None) -> Reply:
        body = {**self.body, "messages": messages, **({"tools": list(tools)} if tools else {})}
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(is_transient), stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(multiplier=0.5, jitter=0.5, max=30.0), reraise=True,
            before_sleep=self._count_retry,
        ):
            with attempt:
                response = await self.http.post(self.url, json=body)
                response.raise_for_status()
        try:
            answer = response.json()
            choice = answer["choices"][0]
            content = choice["message"].get("content") or ""
            reasoning = choice["message"].get("reasoning_content") or None
            tool_calls = choice["message"].get("tool_calls") or None
            tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise RowFailed(f"malformed answer from {self.url}: {describe(err)}") from None
        if not content.strip() and not tool_calls:
            raise RowFailed("the server answered with an empty message")
        return Reply(content, reasoning if self.keep_reasoning else None, tokens, choice.get("finish_reason") or "",
                     tool_calls)

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

    def next_request(self) -> list[dict] | None:
        if self.cut_short or self.failed:
            return None
        while self.index < len(self.turns) and self.turns[self.index]["role"] != "assistant":
            self.history.append(dict(self.turns[self.index]))
            self.index += 1
        return list(self.history) if self.index < len(self.turns) else None

    def answer(self, reply: Reply) -> None:
        if not reply.content.strip() and not reply.tool_calls:
            self.failed = "the target answered with an empty message"
            return
        original = self.turns[self.index]
        message = {"role": "assistant", "content": reply.content,
                   **({"reasoning_content": reply.reasoning} if reply.reasoning else {})}
        old_calls, new_calls = original.get("tool_calls") or [], reply.tool_calls or []
        if [c["function"]["name"] for c in old_calls] != [c["function"]["name"] for c in new_calls]:
            self.cut_short = bool(old_calls)  # what follows answered calls this turn no longer makes
        elif new_calls:  # the same tools: keep the original ids, which the tool results refer to
            new_calls = [{**new, **({"id": old["id"]} if "id" in old else {})}
                         for old, new in zip(old_calls, new_calls)]
        if new_calls:
            message["tool_calls"] = new_calls
        self.history.append(message)
        self.index += 1
        self.tokens += reply.completion_tokens
        self.truncated |= reply.finish_reason == "length"

    def result(self) -> dict:
        return {"messages": self.history, **({"tools": list(self.conversation.tools)} if self.conversation.tools
                                              else {}),
                "completion_tokens": self.tokens, "truncated": self.truncated, "cut_at_tool_call": self.cut_short}


async def regenerate(client: ChatClient, conversation: Conversation) -> dict:
    """Every assistant turn again, in order, each after the regenerated ones (see Regeneration)."""
    walk = Regeneration(conversation)
    while (history := walk.next_request()) is not None:
        walk.answer(await client.reply(history, conversation.tools))
    return walk.result()


class HfChat:
    """generate.backend "hf": the target in transformers on this process's device, batched, left-padded."""

    def __init__(self, cfg):
        import torch
        from transformers import AutoModelForCausalLM

        from eagle3.capture.hf import pick_device
        from eagle3.data import SampleTokenizer

        self.torch, self.gen = torch, cfg.generate
        self.device = pick_device(cfg.extract.device)
        self.tokenizing = SampleTokenizer.for_run(cfg)
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.target.model_path, dtype=getattr(torch, cfg.target.dtype),
            trust_remote_code=cfg.target.trust_remote_code,
        ).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id or self.model.config.eos_token_id
        self.eos = eos if isinstance(eos, list) else [eos]
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else self.eos[0]
        log.info("generate: %s in transformers on %s, %d conversations at a time", cfg.target.model_path,
                 self.device, self.gen.concurrency)

    def replies(self, requests: list[tuple[list[dict], tuple | None]]) -> list[Reply]:
        """One reply per (history, tools), generated together."""
        torch = self.torch
        prompts = [self.tokenizing.prompt_ids(history, tools) for history, tools in requests]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.as_tensor(prompt)
            attention[row, width - len(prompt):] = 1
        sampling = ({"do_sample": True, "temperature": self.gen.temperature, "top_p": self.gen.top_p}
                    if self.gen.temperature > 0 else {"do_sample": False})
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                                      max_new_tokens=self.gen.max_tokens, eos_token_id=self.eos,
                                      pad_token_id=self.pad_id, **sampling)
        replies = []
        for new in out[:, width:].tolist():
            stop = next((i for i, token in enumerate(new) if token in self.eos), None)
            new = new[: stop + 1] if stop is not None else new
            text = self.tokenizing.tokenizer.decode(new, skip_special_tokens=True)
            replies.append(Reply(text, None, len(new), "stop" if stop is not None else "length"))
        return replies


def regenerate_with_hf(cfg, todo: list[Conversation], writer: PartWriter, progress: ProgressLog) -> dict:
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
                    writer.add({**row, "status": "failed", "error": walk.failed})
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
    """Finished rows, in batches, each batch one new part file written atomically."""

    def __init__(self, parts_dir: Path, interval_s: float):
        self.dir, self.interval_s = parts_dir, interval_s
        self.dir.mkdir(parents=True, exist_ok=True)
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


async def regenerate_all(cfg, base_url: str, todo: list[Conversation], writer: PartWriter,
                         progress: ProgressLog) -> dict:
    """Run the conversations through `concurrency` workers, counting into `progress` (done_here: regenerated,
    failed, tokens). Returns {"retries": retried requests, "truncated": answers cut at max_tokens}."""
    gen = cfg.generate
    client = ChatClient(cfg, base_url)
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
            except (httpx.HTTPError, RowFailed) as err:
                writer.add({**row, "status": "failed", "error": describe(err)})
                progress.update(0, 0, failed=1)
                tried = progress.done_here + progress.failed
                if tried >= min(MIN_TRIED_BEFORE_ABORT, len(todo)) and progress.failed > gen.max_failure_rate * tried:
                    abort.append(f"{progress.failed} of the {tried} conversations tried failed "
                                 f"(generate.max_failure_rate {gen.max_failure_rate:.0%}); last error: {describe(err)}")
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
            f"generate stopped early: {abort[0]}. Is the server at {base_url} up and serving "
            f"{cfg.generate.model or cfg.target.model_path}? Rows done so far are kept; run the stage again to go on."
        )
    return {"retries": client.retries, "truncated": truncated}


def check_endpoint(base_url: str) -> None:
    """Fail in seconds, not after a dataset's worth of retries, when nothing listens at the endpoint."""
    try:
        httpx.get(base_url.rstrip("/") + "/models", timeout=10.0)
    except httpx.TransportError as err:
        raise GenerateAborted(
            f"generate.endpoint: cannot reach {base_url} ({describe(err)}); start the target's server there, or "
            "set generate.launch_server to have the stage start it"
        ) from None


def run_generate(cfg) -> dict:
    from eagle3.server import sglang_server

    gen = cfg.generate
    started = time.monotonic()
    out = cfg.run_dir / "generate"
    limit = gen.num_samples or cfg.data.max_samples
    conversations, read_stats = read_conversations(cfg.data.path, cfg.data.on_bad_record, limit)
    writer = PartWriter(out / "parts", gen.progress_interval_s)  # a kill -9 loses one interval's rows at most
    rows = read_rows(writer.dir)
    todo = [c for c in conversations if rows.get(c.sample_id, {}).get("status") != "ok"]
    progress = ProgressLog("generate", len(conversations), len(conversations) - len(todo), gen.progress_interval_s,
                           log, unit="conversations", track_bytes=False, track_failures=True)
    log.info("generate: %d conversations, %d already regenerated, %d to go", progress.total, progress.done,
             len(todo))
    outcome = {"retries": 0, "truncated": 0}
    if todo:
        random.Random(cfg.seed).shuffle(todo)  # long and short conversations mixed: a steadier ETA
        if gen.backend == "hf":
            outcome = regenerate_with_hf(cfg, todo, writer, progress)
        elif gen.launch_server:
            with sglang_server(cfg, out / "server.log") as server_url:
                outcome = asyncio.run(regenerate_all(cfg, server_url + "/v1", todo, writer, progress))
        else:
            check_endpoint(gen.endpoint)
            outcome = asyncio.run(regenerate_all(cfg, gen.endpoint, todo, writer, progress))
        progress.emit()

    rows = read_rows(writer.dir)
    ok_rows = [rows[c.sample_id] for c in conversations if rows.get(c.sample_id, {}).get("status") == "ok"]
    failed = {c.line_no: rows[c.sample_id]["error"] for c in conversations
              if rows.get(c.sample_id, {}).get("status") == "failed"}
    records = [{"messages": r["messages"], **({"tools": r["tools"]} if r.get("tools") else {})} for r in ok_rows]
    atomic_write_text(out / "conversations.jsonl",
                      "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    elapsed = time.monotonic() - started
    stats = {
        "conversations": len(conversations),
        "regenerated": len(ok_rows),
        "regenerated_now": progress.done_here,
        "already_done": len(conversations) - len(todo),
        "failed": len(failed),
        "failed_lines": dict(list(failed.items())[:50]),
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
        log.warning("generate: %d conversation(s) failed and are left out of the data (first: line %d: %s); "
                    "run the stage again to retry them", len(failed), *next(iter(failed.items())))
    return stats
