"""The generate stage against a live OpenAI-compatible server, and the SGLang server lifecycle.

SGLang cannot run on a CPU machine: the server here is tests/fakes/sglang_server.py, a stand-in that serves the
tiny target's real greedy generation with SGLang's flags and endpoints, and can be told to fail (500, 429,
dropped connections, slow answers, empty answers) or to exit at start. The attacks at the end (a server that
trickles, floods, redirects, answers nonsense, or echoes the API key) use tests/fakes/hostile_server.py, a
test double in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from eagle3.config import ConfigError, write_run_config
from eagle3.data.samples import DataError, read_conversations
from eagle3.stages.generate import (
    GenerateAborted,
    check_endpoint,
    endpoint_url,
    read_rows,
    redact_url,
    response_cap,
    run_generate,
)
from tests.dagruns import wait_for
from tests.fakes.hostile_server import GOOD, HostileServer, body, echo_headers, flood, redirect, trickle
from tests.sshd import free_port
from tests.standin import STAND_IN, stand_in_processes

# One worker runs the module: its stand-in servers (module-scoped) start once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_generate")]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def answers_health(client: httpx.Client, port: int) -> bool:
    """The server on 127.0.0.1:`port` says it is healthy (nothing listening yet is a no)."""
    with contextlib.suppress(httpx.TransportError):
        return client.get(f"http://127.0.0.1:{port}/health").status_code == 200
    return False


@contextlib.contextmanager
def stand_in_servers(tiny_target: Path, log_dir: Path):
    """A function that starts a stand-in server with extra flags and returns its /v1 URL; all stopped at exit."""
    servers = []

    def start(*flags: str) -> str:
        port = free_port()
        log_path = log_dir / f"stand-in-{port}.log"
        proc = subprocess.Popen(
            [sys.executable, str(STAND_IN), "--model-path", str(tiny_target), "--port", str(port), *flags],
            stdout=open(log_path, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        servers.append(proc)

        with httpx.Client() as client:  # one for all polls: each httpx.get builds a TLS context (~30 CPU-ms)

            def healthy() -> bool:
                assert proc.poll() is None, log_path.read_text()
                return answers_health(client, port)

            wait_for(healthy, 120, "the stand-in server")
        return f"http://127.0.0.1:{port}/v1"

    try:
        yield start
    finally:
        for proc in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def misbehaving_server(tiny_target, tmp_path_factory) -> str:
    """One stand-in server for the tests that make it misbehave (`stand_in`): its /v1 URL."""
    with stand_in_servers(tiny_target, tmp_path_factory.mktemp("misbehaving-stand-in")) as start:
        yield start()


@pytest.fixture
def stand_in(misbehaving_server):
    """`stand_in(*flags)` gives the misbehaving server this test's stand-in flags (faults are used up by the
    requests) and returns its /v1 URL; it behaves again after the test. The server is told, not restarted:
    loading the tiny target is most of what a start costs (about 8 CPU-seconds)."""
    control = misbehaving_server.removesuffix("/v1") + "/stand-in/misbehave"

    def misbehave(*flags: str) -> str:
        httpx.post(control, json={"flags": list(flags)}, timeout=90).raise_for_status()
        return misbehaving_server

    yield misbehave
    misbehave()


@pytest.fixture(scope="module")
def shared_server(tiny_target, tmp_path_factory):
    """One well-behaved server for the tests that need nothing special: (its /v1 URL, its request record)."""
    log_dir = tmp_path_factory.mktemp("shared-stand-in")
    with stand_in_servers(tiny_target, log_dir) as start:
        yield start("--record", str(log_dir / "requests.jsonl")), log_dir / "requests.jsonl"


def generate_config(make_config, endpoint: str = "http://127.0.0.1:9/v1", samples: int = 6, workdir=None, **gen):
    return make_config(
        workdir=workdir,
        data={"max_samples": samples},
        generate={
            "enabled": True,
            "endpoint": endpoint,
            "max_tokens": 48,
            "concurrency": 3,
            "progress_interval_s": 0.3,
            **gen,
        },
    )


def output_of(cfg) -> list[list[dict]]:
    lines = (cfg.run_dir / "generate" / "conversations.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines]


def test_every_assistant_turn_is_regenerated_in_order_after_the_regenerated_history(
    make_config, shared_server, caplog, tmp_path
):
    caplog.set_level("INFO", logger="eagle3.stages.generate")
    url, record = shared_server
    earlier_requests = len(record.read_text().splitlines()) if record.exists() else 0
    cfg = generate_config(make_config, url, samples=8)
    # Answers the target would not give (it answers the tiny target's own prompts as written): each must be replaced.
    others = tmp_path / "others.jsonl"
    with open(cfg.data.path) as source_file:
        rows = [json.loads(line) for line, _ in zip(source_file, range(8))]
    for row in rows:
        for i, turn in enumerate(row["conversations"]):
            if turn["from"] == "gpt":
                turn["value"] = f"someone else's answer {i}."
    others.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": str(others)})})
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
    regenerated_answers = [m["content"] for c in output for m in c if m["role"] == "assistant"]
    assert not [a for a in regenerated_answers if a.startswith("someone else's")], "an answer was not regenerated"
    assert stats["completion_tokens_now"] > 0
    assert re.search(r"generate: 8/8 conversations \(100.0%\), 0 failed, \d+ tokens/s, elapsed \S+, ETA", caplog.text)


def test_runs_with_the_same_target_and_settings_ask_only_for_new_conversations(make_config, shared_server):
    """A scheduled rerun on last week's prompts plus new ones: only the new ones are sent to the server."""
    url, record = shared_server

    def requests_during(run) -> int:
        before = len(record.read_text().splitlines()) if record.exists() else 0
        stats = run()
        return stats, len(record.read_text().splitlines()) - before

    def week(name: str, samples: int, **gen):
        cfg = generate_config(make_config, url, samples=samples, **gen).model_copy(update={"run_name": name})
        return cfg, *requests_during(lambda: run_generate(cfg))

    first, stats, asked = week("week-1", 6)
    assert stats["regenerated_now"] == 6 and asked >= 6
    again, stats, asked = week("week-2", 6)
    assert (stats["regenerated_now"], stats["already_done"], asked) == (0, 6, 0)
    assert output_of(again) == output_of(first) and stats["answers_cache"] == first_cache(first)
    grown, stats, asked = week("week-3", 8)
    assert (stats["regenerated_now"], stats["already_done"]) == (2, 6) and asked >= 2
    assert output_of(grown)[:6] == output_of(first)
    other, stats, _ = week("hotter", 6, temperature=0.7)  # other settings: other answers, asked again
    assert stats["regenerated_now"] == 6 and stats["answers_cache"] != first_cache(first)


