"""Public benchmark sets, measured the way the published Kimi drafters report them (evaluate.benchmarks).

The published EAGLE-3 drafters for Kimi report acceptance length on public sets at 3 steps / topk 1 / 4 draft
tokens (TorchSpec's Kimi-K2.5 drafter, AQ-MedAI's Kimi-K2 one); evaluate measures this run's drafter on the same
sets, at that configuration and at 7 / 1 / 8 (PUBLISHED_CONFIGURATIONS), beside the held-out figure. A chain of
topk 1 with k steps verifies k + 1 tokens, so these are evaluate's draft lengths k = 3 and k = 7.

  name       from the hub: dataset (config), split; its records          one record becomes
  mtbench    HuggingFaceH4/mt_bench_prompts, train;                     its first turn, then its second after the
             {"prompt": [turn 1, turn 2]} (FastChat's file: "turns")    target's own greedy answer to the first
  gsm8k      openai/gsm8k (main), test; {"question"}                    the question as the user's message, zero-shot
  humaneval  openai/openai_humaneval, test; {"prompt"}                  the function stub as the user's message
  bfcl       gorilla-llm/Berkeley-Function-Calling-Leaderboard, its     the first turn's messages, the functions
             file BFCL_v3_simple.json (JSON lines); {"question":        offered as tools (OpenAI's form; BFCL's type
             [[messages of turn 1], ...], "function": [...]}            names made JSON Schema's: dict -> object)

The first records of each set in the set's order, up to evaluate.benchmark_prompts (each set's default otherwise:
SpecForge's bench sizes). Prompts are rendered as the held-out ones are
(eagle3.data.samples.SampleTokenizer.prompt_ids):
the target's chat template with data.chat_template_kwargs, the generation prompt added, so a thinking target
thinks where it is served thinking. No system prompt is added (a template's own default applies).

Sources: the hub, read on the box (it has internet) with `datasets.load_dataset` (BFCL's records differ in their
functions' schemas: datasets 5.2 keeps each as written, as a Json feature). Or a local file,
evaluate.benchmark_files.<name> (offline boxes, tests): the set's own records as a JSON array, JSON lines or parquet,
which the datasets library reads alike. Nothing is written; a bad record stops the stage naming the file, the
record, the field and the fix (exit 2).

An MT-Bench answer goes back into the conversation as a server's reasoning parser would hand it to a client: the
text after the last `</think>` as content, what came before it as reasoning_content (templates that drop earlier
turns' reasoning then drop it).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.config import ConfigError, RunConfig
from eagle3.data.samples import DataError
from eagle3.disk.fsutil import UnsafeFile, read_small_file

log = logging.getLogger(__name__)

# (num_steps, eagle_topk, num_draft_tokens) of SGLang's EAGLE-3 flags; a chain: draft length k = num_steps.
PUBLISHED_CONFIGURATIONS = {3: (3, 1, 4), 7: (7, 1, 8)}
DATASETS_PIN = "datasets==5.2.0"  # requirements-box.txt
MAX_SET_FILE_BYTES = 1 << 30  # a local copy of a set is read whole; the largest here (GSM8K test) is ~1 MB


@dataclass(frozen=True)
class Chat:
    """One record as the target is asked it: the messages of each user turn, asked one after another (each after the
    target's own answer to the one before), and the tools offered."""

    turns: tuple[tuple[dict, ...], ...]
    tools: tuple[dict, ...] | None = None


class RecordError(ValueError):
    """A record that is not in its set's format; the message names the field."""


def text_field(record: dict, name: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f'"{name}" is {"missing" if value is None else "not a non-empty string"}')
    return value


def single_question(field_name: str) -> Callable[[dict], Chat]:
    def to_chat(record: dict) -> Chat:
        message = {"role": "user", "content": text_field(record, field_name)}
        return Chat(((message,),))

    return to_chat


def mtbench_chat(record: dict) -> Chat:
    name = "prompt" if "prompt" in record else "turns"  # the hub's field, or FastChat's question.jsonl
    turns = record.get(name)
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise RecordError('"prompt" (or "turns") is missing or not a list of non-empty strings')
    return Chat(tuple(({"role": "user", "content": turn},) for turn in turns))


# BFCL names some parameter types by Python's or Java's names; a tool's parameters are JSON Schema for the template.
BFCL_TYPES = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "list": "array",
    "any": "string",
    "bool": "boolean",
    "double": "number",
    "long": "integer",
    "short": "integer",
    "byte": "integer",
    "char": "string",
    "String": "string",
    "Any": "string",
    "HashMap": "object",
    "ArrayList": "array",
}


