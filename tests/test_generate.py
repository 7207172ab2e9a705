"""The generate stage against a live OpenAI-compatible server, and the SGLang server lifecycle.

SGLang cannot run on a CPU machine: the server here is tests/fakes/sglang_server.py, a stand-in that serves the
tiny target's real greedy generation with SGLang's flags and endpoints, and can be told to fail (500, 429,
dropped connections, slow answers, empty answers) or to exit at start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eagle3.config import write_run_config
from eagle3.data import DataError, read_conversations
from eagle3.generate import GenerateAborted, read_rows, run_generate
from tests.dagruns import wait_for
from tests.sshd import free_port
from tests.standin import STAND_IN, stand_in_processes

pytestmark = pytest.mark.slow

def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def stand_in_servers(tiny_target: Path, log_dir: Path):
    """A function that starts a stand-in server with extra flags and returns its /v1 URL; all stopped at exit."""
    servers = []

    def start(*flags: str) -> str:
        port = free_port()
        log_path = log_dir / f"stand-in-{port}.log"
        proc = subprocess.Popen([sys.executable, str(STAND_IN), "--model-path", str(tiny_target), "--port", str(port),
                                 *flags], stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        servers.append(proc)

        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            return False

        wait_for(healthy, 120, "the stand-in server")
        return f"http://127.0.0.1:{port}/v1"

    try:
        yield start
    finally:
        for proc in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def stand_in(tiny_target, tmp_path):
    """A server of this test's own, for flags that change it (faults are used up by the requests)."""
    with stand_in_servers(tiny_target, tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def shared_server(tiny_target, tmp_path_factory):
    """One well-behaved server for the tests that need nothing special: (its /v1 URL, its request record)."""
    log_dir = tmp_path_factory.mktemp("shared-stand-in")
    with stand_in_servers(tiny_target, log_dir) as start:
        yield start("--record", str(log_dir / "requests.jsonl")), log_dir / "requests.jsonl"


def generate_config(make_config, endpoint: str = "http://127.0.0.1:9/v1", samples: int = 6, workdir=None, **gen):
    return make_config(workdir=workdir, data={"max_samples": samples},
                       generate={"enabled": True, "endpoint": endpoint, "max_tokens": 48, "concurrency": 3,
                                 "progress_interval_s": 0.3, **gen})


def output_of(cfg) -> list[list[dict]]:
    lines = (cfg.run_dir / "generate" / "conversations.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines]


def test_every_assistant_turn_is_regenerated_in_order_after_the_regenerated_history(make_config, shared_server,
                                                                                      caplog):
    caplog.set_level("INFO", logger="eagle3.generate")
    url, record = shared_server
    earlier_requests = len(record.read_text().splitlines()) if record.exists() else 0
    cfg = generate_config(make_config, url, samples=8)
    stats = run_generate(cfg)

    source, _ = read_conversations(cfg.data.path, max_samples=8)
    output = output_of(cfg)
    requests = [json.loads(line)["messages"] for line in record.read_text().splitlines()[earlier_requests:]]
    assert stats["regenerated"] == len(output) == 8 and stats["failed"] == 0
    answers = 0
    for conversation, regenerated in zip(source, output, strict=True):  # input order kept
        last_answer = max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
        kept = conversation.messages[: last_answer + 1]
        assert [m["role"] for m in regenerated] == [m["role"] for m in kept]
        assert [m for m in regenerated if m["role"] != "assistant"] == [m for m in kept if m["role"] != "assistant"]
        for i, message in enumerate(regenerated):
            if message["role"] == "assistant":
                answers += 1
                assert regenerated[:i] in requests, "a turn was not asked for with the regenerated turns before it"
    assert answers > len(output), "no multi-turn conversation in the sample: the order was not tested"
    assert len(requests) == answers  # one request per assistant turn, none repeated
    assert output != [list(c.messages) for c in source], "nothing was regenerated"
    assert stats["completion_tokens_now"] > 0
    assert re.search(r"generate: 8/8 conversations \(100.0%\), 0 failed, \d+ tokens/s, elapsed \S+, ETA", caplog.text)


def test_transient_errors_are_retried_until_the_answer_comes(make_config, stand_in):
    """One each of 500, 429, a dropped connection and a request slower than the timeout: all retried."""
    url = stand_in("--faults", "500,429,drop,slow", "--slow-s", "3")
    cfg = generate_config(make_config, url, samples=4, concurrency=4, request_timeout_s=1.5, max_retries=3)
    stats = run_generate(cfg)
    assert (stats["regenerated"], stats["failed"], stats["retried_requests"]) == (4, 0, 4)


def test_a_failed_conversation_is_counted_left_out_and_retried_by_the_next_run(make_config, stand_in):
    """An empty answer is not worth retrying at once: that conversation is recorded as failed, the rest is
    data, and the next run regenerates only the failed one."""
    url = stand_in("--faults", "empty")
    cfg = generate_config(make_config, url, samples=5, concurrency=1, max_failure_rate=1.0)
    first = run_generate(cfg)
    assert (first["regenerated"], first["failed"]) == (4, 1)
    assert "empty message" in next(iter(first["failed_lines"].values()))
    assert len(output_of(cfg)) == 4
    second = run_generate(cfg)  # the fault is spent: the server answers now
    assert (second["regenerated"], second["failed"], second["already_done"], second["regenerated_now"]) == (5, 0, 4, 1)
    assert len(output_of(cfg)) == 5


def test_a_dead_server_stops_the_stage_early(make_config, stand_in):
    """Every request answers 500: the stage stops after the first 20 conversations or so, not after all 60."""
    url = stand_in("--always", "500")
    cfg = generate_config(make_config, url, samples=60, concurrency=8, max_retries=1, max_failure_rate=0.5)
    with pytest.raises(GenerateAborted, match=r"stopped early: \d+ of the \d+ conversations tried failed.*HTTP 500"):
        run_generate(cfg)
    rows = read_rows(cfg.run_dir / "generate" / "parts")
    assert 20 <= len(rows) <= 20 + 8 and all(r["status"] == "failed" for r in rows.values())


def test_nothing_listening_fails_in_seconds_naming_the_endpoint(make_config):
    cfg = generate_config(make_config, f"http://127.0.0.1:{free_port()}/v1")
    started = time.monotonic()
    with pytest.raises(GenerateAborted, match=r"generate.endpoint: cannot reach http://127.0.0.1:\d+/v1"):
        run_generate(cfg)
    assert time.monotonic() - started < 15


def test_malformed_prompt_lines_are_named_before_any_request(make_config, tmp_path):
    data = tmp_path / "prompts.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    data.write_text("\n".join([good, "{not json", json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                               good.replace("hi", "hey")]) + "\n")
    cfg = make_config(data={"path": str(data)}, generate={"enabled": True, "endpoint": "http://127.0.0.1:9/v1"})
    with pytest.raises(DataError, match=r"2 bad record\(s\):\n  line 2: invalid JSON.*\n  line 3: no assistant turn"):
        run_generate(cfg)


def test_reasoning_content_is_kept_or_dropped(make_config, stand_in, tmp_path):
    url = stand_in("--reasoning", "Let me think.")
    for reasoning, expected in (("keep", "Let me think."), ("drop", None)):
        cfg = generate_config(make_config, url, samples=2, reasoning=reasoning, workdir=tmp_path / reasoning)
        run_generate(cfg)
        answers = [m for messages in output_of(cfg) for m in messages if m["role"] == "assistant"]
        assert answers and all(m.get("reasoning_content") == expected for m in answers), reasoning


def test_kill_9_at_a_random_moment_loses_and_duplicates_nothing(make_config, shared_server, tmp_path):
    """The stage is SIGKILLed once some rows are on disk; the rerun finishes: the output equals an
    uninterrupted run's, and no conversation was stored twice."""
    url, _ = shared_server
    baseline = generate_config(make_config, url, samples=16, concurrency=2, workdir=tmp_path / "baseline")
    run_generate(baseline)
    cfg = generate_config(make_config, url, samples=16, concurrency=2, workdir=tmp_path / "killed")
    config_path = write_run_config(cfg)
    parts = cfg.run_dir / "generate" / "parts"
    argv = [sys.executable, "-m", "eagle3", "generate", "--config", str(config_path)]
    stage = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(parts.glob("part-*.jsonl"))) >= 2 or stage.poll() is not None, 120, "two part files")
    assert stage.poll() is None, f"the stage ended before it could be killed:\n{stage.stderr.read()[-3000:]}"
    stage.kill()
    stage.wait()
    rows_at_kill = sum(len(p.read_text().splitlines()) for p in parts.glob("part-*.jsonl"))
    assert 0 < rows_at_kill < 16
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    stats = json.loads(rerun.stdout)
    print(f"kill -9 after {rows_at_kill}/16 rows were on disk; the rerun regenerated {stats['regenerated_now']}")
    assert stats["already_done"] == rows_at_kill and stats["regenerated_now"] == 16 - rows_at_kill
    ok_ids = [json.loads(line)["source_id"] for p in sorted(parts.glob("part-*.jsonl"))
              for line in p.read_text().splitlines()]
    assert len(ok_ids) == len(set(ok_ids)) == 16
    assert output_of(cfg) == output_of(baseline)


# -- the server lifecycle (generate.launch_server) -------------------------------------------------------------


def launched_config(make_config, tmp_path, **extra_args):
    port = free_port()
    return make_config(
        data={"max_samples": 4},
        generate={"enabled": True, "launch_server": True, "max_tokens": 32, "concurrency": 2, "max_retries": 0,
                  "max_failure_rate": 0.0, "progress_interval_s": 0.3},
        server={"port": port, "startup_timeout_s": 120, "extra_args": extra_args},
    )


def run_stage(cfg, *, wait: bool = True):
    argv = [sys.executable, "-m", "eagle3", "generate", "--config", str(write_run_config(cfg))]
    env = {**os.environ, "EAGLE3_SERVER_LAUNCHER": str(STAND_IN)}
    if wait:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def test_the_stage_starts_the_server_and_stops_it_after_success(make_config, tmp_path):
    cfg = launched_config(make_config, tmp_path)
    proc = run_stage(cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["regenerated"] == 4
    assert "server: healthy" in proc.stderr and "server: stopped" in proc.stderr
    assert not stand_in_processes(cfg.server.port) and not listening(cfg.server.port)
    assert "model loaded" in (cfg.run_dir / "generate" / "server.log").read_text()


def test_the_server_is_stopped_when_the_stage_fails(make_config, tmp_path):
    cfg = launched_config(make_config, tmp_path, always="500")
    proc = run_stage(cfg)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: generate stopped early" in proc.stderr and "Traceback" not in proc.stderr
    assert not stand_in_processes(cfg.server.port) and not listening(cfg.server.port)


def test_a_server_that_exits_at_start_is_reported_with_its_log(make_config, tmp_path):
    cfg = launched_config(make_config, tmp_path, **{"exit-at-start": 3})
    proc = run_stage(cfg)
    assert proc.returncode == 1
    assert "the server exited with code 3 before it served" in proc.stderr
    assert "stand-in: exiting at start, as told" in proc.stderr  # its log's last lines are in the error


def test_kill_9_of_the_stage_takes_the_server_down_too(make_config, tmp_path):
    """No orphan: SIGKILL leaves the stage no chance to clean up; the kernel's parent-death signal does it."""
    cfg = launched_config(make_config, tmp_path, always="slow", **{"slow-s": 60})
    stage = run_stage(cfg, wait=False)
    try:
        def serving() -> bool:  # healthy, so requests are in flight when the stage dies
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"http://127.0.0.1:{cfg.server.port}/health").status_code == 200
            return False

        wait_for(serving, 120, "the server to serve")
        assert stand_in_processes(cfg.server.port)
        stage.kill()
        stage.wait()
        wait_for(lambda: not stand_in_processes(cfg.server.port), 15, "the server to go with its stage")
    finally:
        for pid in stand_in_processes(cfg.server.port):
            os.kill(pid, signal.SIGKILL)


TOOL_CONVERSATION = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_original", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_original", "content": "18C and sunny"},
        {"role": "assistant", "content": "It is 18C and sunny in Paris."},
    ],
}


