"""The extract stage end to end on the tiny target: stats, resume, sharding, bad records. Its fault drills (kill -9
in a DAG run, a full disk) are in tests/faults/."""

from __future__ import annotations

import json
import logging
import re

import pytest

from eagle3.config import write_run_config
from eagle3.data.samples import TokenizedSample
from eagle3.data.store import HiddenStateStore, verify
from eagle3.disk.layout import run_stats_path
from eagle3.stages.extract import plan_batches, run_extract
from tests.conftest import run_eagle3


def sample(n: int, sid: str) -> TokenizedSample:
    return TokenizedSample(sid, [0] * n, [1] * n, False)


def test_plan_batches_respects_the_token_budget_and_keeps_every_sample():
    samples = [sample(n, f"{i:016x}") for i, n in enumerate([5, 50, 7, 30, 30, 200, 1, 12])]
    batches = list(plan_batches(samples, batch_tokens=64))
    assert sorted(s.sample_id for b in batches for s in b) == sorted(s.sample_id for s in samples)
    for batch in batches:
        longest = max(len(s.input_ids) for s in batch)
        assert len(batch) == 1 or len(batch) * longest <= 64
    assert [len(s.input_ids) for s in batches[0]] == [200]  # over budget: a batch of its own
    assert batches == list(plan_batches(samples, batch_tokens=64))  # deterministic


@pytest.mark.slow
def test_extract_stores_every_sample_and_a_rerun_computes_nothing(make_config, caplog):
    caplog.set_level(logging.INFO, logger="eagle3")
    cfg = make_config()
    first = run_extract(cfg)
    progress = [r.getMessage() for r in caplog.records if "samples (" in r.getMessage()]
    assert progress and re.fullmatch(
        r"extract shard 0: \d+/\d+ samples \([\d.]+%\), \d+ tokens/s, [\d.]+ GiB written, "
        r"elapsed \d+m\d\ds, ETA (\d+m\d\ds|\?)",
        progress[-1],
    ), progress[-1]
    assert first["samples_extracted"] == first["samples_in_shard"] == first["samples_stored"] > 150
    assert first["bad_records"] == 0 and first["rejected_nonfinite"] == 0
    stats = verify(cfg.store_dir)
    assert stats["samples"] == first["samples_stored"] and stats["tokens"] == first["tokens"]
    assert stats["aux_layers"] == [1, 3, 4] and stats["hidden_size"] == 256
    assert 0 < stats["loss_tokens"] < stats["tokens"]

    again = run_extract(cfg)
    assert again["samples_extracted"] == 0 and again["samples_stored_before"] == first["samples_stored"]
    assert json.loads(run_stats_path(cfg.run_dir, 0).read_text()) == again


@pytest.mark.slow
def test_shards_partition_the_samples(make_config):
    whole = make_config(run_name="whole")
    run_extract(whole)
    split = make_config(run_name="split", extract={"num_shards": 3})
    counts = [run_extract(split, shard=i)["samples_stored"] for i in range(3)]
    assert all(counts) and sum(counts) == len(HiddenStateStore(whole.store_dir))
    assert sorted(HiddenStateStore(split.store_dir).sample_ids) == sorted(HiddenStateStore(whole.store_dir).sample_ids)
    with pytest.raises(ValueError, match="--shard 3 is out of range for 3 shard"):
        run_extract(split, shard=3)


@pytest.mark.slow
def test_extract_by_hand_without_shard_does_every_shard_and_says_so(make_config):
    """`python -m eagle3 extract --config F` on a sharded config used to extract shard 0 only, silently."""
    whole = make_config(run_name="whole", data={"max_samples": 40})
    run_extract(whole)
    cfg = make_config(run_name="by-hand", data={"max_samples": 40}, extract={"num_shards": 3})
    write_run_config(cfg)
    proc = run_eagle3("extract", "--config", str(cfg.config_path))
    assert [stats["shard"] for stats in json.loads(proc.stdout)] == [0, 1, 2]
    assert "shard 2 of 3 (no --shard given: extracting every shard in turn)" in proc.stderr
    assert sorted(HiddenStateStore(cfg.store_dir).sample_ids) == sorted(HiddenStateStore(whole.store_dir).sample_ids)