def json_schema(node):
    if isinstance(node, dict):
        return {
            key: BFCL_TYPES.get(value, value) if key == "type" and isinstance(value, str) else json_schema(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [json_schema(item) for item in node]
    return node


def bfcl_chat(record: dict) -> Chat:
    question, functions = record.get("question"), record.get("function")
    first = question[0] if isinstance(question, list) and question else None
    if (
        not isinstance(first, list)
        or not first
        or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user") and isinstance(m.get("content"), str)
            for m in first
        )
    ):
        raise RecordError(
            '"question" is missing or its first turn is not a list of {"role": "system" | "user", '
            '"content": str} messages'
        )
    if (
        not isinstance(functions, list)
        or not functions
        or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("parameters"), dict)
            for f in functions
        )
    ):
        raise RecordError(
            '"function" is missing or not a list of {"name": str, "description": str, "parameters": {...}} definitions'
        )
    tools = tuple(
        {
            "type": "function",
            "function": {
                "name": f["name"],
                "description": f.get("description") or "",
                "parameters": json_schema(f["parameters"]),
            },
        }
        for f in functions
    )
    return Chat((tuple({"role": m["role"], "content": m["content"]} for m in first),), tools)


@dataclass(frozen=True)
class PublicSet:
    name: str  # as evaluate.benchmarks names it
    title: str
    dataset: str  # the hub's id
    config: str | None
    split: str
    data_file: str | None  # the one file of the dataset repo that is the set (BFCL's repo holds many)
    record_format: str  # for error messages
    default_records: int  # SpecForge's bench size (bench_eagle3.py: mtbench:80, gsm8k:200, humaneval:200)
    to_chat: Callable[[dict], Chat]
    # Acceptance length published at 3 steps / topk 1 / 4 draft tokens, by drafter (docs/results.md cites them).
    published_k3: dict[str, float] = field(default_factory=dict)

    @property
    def hub_source(self) -> str:
        if self.data_file:
            return f"{self.dataset}, file {self.data_file}"
        return f"{self.dataset}{f' ({self.config})' if self.config else ''}, split {self.split}"


TORCHSPEC, AQ_MEDAI = "TorchSpec Kimi-K2.5 EAGLE-3", "AQ-MedAI Kimi-K2 EAGLE-3"
SETS = {
    s.name: s
    for s in (
        PublicSet(
            "mtbench",
            "MT-Bench",
            "HuggingFaceH4/mt_bench_prompts",
            None,
            "train",
            None,
            '{"prompt": ["<turn 1>", "<turn 2>"], ...}',
            80,
            mtbench_chat,
            {TORCHSPEC: 2.69, AQ_MEDAI: 2.39},
        ),
        PublicSet(
            "gsm8k",
            "GSM8K",
            "openai/gsm8k",
            "main",
            "test",
            None,
            '{"question": "<the problem>", ...}',
            200,
            single_question("question"),
            {TORCHSPEC: 3.20, AQ_MEDAI: 3.27},
        ),
        PublicSet(
            "humaneval",
            "HumanEval",
            "openai/openai_humaneval",
            None,
            "test",
            None,
            '{"prompt": "<the function stub>", ...}',
            200,
            single_question("prompt"),
            {TORCHSPEC: 3.29, AQ_MEDAI: 3.36},
        ),
        PublicSet(
            "bfcl",
            "BFCL (simple)",
            "gorilla-llm/Berkeley-Function-Calling-Leaderboard",
            None,
            "train",
            "BFCL_v3_simple.json",
            '{"question": [[{"role": "user", "content": "..."}]], "function": [{"name", "description", "parameters"}]}',
            200,
            bfcl_chat,
        ),
    )
}


# -- reading records -------------------------------------------------------------------------------------------


def read_local_records(path: Path) -> list[tuple[str, dict]]:
    """(where in the file, record) for each record of a JSON array, JSON lines or parquet file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet
        except ImportError:
            raise ConfigError(
                path,
                f"reading parquet needs pyarrow (installed with {DATASETS_PIN}, requirements-box.txt)",
                "install it, or give the file as JSON lines",
            ) from None
        return [(f"row {i + 1}", row) for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist())]
    try:  # a regular file only, as every file a config names (a FIFO would hang the stage)
        text = read_small_file(path, MAX_SET_FILE_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnsafeFile as err:
        raise DataError(f"{err}; point evaluate.benchmark_files at the set's records, a regular file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot be read as UTF-8 text ({err})") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # JSON lines (BFCL's .json files are too)
    if isinstance(whole, list):
        return [(f"record {i + 1}", record) for i, record in enumerate(whole)]
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}, line {number}: not JSON ({err.msg}); the file must hold the set's records as a "
                "JSON array, one JSON object a line, or parquet"
            ) from None
    return records


class PublicSetUnavailable(RuntimeError):
    """The hub could not be read (no network, a renamed file): a retry, or a local copy, may do."""


def hub_records(spec: PublicSet, count: int) -> list[tuple[str, dict]]:
    """The set's first `count` records from the Hugging Face hub, through the datasets library."""
    fix = (
        f"set evaluate.benchmark_files.{spec.name} to a local copy of {spec.hub_source} (the box reads it from "
        "there, offline)"
    )
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "evaluate.benchmarks",
            f"{spec.name} is loaded with the `datasets` library, which {sys.executable} lacks",
            f"install {DATASETS_PIN} (requirements-box.txt), or {fix}",
        ) from None
    try:
        rows = datasets.load_dataset(spec.dataset, spec.config, data_files=spec.data_file, split=spec.split)
        return [(f"row {i + 1}", dict(rows[i])) for i in range(min(count, len(rows)))]
    except Exception as err:  # noqa: BLE001 - the hub's and the library's errors are many; each means the same here
        what = " ".join(str(err).split())[:300].rstrip(".")
        raise PublicSetUnavailable(
            f"evaluate.benchmarks: {spec.name} could not be loaded from the hub "
            f"({spec.hub_source}): {type(err).__name__}: {what}. Stages reach huggingface.co "
            f"with the HF_* settings of their environment; or {fix}"
        ) from err


