"""`python -m eagle3 job`: detached jobs that survive their SSH session, re-attach, die cleanly and are seen dead.

Real processes throughout: the CLI runs in fresh interpreters as over SSH, and the jobs are small Python commands.
Waiting loops call eagle3.jobs.job directly (no interpreter start per look). The `jobs` fixture SIGKILLs whatever a test
leaves running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eagle3
from eagle3.contracts import Exit
from eagle3.disk.hostid import read_host_id
from eagle3.jobs import job, jobdir, processes, supervisor
from tests.conftest import run_eagle3

PY = sys.executable


@pytest.fixture
def jobs(tmp_path):
    jobs_dir = tmp_path / "jobs"
    yield jobs_dir
    for state_file in jobs_dir.glob("*/state.json"):
        try:
            state = jobdir.read_state(state_file.parent)
        except (jobdir.CorruptState, jobdir.UnsafeJobFile):  # a test's hostile file: it names nothing started here
            continue
        if state["pgid"] != os.getpgid(0):  # never this test process's own group
            # This boot's id: a test that faked a reboot has put the real one back by now.
            processes.kill_leftovers({**state, "boot_id": processes.read_boot_id()}, wait_s=5)


def eagle3_job(*args: str) -> dict:
    return json.loads(run_eagle3("job", *args, timeout=60).stdout)


def start(jobs_dir: Path, key: str, code: str, *options: str) -> dict:
    return eagle3_job("start", "--jobs-dir", str(jobs_dir), "--key", key, *options, "--", PY, "-c", code)


def poll(jobs_dir: Path, key: str, *options: str) -> dict:
    return eagle3_job("poll", "--jobs-dir", str(jobs_dir), "--key", key, *options)


def wait_until(condition, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for_effective(jobs_dir: Path, key: str, effective: str, **poll_options) -> dict:
    def reached():
        result = job.poll_job(jobs_dir, key, **poll_options)
        return result if result["effective"] == effective else None

    return wait_until(reached, f"job {key} to be {effective}")


def is_running(pid: int) -> bool:
    return processes.pid_start_ticks(pid) is not None


def wait_for_file(path: Path) -> str:
    """Python code that waits until `path` exists: lets a test decide when a job moves on."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}):\n    time.sleep(0.05)\n"


@pytest.mark.slow
def test_start_poll_and_success_with_the_output_in_the_log(jobs, tmp_path):
    go_on = tmp_path / "go-on"
    started = start(jobs, "ok", "print('hello from the stage')\n" + wait_for_file(go_on) + "print('done')")
    assert started["attached"] is False and started["status"] == "running" and started["try"] == 1
    assert started["pgid"] == started["pid"] and started["boot_id"] == processes.read_boot_id()
    assert started["pid_start_ticks"] == processes.pid_start_ticks(started["pid"])

    polled = poll(jobs, "ok")
    assert polled["effective"] == "running" and polled["state"]["pid"] == started["pid"]

    go_on.touch()
    done = wait_for_effective(jobs, "ok", "succeeded")
    assert done["state"]["exit_code"] == 0 and done["state"]["ended_at"] and done["log_tail"] == []
    # The first line of a try names when, where and which code: the directory this package was imported from.
    code = str(Path(eagle3.__file__).resolve().parents[1])
    header = rf"==== eagle3 job ok try 1 started \d{{4}}-\d\d-\d\dT[\d:]{{8}}Z on \S+, code {re.escape(code)} ====\n"
    assert re.match(header, done["log"])
    assert done["state"]["code"] == code
    assert "hello from the stage\ndone\n" in done["log"]
    assert (jobs / "ok").stat().st_mode & 0o777 == 0o700  # private: the log and argv are nobody else's business

    again = start(jobs, "ok", "print('must not run')")  # a succeeded job is reported, not rerun
    assert again["attached"] is True and again["try"] == 1
    assert "must not run" not in (jobs / "ok" / "log").read_text()


@pytest.mark.slow
def test_a_failing_command_is_failed_with_its_exit_code_and_log_tail(jobs):
    start(jobs, "bad", "import sys; print('about to fail'); sys.exit(3)")
    wait_for_effective(jobs, "bad", "failed")
    polled = poll(jobs, "bad")
    assert polled["state"]["exit_code"] == 3 and "exit code 3" in polled["reason"]
    assert "about to fail" in polled["log_tail"]


@pytest.mark.slow
def test_a_missing_program_fails_with_127(jobs):
    result = eagle3_job("start", "--jobs-dir", str(jobs), "--key", "nope", "--", "/no/such/program")
    result = result if result["status"] == "failed" else wait_for_effective(jobs, "nope", "failed")["state"]
    assert result["exit_code"] == 127
    assert "cannot start '/no/such/program'" in (jobs / "nope" / "log").read_text()


@pytest.mark.slow
def test_start_twice_attaches_to_the_running_job(jobs):
    # (start returns at once while the job runs on: the supervisor does not hold start's stdout pipe open)
    first = start(jobs, "twice", "import time; time.sleep(30)")
    second = start(jobs, "twice", "import time; time.sleep(30)")
    assert second["attached"] is True and second["pid"] == first["pid"] and second["try"] == 1
    assert (jobs / "twice" / "log").read_text().count("==== eagle3 job twice try") == 1


@pytest.mark.slow
def test_concurrent_starts_launch_one_try(jobs):
    argv = [
        PY,
        "-m",
        "eagle3",
        "job",
        "start",
        "--jobs-dir",
        str(jobs),
        "--key",
        "race",
        "--",
        PY,
        "-c",
        "import time; time.sleep(30)",
    ]
    racers = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    results = [json.loads(racer.communicate(timeout=60)[0]) for racer in racers]
    assert len({result["pid"] for result in results}) == 1 and {result["try"] for result in results} == {1}
    assert sorted(result["attached"] for result in results) == [False, True, True]


def test_a_supervisor_that_dies_at_once_is_reported_with_the_log(tmp_path):
    directory = tmp_path / "jobs" / "early"
    directory.mkdir(parents=True)
    with open(directory / "log", "ab") as log:
        crashing = subprocess.Popen([PY, "-c", "import sys; sys.exit('supervisor broke')"], stderr=log)
    with pytest.raises(job.JobLaunchError, match=r"exited with code 1 before reporting(.|\n)*supervisor broke"):
        job.wait_for_report(directory, crashing, try_number=1)