def first_cache(cfg) -> str:
    return (cfg.run_dir / "generate" / "parts").resolve().name


def test_transient_errors_are_retried_until_the_answer_comes(make_config, stand_in, shared_server, tmp_path):
    """One each of 500, 429, a dropped connection and a request slower than the deadline, each on a turn of its
    own: each is retried, asking for the same turn again, and the answers are those of a server that never failed.

    The count is the fault sequence's, not the clock's. One request at a time, so the faults fall on the requests in
    the order given. The "slow" one answers 3 s after the 5 s deadline, and an ordinary answer takes a small part of
    it: 0.15 s on 2 idle cores, 0.45 s at most with the cores loaded (load 9; measured 2026-12). It was 1.5 s and
    four at a time: on a machine twice as slow an ordinary turn, queued behind three others on the stand-in's model
    lock, outlasted the deadline and was retried too (5 retries, not 4)."""
    record = tmp_path / "requests.jsonl"
    url = stand_in("--faults", "500,ok,429,ok,drop,ok,slow", "--slow-s", "8", "--record", str(record))
    cfg = generate_config(
        make_config, url, samples=4, concurrency=1, request_timeout_s=5.0, max_retries=3, workdir=tmp_path / "faulty"
    )
    stats = run_generate(cfg)
    assert (stats["regenerated"], stats["failed"]) == (4, 0)

    requests = [json.loads(line) for line in record.read_text().splitlines()]
    faulted = [i for i, request in enumerate(requests) if request["fault"] != "ok"]
    assert [requests[i]["fault"] for i in faulted] == ["500", "429", "drop", "slow"]
    for i in faulted:  # retried: the request after a fault asks for the same turn again
        assert requests[i + 1]["messages"] == requests[i]["messages"], requests[i]["fault"]
    # One request per turn, and one more per retry: 4 retries, one per fault. Counted from the record rather than
    # fixed at 4: an ordinary answer that did outlast the deadline would be retried too, rightly, and counted.
    turns = sum(m["role"] == "assistant" for messages in output_of(cfg) for m in messages)
    assert stats["retried_requests"] == len(requests) - turns >= 4

    clean = generate_config(make_config, shared_server[0], samples=4, workdir=tmp_path / "clean")
    run_generate(clean)
    assert output_of(cfg) == output_of(clean)  # no fault reached the data: the retried turns' answers are right


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
    data.write_text(
        "\n".join(
            [good, "{not json", json.dumps({"messages": [{"role": "user", "content": "x"}]}), good.replace("hi", "hey")]
        )
        + "\n"
    )
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
    ok_ids = [
        json.loads(line)["source_id"] for p in sorted(parts.glob("part-*.jsonl")) for line in p.read_text().splitlines()
    ]
    assert len(ok_ids) == len(set(ok_ids)) == 16
    assert output_of(cfg) == output_of(baseline)