@pytest.mark.parametrize("calls, kept_turns", [("get_weather", 4), ("get_time", 2)], ids=["same-tool", "other-tool"])
def test_tool_turns_are_kept_and_a_diverging_tool_call_ends_the_conversation(make_config, stand_in, tmp_path,
                                                                             calls, kept_turns):
    """Only assistant turns are asked again, with the record's tools. A regenerated call of the same tool keeps
    the original call id, so the tool's result (kept as it was) still answers it; a call of another tool ends
    the conversation there: the result that follows answered a call the target no longer makes."""
    record = tmp_path / "requests.jsonl"
    url = stand_in("--tool-call", calls, "--record", str(record))
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(TOOL_CONVERSATION) + "\n")
    cfg = make_config(data={"path": str(data), "max_samples": None},
                      generate={"enabled": True, "endpoint": url, "max_tokens": 32, "progress_interval_s": 0.3})
    stats = run_generate(cfg)

    [line] = (cfg.run_dir / "generate" / "conversations.jsonl").read_text().splitlines()
    output = json.loads(line)
    assert output["tools"] == TOOL_CONVERSATION["tools"]
    assert len(output["messages"]) == kept_turns and stats["cut_at_tool_call"] == (kept_turns == 2)
    call = output["messages"][1]["tool_calls"][0]
    assert call["function"]["name"] == calls
    requests = [json.loads(r) for r in record.read_text().splitlines()]
    assert all(r["tools"] == TOOL_CONVERSATION["tools"] for r in requests)
    if kept_turns == 4:
        assert call["id"] == "call_original"
        assert output["messages"][2] == TOOL_CONVERSATION["messages"][2]  # the tool turn as it was
        assert requests[1]["messages"][2] == TOOL_CONVERSATION["messages"][2]
        assert output["messages"][3]["content"] != TOOL_CONVERSATION["messages"][3]["content"]  # asked again
    conversations, _ = read_conversations(cfg.conversations_path)  # what extract reads accepts it
    assert conversations[0].tools == tuple(TOOL_CONVERSATION["tools"])