@dataclass
class LoadedSet:
    """A public set's chats, and the prompts measured on it: every turn's, in the order they were asked."""

    spec: PublicSet
    source: str
    chats: list[Chat]
    first_prompts: list[list[int]]  # of each chat's first turn, rendered when loaded (a bad template fails early)
    prompts: list[list[int]] = field(default_factory=list)
    baseline: list[list[int]] = field(default_factory=list)  # the target's greedy answer to each prompt


def load_set(spec: PublicSet, local: str | None, count: int, tokenizing) -> LoadedSet:
    """The set's first `count` records as chats, their first turns rendered (`tokenizing`: the run's
    eagle3.data.samples.SampleTokenizer)."""
    if local:
        path = Path(local)
        where = f"evaluate.benchmark_files.{spec.name}: {path}"
        records, source = read_local_records(path)[:count], f"file {path}"
        fix = f"fix the file, or remove {spec.name} from evaluate.benchmark_files to load {spec.hub_source}"
    else:
        where = f"{spec.hub_source} (evaluate.benchmarks: {spec.name})"
        records, source = hub_records(spec, count), spec.hub_source
        fix = f"set evaluate.benchmark_files.{spec.name} to a copy in that format"
    if not records:
        raise DataError(f"{where}: holds no records; a {spec.title} record is {spec.record_format}; {fix}")
    chats = []
    for at, record in records:
        try:
            if not isinstance(record, dict):
                raise RecordError("not a JSON object")
            chats.append(spec.to_chat(record))
        except RecordError as err:
            raise DataError(f"{where}, {at}: {err}; a {spec.title} record is {spec.record_format}; {fix}") from None
    first = [tokenizing.prompt_ids(list(chat.turns[0]), chat.tools) for chat in chats]
    log.info(
        "evaluate: %s: %d records (%d prompts) from %s",
        spec.title,
        len(chats),
        sum(len(chat.turns) for chat in chats),
        source,
    )
    return LoadedSet(spec, source, chats, first)


def load_public_sets(cfg: RunConfig, tokenizing) -> list[LoadedSet]:
    """evaluate.benchmarks, loaded and their first turns rendered: before anything is measured, so that a missing
    file or a bad record stops the stage in seconds."""
    ev = cfg.evaluate
    return [
        load_set(
            SETS[name], ev.benchmark_files.get(name), ev.benchmark_prompts or SETS[name].default_records, tokenizing
        )
        for name in ev.benchmarks
    ]


# -- asking the chats, turn by turn ----------------------------------------------------------------------------


def answer_message(tokenizer, answer: list[int], end_ids: set[int]) -> dict:
    """The target's answer as the next request carries it: what a reasoning parser leaves as content (after the last
    </think>; all of it is reasoning when the answer opened <think> and was cut before closing it)."""
    while answer and answer[-1] in end_ids:
        answer = answer[:-1]
    text = tokenizer.decode(answer, skip_special_tokens=False)
    reasoning, closed, content = text.rpartition("</think>")
    if not closed and text.lstrip().startswith("<think>"):
        reasoning, content = text, ""
    reasoning = reasoning.strip().removeprefix("<think>").strip()
    return {"role": "assistant", "content": content.strip(), **({"reasoning_content": reasoning} if reasoning else {})}


def ask_turn_by_turn(
    loaded: LoadedSet, ask: Callable[[list[list[int]], int], list[list[int]]], tokenizing, end_ids: set[int]
) -> None:
    """Ask every chat's first turn, then each later turn with the target's own answers before it, until no chat has
    one left; `ask(prompts, turn)` answers greedily (turn: 1, 2, ...). Fills loaded.prompts and loaded.baseline,
    every turn's in order."""
    histories = [list(chat.turns[0]) for chat in loaded.chats]
    asking, prompts, turn = list(range(len(loaded.chats))), loaded.first_prompts, 0
    while asking:
        answers = ask(prompts, turn + 1)
        loaded.prompts += prompts
        loaded.baseline += answers
        turn, still = turn + 1, []
        for i, answer in zip(asking, answers):
            chat = loaded.chats[i]
            if turn < len(chat.turns):
                histories[i] += [answer_message(tokenizing.tokenizer, answer, end_ids), *chat.turns[turn]]
                still.append(i)
        asking = still
        prompts = [tokenizing.prompt_ids(histories[i], loaded.chats[i].tools) for i in asking]