# -- the server lifecycle (generate.launch_server) -------------------------------------------------------------


def launched_config(make_config, tmp_path, **extra_args):
    """`extra_args`: the stand-in server's own misbehaviour flags, which no engine has: allowed by name as an operator
    allows a flag the project did not review (server.reviewed_flags)."""
    port = free_port()
    return make_config(
        data={"max_samples": 4},
        generate={
            "enabled": True,
            "launch_server": True,
            "max_tokens": 32,
            "concurrency": 2,
            "max_retries": 0,
            "max_failure_rate": 0.0,
            "progress_interval_s": 0.3,
        },
        server={"port": port, "startup_timeout_s": 120, "extra_args": extra_args, "reviewed_flags": list(extra_args)},
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


class Impostor:
    """A box user's listener on 127.0.0.1:`port`: healthy, and answering every request, which it records."""

    def __init__(self, port: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        impostor = self
        self.requests: list[tuple[str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                impostor.requests.append((self.command, self.path))
                data = json.dumps(GOOD).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = answer

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)

    def __enter__(self) -> Impostor:
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_a_listener_on_the_engines_port_is_refused_before_it_hears_anything(make_config, tmp_path):
    """Attack: a box user listens on server.port before the stage's engine starts. Their /health answers 200, so the
    stage took them for the engine and sent them the training conversations. Now the stage refuses the port before
    it starts the engine, and nothing reaches the listener."""
    cfg = launched_config(make_config, tmp_path)
    with Impostor(cfg.server.port) as impostor:
        proc = run_stage(cfg)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"server.port: 127.0.0.1:{cfg.server.port} is taken" in proc.stderr and "Traceback" not in proc.stderr
    assert impostor.requests == [] and not stand_in_processes(cfg.server.port)


def test_an_engine_whose_port_another_process_also_listens_on_is_refused():
    """Attack: the listener arrives between the stage's check and the engine's bind, and answers /health first. What
    the stage accepts is a port every listener of which is its engine's process group."""
    from eagle3.engines.server import ServerError, refuse_other_listeners

    port = free_port()
    listen = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)"
    engine = subprocess.Popen([sys.executable, "-c", listen], start_new_session=True)
    try:
        wait_for(lambda: listening(port), 30, "the engine to listen")
        refuse_other_listeners(engine, f"http://127.0.0.1:{port}")  # its own listener: accepted
    finally:
        engine.kill()
        engine.wait()
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with Impostor(port), pytest.raises(ServerError, match=f"another process listens on 127.0.0.1:{port}"):
            refuse_other_listeners(engine, f"http://127.0.0.1:{port}")
    finally:
        engine.kill()
        engine.wait()


def test_a_planted_server_record_kills_nothing_but_a_leftover_server_is_stopped(tmp_path):
    """Attack: a server.json written into a shared run directory naming another run's live job (its group, start time
    and boot, all readable in /proc) had the next stage SIGKILL that job as "what is left of an earlier server". Only a
    group that carries the record's random mark, which only the server the stage started has, is killed now."""
    from eagle3.engines.server import SERVER_MARK_VAR, stop_leftover
    from eagle3.jobs.processes import pid_start_ticks, read_boot_id

    def record(process, mark) -> Path:
        path = tmp_path / "server.json"
        fields = {"pgid": process.pid, "pid_start_ticks": pid_start_ticks(process.pid), "boot_id": read_boot_id()}
        path.write_text(json.dumps({**fields, "mark": mark}))
        return path

    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)  # another run's training job
    leftover = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, SERVER_MARK_VAR: "m1"})
    try:
        wait_for(lambda: pid_start_ticks(leftover.pid) is not None, 10, "the processes to start")
        stop_leftover(path := record(victim, "m1"))
        assert victim.poll() is None and not path.exists()
        stop_leftover(record(leftover, "m1"))
        assert leftover.wait(timeout=10) == -signal.SIGKILL
    finally:
        for process in (victim, leftover):
            process.kill()
            process.wait()


