"""`python -m eagle3 job`: detached jobs that survive their SSH session, re-attach, die cleanly and are seen dead.

Real processes throughout: the CLI runs in fresh interpreters as over SSH, and the jobs are small Python commands.
Waiting loops call eagle3.job directly (no interpreter start per look). The `jobs` fixture SIGKILLs whatever a
test leaves running.
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

from eagle3 import job
from tests.conftest import run_eagle3

PY = sys.executable


@pytest.fixture
def jobs(tmp_path):
    jobs_dir = tmp_path / "jobs"
    yield jobs_dir
    for state_file in jobs_dir.glob("*/state.json"):
        state = json.loads(state_file.read_text())
        if state["pgid"] != os.getpgid(0):  # never this test process's own group
            job.kill_leftovers(state, wait_s=5)


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
    return job.pid_start_ticks(pid) is not None


def wait_for_file(path: Path) -> str:
    """Python code that waits until `path` exists: lets a test decide when a job moves on."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}):\n    time.sleep(0.05)\n"


def test_start_poll_and_success_with_the_output_in_the_log(jobs, tmp_path):
    go_on = tmp_path / "go-on"
    started = start(jobs, "ok", "print('hello from the stage')\n" + wait_for_file(go_on) + "print('done')")
    assert started["attached"] is False and started["status"] == "running" and started["try"] == 1
    assert started["pgid"] == started["pid"] and started["boot_id"] == job.read_boot_id()
    assert started["pid_start_ticks"] == job.pid_start_ticks(started["pid"])

    polled = poll(jobs, "ok")
    assert polled["effective"] == "running" and polled["state"]["pid"] == started["pid"]

    go_on.touch()
    done = wait_for_effective(jobs, "ok", "succeeded")
    assert done["state"]["exit_code"] == 0 and done["state"]["ended_at"] and done["log_tail"] == []
    assert re.match(r"==== eagle3 job ok try 1 started \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ on \S+ ====\n", done["log"])
    assert "hello from the stage\ndone\n" in done["log"]
    assert (jobs / "ok").stat().st_mode & 0o777 == 0o700  # spec.json holds the environment

    again = start(jobs, "ok", "print('must not run')")  # a succeeded job is reported, not rerun
    assert again["attached"] is True and again["try"] == 1
    assert "must not run" not in (jobs / "ok" / "log").read_text()


def test_a_failing_command_is_failed_with_its_exit_code_and_log_tail(jobs):
    start(jobs, "bad", "import sys; print('about to fail'); sys.exit(3)")
    wait_for_effective(jobs, "bad", "failed")
    polled = poll(jobs, "bad")
    assert polled["state"]["exit_code"] == 3 and "exit code 3" in polled["reason"]
    assert "about to fail" in polled["log_tail"]


def test_a_missing_program_fails_with_127(jobs):
    result = eagle3_job("start", "--jobs-dir", str(jobs), "--key", "nope", "--", "/no/such/program")
    result = result if result["status"] == "failed" else wait_for_effective(jobs, "nope", "failed")["state"]
    assert result["exit_code"] == 127
    assert "cannot start '/no/such/program'" in (jobs / "nope" / "log").read_text()


def test_start_twice_attaches_to_the_running_job(jobs):
    # (start returns at once while the job runs on: the supervisor does not hold start's stdout pipe open)
    first = start(jobs, "twice", "import time; time.sleep(30)")
    second = start(jobs, "twice", "import time; time.sleep(30)")
    assert second["attached"] is True and second["pid"] == first["pid"] and second["try"] == 1
    assert (jobs / "twice" / "log").read_text().count("==== eagle3 job twice try") == 1


def test_concurrent_starts_launch_one_try(jobs):
    argv = [PY, "-m", "eagle3", "job", "start", "--jobs-dir", str(jobs), "--key", "race", "--",
            PY, "-c", "import time; time.sleep(30)"]
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