@pytest.mark.slow
def test_kill_ends_the_whole_process_group(jobs, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # The stage spawns a grandchild that even ignores SIGTERM: only the final SIGKILL of the group gets it.
    # (It writes its pid once its SIGTERM handler is in place: the pid file is the readiness check.)
    ignoring = (
        f"import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); "
        f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(60)"
    )
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {ignoring!r}])\ntime.sleep(60)\n"
    started = start(jobs, "victim", code)
    grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the grandchild's pid"))
    pids = [started["pid"], started["child_pid"], grandchild]
    assert all(is_running(pid) for pid in pids)

    killed = eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "victim", "--grace-s", "5")
    assert killed["effective"] == "killed" and killed["state"]["status"] == "killed"
    assert [pid for pid in pids if is_running(pid)] == []
    assert processes.group_members(started["pgid"]) == []
    assert "killed" in killed["log_tail"][-1]

    again = eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "victim")  # killing a finished job: a no-op
    assert again["effective"] == "killed" and again["state"] == killed["state"]
    absent = eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "never-started")
    assert absent["effective"] == "absent" and absent["state"] is None


# A stage that ignores SIGTERM: only SIGKILL ends it.
STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring SIGTERM', flush=True)\ntime.sleep(60)\n"
)


@pytest.mark.slow
def test_a_detached_kill_answers_at_once_and_a_start_meanwhile_waits_for_it_then_relaunches(jobs):
    """`job kill --detach` (the trigger's on_kill, which the triggerer cuts at 30 s) answers once the SIGTERM is
    sent, though the stage ignores it; the rest of the kill goes on in a detached process that holds the job's
    lock, so a `job start` that comes meanwhile waits, then finds the job killed and starts a new try, never
    attaching to the one being killed; nothing of that try survives."""
    first = start(jobs, "stubborn", STUBBORN)
    wait_until(lambda: "ignoring SIGTERM" in job.poll_job(jobs, "stubborn")["log"], "the stage to ignore SIGTERM")
    began = time.monotonic()
    killing = eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "stubborn", "--grace-s", "4", "--detach")
    assert time.monotonic() - began < 3.5  # the grace period (4 s) goes on after the answer
    assert killing["detached"] is True and killing["signalled"] is True
    assert killing["effective"] == "running"  # not recorded yet: the detached process does it

    second = start(jobs, "stubborn", "print('try 2')")  # waits for the lock
    assert time.monotonic() - began >= 4 and second["attached"] is False and second["try"] == 2
    assert not is_running(first["pid"]) and processes.group_members(first["pgid"]) == []
    assert second["refused"] is None  # try 1's group was gone: nothing left to stop
    done = wait_for_effective(jobs, "stubborn", "succeeded", log_offset=None)
    assert done["log"].splitlines()[1:] == ["try 2", done["log"].splitlines()[-1]]


# A stage that resumes: the first try works forever, a rerun finds its "checkpoint" and finishes.
RESUMING = (
    "import os, time\n"
    "if os.path.exists({marker!r}):\n"
    "    print('resumed from the checkpoint')\n"
    "else:\n"
    "    open({marker!r}, 'w').close()\n"
    "    print('first try, working')\n"
    "    time.sleep(60)\n"
)


@pytest.mark.slow
def test_a_crashed_job_is_dead_and_the_next_start_relaunches_it(jobs, tmp_path):
    marker = tmp_path / "checkpoint"
    code = RESUMING.format(marker=str(marker))
    first = start(jobs, "crash", code)
    wait_until(marker.exists, "the first try to start working")
    os.killpg(first["pgid"], signal.SIGKILL)  # supervisor and stage die at once, as in a crash
    wait_until(lambda: not is_running(first["pid"]), "the supervisor to die")

    dead = poll(jobs, "crash")
    assert dead["effective"] == "dead" and f"pid {first['pid']} is gone" in dead["reason"]
    assert dead["state"]["status"] == "running"  # poll never rewrites the state
    assert "first try, working" in dead["log_tail"]

    second = start(jobs, "crash", code)
    assert second["attached"] is False and second["try"] == 2 and second["pid"] != first["pid"]
    done = wait_for_effective(jobs, "crash", "succeeded")
    assert "try 1 started" in done["log"] and "try 2 started" in done["log"]
    assert "resumed from the checkpoint" in done["log"]


@pytest.mark.slow
def test_a_reboot_makes_the_job_dead(jobs, tmp_path, monkeypatch):
    boot_id_file = tmp_path / "boot_id"
    boot_id_file.write_text("boot-a\n")
    monkeypatch.setenv("EAGLE3_BOOT_ID_FILE", str(boot_id_file))  # seen by the CLI, the supervisor and job here
    start(jobs, "reboot", "import time; time.sleep(30)")
    assert poll(jobs, "reboot")["effective"] == "running"

    boot_id_file.write_text("boot-b\n")
    dead = poll(jobs, "reboot")
    assert dead["effective"] == "dead" and "boot id changed (box rebooted)" in dead["reason"]
    # kill after a "reboot" only records it: the pids belong to the previous boot (the fixture ends them here)
    assert eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "reboot")["state"]["status"] == "killed"


def hand_written_state(jobs_dir: Path, key: str, pid: int, **fields) -> dict:
    """Write the state.json a supervisor with `pid` would write for a running job (fields override)."""
    directory = jobs_dir / key
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "key": key,
        "try": 1,
        "status": "running",
        "pid": pid,
        "pgid": pid,
        "pid_start_ticks": processes.pid_start_ticks(pid),
        "boot_id": processes.read_boot_id(),
        "host": "box",
        "host_id": read_host_id(),
        "argv": ["x"],
        "started_at": "2026-01-01T00:00:00Z",
        "heartbeat_at": time.time(),
        "exit_code": None,
        "ended_at": None,
        "log": str(directory / "log"),
        "log_start": 0,
        **fields,
    }
    (directory / "state.json").write_text(json.dumps(state))
    return state


@pytest.fixture
def stranger():
    """A process that is no job's: a `sleep` leading a session (and so a process group) of its own."""
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    wait_until(lambda: processes.pid_start_ticks(process.pid), "the stranger to start")
    yield process
    process.kill()
    process.wait()


@pytest.mark.slow
def test_an_old_heartbeat_makes_the_job_dead(tmp_path, stranger):
    # A hand-written state whose "supervisor" is a stand-in: alive, right start time, silent for 300 s.
    hand_written_state(tmp_path / "jobs", "stale", stranger.pid, heartbeat_at=time.time() - 300)
    dead = poll(tmp_path / "jobs", "stale", "--stale-after-s", "120")
    assert dead["effective"] == "dead"
    assert re.search(r"heartbeat 30\d s old \(limit 120 s\)", dead["reason"]), dead["reason"]
    assert poll(tmp_path / "jobs", "stale", "--stale-after-s", "1000")["effective"] == "running"