def test_kill_9_of_the_stage_takes_the_server_down_too(make_config, tmp_path):
    """No orphan: SIGKILL leaves the stage no chance to clean up; the kernel's parent-death signal does it."""
    cfg = launched_config(make_config, tmp_path, always="slow", **{"slow-s": 60})
    stage = run_stage(cfg, wait=False)
    try:
        with httpx.Client() as client:  # healthy, so requests are in flight when the stage dies
            wait_for(lambda: answers_health(client, cfg.server.port), 120, "the server to serve")
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
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_original", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_original", "content": "18C and sunny"},
        {"role": "assistant", "content": "It is 18C and sunny in Paris."},
    ],
}


@pytest.mark.parametrize("calls, kept_turns", [("get_weather", 4), ("get_time", 2)], ids=["same-tool", "other-tool"])
def test_tool_turns_are_kept_and_a_diverging_tool_call_ends_the_conversation(
    make_config, stand_in, tmp_path, calls, kept_turns
):
    """Only assistant turns are asked again, with the record's tools. A regenerated call of the same tool keeps
    the id the target wrote (trained tokens are the target's own), and the tool's result, kept as it was but
    for its tool_call_id, answers that id; a call of another tool ends the conversation there: the result that
    follows answered a call the target no longer makes."""
    record = tmp_path / "requests.jsonl"
    url = stand_in("--tool-call", calls, "--record", str(record))
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(TOOL_CONVERSATION) + "\n")
    cfg = make_config(
        data={"path": str(data), "max_samples": None},
        generate={"enabled": True, "endpoint": url, "max_tokens": 32, "progress_interval_s": 0.3},
    )
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
        assert call["id"] != "call_original" and call["id"].startswith("call_")  # the stand-in's own id
        tool_turn = {**TOOL_CONVERSATION["messages"][2], "tool_call_id": call["id"]}  # answers the target's call
        assert output["messages"][2] == tool_turn and requests[1]["messages"][2] == tool_turn
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
    local = generate_config(make_config, samples=8, workdir=tmp_path / "hf", backend="hf", concurrency=4, num_samples=5)
    assert run_generate(local)["regenerated_now"] == 5
    more = generate_config(make_config, samples=8, workdir=tmp_path / "hf", backend="hf", concurrency=4)
    stats = run_generate(more)
    assert (stats["regenerated"], stats["regenerated_now"], stats["already_done"]) == (8, 3, 5)
    assert output_of(more) == output_of(served)


