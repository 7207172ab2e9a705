"""The extract stage end to end on the tiny target: stats, resume, sharding, bad records. Its fault drills (kill -9
in a DAG run, a full disk) are in tests/faults/."""

from __future__ import annotations

import json
import logging
import re

import pytest

from eagle3.config import write_run_config
from eagle3.data import TokenizedSample
from eagle3.extract import plan_batches, run_extract
from eagle3.runlayout import run_stats_path
from eagle3.store import HiddenStateStore, verify
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


def test_extract_stores_every_sample_and_a_rerun_computes_nothing(make_config, caplog):
    caplog.set_level(logging.INFO, logger="eagle3")
    cfg = make_config()
    first = run_extract(cfg)
    progress = [r.getMessage() for r in caplog.records if "samples (" in r.getMessage()]
    assert progress and re.fullmatch(
        r"extract shard 0: \d+/\d+ samples \([\d.]+%\), \d+ tokens/s, [\d.]+ GiB written, "
        r"elapsed \d+m\d\ds, ETA (\d+m\d\ds|\?)", progress[-1]
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


def test_shards_partition_the_samples(make_config):
    whole = make_config(run_name="whole")
    run_extract(whole)
    split = make_config(run_name="split", extract={"num_shards": 3})
    counts = [run_extract(split, shard=i)["samples_stored"] for i in range(3)]
    assert all(counts) and sum(counts) == len(HiddenStateStore(whole.store_dir))
    assert sorted(HiddenStateStore(split.store_dir).sample_ids) == sorted(HiddenStateStore(whole.store_dir).sample_ids)
    with pytest.raises(ValueError, match="--shard 3 is out of range for 3 shard"):
        run_extract(split, shard=3)


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


def test_bad_records_stop_extract_with_line_numbers(make_config, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    "not json\n")
    cfg = make_config(data={"path": str(data), "max_samples": None})
    write_run_config(cfg)
    proc = run_eagle3("extract", "--config", str(cfg.config_path), check=False)
    assert proc.returncode == 2
    assert f"error: {data}: 1 bad record(s):\n  line 2: invalid JSON" in proc.stderr

    skipping = make_config(run_name="skip", data={"path": str(data), "max_samples": None, "on_bad_record": "skip"})
    stats = run_extract(skipping)
    assert stats["bad_records"] == 1 and stats["bad_record_lines"] == [2] and stats["samples_stored"] == 1


def test_the_background_writer_leaves_the_forward_pass_all_its_threads():
    """torch.set_num_threads is process-wide: a writer thread that set it to 1 made a model that starts
    later (the sglang backend's) compute single-threaded. Checked in a fresh interpreter, as a stage runs."""
    import os
    import subprocess
    import sys

    def threads_seen_by_main(start_writer: bool) -> str:
        script = (
            "import torch\n"
            "from eagle3.extract import BackgroundWriter\n"
            "class Writer:\n"
            "    def flush(self): pass\n"
            f"if {start_writer}:\n"
            "    BackgroundWriter(Writer(), depth=1).close()\n"
            "print(torch.get_num_threads())\n"  # the main thread's first parallel setting: after the writer's
        )
        # Two threads asked for whatever the suite's setting (tests/conftest.py): with one, a writer that set it
        # to one would go unseen.
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              check=True, env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.strip()

    assert threads_seen_by_main(start_writer=True) == threads_seen_by_main(start_writer=False)


# Drops the reasoning of assistant turns before the last user turn, as Qwen3's and Kimi-K2.5's templates do.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user and m.get('reasoning_content') %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_multi_turn_thinking_conversations_are_trained_turn_by_turn_not_skipped(make_config, tiny_target, tmp_path):
    """A template that drops earlier reasoning: each earlier turn becomes a sample of its own, rendered as the
    target served it (with its reasoning), in the same shard and on the same side of the train/val split."""
    from eagle3.data import conversation_id_of
    from eagle3.split import run_split

    thinking = tmp_path / "thinking-target"
    thinking.mkdir()
    for path in tiny_target.iterdir():
        (thinking / path.name).symlink_to(path)
    (thinking / "chat_template.jinja").unlink()
    (thinking / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    turns = [{"role": "user", "content": "What is 2 + 3?"},
             {"role": "assistant", "content": "5.", "reasoning_content": "Two plus three."},
             {"role": "user", "content": "And 4 + 4?"},
             {"role": "assistant", "content": "8.", "reasoning_content": "Four plus four."}]
    data = tmp_path / "thinking.jsonl"
    data.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": turns[:2]}) + "\n")
    cfg = make_config(target={"model_path": str(thinking)}, data={"path": str(data), "max_samples": None})
    stats = run_extract(cfg)

    assert (stats["conversations_in_shard"], stats["samples_stored"], stats["turn_samples"], stats["skipped"]) \
        == (2, 3, 1, 0)
    store = HiddenStateStore(cfg.store_dir)
    conversation_ids = {conversation_id_of(s) for s in store.sample_ids}
    assert len(conversation_ids) == 2 and any("." in s for s in store.sample_ids)
    per_turn = [s for s in store.sample_ids if "." in s]
    siblings = [s for s in store.sample_ids if conversation_id_of(s) == conversation_id_of(per_turn[0])]
    assert len(siblings) == 2 and len({run_split(cfg).part(s) for s in siblings}) == 1
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking)
    trained = sorted(tokenizer.decode([t for t, m in zip(store[s]["input_ids"].tolist(), store[s]["loss_mask"])
                                       if m]) for s in store.sample_ids)
    # Each answer once per conversation, with its own reasoning, as the target generated it.
    first, second = "<think>Two plus three.</think>5.<|im_end|>", "<think>Four plus four.</think>8.<|im_end|>"
    assert trained == sorted([first, first, second])