@pytest.mark.slow
def test_bad_records_stop_extract_with_line_numbers(make_config, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\nnot json\n'
    )
    cfg = make_config(data={"path": str(data), "max_samples": None})
    write_run_config(cfg)
    proc = run_eagle3("extract", "--config", str(cfg.config_path), check=False)
    assert proc.returncode == 2
    assert f"error: {data}: 1 bad record(s):\n  line 2: invalid JSON" in proc.stderr

    skipping = make_config(run_name="skip", data={"path": str(data), "max_samples": None, "on_bad_record": "skip"})
    stats = run_extract(skipping)
    assert stats["bad_records"] == 1 and stats["bad_record_lines"] == [2] and stats["samples_stored"] == 1


@pytest.mark.slow
def test_the_background_writer_leaves_the_forward_pass_all_its_threads():
    """torch.set_num_threads is process-wide: a writer thread that set it to 1 made a model that starts
    later (the sglang backend's) compute single-threaded. Checked in a fresh interpreter, as a stage runs."""
    import os
    import subprocess
    import sys

    def threads_seen_by_main(start_writer: bool) -> str:
        script = (
            "import torch\n"
            "from eagle3.stages.extract import BackgroundWriter\n"
            "class Writer:\n"
            "    def flush(self): pass\n"
            f"if {start_writer}:\n"
            "    BackgroundWriter(Writer(), depth=1).close()\n"
            "print(torch.get_num_threads())\n"  # the main thread's first parallel setting: after the writer's
        )
        # Two threads asked for whatever the suite's setting (tests/conftest.py): with one, a writer that set it
        # to one would go unseen.
        return subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "2"},
        ).stdout.strip()

    assert threads_seen_by_main(start_writer=True) == threads_seen_by_main(start_writer=False)


# Drops the reasoning of assistant turns before the last user turn, as Qwen3's and Kimi-K2.5's templates do.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user and m.get('reasoning_content') %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def target_with_template(tiny_target, directory, template: str):
    """The tiny target with another chat template (its other files linked)."""
    directory.mkdir()
    for path in tiny_target.iterdir():
        if path.name != "chat_template.jinja":
            (directory / path.name).symlink_to(path)
    (directory / "chat_template.jinja").write_text(template)
    return directory


@pytest.mark.slow
def test_multi_turn_thinking_conversations_are_trained_turn_by_turn_not_skipped(make_config, tiny_target, tmp_path):
    """A template that drops earlier reasoning: each earlier turn becomes a sample of its own, rendered as the
    target served it (with its reasoning), in the same shard and on the same side of the train/val split."""
    from eagle3.data.samples import conversation_id_of
    from eagle3.stages.split import run_split

    thinking = target_with_template(tiny_target, tmp_path / "thinking-target", THINKING_TEMPLATE)
    turns = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5.", "reasoning_content": "Two plus three."},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8.", "reasoning_content": "Four plus four."},
    ]
    data = tmp_path / "thinking.jsonl"
    data.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": turns[:2]}) + "\n")
    cfg = make_config(target={"model_path": str(thinking)}, data={"path": str(data), "max_samples": None})
    stats = run_extract(cfg)

    assert (stats["conversations_in_shard"], stats["samples_stored"], stats["turn_samples"], stats["skipped"]) == (
        2,
        3,
        1,
        0,
    )
    store = HiddenStateStore(cfg.store_dir)
    conversation_ids = {conversation_id_of(s) for s in store.sample_ids}
    assert len(conversation_ids) == 2 and any("." in s for s in store.sample_ids)
    per_turn = [s for s in store.sample_ids if "." in s]
    siblings = [s for s in store.sample_ids if conversation_id_of(s) == conversation_id_of(per_turn[0])]
    assert len(siblings) == 2 and len({run_split(cfg).part(s) for s in siblings}) == 1
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking)
    trained = sorted(
        tokenizer.decode([t for t, m in zip(store[s]["input_ids"].tolist(), store[s]["loss_mask"]) if m])
        for s in store.sample_ids
    )
    # Each answer once per conversation, with its own reasoning, as the target generated it.
    first, second = "<think>Two plus three.</think>5.<|im_end|>", "<think>Four plus four.</think>8.<|im_end|>"
    assert trained == sorted([first, first, second])