def test_an_empty_answer_fails_the_conversation_and_is_not_kept():
    """The hf backend has no server to refuse an empty message: the walk fails the conversation (a failed row,
    left out of the data and counted) rather than keep an assistant turn that extract would reject."""
    from eagle3.data.samples import Conversation
    from eagle3.stages.generate import Regeneration, Reply

    walk = Regeneration(
        Conversation("0" * 16, ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}), 1)
    )
    assert walk.next_request() == [{"role": "user", "content": "hi"}]
    walk.answer(Reply("  ", None, 1, "stop"))
    assert walk.failed == "the target answered with an empty message" and walk.next_request() is None


# -- a hostile or broken server (tests/fakes/hostile_server.py, a stand-in in this process) -------------------


def hostile_config(make_config, server: HostileServer, samples: int = 1, **gen):
    """One request at a time, one retry, and no stop by the failure rate unless a test asks for one. The deadline
    is roomy unless a test is about deadlines: a request that times out is retried and takes the server's next
    answer, so on a loaded machine a 0.5 s deadline turned a malformed answer into a retry and the last
    conversation's answer into a second good one (seen: 18 malformed instead of 19)."""
    return generate_config(
        make_config,
        server.url,
        samples=samples,
        concurrency=1,
        max_retries=1,
        **{"request_timeout_s": 30.0, "max_failure_rate": 1.0, **gen},
    )


def failed_rows(cfg) -> list[dict]:
    return [r for r in read_rows(cfg.run_dir / "generate" / "parts").values() if r["status"] == "failed"]


def test_a_trickling_server_cannot_hold_a_request_past_its_deadline(make_config):
    """The attack: headers at once, then a byte every 0.1 s of a promised megabyte. Every read comes in within
    httpx's per-read timeout, so without a deadline on the whole request one conversation would take 29 hours.
    Each attempt ends at generate.request_timeout_s; the conversation fails as a timeout after its retries."""
    with HostileServer(then=trickle(every_s=0.1)) as server:
        cfg = hostile_config(make_config, server, request_timeout_s=0.5)
        started = time.monotonic()
        stats = run_generate(cfg)
        elapsed = time.monotonic() - started
    # 2 attempts of 0.5 s, one backoff of at most 1 s, and slack for a loaded machine.
    assert elapsed < 0.5 * 2 + 1 + 3, elapsed
    assert server.paths().count("/v1/chat/completions") == 2  # the timeout was retried, once
    assert stats["failure_reasons"] == {"timeout": 1}
    [row] = failed_rows(cfg)
    assert "no whole answer from http://127.0.0.1" in row["error"]
    assert "within generate.request_timeout_s (0.5 s)" in row["error"]


def test_a_100_mib_answer_is_refused_unread_and_memory_stays_bounded(make_config):
    """The attack: a 200 answer whose content runs on for 100 MiB (no Content-Length, so only reading tells).
    It is refused at the cap, 1 MiB + 256 bytes a max token, without buffering more than the cap, without
    reading the rest, and without a retry: the row fails as oversize."""
    with HostileServer(then=flood(100 << 20)) as server:
        cfg = hostile_config(make_config, server)
        tracemalloc.start()
        try:
            stats = run_generate(cfg)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        time.sleep(0.2)  # the server's last write fails once the closed connection is noticed
        sent = server.sent_bytes
    print(f"peak {peak / 2**20:.1f} MiB allocated, {sent / 2**20:.1f} MiB sent")
    cap = response_cap(cfg.generate.max_tokens)
    assert stats["failure_reasons"] == {"oversize": 1} and stats["retried_requests"] == 0
    [row] = failed_rows(cfg)
    assert f"response over {cap} bytes" in row["error"]
    assert peak < 50 << 20, f"{peak / 2**20:.0f} MiB allocated at the peak"
    # Loopback's socket buffers hold a few MiB that were sent but never read; the rest was never sent.
    assert sent < 32 << 20, f"{sent / 2**20:.0f} MiB of the 100 were sent"