@pytest.mark.slow
def test_a_hung_supervisor_is_dead_and_replaced_without_a_second_copy(jobs, tmp_path):
    marker = tmp_path / "checkpoint"
    code = RESUMING.format(marker=str(marker))
    timing = ("--heartbeat-s", "0.2", "--stale-after-s", "1")
    first = start(jobs, "hung", code, *timing)
    wait_until(marker.exists, "the first try to start working")
    beat = first["heartbeat_at"]
    wait_until(lambda: jobdir.read_state(jobs / "hung")["heartbeat_at"] > beat, "a heartbeat")

    os.kill(first["pid"], signal.SIGSTOP)  # the supervisor hangs; its stage works on
    dead = wait_until(
        lambda: (answer := poll(jobs, "hung", "--stale-after-s", "1"))["effective"] == "dead" and answer,
        "the silent supervisor's heartbeat to go stale",
    )
    assert "heartbeat" in dead["reason"] and "limit 1 s" in dead["reason"]

    second = start(jobs, "hung", code, *timing)
    assert second["try"] == 2 and second["attached"] is False
    assert not is_running(first["pid"]) and not is_running(first["child_pid"])  # the old copy is gone
    wait_for_effective(jobs, "hung", "succeeded", stale_after_s=1)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["../escape", "a b", "", ".hidden", "-x", "x" * 201, "bad\nkey", "a/b"])
def test_an_invalid_key_exits_2_naming_it(tmp_path, key):
    for command in (["start", f"--key={key}", "--", "true"], ["poll", f"--key={key}"], ["kill", f"--key={key}"]):
        proc = run_eagle3("job", command[0], "--jobs-dir", str(tmp_path / "jobs"), *command[1:], check=False)
        assert proc.returncode == 2 and f"error: job key {key!r} is invalid" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_log_streams_by_offset_without_overlap_or_half_lines(jobs, tmp_path):
    go_on = tmp_path / "go-on"
    code = (
        "import sys\n"
        "for i in range(5):\n"
        "    print(f'line {i}')\n"
        "sys.stdout.write('half a'); sys.stdout.flush()\n" + wait_for_file(go_on) + "print(' line')\n"
        "for i in range(5, 10):\n"
        "    print(f'line {i}')\n"
    )
    start(jobs, "stream", code)
    log_path = jobs / "stream" / "log"
    wait_until(lambda: log_path.exists() and "half a" in log_path.read_text(), "the first lines")

    first = poll(jobs, "stream")
    assert first["effective"] == "running"
    assert first["log"].endswith("line 4\n") and "half" not in first["log"]  # no half line while running
    assert first["log_offset"] == len(first["log"].encode())

    go_on.touch()
    wait_for_effective(jobs, "stream", "succeeded")
    second = poll(jobs, "stream", "--log-offset", str(first["log_offset"]))
    assert second["log"].startswith("half a line\nline 5\n") and "line 4" not in second["log"]
    assert first["log"] + second["log"] == log_path.read_text()
    assert poll(jobs, "stream", "--log-offset", str(second["log_offset"]))["log"] == ""

    # small pieces add up to the whole log too
    pieces, offset = [], 0
    while True:
        result = job.poll_job(jobs, "stream", log_offset=offset, max_log_bytes=7)
        if result["log_offset"] == offset:
            break
        pieces.append(result["log"])
        offset = result["log_offset"]
    assert "".join(pieces) == log_path.read_text()


@pytest.mark.slow
def test_a_stream_goes_on_from_its_cursor_and_another_stream_or_try_starts_at_the_try(jobs):
    """poll --stream: the box records how far a stream has copied the log (the offset it asks from), and a poll of
    that stream without an offset reads on from there; another stream (another Airflow try) and a new job try start
    at the try's first line; a stream's name is checked like a key."""
    start(jobs, "cursor", "for i in range(4): print(f'line {i}')\nraise SystemExit(1)")
    done = wait_for_effective(jobs, "cursor", "failed", log_offset=None)
    first = job.poll_job(jobs, "cursor", None, stream="ti-a")
    assert first["log"] == done["log"]  # no cursor yet: from the try's first line
    after_line_1 = first["log_offset"] - len("".join(first["log"].splitlines(keepends=True)[3:]).encode())
    job.poll_job(jobs, "cursor", after_line_1, stream="ti-a")  # ti-a has copied up to "line 1"
    assert job.poll_job(jobs, "cursor", None, stream="ti-a")["log"].splitlines()[:2] == ["line 2", "line 3"]
    assert job.poll_job(jobs, "cursor", None, stream="ti-b")["log"] == done["log"]

    assert start(jobs, "cursor", "print('second try')")["try"] == 2
    again = wait_for_effective(jobs, "cursor", "succeeded", log_offset=None)
    assert job.poll_job(jobs, "cursor", None, stream="ti-a")["log"] == again["log"]  # try 2's lines only
    assert "second try" in again["log"] and "line 0" not in again["log"]
    with pytest.raises(jobdir.JobError, match="--stream '../x' is invalid"):
        job.poll_job(jobs, "cursor", None, stream="../x")