# -- issue 37: train what the template serves, or stop ------------------------------------------------------------


def kimi_shaped_conversations(n: int) -> list[dict]:
    """`n` multi-turn thinking conversations with tool chains, as Kimi-K2.5's agent traffic looks, each its own."""
    from tests.test_data import KIMI_AGENT_CONVERSATION

    conversations = []
    for k in range(n):
        messages = json.loads(
            json.dumps(KIMI_AGENT_CONVERSATION).replace("Paris", f"City {k}").replace("18C", f"{10 + k}C")
        )
        conversations.append(
            {
                "messages": messages,
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            }
        )
    return conversations


@pytest.mark.slow
def test_a_kimi_shaped_set_trains_every_turn_with_its_reasoning_by_default(make_config, tiny_target, tmp_path):
    """Issue 37's bar: multi-turn thinking with tool calls, Kimi-K2.5's blanking template (a look-alike), no
    data.generation_chat_template. Every assistant turn is stored, trained with its own reasoning and tool calls,
    after the prompt the template serves for it; none dropped; the figures are in the extract stats."""
    from transformers import AutoTokenizer

    from tests.test_data import KIMI_K25_LIKE

    target = target_with_template(tiny_target, tmp_path / "kimi-target", KIMI_K25_LIKE)
    records = kimi_shaped_conversations(12)
    data = tmp_path / "kimi.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = make_config(target={"model_path": str(target)}, data={"path": str(data), "max_samples": None})
    stats = run_extract(cfg)

    tokenizer = AutoTokenizer.from_pretrained(target)
    reasoning = [m["reasoning_content"] for r in records for m in r["messages"] if m.get("reasoning_content")]
    reasoning_tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in reasoning)
    assert (stats["assistant_turns"], stats["turns_trained"], stats["turns_dropped"], stats["skipped"]) == (
        60,
        60,
        {},
        0,
    )
    assert stats["reasoning_tokens_trained"] == reasoning_tokens > 0
    assert stats["untrained_fraction"] == {"turns": 0.0, "tokens": 0.0} and stats["samples_stored"] == 60
    store = HiddenStateStore(cfg.store_dir)
    trained = [
        tokenizer.decode([t for t, m in zip(store[s]["input_ids"].tolist(), store[s]["loss_mask"]) if m])
        for s in store.sample_ids
    ]
    assert all(text.startswith("<think>") and "</think>" in text and text.endswith("<|im_end|>") for text in trained)
    assert sorted(text[len("<think>") : text.index("</think>")] for text in trained) == sorted(reasoning)
    assert json.loads(run_stats_path(cfg.run_dir, 0).read_text())["turns_trained"] == 60


