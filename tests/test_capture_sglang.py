"""The sglang capture backend: engine arguments, version gate, and the two-pass capture end to end.

SGLang cannot run on a CPU machine, so tests/fakes/sglang_engine.py stands in for sglang.Engine: it
computes the tiny target's real states the way sglang 0.5.23's source says the engine returns them (layer
ids read the DeepSeek way, nested lists in meta_info), refuses a second live engine (one copy of a
Kimi-size target fills the box) and can crash mid-pass. The real engine is checked against the hf backend
by bench/gpu_capture_check.py on a GPU box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from eagle3.capture import sglang_plugin
from eagle3.capture.sglang import SglangSetupError, check_version, engine_kwargs, sink_dir, states_from_output
from eagle3.capture.staging import staging_dir
from eagle3.config import write_run_config
from eagle3.data.store import digest, verify
from eagle3.disk.layout import run_stats_path
from eagle3.stages.extract import run_extract
from tests.conftest import REPO, run_eagle3
from tests.fakes.sglang_engine import EngineCrashed, FakeSglangEngine


@pytest.fixture
def fake_engine(monkeypatch):
    FakeSglangEngine.reset()
    monkeypatch.setenv("EAGLE3_SGLANG_ENGINE", "tests.fakes.sglang_engine:FakeSglangEngine")
    yield FakeSglangEngine
    assert FakeSglangEngine.live == 0, "an engine was left running"


def hf_digest(make_config, max_samples: int, **extract) -> str:
    cfg = make_config(run_name="reference-hf", data={"max_samples": max_samples}, extract=extract)
    run_extract(cfg)
    return digest(cfg.store_dir)


def test_engine_arguments_for_capture(make_config):
    cfg = make_config(
        extract={
            "backend": "sglang",
            "sglang": {
                "tp_size": 8,
                "mem_fraction_static": 0.8,
                "attention_backend": "triton",
                "extra_args": {"cuda_graph_max_bs_decode": 16},
            },
        }
    )
    aux = engine_kwargs(cfg, "DeepseekV3ForCausalLM", "aux")
    assert aux["enable_return_aux_hidden_states"] is True and aux["speculative_algorithm"] == "EAGLE3"
    # HF [1, 3, 4] are the inputs of layers 2, 4, 5: a DeepSeek model takes ids not starting at 1 as inputs
    assert aux["return_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert aux["tp_size"] == 8 and aux["attention_backend"] == "triton" and aux["cuda_graph_max_bs_decode"] == 16
    assert aux["disable_radix_cache"] is True and aux["chunked_prefill_size"] == -1
    assert aux["mem_fraction_static"] == pytest.approx(0.8)  # one engine at a time: all of it
    assert aux["base_gpu_id"] == 0  # the box's second shard starts at GPU tp_size:
    assert engine_kwargs(cfg, "DeepseekV3ForCausalLM", "aux", gpu_group=1)["base_gpu_id"] == 8
    last = engine_kwargs(cfg, "DeepseekV3ForCausalLM", "last")
    assert last["enable_return_hidden_states"] is True and "speculative_algorithm" not in last
    assert "disable_overlap_schedule" not in aux  # the list path keeps overlap scheduling
    plugin = engine_kwargs(cfg, "DeepseekV3ForCausalLM", "plugin")
    assert plugin == aux | {"disable_overlap_schedule": True}  # overlap's CPU copy leaves the final states out


def test_extra_args_cannot_undo_the_capture_or_spread_a_shard_over_more_gpus(make_config):
    from eagle3.config import InvalidConfig

    for extra, why in (
        ({"disable_radix_cache": False}, "are set by the capture backend"),
        ({"tp_size": 4}, "come from the run config"),
        ({"dp_size": 2}, "would spread a shard over more GPUs than its group"),
    ):
        with pytest.raises(InvalidConfig) as refused:
            make_config(extract={"backend": "sglang", "sglang": {"extra_args": extra}})
        assert refused.value.fields == ["extract.sglang.extra_args"] and why in refused.value.fact


def test_version_gate_names_the_versions_and_the_fix():
    check_version("0.5.23")
    with pytest.raises(SglangSetupError, match="sglang 0.4.9 is installed.*>=0.5.23,<0.6.*gpu_capture_check"):
        check_version("0.4.9")


def test_wrong_row_count_is_an_error_that_suggests_the_cause():
    output = {"meta_info": {"hidden_states": [[[0.0] * 8] * 3]}}
    assert states_from_output(output, 3, 8).shape == (3, 8)
    with pytest.raises(RuntimeError, match="radix cache or chunked prefill"):
        states_from_output(output, 5, 8)
    ragged = {"meta_info": {"hidden_states": [[[0.0] * 8, [0.0] * 7]]}}
    with pytest.raises(RuntimeError, match="2 ragged rows for a 2-token prompt"):
        states_from_output(ragged, 2, 8)


LISTS = {"backend": "sglang", "sglang": {"capture": "lists"}}


@pytest.mark.slow
def test_two_passes_one_engine_at_a_time_store_what_the_hf_backend_stores(make_config, fake_engine):
    cfg = make_config(data={"max_samples": 60}, extract={**LISTS, "batch_tokens": 256})
    staged_parts_seen_by_aux_pass = []
    fake_engine.on_generate = lambda mode: (
        mode == "aux" and staged_parts_seen_by_aux_pass.append(len(list(staging_dir(cfg.run_dir, 0).glob("part-*"))))
    )
    stats = run_extract(cfg)

    assert digest(cfg.store_dir) == hf_digest(make_config, 60, batch_tokens=256)  # same bits, default layers
    assert verify(cfg.store_dir)["samples"] == stats["samples_stored"] == 60
    assert fake_engine.started == {"last": 1, "aux": 1}  # the fake refuses a second live engine
    assert fake_engine.tokens_computed == {"last": stats["tokens"], "aux": stats["tokens"]}  # each pass once
    # The staging shrank while the aux pass stored batches (staging + store never outgrow the final store),
    # and what was left went at the end.
    assert staged_parts_seen_by_aux_pass[0] > staged_parts_seen_by_aux_pass[-1] > 0
    assert not staging_dir(cfg.run_dir, 0).exists()


@pytest.mark.slow
def test_layer_ids_not_starting_at_1_are_converted_for_deepseek(make_config, fake_engine):
    """DeepSeek-family sglang adds 1 to the ids only when the first is 1: [2, 4, 5] must go as [3, 5, 6]."""
    cfg = make_config(data={"max_samples": 12}, extract={"backend": "sglang", "aux_layers": [2, 4, 5]})
    run_extract(cfg)
    assert digest(cfg.store_dir) == hf_digest(make_config, 12, aux_layers=[2, 4, 5])


@pytest.mark.slow
def test_the_plugin_path_runs_one_engine_and_one_prefill_and_stores_what_the_hf_backend_stores(
    make_config, fake_engine
):
    cfg = make_config(data={"max_samples": 60}, extract={"backend": "sglang", "batch_tokens": 256, "chunk_mib": 2})
    sink, manifest = sink_dir(cfg.run_dir, 0), cfg.store_dir / "shard-00000" / "manifest.jsonl"
    seen = []  # (states files waiting in the sink, samples the store has committed) before every batch

    def look(mode: str) -> None:
        stored = (
            sum(len(json.loads(line)["samples"]) for line in manifest.read_text().splitlines())
            if manifest.exists()
            else 0
        )
        seen.append((len(list(sink.glob("*.safetensors"))), stored))

    fake_engine.on_generate = look
    stats = run_extract(cfg)

    assert digest(cfg.store_dir) == hf_digest(make_config, 60, batch_tokens=256, chunk_mib=2)
    assert (stats["capture_path"], stats["prefill_passes"], stats["capture_fallback"]) == ("plugin", 1, None)
    assert fake_engine.started == {"last": 0, "aux": 1}  # the plugin engine is an aux-capture engine
    probe = fake_engine.tokens_computed["aux"] - stats["tokens"]  # the start-up probe's short request
    assert fake_engine.tokens_computed["last"] == 0 and 0 < probe <= 8
    # A file stays only until the store has committed its sample (never a file for a stored one), and the
    # sink is gone at the end; the list path's staging is never used.
    assert all(files + stored <= 60 for files, stored in seen) and max(files for files, _ in seen) > 0
    assert not sink.exists() and not staging_dir(cfg.run_dir, 0).exists()
    assert json.loads(run_stats_path(cfg.run_dir, 0).read_text())["capture_path"] == "plugin"


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["gate", "probe"])
def test_auto_falls_back_to_the_list_path_and_says_why(make_config, fake_engine, monkeypatch, caplog, failure):
    """The version gate refuses the installed sglang, or the hook never ran in the engine (HookRegistry only logs
    a hook it could not apply): either way the run goes on over the list path, logged and in the stats."""
    if failure == "gate":
        monkeypatch.setenv(
            "FAKE_SGLANG_PLUGIN_GATE_PROBLEM",
            "sglang 0.6.0 is installed and the plugin was checked against sglang 0.5.23 only",
        )
    else:
        monkeypatch.setenv("FAKE_SGLANG_PLUGIN_SILENT", "1")
    cfg = make_config(data={"max_samples": 24}, extract={"backend": "sglang", "batch_tokens": 256})
    stats = run_extract(cfg)

    why = "sglang 0.6.0 is installed" if failure == "gate" else "the start-up probe's request produced no states file"
    assert stats["capture_path"] == "lists" and stats["prefill_passes"] == 2 and why in stats["capture_fallback"]
    assert any("falling back to the list path" in r.message and why in r.message for r in caplog.records)
    assert digest(cfg.store_dir) == hf_digest(make_config, 24, batch_tokens=256)
    # gate: no plugin engine at all; probe: the plugin engine was started, probed and shut down first
    assert fake_engine.started == {"last": 1, "aux": 1 if failure == "gate" else 2}
    assert not sink_dir(cfg.run_dir, 0).exists()


@pytest.mark.slow
def test_capture_plugin_insists_and_names_the_setting_when_the_plugin_cannot_run(make_config, fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_PLUGIN_SILENT", "1")
    cfg = make_config(data={"max_samples": 8}, extract={"backend": "sglang", "sglang": {"capture": "plugin"}})
    with pytest.raises(SglangSetupError, match="extract.sglang.capture is 'plugin', but the start-up probe"):
        run_extract(cfg)
    assert fake_engine.started == {"last": 0, "aux": 1}  # and that engine is shut down (the fixture checks)


@pytest.mark.slow
def test_a_crash_on_the_plugin_path_resumes_and_a_dead_try_s_files_are_not_taken(make_config, fake_engine):
    cfg = make_config(data={"max_samples": 60}, extract={"backend": "sglang", "batch_tokens": 256})
    fake_engine.crash_after_batches = 6  # the probe and five batches
    with pytest.raises(EngineCrashed):
        run_extract(cfg)
    stored_before = verify(cfg.store_dir)["samples"]
    assert 0 < stored_before < 60
    # A kill -9 leaves the sink behind, with files of a batch the store never got: the next try must not read them.
    sink = sink_dir(cfg.run_dir, 0)
    sink.mkdir(parents=True, exist_ok=True)
    planted = sink / "e3-00000-0badcafe-000000000.safetensors"
    sglang_plugin.write_request_states(sink, planted.stem, torch.zeros(3, 768), torch.zeros(3, 256))

    fake_engine.crash_after_batches = None
    fake_engine.tokens_computed = {"aux": 0, "last": 0}
    stats = run_extract(cfg)
    assert stats["samples_stored_before"] == stored_before and stats["samples_stored"] == 60
    assert digest(cfg.store_dir) == hf_digest(make_config, 60, batch_tokens=256)
    assert fake_engine.tokens_computed["aux"] - stats["tokens"] <= 8  # only the new samples (and the probe)
    assert not sink.exists()


@pytest.mark.slow
@pytest.mark.parametrize("crash_in", ["final-state pass", "aux pass"])
def test_a_crash_in_either_pass_resumes_without_computing_anything_twice(make_config, fake_engine, crash_in, tmp_path):
    cfg = make_config(data={"max_samples": 60}, extract={**LISTS, "batch_tokens": 256})
    first_pass_batches = None
    if crash_in == "aux pass":  # count the batches of the final-state pass, then crash the aux pass midway
        # (in a work directory of its own: in the same one, the run would find the states in the shared store)
        run_extract(
            make_config(
                run_name="count",
                workdir=tmp_path / "counting",
                data={"max_samples": 60},
                extract={**LISTS, "batch_tokens": 256},
            )
        )
        first_pass_batches = fake_engine.batches_served // 2
        fake_engine.reset()
        fake_engine.crash_after_batches = first_pass_batches + first_pass_batches // 2
    else:
        fake_engine.crash_after_batches = 3
    with pytest.raises(EngineCrashed):
        run_extract(cfg)
    assert fake_engine.live == 0  # the crashed pass shut its engine down
    assert staging_dir(cfg.run_dir, 0).exists()

    fake_engine.crash_after_batches = None
    stats = run_extract(cfg)
    tokens = verify(cfg.store_dir)["tokens"]
    assert stats["samples_stored"] == 60
    assert digest(cfg.store_dir) == hf_digest(make_config, 60, batch_tokens=256)
    assert fake_engine.tokens_computed == {"last": tokens, "aux": tokens}  # nothing computed twice
    # A crash in the aux pass restarts only the aux engine: every final state was staged already.
    assert fake_engine.started == ({"last": 2, "aux": 1} if crash_in == "final-state pass" else {"last": 1, "aux": 2})
    assert not staging_dir(cfg.run_dir, 0).exists()


@pytest.mark.slow
def test_kill_9_in_either_pass_then_finish_stores_what_the_hf_backend_stores(make_config, monkeypatch):
    """SIGKILL the extract process mid final-state pass (twice) and mid aux pass, then let it finish."""
    monkeypatch.setenv("EAGLE3_SGLANG_ENGINE", "tests.fakes.sglang_engine:FakeSglangEngine")
    monkeypatch.setenv("FAKE_SGLANG_BATCH_DELAY_S", "0.1")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    cfg = make_config(data={"max_samples": 60}, extract={**LISTS, "batch_tokens": 256})
    config_path = write_run_config(cfg)
    staging, manifest = staging_dir(cfg.run_dir, 0), cfg.store_dir / "shard-00000" / "manifest.jsonl"

    def parts() -> int:
        return len(list(staging.glob("part-*.safetensors"))) if staging.exists() else 0

    def chunks() -> int:
        return len(manifest.read_text().splitlines()) if manifest.exists() else 0

    kill_when = [
        ("final-state pass", lambda: parts() >= 2),
        ("final-state pass", lambda: parts() >= 5),
        ("aux pass", lambda: chunks() >= 1),
    ]
    seen = []  # (staged parts, store chunks) after each kill
    for moment, reached in kill_when:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3", "extract", "--config", str(config_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not reached():
            assert proc.poll() is None, f"extract ended before the kill in the {moment}"
            assert time.monotonic() < deadline, f"the {moment} made no progress"
            time.sleep(0.01)
        proc.kill()
        proc.wait()
        seen.append((parts(), chunks()))
    assert seen[1][0] >= 5 and seen[1][1] == 0 and seen[2][1] >= 1  # mid pass 1 (twice), then mid pass 2

    run_eagle3("extract", "--config", str(config_path))
    assert verify(cfg.store_dir)["samples"] == 60
    assert digest(cfg.store_dir) == hf_digest(make_config, 60, batch_tokens=256)
    assert not staging.exists()


@pytest.mark.slow
def test_no_sample_is_ever_in_neither_the_store_nor_the_staging(make_config, fake_engine):
    """A part may go only once the store has COMMITTED its batch, not when the writer merely holds it:
    checked before every batch of the aux pass, with chunks big enough to keep batches pending for long."""
    from safetensors import safe_open

    from eagle3.data.store import read_manifest

    cfg = make_config(data={"max_samples": 60}, extract={**LISTS, "batch_tokens": 256, "chunk_mib": 2})
    staging, manifest = staging_dir(cfg.run_dir, 0), cfg.store_dir / "shard-00000" / "manifest.jsonl"
    checks = []

    def check(mode: str) -> None:
        if mode != "aux":
            return
        staged = set()
        for part in staging.glob("part-*.safetensors"):
            with safe_open(str(part), framework="pt") as f:
                staged.update(json.loads(f.metadata()["sample_ids"]))
        stored = {sid for r in read_manifest(manifest)[0] for sid, _ in r["samples"]} if manifest.exists() else set()
        checks.append((len(staged), len(stored)))
        assert len(staged | stored) == 60, f"a sample is in neither: {len(staged)} staged, {len(stored)} stored"

    fake_engine.on_generate = check
    run_extract(cfg)
    assert checks[0] == (60, 0) and any(0 < stored < 60 for _, stored in checks)


@pytest.mark.slow
def test_a_partly_stored_batch_after_a_plan_change_is_captured_whole(make_config, fake_engine):
    """The data (here: the batch budget) changed after a crash in the aux pass, so a new batch mixes stored
    and unstored samples: captured whole, nothing missing or doubled."""
    first = make_config(data={"max_samples": 60}, extract={**LISTS, "batch_tokens": 256})
    fake_engine.crash_after_batches = 16  # about 10 batches per pass: mid aux pass
    with pytest.raises(EngineCrashed):
        run_extract(first)
    stored_before = verify(first.store_dir)["samples"]
    assert 0 < stored_before < 60

    fake_engine.crash_after_batches = None
    replanned = make_config(data={"max_samples": 60}, extract={**LISTS, "batch_tokens": 400})
    stats = run_extract(replanned)
    assert stats["samples_stored_before"] == stored_before and stats["samples_stored"] == 60
    assert verify(replanned.store_dir)["samples"] == 60
    assert not staging_dir(replanned.run_dir, 0).exists()


@pytest.mark.slow
def test_a_stored_sample_whose_part_is_gone_comes_back_without_a_final_state(make_config, fake_engine):
    """After a replan, a later batch can hold a sample stored long ago whose staged part release_stored has
    deleted in the meantime: the aux pass must not ask the staging for it (extract drops it anyway)."""
    from eagle3.capture.sglang import SglangCapture
    from eagle3.data.samples import TokenizedSample

    cfg = make_config(extract=LISTS)
    a, c, d, e, f = (TokenizedSample(name * 16, [5, 6, 7], [0, 1, 1], False) for name in "acdef")
    stored: set[str] = set()
    first = SglangCapture(cfg, is_stored=stored.__contains__)
    first.prepare([[a, c], [d, e]], 4)  # parts [a, c] and [d, e]
    stored |= {a.sample_id, c.sample_id}  # the store committed [a, c]; then the run died

    again = SglangCapture(cfg, is_stored=stored.__contains__)  # the next run plans [d, e], then [a, f]
    again.prepare([[d, e], [a, f]], 3)  # stages f only
    again.capture([d, e])
    again.release_stored()  # [a, c] is stored: its part goes
    got = again.capture([a, f])
    again.close()
    assert got[0].last_hidden_state is None and got[1].last_hidden_state.shape == (3, 256)
    assert fake_engine.tokens_computed == {"last": 18, "aux": 12}  # [a, f] computed whole for f, once


def test_the_last_layer_is_refused_before_any_engine_starts(make_config):
    from eagle3.config import InvalidConfig

    with pytest.raises(InvalidConfig) as refused:
        make_config(extract={"backend": "sglang", "aux_layers": [1, 3, 7]})
    assert refused.value.fields == ["extract.aux_layers"] and "up to 6" in refused.value.fact
    make_config(extract={"backend": "hf", "aux_layers": [1, 3, 7]})  # the hf backend can capture it


def test_staged_states_survive_a_reopen_and_crash_leftovers_are_removed(tmp_path):
    import torch

    from eagle3.capture.staging import StagedStates
    from eagle3.data.samples import TokenizedSample

    samples = [TokenizedSample("a" * 16, [5, 6, 7], [0, 1, 1], False), TokenizedSample("b" * 16, [9], [1], False)]
    states = [torch.randn(3, 8), torch.randn(1, 8)]
    staged = StagedStates(tmp_path / "staging", hidden_size=8)
    staged.add(samples, states)
    leftover = tmp_path / "staging" / ".part-000001.safetensors.tmp-123"  # a crash mid-write
    leftover.write_bytes(b"half a part")

    reopened = StagedStates(tmp_path / "staging", hidden_size=8)
    assert not leftover.exists() and len(reopened) == 2
    assert torch.equal(reopened.get(samples[0]), states[0].to(torch.bfloat16))
    assert torch.equal(reopened.get(samples[1]), states[1].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="no staged final state for sample cccc"):
        reopened.get(TokenizedSample("c" * 16, [1], [1], False))
    with pytest.raises(RuntimeError, match="has 1 rows for a 2-token sample; delete"):
        reopened.get(TokenizedSample("b" * 16, [9, 9], [1, 1], False))


def test_staged_parts_go_oldest_first_once_stored_and_names_are_never_reused(tmp_path):
    import torch

    from eagle3.capture.staging import StagedStates
    from eagle3.data.samples import TokenizedSample

    staged = StagedStates(tmp_path / "staging", hidden_size=4)
    batches = [[TokenizedSample(f"{b}{i}".ljust(16, "0"), [1, 2], [1, 1], False) for i in range(2)] for b in "abc"]
    for batch in batches:
        staged.add(batch, [torch.zeros(2, 4)] * 2)
    stored = {s.sample_id for s in batches[0]} | {batches[1][0].sample_id} | {s.sample_id for s in batches[2]}
    assert staged.discard_stored(stored.__contains__) == 1  # part 1 still has a sample to store: stop there
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == [
        "part-000001.safetensors",
        "part-000002.safetensors",
    ]
    assert batches[0][0].sample_id not in staged and batches[1][1].sample_id in staged

    reopened = StagedStates(tmp_path / "staging", hidden_size=4)
    reopened.add([TokenizedSample("d".ljust(16, "0"), [3], [1], False)], [torch.zeros(1, 4)])
    assert (tmp_path / "staging" / "part-000003.safetensors").exists() and len(reopened) == 5


@pytest.mark.slow
def test_gpu_capture_check_runs_and_reports_agreement(tiny_target):
    """The one command that validates a box's sglang, run here against the stand-in engine (its states
    are transformers' own, so the check must report agreement; on a GPU box the real engine is compared)."""
    env = dict(os.environ, EAGLE3_SGLANG_ENGINE="tests.fakes.sglang_engine:FakeSglangEngine", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "bench/gpu_capture_check.py",
            "--model",
            str(tiny_target),
            "--device",
            "cpu",
            "--samples",
            "3",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["agree"] is True and report["samples"] == 3
    assert list(report["paths"]) == ["plugin", "lists"]
    for layers in report["paths"].values():
        assert list(layers) == ["aux layer 1", "aux layer 3", "aux layer 4", "final (post-norm)"]
        assert all(layer["mean_cosine"] > 0.999 for layer in layers.values())