@pytest.mark.slow
def test_a_redo_runs_a_finished_job_again_from_scratch_once_with_its_outputs_set_aside(tmp_path):
    """start --redo NAME: a succeeded job runs again, as try 1, with its earlier tries' files in redone/<time>/ and
    the outputs named by --set-aside renamed aside whole (a stage resumes from what it finds: it must find nothing
    of the old run); a retry with the same NAME attaches to the new try; only a stage's outputs a redo may move
    (eagle3.disk.layout.REDO_OUTPUTS), in the run directory, can be set aside: not its jobs, config or store link; no
    redo beside a live try."""
    run_dir = tmp_path / "run"
    jobs, out = run_dir / "jobs", run_dir / "train"
    write = (
        f"import os, sys\nos.makedirs({str(out)!r}, exist_ok=True)\n"
        f"open(os.path.join({str(out)!r}, 'step'), 'a').write(sys.argv[1])\nprint('wrote', sys.argv[1])\n"
    )

    def start_redo(marker: str, *redo: str) -> dict:
        return eagle3_job(
            "start",
            "--jobs-dir",
            str(jobs),
            "--key",
            "train",
            "--heartbeat-s",
            "0.5",
            *redo,
            "--",
            PY,
            "-c",
            write,
            marker,
        )

    start_redo("old")
    wait_for_effective(jobs, "train", "succeeded")
    assert start_redo("again")["attached"] is True  # no redo: a finished job is done
    redone = start_redo("new", "--redo", "run-abc", "--set-aside", str(out))
    assert redone["attached"] is False and redone["try"] == 1
    done = wait_for_effective(jobs, "train", "succeeded", log_offset=None)
    assert (out / "step").read_text() == "new" and "wrote new" in done["log"] and "wrote old" not in done["log"]
    (aside,) = run_dir.glob("train.before-redo-*")
    assert (aside / "step").read_text() == "old"
    (archive,) = (jobs / "train" / "redone").iterdir()
    assert "wrote old" in (archive / "log").read_text() and json.loads((archive / "state.json").read_text())["try"] == 1
    assert start_redo("retry", "--redo", "run-abc", "--set-aside", str(out))["attached"] is True  # once per NAME
    assert (out / "step").read_text() == "new"

    for hostile in (
        str(tmp_path / "elsewhere"),
        str(run_dir / "jobs"),
        str(run_dir / "config.json"),
        str(run_dir / "train" / ".." / ".." / "x"),
        str(run_dir / "hidden_states"),
    ):  # (the shared store)
        refused = run_eagle3(
            "job",
            "start",
            "--jobs-dir",
            str(jobs),
            "--key",
            "train",
            "--redo",
            "run-b",
            "--set-aside",
            hostile,
            "--",
            PY,
            "-c",
            "pass",
            check=False,
        )
        assert (
            refused.returncode == 2 and f"--set-aside {hostile!r} is not an output this job may move" in refused.stderr
        )
    assert (run_dir / "jobs").is_dir() and len(list(run_dir.glob("train.before-redo-*"))) == 1

    live = start(jobs, "live", "import time; time.sleep(30)")
    refused = run_eagle3(
        "job", "start", "--jobs-dir", str(jobs), "--key", "live", "--redo", "run-c", "--", PY, "-c", "pass", check=False
    )
    assert (
        refused.returncode == 1
        and f"job live is running (try 1, pid {live['pid']}): a redo does not start beside a live try" in refused.stderr
    )
    job.kill_job(jobs, "live", grace_s=1)


@pytest.mark.slow
def test_job_help_hides_supervise_and_the_module_stays_light():
    assert "supervise" not in run_eagle3("job", "--help").stdout
    check = "import sys, eagle3.jobs.job; assert not {'torch', 'airflow'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([PY, "-c", check], check=True)


# ---------------------------------------------------------------------------------------------------------------------
# Trust boundaries: a stale or hostile file never gets anything signalled that the job does not own, and the
# caller's secrets never reach the stage or the job's files.


