"""Regenerate the assistant turns of the data with the target itself, through an OpenAI-compatible server.

    python -m eagle3 generate --config RUN_DIR/config.json

EAGLE-3 drafters learn to predict the target's own next tokens, so training on the target's answers beats
training on someone else's. For each conversation of data.path (ShareGPT or OpenAI-messages JSONL), every
assistant turn is regenerated in order, each conditioned on the regenerated turns before it, with
POST {endpoint}/chat/completions (SGLang's OpenAI-compatible server; generate.launch_server starts one on the
box for the stage and stops it afterwards, see eagle3.server).

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


class ChatClient:
    """POST /chat/completions with retries. One reply: (content, reasoning_content or None, completion tokens)."""

    def __init__(self, cfg, base_url: str):
        gen = cfg.generate
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.body = {"model": gen.model or cfg.target.model_path, "temperature": gen.temperature, "top_p": gen.top_p,
                     "max_tokens": gen.max_tokens}
        self.keep_reasoning = gen.reasoning == "keep"
        self.attempts = gen.max_retries + 1
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(gen.request_timeout_s, connect=min(30.0, gen.request_timeout_s)),
            limits=httpx.Limits(max_connections=gen.concurrency, max_keepalive_connections=gen.concurrency),
        )
        self.retries = 0

    async def reply(self, messages: list[dict]) -> tuple[str, str | None, int, str]:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(is_transient), stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(multiplier=0.5, jitter=0.5, max=30.0), reraise=True,
            before_sleep=self._count_retry,
        ):
            with attempt:
                response = await self.http.post(self.url, json={**self.body, "messages": messages})
                response.raise_for_status()
        try:
            answer = response.json()
            choice = answer["choices"][0]
            content = choice["message"].get("content") or ""
            reasoning = choice["message"].get("reasoning_content") or None
            tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise RowFailed(f"malformed answer from {self.url}: {describe(err)}") from None
        if not content.strip():
            raise RowFailed("the server answered with an empty message")
        return content, reasoning if self.keep_reasoning else None, tokens, choice.get("finish_reason") or ""

    def _count_retry(self, retry_state) -> None:
        self.retries += 1

    async def close(self) -> None:
        await self.http.aclose()


async def regenerate(client: ChatClient, conversation: Conversation) -> dict:
    """Every assistant turn again, in order, each after the regenerated ones; trailing user turns are dropped."""
    history: list[dict] = []
    tokens, truncated = 0, False
    last_answer = max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
    for message in conversation.messages[: last_answer + 1]:
        if message["role"] != "assistant":
            history.append({"role": message["role"], "content": message["content"]})
            continue
        content, reasoning, n, finish_reason = await client.reply(history)
        history.append({"role": "assistant", "content": content,
                        **({"reasoning_content": reasoning} if reasoning else {})})
        tokens += n
        truncated |= finish_reason == "length"
    return {"messages": history, "completion_tokens": tokens, "truncated": truncated}


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
        if gen.launch_server:
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
    atomic_write_text(out / "conversations.jsonl",
                      "".join(json.dumps({"messages": r["messages"]}, ensure_ascii=False) + "\n" for r in ok_rows))
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