def test_the_hf_backend_answers_as_the_server_does_and_resumes(make_config, shared_server, tmp_path):
    """generate.backend "hf" (the demo's): the target in transformers, batched and left-padded, gives the same
    greedy answers as the served target does one request at a time, and a rerun with more conversations only
    regenerates the new ones."""
    url, _ = shared_server
    served = generate_config(make_config, url, samples=8, workdir=tmp_path / "served")
    run_generate(served)
    local = generate_config(make_config, samples=8, workdir=tmp_path / "hf", backend="hf", concurrency=4,
                            num_samples=5)
    assert run_generate(local)["regenerated_now"] == 5
    more = generate_config(make_config, samples=8, workdir=tmp_path / "hf", backend="hf", concurrency=4)
    stats = run_generate(more)
    assert (stats["regenerated"], stats["regenerated_now"], stats["already_done"]) == (8, 3, 5)
    assert output_of(more) == output_of(served)


def test_an_empty_answer_fails_the_conversation_and_is_not_kept():
    """The hf backend has no server to refuse an empty message: the walk fails the conversation (a failed row,
    left out of the data and counted) rather than keep an assistant turn that extract would reject."""
    from eagle3.data import Conversation
    from eagle3.generate import Regeneration, Reply

    walk = Regeneration(Conversation("0" * 16, ({"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "yo"}), 1))
    assert walk.next_request() == [{"role": "user", "content": "hi"}]
    walk.answer(Reply("  ", None, 1, "stop"))
    assert walk.failed == "the target answered with an empty message" and walk.next_request() is None