def kill_cli(jobs_dir: Path, key: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_eagle3(
        "job", "kill", "--jobs-dir", str(jobs_dir), "--key", key, "--grace-s", "2", check=False, timeout=60
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(proc.stdout)


@pytest.fixture
def signals_sent(monkeypatch) -> list:
    """Record, instead of sending, every signal this process would send."""
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pgid, signum: sent.append(("killpg", pgid, signum)))
    monkeypatch.setattr(os, "kill", lambda pid, signum: sent.append(("kill", pid, signum)))
    return sent


@pytest.mark.slow
def test_a_pgid_tampered_to_name_another_group_gets_that_group_neither_killed_nor_in_the_way(jobs, stranger):
    """Attack: state.json keeps a live supervisor's pid but its pgid names a stranger's process group."""
    stand_in = subprocess.Popen(["sleep", "60"], start_new_session=True)  # the "supervisor" the file names
    try:
        wait_until(lambda: processes.pid_start_ticks(stand_in.pid), "the stand-in to start")
        hand_written_state(jobs, "tampered", stand_in.pid, pgid=stranger.pid)

        proc, killed = kill_cli(jobs, "tampered")
        assert proc.returncode == 1 and "error: job tampered was not killed" in proc.stderr
        assert killed["signalled"] is False and killed["effective"] == "dead"
        assert str(jobs / "tampered" / "state.json") in killed["refused"]
        assert f"pgid {stranger.pid} is not pid {stand_in.pid}" in killed["refused"]

        started = start(jobs, "tampered", "print('the real stage')")  # relaunched over the file, nothing signalled
        assert started["attached"] is False and started["try"] == 2  # (the try number is still readable)
        assert f"pgid {stranger.pid} is not pid {stand_in.pid}" in started["refused"]
        wait_for_effective(jobs, "tampered", "succeeded")
        assert is_running(stranger.pid) and is_running(stand_in.pid)
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.slow
def test_pid_1_or_0_in_state_json_is_never_signalled(jobs, signals_sent):
    """Attack: state.json names init (pid and pgid 1), which would have had `killpg(1, SIGKILL)` sent to it."""
    state = hand_written_state(jobs, "init", 1)
    killed = job.kill_job(jobs, "init", grace_s=1)
    assert killed["signalled"] is False and "pid 1 cannot be a supervisor's" in killed["refused"]
    assert signals_sent == []
    assert (jobs / "init" / "state.json").read_text() == json.dumps(state)  # a corrupt state is left as it is

    # kill_leftovers, whatever it is handed, and the ownership check itself
    for bad in (1, 0, -1):
        record = {"pid": bad, "pgid": bad, "pid_start_ticks": 0, "boot_id": processes.read_boot_id()}
        assert "cannot be a supervisor's" in processes.group_ownership_problem(record)
        assert "cannot be a supervisor's" in processes.kill_leftovers(record, wait_s=0)
        assert "cannot be a supervisor's" in processes.kill_leftovers({"pgid": bad, "pid_start_ticks": 0}, wait_s=0)
    assert signals_sent == []

    started = job.start_job(jobs, "init", [PY, "-c", "print('relaunched')"])  # (the supervisor is a real process)
    assert started["attached"] is False and "pid 1 cannot be a supervisor's" in started["refused"]
    assert signals_sent == []
    wait_for_effective(jobs, "init", "succeeded")


def test_pid_1_refused_by_the_cli_too(jobs):
    """Attack: as above, through `python -m eagle3 job kill` (nothing is monkeypatched: the refusal is real)."""
    hand_written_state(jobs, "init", 1)
    proc, killed = kill_cli(jobs, "init")
    assert proc.returncode == 1 and "pid 1 cannot be a supervisor's" in killed["refused"]
    assert killed["signalled"] is False


@pytest.mark.slow
def test_a_reused_pid_is_not_signalled(jobs, stranger):
    """Attack (or just a stale file): the recorded pid is alive, but it is another process: it started later."""
    ticks = processes.pid_start_ticks(stranger.pid)
    hand_written_state(jobs, "reused", stranger.pid, pid_start_ticks=ticks - 1)

    proc, killed = kill_cli(jobs, "reused")
    assert proc.returncode == 0, proc.stderr  # nothing of the job is left, which is what kill is for
    assert killed["signalled"] is False and killed["state"]["status"] == "killed"
    assert f"pid {stranger.pid} is another process now" in killed["refused"]

    hand_written_state(jobs, "reused", stranger.pid, pid_start_ticks=ticks - 1)
    started = start(jobs, "reused", "print('relaunched')")
    assert started["try"] == 2 and f"pid {stranger.pid} is another process now" in started["refused"]
    wait_for_effective(jobs, "reused", "succeeded")
    assert is_running(stranger.pid)


@pytest.mark.slow
def test_a_live_stranger_leading_its_own_group_is_not_signalled(jobs, stranger):
    """Attack: state.json names a live process that leads a group of its own (a shell, a daemon), with its true start
    time, this boot's id and a fresh heartbeat: every check on the file's numbers passes, yet nothing marks it as
    the job's supervisor. Neither kill nor a relaunch's clean-up signals it."""
    hand_written_state(jobs, "foreign", stranger.pid)
    proc, killed = kill_cli(jobs, "foreign")
    assert killed["signalled"] is False and is_running(stranger.pid)
    assert (
        f"pid {stranger.pid} leads a live process group, but neither it nor any process of its group carries "
        f"this job's marks ({processes.JOB_DIR_VAR}={os.path.realpath(jobs / 'foreign')}, {processes.GROUP_MARK_VAR}="
        in killed["refused"]
        and killed["refused"].endswith("it is not the job's supervisor")
    )

    hand_written_state(jobs, "foreign", stranger.pid, heartbeat_at=time.time() - 300)  # dead: start relaunches
    started = start(jobs, "foreign", "print('relaunched')")
    assert started["try"] == 2 and "it is not the job's supervisor" in started["refused"]
    wait_for_effective(jobs, "foreign", "succeeded")
    assert is_running(stranger.pid)


@pytest.mark.slow
def test_another_jobs_live_supervisor_named_in_a_tampered_state_is_not_signalled(jobs, tmp_path):
    """Attack: state.json copies another live job's pid and start time. That group does carry a supervisor's mark,
    but the other job's: its directory is not this one."""
    go_on = tmp_path / "go-on"
    other = start(jobs, "other", wait_for_file(go_on))
    hand_written_state(jobs, "tampered", other["pid"])
    proc, killed = kill_cli(jobs, "tampered")
    assert killed["signalled"] is False and "it is not the job's supervisor" in killed["refused"]
    assert poll(jobs, "other")["effective"] == "running" and is_running(other["child_pid"])
    go_on.touch()
    wait_for_effective(jobs, "other", "succeeded")


def test_a_group_whose_leader_is_gone_is_signalled_only_if_it_carries_the_jobs_mark(jobs):
    """Attack: the recorded supervisor is gone and a stranger's group of that number lives on without its leader
    (the number was reused after the job had ended); its pid and start time match what state.json says."""
    leader = subprocess.Popen(
        [
            PY,
            "-c",
            "import subprocess, sys; print(subprocess.Popen(['sleep', '60']).pid, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    orphan = int(leader.stdout.readline())
    try:
        hand_written_state(jobs, "orphans", leader.pid)  # the leader's true start time
        leader.stdin.close()
        leader.wait()
        assert processes.group_members(leader.pid) == [orphan]

        proc, killed = kill_cli(jobs, "orphans")
        assert killed["signalled"] is False and f"carries its mark {processes.GROUP_MARK_VAR}=" in killed["refused"]
        assert is_running(orphan)
    finally:
        os.kill(orphan, signal.SIGKILL)


@pytest.mark.slow
def test_a_supervisor_killed_alone_has_its_stage_stopped_before_the_relaunch(jobs, tmp_path):
    """The other side of the mark: the stage that outlived its supervisor is the job's, and is SIGKILLed."""
    marker = tmp_path / "checkpoint"
    code = RESUMING.format(marker=str(marker))
    first = start(jobs, "alone", code)
    wait_until(marker.exists, "the first try to start working")
    os.kill(first["pid"], signal.SIGKILL)  # the supervisor only: its stage works on, leading nothing
    wait_until(lambda: not is_running(first["pid"]), "the supervisor to die")
    assert is_running(first["child_pid"])

    second = start(jobs, "alone", code)
    assert second["try"] == 2 and second["refused"] is None
    assert not is_running(first["child_pid"])  # no second copy beside the first
    assert "resumed from the checkpoint" in wait_for_effective(jobs, "alone", "succeeded")["log"]


@pytest.mark.slow
def test_a_permission_error_from_the_kernel_is_reported_not_raised(jobs, monkeypatch, capsys):
    """Attack: the job's group holds a process this user may not signal (here: killpg raises EPERM)."""
    from eagle3.__main__ import main

    started = start(jobs, "perm", "import time; time.sleep(30)")

    def refuse(pgid, signum):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "killpg", refuse)
    killed = job.kill_job(jobs, "perm", grace_s=1)
    assert killed["signalled"] is False and killed["state"]["status"] == "running"  # nothing recorded
    assert "Operation not permitted" in killed["refused"] and f"kill -KILL -- -{started['pgid']}" in killed["refused"]

    with pytest.raises(SystemExit) as exit_info:
        main(["job", "kill", "--jobs-dir", str(jobs), "--key", "perm", "--grace-s", "1"])
    assert exit_info.value.code == 1
    assert "error: job perm was not killed: the kernel refused" in capsys.readouterr().err

    # A start that finds the try dead (stale heartbeat) but cannot stop it launches no second copy.
    with pytest.raises(job.JobLaunchError, match="cannot be stopped: the kernel refused"):
        job.start_job(jobs, "perm", [PY, "-c", "pass"], heartbeat_s=0.01, stale_after_s=0.02)
    assert jobdir.read_state(jobs / "perm")["try"] == 1 and is_running(started["child_pid"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "content, problem",
    [
        ('{"key": "torn", "sta', "not valid JSON"),
        ("{}", "no key, try, status, pid"),
        ("[1, 2]", "JSON an array, not an object"),
    ],
)
def test_a_torn_or_keyless_state_json_is_reported_and_relaunched_over(jobs, content, problem):
    """Attack (or a broken disk): state.json is torn, empty of keys or not an object. Before, every start raised
    KeyError or JSONDecodeError on it, for ever."""
    (jobs / "torn").mkdir(parents=True)
    (jobs / "torn" / "state.json").write_text(content)
    polled = poll(jobs, "torn")
    assert polled["effective"] == "dead" and polled["state"] is None
    assert f"{jobs / 'torn' / 'state.json'} is not a job state ({problem}" in polled["reason"]
    proc, killed = kill_cli(jobs, "torn")
    assert proc.returncode == 1 and "nothing was signalled" in killed["refused"]

    first = start(jobs, "torn", "print('ran')")
    assert first["try"] == 1 and problem in first["refused"]
    wait_for_effective(jobs, "torn", "succeeded")

    (jobs / "torn" / "state.json").write_text(content)  # again, now that spec.json tells the last try
    second = start(jobs, "torn", "print('ran again')")
    assert second["try"] == 2
    assert "ran again" in wait_for_effective(jobs, "torn", "succeeded")["log"]


@pytest.mark.slow
def test_a_corrupt_state_json_with_its_supervisor_alive_launches_no_second_copy(jobs):
    """Attack: state.json is overwritten while the job runs. Its supervisor still runs and repairs the file at its
    next heartbeat; a relaunch meanwhile would run the stage twice."""
    started = start(jobs, "live", "import time; time.sleep(30)", "--heartbeat-s", "0.2")
    os.kill(started["pid"], signal.SIGSTOP)  # no heartbeat until the checks below are done
    try:
        (jobs / "live" / "state.json").write_text("{}")
        proc = run_eagle3("job", "start", "--jobs-dir", str(jobs), "--key", "live", "--", PY, "-c", "pass", check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert f"supervisor (pid {started['pid']}) still runs: not launching a second copy" in proc.stderr
        proc, killed = kill_cli(jobs, "live")
        assert proc.returncode == 1 and f"its supervisor (pid {started['pid']}) still runs" in killed["refused"]
    finally:
        os.kill(started["pid"], signal.SIGCONT)
    repaired = wait_for_effective(jobs, "live", "running")
    assert repaired["state"]["pid"] == started["pid"] and repaired["state"]["try"] == 1


SECRETS = {
    "AIRFLOW__CORE__FERNET_KEY": "secret-fernet",
    "AIRFLOW__API_AUTH__JWT_SECRET": "secret-jwt",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:secret-pw@h/db",
}


@pytest.mark.slow
def test_the_callers_secrets_reach_neither_the_stage_nor_spec_json(jobs, monkeypatch):
    """Attack: `job start` runs on an Airflow worker whose environment holds the Fernet key, the JWT secret and
    the database URL; the stage gets only the allowlist and --pass-env names, and spec.json holds no value."""
    for name, value in {**SECRETS, "MY_TOKEN": "secret-token", "HF_HOME": "/cache/hf"}.items():
        monkeypatch.setenv(name, value)
    jobs.mkdir(mode=0o755)  # as older code left it
    os.chmod(jobs, 0o755)
    code = "import json, os; print('ENV=' + json.dumps(dict(os.environ)))"
    start(jobs, "env", code, "--pass-env", "MY_TOKEN")
    log = wait_for_effective(jobs, "env", "succeeded")["log"]
    stage_env = json.loads(next(line for line in log.splitlines() if line.startswith("ENV="))[4:])

    assert not set(SECRETS) & set(stage_env)
    assert stage_env["MY_TOKEN"] == "secret-token" and stage_env["HF_HOME"] == "/cache/hf"
    assert stage_env["PATH"] == os.environ["PATH"] and processes.GROUP_MARK_VAR in stage_env
    assert stage_env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # (not the supervisor's, which has ours first)
    spec_bytes = (jobs / "env" / "spec.json").read_bytes()
    for value in [*SECRETS.values(), "secret-token", "secret-pw"]:
        assert value.encode() not in spec_bytes
    spec = json.loads(spec_bytes)
    assert "MY_TOKEN" in spec["env_names"] and "env" not in spec and not set(SECRETS) & set(spec["env_names"])

    assert {path.name: path.stat().st_mode & 0o777 for path in [jobs, *jobs.iterdir()]} == {"jobs": 0o700, "env": 0o700}
    for name in ("spec.json", "state.json", "log", "lock"):
        assert (jobs / "env" / name).stat().st_mode & 0o777 == 0o600, name


@pytest.mark.slow
def test_pass_env_takes_names_only(jobs):
    proc = run_eagle3(
        "job", "start", "--jobs-dir", str(jobs), "--key", "bad", "--pass-env", "A=B", "--", "true", check=False
    )
    assert proc.returncode == 2 and "error: --pass-env 'A=B' is not an environment variable's name" in proc.stderr
    assert not jobs.exists()


def test_a_job_directory_of_another_user_is_refused(jobs, monkeypatch):
    """Attack: someone else made the job's directory (and could read or swap its files)."""
    (jobs / "theirs").mkdir(parents=True)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(jobs).st_uid + 4242)
    with pytest.raises(jobdir.JobError, match=r"job directory .*theirs belongs to uid \d+, not to this user"):
        job.start_job(jobs, "theirs", [PY, "-c", "pass"])
    assert list((jobs / "theirs").iterdir()) == []


# -- job files that are links or another user's: poll and kill read nothing through them and act on nothing --------

SECRET = "AWS_SECRET_ACCESS_KEY=hunter2\n"  # what a link in the job's directory would have poll copy to the caller
OTHER_UID = 65534  # nobody


def finished_job(jobs_dir: Path, key: str, stranger) -> Path:
    """A succeeded job's directory, as its supervisor leaves it: state.json, a log of two lines, a stream's cursor."""
    hand_written_state(jobs_dir, key, stranger.pid, status="succeeded", exit_code=0, log_start=0)
    directory = jobs_dir / key
    (directory / "log").write_text("line 0\nline 1\n")
    (directory / job.CURSOR_FILE).write_text(json.dumps({"stream": "ti-a", "try": 1, "offset": 7}))
    return directory


def link_in_place(path: Path, target: Path) -> None:
    """Replace `path` by a link to `target`, which holds `path`'s bytes unless it exists already."""
    if not target.exists():
        target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)


def test_a_finished_jobs_own_files_are_read_and_streamed(jobs, stranger):
    """The ordinary case the checks below must leave alone: the job's own files, read and streamed."""
    finished_job(jobs, "own", stranger)
    polled = job.poll_job(jobs, "own", None, stream="ti-a")
    assert (polled["effective"], polled["log"], polled["log_size"]) == ("succeeded", "line 1\n", 14)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["state.json", "log", job.CURSOR_FILE])
def test_a_job_file_that_is_a_link_is_not_followed_by_poll_or_its_stream(jobs, tmp_path, stranger, name):
    """Attack: the job's state.json, log or stream cursor made a link (the log to a file of secrets, which poll
    --stream would copy into the Airflow task log). poll reads nothing through it: exit 2, naming the file."""
    directory = finished_job(jobs, "linked", stranger)
    link_in_place(directory / name, tmp_path / "elsewhere")
    if name == "log":
        (tmp_path / "elsewhere").write_text(SECRET)
    refusal = rf"^{re.escape(str(directory / name))}: a symbolic link, where the job keeps a regular file\. "
    with pytest.raises(jobdir.UnsafeJobFile, match=refusal):
        job.poll_job(jobs, "linked", None, stream="ti-a")
    proc = run_eagle3(
        "job", "poll", "--jobs-dir", str(jobs), "--key", "linked", "--stream", "ti-a", check=False, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {directory / name}: a symbolic link")
    assert "remove it (as its owner or root)" in proc.stderr
    assert "hunter2" not in proc.stdout + proc.stderr and (directory / name).is_symlink()


@pytest.mark.timeout(60)  # (signal method: a FIFO opened to read without blocking would hang here, and is stopped)
def test_a_log_that_is_a_fifo_is_refused_without_waiting_for_a_writer(jobs, stranger):
    directory = finished_job(jobs, "fifo", stranger)
    (directory / "log").unlink()
    os.mkfifo(directory / "log")
    with pytest.raises(jobdir.UnsafeJobFile, match=r"log: a FIFO, where the job keeps a regular file"):
        job.poll_job(jobs, "fifo")


@pytest.mark.slow
def test_kill_acts_on_no_state_json_that_is_a_link_and_makes_no_lock_through_one(
    jobs, tmp_path, stranger, signals_sent
):
    """Attack: state.json a link (kill would act on what it points at, and record the kill over the link); the lock
    a link to another file (kill's 0600 would have been set on that file)."""
    directory = finished_job(jobs, "linked", stranger)
    hand_written_state(jobs, "linked", stranger.pid)  # running, so that kill would act
    link_in_place(directory / "state.json", tmp_path / "state-elsewhere.json")
    before = (tmp_path / "state-elsewhere.json").read_bytes()
    with pytest.raises(jobdir.UnsafeJobFile, match=r"state\.json: a symbolic link"):
        job.kill_job(jobs, "linked", grace_s=1)
    assert signals_sent == [] and (directory / "state.json").is_symlink()
    assert (tmp_path / "state-elsewhere.json").read_bytes() == before

    (directory / "state.json").unlink()
    hand_written_state(jobs, "linked", stranger.pid)
    victim = tmp_path / "victim"
    victim.write_text("someone's file\n")
    victim.chmod(0o644)
    (directory / "lock").unlink(missing_ok=True)
    (directory / "lock").symlink_to(victim)
    with pytest.raises(jobdir.UnsafeJobFile, match=r"lock: a symbolic link"):
        job.kill_job(jobs, "linked", grace_s=1)
    assert signals_sent == [] and (victim.stat().st_mode & 0o777) == 0o644
    proc = run_eagle3("job", "kill", "--jobs-dir", str(jobs), "--key", "linked", check=False, timeout=60)
    assert proc.returncode == 2 and f"error: {directory / 'lock'}: a symbolic link" in proc.stderr


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="making a file of another uid takes root (os.chown), and these tests do not run as root here",
)
@pytest.mark.parametrize("name", ["", "state.json", "log", job.CURSOR_FILE])
def test_a_job_directory_or_file_of_another_user_is_not_read_by_poll_or_kill(jobs, stranger, signals_sent, name):
    """Attack: the job's directory, or a file in it, made by another user (in a shared jobs dir, say): its state
    would name any process group, its log any text. poll and kill refuse it, naming it and its owner."""
    directory = finished_job(jobs, "theirs", stranger)
    hand_written_state(jobs, "theirs", stranger.pid)  # running, so that kill would act
    os.chown(directory / name, OTHER_UID, OTHER_UID)
    shown = directory / name if name else directory
    refusal = rf"^{re.escape(str(shown))}: owned by uid {OTHER_UID}, not by this user \(uid 0\)\. "
    with pytest.raises(jobdir.UnsafeJobFile, match=refusal):
        job.poll_job(jobs, "theirs", None, stream="ti-a")
    if name != job.CURSOR_FILE:  # (a stream's cursor is poll --stream's alone)
        with pytest.raises(jobdir.UnsafeJobFile, match=refusal):
            job.kill_job(jobs, "theirs", grace_s=1)
    assert signals_sent == [] and not (directory / "lock").exists()
    assert json.loads((directory / "state.json").read_text())["status"] == "running"  # no kill recorded either


# -- stalls: alive, heartbeating, and doing nothing ------------------------------------------------------------

BEATING = """
import os, signal, sys, time
from eagle3.jobs.progress import beat
for step in range({steps}):
    beat(f"step {{step}}")
    print(f"step {{step}}", flush=True)
    time.sleep({pause})
    if step == {stop_at}:
        os.kill(os.getpid(), signal.SIGSTOP)  # as an NCCL hang or a dead mount would: alive, and stuck
"""


@pytest.mark.slow
def test_a_stage_that_stops_making_progress_is_killed_and_its_try_failed(jobs):
    """Attack on an unattended weekend: the stage's process is stopped (SIGSTOP) after three progress beats. The
    supervisor keeps heartbeating, so the job looked alive forever; now the stage is killed within the stall limit
    (2 s here, checked every heartbeat) and the try fails naming the last progress line."""
    code = BEATING.format(steps=100, pause=0.3, stop_at=2)
    started = time.monotonic()
    job_state = start(jobs, "hung", code, "--heartbeat-s", "0.5", "--stall-timeout-s", "2")
    result = wait_for_effective(jobs, "hung", "failed")
    elapsed = time.monotonic() - started
    assert elapsed < 2 + 0.9 + 1.0 + 5, f"took {elapsed:.1f} s"  # the beats, the limit, a heartbeat, slack
    assert result["reason"].startswith("no progress for") and "since its last progress: 'step 2'" in result["reason"]
    assert not is_running(result["state"]["child_pid"])
    assert result["state"]["progress_line"] == "step 2"
    assert "no progress for" in (jobs / "hung" / "log").read_text()
    assert job_state["try"] == 1 and result["state"]["stalled"]


@pytest.mark.slow
def test_a_slow_stage_that_keeps_making_progress_is_not_killed(jobs):
    """Eight beats 0.8 s apart (6 s in all) under a 2 s stall limit, and a first beat only after 1.5 s, under
    --first-progress-timeout-s 3: never more silent than allowed, so it runs to success."""
    code = "import time; time.sleep(1.5)\n" + BEATING.format(steps=8, pause=0.8, stop_at=-1)
    start(jobs, "slow", code, "--heartbeat-s", "0.5", "--stall-timeout-s", "2", "--first-progress-timeout-s", "3")
    result = wait_until(lambda: (r := job.poll_job(jobs, "slow"))["effective"] != "running" and r, "slow job's end")
    assert result["effective"] == "succeeded", result["reason"]
    assert result["state"]["progress_line"] == "step 7"


@pytest.mark.slow
def test_a_stage_that_waited_before_loading_gets_the_first_progress_limit_again(jobs):
    """A stage that waits for something before it loads its model (extract, for a shard another writer holds) beats
    while it waits, which leaves it the limit between beats for the load that follows. The supervisor hands it the
    first-progress limit (FIRST_PROGRESS_VAR), which it announces as its allowance once the wait is over: a load
    longer than the limit between beats, within the first one, is not killed."""
    code = (
        f"import os, time\nfrom eagle3.jobs.progress import beat\nfor i in range(4):\n    beat(f'waiting {{i}}')\n"
        f"    time.sleep(0.3)\nbeat('loading', allowance_s=float(os.environ[{supervisor.FIRST_PROGRESS_VAR!r}]))\n"
        "time.sleep(3.5)\nbeat('step 0')\ntime.sleep(1)\n"
    )
    start(jobs, "waited", code, "--heartbeat-s", "0.5", "--stall-timeout-s", "1.5", "--first-progress-timeout-s", "6")
    result = wait_until(lambda: (r := job.poll_job(jobs, "waited"))["effective"] != "running" and r, "its end")
    assert result["effective"] == "succeeded", (result["reason"], result["log_tail"])
    assert result["state"]["progress_line"] == "step 0"


@pytest.mark.slow
def test_a_stage_that_never_reports_progress_is_killed_after_the_first_limit(jobs):
    """A stage that hangs while loading (before any progress) is caught by --first-progress-timeout-s."""
    start(
        jobs,
        "loading",
        "import time; time.sleep(600)",
        "--heartbeat-s",
        "0.5",
        "--stall-timeout-s",
        "60",
        "--first-progress-timeout-s",
        "1.5",
    )
    result = wait_for_effective(jobs, "loading", "failed")
    assert "since the stage started (no progress yet)" in result["reason"] and "limit 1.5 s" in result["reason"]


# ---------------------------------------------------------------------------------------------------------------------
# Another host's job (two boxes sharing a work directory: issue 43, item 4)


def as_host(monkeypatch, tmp_path: Path, name: str) -> None:
    """Make the CLI run from here as host `name`: its host id file says so (EAGLE3_HOST_ID_FILE, read by job start,
    poll and kill, and handed on to the supervisor, which records it). One machine, two hosts by their records."""
    path = tmp_path / f"machine-id-{name}"
    path.write_text(f"machine-id-of-{name}\n")
    monkeypatch.setenv("EAGLE3_HOST_ID_FILE", str(path))


@pytest.mark.slow
def test_a_job_running_on_another_host_is_foreign_never_started_again_killed_or_redone(jobs, tmp_path, monkeypatch):
    """Box A runs the job; box B shares the work directory. B's poll says "foreign" naming A, B's start and redo
    refuse with an exit status of their own (Exit.FOREIGN: the control plane fails the task without spending its
    retries, each of which would be refused again; not 2, which also means argparse's usage errors), and B's kill
    signals nothing and records nothing: A's job runs on untouched, same pid, try 1. A itself still polls and kills
    it."""
    as_host(monkeypatch, tmp_path, "gpu-box-1")
    started = start(jobs, "train", "import time; time.sleep(60)")
    assert started["host_id"] == "machine-id-of-gpu-box-1"
    as_host(monkeypatch, tmp_path, "gpu-box-2")
    polled = poll(jobs, "train")
    assert polled["effective"] == "foreign" and "machine-id-of-gpu-box-1" in polled["reason"], polled
    for redo in ([], ["--redo", "run-0123"]):
        again = run_eagle3(
            "job",
            "start",
            "--jobs-dir",
            str(jobs),
            "--key",
            "train",
            *redo,
            "--",
            PY,
            "-c",
            "1",
            check=False,
            timeout=60,
        )
        assert again.returncode == Exit.FOREIGN == 3 and "running on another host" in again.stderr, again.stderr
    proc, killed = kill_cli(jobs, "train")
    assert proc.returncode == 1 and "not killed from this host" in killed["refused"] and not killed["signalled"]
    state = jobdir.read_state(jobs / "train")
    assert (state["status"], state["pid"], state["try"]) == ("running", started["pid"], 1)
    assert processes.pid_start_ticks(started["pid"]) == started["pid_start_ticks"]  # alive
    as_host(monkeypatch, tmp_path, "gpu-box-1")
    assert poll(jobs, "train")["effective"] == "running"
    assert kill_cli(jobs, "train")[1]["signalled"]


@pytest.mark.slow
def test_another_hosts_job_is_foreign_however_old_its_heartbeat(jobs, tmp_path, monkeypatch):
    """This host cannot see another host's processes, so a recorded pid that is gone here, another boot id and an
    old heartbeat (a slow shared filesystem, a clock apart) never make that host's job dead: it is not relaunched.
    The same record made on this host is a dead job, relaunched."""
    as_host(monkeypatch, tmp_path, "gpu-box-2")
    gone = 4_000_000  # no process here has this pid
    hand_written_state(
        jobs,
        "train",
        gone,
        pid_start_ticks=1,
        boot_id="boot-of-box-1",
        host="gpu-box-1",
        host_id="machine-id-of-gpu-box-1",
        heartbeat_at=time.time() - 3600,
    )
    assert poll(jobs, "train")["effective"] == "foreign"
    refused = run_eagle3(
        "job", "start", "--jobs-dir", str(jobs), "--key", "train", "--", PY, "-c", "1", check=False, timeout=60
    )
    assert refused.returncode == Exit.FOREIGN and "gpu-box-1" in refused.stderr
    assert jobdir.read_state(jobs / "train")["pid"] == gone  # nothing launched over it
    state = json.loads((jobs / "train" / "state.json").read_text())
    (jobs / "train" / "state.json").write_text(json.dumps({**state, "host_id": "machine-id-of-gpu-box-2"}))
    assert poll(jobs, "train")["effective"] == "dead"
    assert start(jobs, "train", "1")["try"] == 2


def test_a_host_id_that_is_not_a_string_makes_a_corrupt_state(jobs):
    """A planted state.json whose host id is no host's would otherwise block the job forever as foreign."""
    hand_written_state(jobs, "train", os.getpid(), host_id=7)
    assert poll(jobs, "train")["effective"] == "dead"