# The tiny target's ChatML with assistant turns rendered under another role name: the generation prompt
# (<|im_start|>assistant) cannot be laid over any turn.
UNPLACEABLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ 'bot' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.slow
def test_a_template_that_cannot_be_placed_is_refused_not_trained_on_nothing(make_config, tiny_target, tmp_path):
    """Issue 37: with templates whose turns could not be placed, extract stored 0 of 14 conversations, printed no
    warning and exited 0: a whole run could train on nothing. Now the stage refuses (exit 2), naming the counts,
    the template file, data.max_untrained_fraction and the fix, and marks the shard unfinished."""
    from eagle3.disk.layout import run_samples_path

    target = target_with_template(tiny_target, tmp_path / "renaming-target", UNPLACEABLE_TEMPLATE)
    cfg = make_config(target={"model_path": str(target)}, data={"max_samples": 14})
    write_run_config(cfg)
    proc = run_eagle3("extract", "--config", str(cfg.config_path), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr[proc.stderr.index("error: ") :]
    # Refused at the first turn lost: already more than 1% of the 14 conversations' turns.
    assert re.search(
        r"error: extract shard 0/1: 1 of the (\d+) assistant turns \([\d.]+%\) already cannot be "
        r"trained as the target generated them, more than data\.max_untrained_fraction \(0\.01\) "
        r"allows \(not_placed: 1 turns / \d+ tokens; first: line 1: turn 1 \(assistant\): the chat "
        r"template renders this turn with another opening than the generation prompt",
        error,
    ), error
    assert f"The chat template is {target / 'chat_template.jinja'}, the chat template of target.model_path." in error
    assert "Fix: set data.generation_chat_template to a template that renders every assistant turn" in error
    assert not run_samples_path(cfg.run_dir, 0).exists()  # the shard is not done: nothing reads it as a run's


def test_the_refusal_comes_before_the_target_is_loaded(make_config, tiny_target, tmp_path, monkeypatch):
    """Decided on turns while tokenising, as soon as the drop count passes the fraction of the shard's turns: a
    refused run costs no model load and no capture."""
    import eagle3.capture
    from eagle3.data.samples import DataError

    def no_backend(*args, **kwargs):
        raise AssertionError("the target was loaded for a run that is refused")

    monkeypatch.setattr(eagle3.capture, "open_backend", no_backend)
    target = target_with_template(tiny_target, tmp_path / "renaming-target", UNPLACEABLE_TEMPLATE)
    cfg = make_config(target={"model_path": str(target)}, data={"max_samples": 40})
    with pytest.raises(DataError, match=r"^extract shard 0/1: 1 of the \d+ assistant turns .* already cannot be"):
        run_extract(cfg)


@pytest.mark.slow
def test_turns_dropped_within_the_fraction_are_counted_and_the_rest_trained(make_config, tiny_target, tmp_path):
    """A turn the template cannot give its reasoning a place (the tiny target's template writes none): dropped and
    counted per reason, in the stats and the evaluate report's summary; the run goes on within the fraction."""
    from eagle3.stages.evaluate import extraction_summary

    data = tmp_path / "mixed.jsonl"
    plain = [
        json.dumps({"messages": [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}"}]})
        for k in range(9)
    ]
    thinking = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "5.", "reasoning_content": "Add."},
            ]
        }
    )
    data.write_text("\n".join([*plain, thinking]) + "\n")
    cfg = make_config(data={"path": str(data), "max_samples": None, "max_untrained_fraction": 0.25})
    stats = run_extract(cfg)
    assert (stats["assistant_turns"], stats["turns_trained"], stats["samples_stored"]) == (10, 9, 9)
    assert stats["turns_dropped"] == {"reasoning_not_rendered": 1} == {"reasoning_not_rendered": stats["skipped"]}
    assert stats["turn_tokens_dropped"]["reasoning_not_rendered"] > 0 and stats["untrained_fraction"]["turns"] == 0.1
    summary = extraction_summary(cfg)
    assert summary["turns"] == {"assistant": 10, "trained": 9, "derived": 0, "dropped": {"reasoning_not_rendered": 1}}
    assert summary["untrained_fraction"]["turns"] == 0.1 and summary["samples"] == 9

    from eagle3.data.samples import DataError

    with pytest.raises(DataError, match=r"1 of the 10 assistant turns \(10\.0%\) already"):  # the default refuses
        run_extract(make_config(run_name="strict", data={"path": str(data), "max_samples": None}))