MALFORMED = [  # (what the server sends as the whole body, what the failed row's error says)
    (b"<html>502 Bad Gateway</html>", "not readable JSON"),
    (b"\xff\xfe\x00garbage", "not readable JSON"),
    (b"[" * 200_000, "nested too deeply"),
    ({"choices": []}, "no choices[0] object"),
    ({"object": "error"}, "no choices[0] object"),
    ({"choices": [{"message": "hi"}]}, "choices[0].message is a string, not an object"),
    (b'{"choices": [{"message": 1e999}]}', "a number beyond"),
    ({"choices": [{"message": ["hi"]}]}, "choices[0].message is a list, not an object"),
    ({"choices": [{"message": {"content": 42}}]}, "message.content is a number, not a string or null"),
    (
        {"choices": [{"message": {"content": "hi", "reasoning_content": {"a": 1}}}]},
        "message.reasoning_content is an object, not a string",
    ),
    (
        {"choices": [{"message": {"content": None, "tool_calls": [{"function": "get_weather"}]}}]},
        "message.tool_calls is a list, not a list of",
    ),
    ({"choices": [{"message": {"content": "hi"}, "finish_reason": 7}]}, "finish_reason is a number"),
    (b'{"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": NaN}}', "NaN"),
    (
        {"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": "many"}},
        "usage.completion_tokens is a string, not a count",
    ),
    (
        {"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 10**400}},
        "usage.completion_tokens is a number, not a count",
    ),
    ({"choices": [{"message": {"content": "hi"}}], "usage": "lots"}, "usage is a string, not an object"),
    (
        b'{"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1' + b"0" * 5000 + b"}}",
        "not readable JSON",
    ),
    (b'{"choices": [{"message": {"content": "\\ud800 lone"}}]}', "lone surrogate"),
]


def test_malformed_answers_fail_their_rows_with_a_reason_and_the_stage_goes_on(make_config):
    """The attack: every shape of wrong answer at once: not JSON, not UTF-8, nested 200,000 deep, no choices,
    a message that is a string, a number (1e999) or a list, content or reasoning or tool calls or counts of the
    wrong type, NaN, a 400-digit count (which would break the stats' arithmetic), a 5,000-digit number, a lone
    surrogate (which would fail the part file's write), a compressed body. Each is one failed row with a
    one-line reason, not retried; the good conversation after them is kept."""
    answers = [body(content) for content, _ in MALFORMED]
    answers.append(body(GOOD, headers={"Content-Encoding": "gzip"}))  # compressed, though asked for none
    with HostileServer(answers) as server:
        cfg = hostile_config(make_config, server, samples=len(answers) + 1)
        stats = run_generate(cfg)
    assert stats["failure_reasons"] == {"malformed": len(answers)} and stats["regenerated"] == 1, stats
    assert stats["retried_requests"] == 0
    errors = [row["error"] for row in failed_rows(cfg)]
    for _, expected in [*MALFORMED, (None, "compressed (gzip) though the request asked for none")]:
        assert any(expected in error for error in errors), f"no failed row says {expected!r}: {errors}"
    assert all("\n" not in error and len(error) < 300 for error in errors)
    assert "A fine answer." in json.dumps(output_of(cfg))


def test_a_server_that_only_answers_nonsense_stops_the_stage_with_the_reason(make_config):
    """The attack: every answer is {"choices": [{"message": "hi"}]}. The failure-rate rule stops the stage after
    the first 20 conversations, saying what was wrong, instead of an exception out of the row."""
    with HostileServer(then=body({"choices": [{"message": "hi"}]})) as server:
        cfg = hostile_config(make_config, server, samples=40, max_failure_rate=0.5)
        with pytest.raises(
            GenerateAborted,
            match=r"stopped early: 20 of the 20 conversations tried failed.*"
            r"last error: malformed answer: choices\[0\].message is a string",
        ):
            run_generate(cfg)


def test_a_redirect_is_not_followed(make_config):
    """The attack: a 302 to another path. The stage calls {endpoint}/chat/completions and nothing else: the row
    fails with the status, and the other path is never asked."""
    with HostileServer([redirect("/steal")]) as server:
        cfg = hostile_config(make_config, server)
        stats = run_generate(cfg)
    assert stats["failure_reasons"] == {"http 302": 1}
    assert set(server.paths()) == {"/v1/models", "/v1/chat/completions"}


