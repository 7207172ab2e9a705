"""Where the test suite's CPU goes: CPU-seconds per test and per test file, every process a test started included.

On 2 cores the suite is CPU-bound (the machine is ~99 % busy from its first minute to its last), so its wall time is
its CPU time over 2, and the way to a faster suite is to find the CPU. Timing a test tells little (it shares the
cores with two other workers), and a process's rusage misses what a test starts and does not wait for: the box-side
jobs detach into sessions of their own, `airflow standalone`'s children outlive it. So each xdist worker is put in
a cgroup of its own (cgroup v1 `cpuacct`, as root), whose counter includes every descendant, detached or not; a
test's figure is the counter's growth while it ran (what an earlier test left running is charged to the next one).

    .venv/bin/python bench/suite_cpu.py [PYTEST ARGS...]      # the whole suite; or e.g. tests/test_dag.py

Prints the wall time and the machine's busy, idle and I/O-wait CPU-seconds, when each worker's first test began and
its last ended (before and after: pytest's collection and exit), then the test files and tests by CPU-seconds. Runs the
suite as `make test` does (pyproject.toml's options), with this module loaded as a pytest plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
RECORDS_ENV = "EAGLE3_SUITE_CPU_RECORDS"


# -- the pytest plugin (loaded in every worker with -p bench.suite_cpu) ----------------------------------------------


WORKER = os.environ.get("PYTEST_XDIST_WORKER", "master")
CGROUP = CPUACCT / f"eagle3-suite-{WORKER}"
_counting = False  # set in a process that runs tests, when bench/suite_cpu.py started the suite


def _usage_s() -> float:
    return int((CGROUP / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config):
    global _counting
    controller = WORKER == "master" and config.getoption("numprocesses", None)  # distributes, runs no tests
    if RECORDS_ENV in os.environ and not controller:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "tasks").write_text(str(os.getpid()))  # this worker, and from now on all it starts
        _counting = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _counting:
        yield
        return
    started, before = time.time(), _usage_s()
    yield
    record = {
        "test": item.nodeid.split("@")[0],
        "cpu_s": _usage_s() - before,
        "wall_s": time.time() - started,
        "started": started,
    }
    with open(Path(os.environ[RECORDS_ENV]) / f"{WORKER}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


# -- the script ------------------------------------------------------------------------------------------------------


def machine_cpu_s() -> tuple[float, float, float]:
    """CPU-seconds the whole machine has been busy, idle, and idle waiting for I/O, since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle, iowait = values[3], values[4]
    return tuple(v / os.sysconf("SC_CLK_TCK") for v in (sum(values) - idle - iowait, idle, iowait))


def main(pytest_args: list[str]) -> int:
    if os.geteuid() != 0 or not CPUACCT.is_dir():
        sys.exit(
            f"needs root and cgroup v1's cpuacct at {CPUACCT} (a cgroup per worker counts every process a "
            "test starts, detached ones too)"
        )
    records = Path(tempfile.mkdtemp(prefix="suite-cpu-"))
    env = {
        **os.environ,
        RECORDS_ENV: str(records),
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }  # -p bench.suite_cpu in each worker
    before, started, started_at = machine_cpu_s(), time.monotonic(), time.time()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "bench.suite_cpu", *pytest_args], cwd=REPO, env=env)
    (busy, idle, iowait), wall = (now - then for now, then in zip(machine_cpu_s(), before)), time.monotonic() - started
    tests = [
        {**json.loads(line), "worker": path.stem}
        for path in records.glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    for cgroup in CPUACCT.glob("eagle3-suite-*"):
        try:
            cgroup.rmdir()
        except OSError:  # a process of the suite still in it
            pass
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for test in tests:
        totals = by_file[test["test"].split("::")[0]]
        totals[0] += test["cpu_s"]
        totals[1] += 1
    counted = sum(test["cpu_s"] for test in tests)
    print(
        f"\npytest exited {code}; wall {wall:.0f} s; the machine was busy {busy:.0f} CPU-s ({busy / wall:.2f} "
        f"cores), {counted:.0f} of them counted to {len(tests)} tests; idle {idle + iowait:.0f} CPU-s, "
        f"{iowait:.0f} of them waiting for I/O"
    )
    workers: dict[str, list[dict]] = defaultdict(list)
    for test in tests:
        workers[test["worker"]].append(test)
    print("Per worker, seconds after the start: its first test began, its last test ended; its tests' CPU-seconds")
    for worker, its in sorted(workers.items()):
        print(
            f"  {worker}: {min(t['started'] for t in its) - started_at:5.0f}  "
            f"{max(t['started'] + t['wall_s'] for t in its) - started_at:5.0f}  {sum(t['cpu_s'] for t in its):6.0f}"
        )
    print("\nCPU-seconds per test file:")
    for path, (cpu_s, count) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        print(f"  {cpu_s:7.1f}  {100 * cpu_s / counted:4.1f} %  {count:4d} tests  {path}")
    print("\nTests over 10 CPU-seconds:")
    for test in sorted(tests, key=lambda t: -t["cpu_s"]):
        if test["cpu_s"] > 10:
            print(f"  {test['cpu_s']:7.1f} CPU-s  {test['wall_s']:6.1f} s  {test['test']}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