def test_kill_ends_the_whole_process_group(jobs, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # The stage spawns a grandchild that even ignores SIGTERM: only the final SIGKILL of the group gets it.
    code = (
        "import subprocess, sys, time\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(grandchild.pid))\n"
        "time.sleep(60)\n"
    )
    started = start(jobs, "victim", code)
    grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the grandchild's pid"))
    time.sleep(0.3)  # let the grandchild install its SIGTERM handler
    processes = [started["pid"], started["child_pid"], grandchild]
    assert all(is_running(pid) for pid in processes)

    killed = eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "victim", "--grace-s", "5")
    assert killed["effective"] == "killed" and killed["state"]["status"] == "killed"
    assert [pid for pid in processes if is_running(pid)] == []
    assert job.group_members(started["pgid"]) == []
    assert "killed" in killed["log_tail"][-1]

    again = eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "victim")  # killing a finished job: a no-op
    assert again["effective"] == "killed" and again["state"] == killed["state"]
    absent = eagle3_job("kill", "--jobs-dir", str(jobs), "--key", "never-started")
    assert absent["effective"] == "absent" and absent["state"] is None


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


def test_an_old_heartbeat_makes_the_job_dead(tmp_path):
    # A hand-written state whose "supervisor" is this very test process: alive, right start time, silent for 300 s.
    # (Outside the `jobs` fixture, so that nothing ever SIGKILLs this process's group; only poll looks at it.)
    directory = tmp_path / "jobs" / "stale"
    directory.mkdir(parents=True)
    pid = os.getpid()
    (directory / "state.json").write_text(json.dumps({
        "key": "stale", "try": 1, "status": "running", "pid": pid, "pgid": os.getpgid(0),
        "pid_start_ticks": job.pid_start_ticks(pid), "boot_id": job.read_boot_id(), "host": "box",
        "argv": ["x"], "started_at": "2026-01-01T00:00:00Z", "heartbeat_at": time.time() - 300,
        "exit_code": None, "ended_at": None, "log": str(directory / "log"),
    }))
    dead = poll(tmp_path / "jobs", "stale", "--stale-after-s", "120")
    assert dead["effective"] == "dead"
    assert re.search(r"heartbeat 30\d s old \(limit 120 s\)", dead["reason"]), dead["reason"]
    assert poll(tmp_path / "jobs", "stale", "--stale-after-s", "1000")["effective"] == "running"


def test_a_hung_supervisor_is_dead_and_replaced_without_a_second_copy(jobs, tmp_path):
    marker = tmp_path / "checkpoint"
    code = RESUMING.format(marker=str(marker))
    timing = ("--heartbeat-s", "0.2", "--stale-after-s", "1")
    first = start(jobs, "hung", code, *timing)
    wait_until(marker.exists, "the first try to start working")
    beat = first["heartbeat_at"]
    wait_until(lambda: job.read_state(jobs / "hung")["heartbeat_at"] > beat, "a heartbeat")

    os.kill(first["pid"], signal.SIGSTOP)  # the supervisor hangs; its stage works on
    time.sleep(1.5)
    dead = poll(jobs, "hung", "--stale-after-s", "1")
    assert dead["effective"] == "dead" and "heartbeat" in dead["reason"] and "limit 1 s" in dead["reason"]

    second = start(jobs, "hung", code, *timing)
    assert second["try"] == 2 and second["attached"] is False
    assert not is_running(first["pid"]) and not is_running(first["child_pid"])  # the old copy is gone
    wait_for_effective(jobs, "hung", "succeeded", stale_after_s=1)


@pytest.mark.parametrize("key", ["../escape", "a b", "", ".hidden", "-x", "x" * 201, "bad\nkey", "a/b"])
def test_an_invalid_key_exits_2_naming_it(tmp_path, key):
    for command in (["start", f"--key={key}", "--", "true"], ["poll", f"--key={key}"], ["kill", f"--key={key}"]):
        proc = run_eagle3("job", command[0], "--jobs-dir", str(tmp_path / "jobs"), *command[1:], check=False)
        assert proc.returncode == 2 and f"error: job key {key!r} is invalid" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_log_streams_by_offset_without_overlap_or_half_lines(jobs, tmp_path):
    go_on = tmp_path / "go-on"
    code = (
        "import sys\n"
        "for i in range(5):\n"
        "    print(f'line {i}')\n"
        "sys.stdout.write('half a'); sys.stdout.flush()\n"
        + wait_for_file(go_on) +
        "print(' line')\n"
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


def test_job_help_hides_supervise_and_the_module_stays_light():
    assert "supervise" not in run_eagle3("job", "--help").stdout
    check = "import sys, eagle3.job; assert not {'torch', 'airflow'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([PY, "-c", check], check=True)