API_KEY = "sk-test-6f1c2a9e0d4b8e7f"


def test_the_api_key_is_sent_as_a_bearer_token_and_shown_nowhere(make_config, monkeypatch, caplog, capsys):
    """The attack: a server (or a proxy before it) whose 400 error page repeats the request's headers, logging
    at DEBUG everywhere. The key from generate.api_key_env reaches the server on every request, the probe
    included, and is in no log line, no row, no stats, no file of the run."""
    caplog.set_level(logging.DEBUG)
    for noisy in ("httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=noisy)
    monkeypatch.setenv("EAGLE3_TEST_API_KEY", API_KEY)
    with HostileServer([echo_headers(400)]) as server:
        cfg = hostile_config(make_config, server, samples=3, api_key_env="EAGLE3_TEST_API_KEY")
        write_run_config(cfg)
        stats = run_generate(cfg)
    assert [headers.get("Authorization") for _, _, headers in server.requests] == [f"Bearer {API_KEY}"] * len(
        server.requests
    )
    assert "/v1/models" in server.paths() and stats["failure_reasons"] == {"http 400": 1}
    [row] = failed_rows(cfg)
    assert "HTTP 400" in row["error"] and "[key]" in row["error"]  # the echo came back, the key did not
    out, err = capsys.readouterr()
    assert API_KEY not in caplog.text + out + err + json.dumps(stats)
    files = [p for p in cfg.run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "config.json" for p in files)
    assert not [p for p in files if API_KEY.encode() in p.read_bytes()]


def test_a_server_that_refuses_the_key_stops_the_stage_at_the_probe(make_config):
    """The attack, or the mistake: a server that wants a key answers GET /models with 401. The stage stops
    before its first conversation, naming generate.api_key_env, instead of failing every row with 401."""
    with HostileServer(models=body({"error": "invalid api key"}, status=401)) as server:
        cfg = hostile_config(make_config, server)
        with pytest.raises(
            GenerateAborted,
            match=r"/v1/models answered HTTP 401: the server wants an API key; "
            r"name the variable .* in generate.api_key_env",
        ):
            run_generate(cfg)
    assert "/v1/chat/completions" not in server.paths()


@pytest.mark.parametrize("value", [None, "", "  "], ids=["unset", "empty", "blank"])
def test_an_api_key_variable_that_is_not_set_is_a_config_error(make_config, monkeypatch, value):
    """The attack: the config names a key variable the box does not have. The stage stops before any request
    with a ConfigError (exit 2) naming the field and the variable, rather than asking without the key."""
    if value is None:
        monkeypatch.delenv("EAGLE3_TEST_API_KEY", raising=False)
    else:
        monkeypatch.setenv("EAGLE3_TEST_API_KEY", value)
    with HostileServer() as server:
        cfg = hostile_config(make_config, server, api_key_env="EAGLE3_TEST_API_KEY")
        with pytest.raises(
            ConfigError,
            match="generate.api_key_env: the variable EAGLE3_TEST_API_KEY is not set in the box's environment",
        ):
            run_generate(cfg)
    assert server.requests == []


def test_credentials_in_an_endpoint_are_never_sent_along_or_printed():
    """The attack: an endpoint with user:password, a ?query and a #fragment, as if it had got past the config
    (which refuses them). The request URLs keep only scheme, host, port and path, with the route in the path;
    an error about the endpoint prints it without the password."""
    port = free_port()
    endpoint = f"http://admin:hunter2@127.0.0.1:{port}/v1/?token=hunter2#hunter2"
    assert str(endpoint_url(endpoint, "chat/completions")) == f"http://127.0.0.1:{port}/v1/chat/completions"
    assert "hunter2" not in redact_url(endpoint)
    with pytest.raises(GenerateAborted, match="generate.endpoint: cannot reach") as caught:
        asyncio.run(check_endpoint(endpoint))
    assert "hunter2" not in str(caught.value)
