"""A throwaway Airflow installation for tests: SQLite metadata DB, this repo's dags/ and plugins/.

Tests drive it the way a user would, through the `airflow` CLI in a subprocess (`airflow dags test`),
so nothing of Airflow's global state leaks between tests or into the test process.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
# The key run plans are sealed with (eagle3_airflow/seal.py), set in every Airflow process's environment the way a
# deployment sets it (docker-compose.yaml: AIRFLOW_VAR_EAGLE3_PLAN_SECRET from .env): no task creates one. The key
# of the tests' own process (conftest.py) where it has one, so that a plan sealed by a DAG run verifies in a test.
PLAN_SECRET_ENV = "AIRFLOW_VAR_EAGLE3_PLAN_SECRET"
PLAN_SECRET = os.environ.get(PLAN_SECRET_ENV) or f"tests-plan-secret-{secrets.token_hex(16)}"


def airflow_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of an Airflow process of this checkout with `home` as AIRFLOW_HOME: none of the caller's
    AIRFLOW* variables (a developer's shell must not reach the test's Airflow), the deployment's sealing key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
        AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT="120",
        PYTHONUNBUFFERED="1",
        **{PLAN_SECRET_ENV: PLAN_SECRET},
        **extra,
    )
    return env


# One migrated metadata DB per Airflow version, for every test and xdist worker: a migration costs about 6
# CPU-seconds on this machine's kind, a copy next to nothing, and the suite is CPU-bound.
MIGRATED_DB = REPO / ".cache" / f"airflow-db-{importlib.metadata.version('apache-airflow')}" / "airflow.db"


def migrated_airflow_home(home: Path) -> Path:
    """`home` made an Airflow home with a migrated SQLite DB (a copy of MIGRATED_DB, made on first use)."""
    from filelock import FileLock

    MIGRATED_DB.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{MIGRATED_DB.parent}.lock"):
        if not MIGRATED_DB.exists():
            building = MIGRATED_DB.parent / "home"
            shutil.rmtree(building, ignore_errors=True)
            subprocess.run(
                [AIRFLOW, "db", "migrate"], env=airflow_env(building), check=True, capture_output=True, timeout=300
            )
            os.replace(building / "airflow.db", MIGRATED_DB)  # complete or absent: a killed migration leaves none
            shutil.rmtree(building)
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MIGRATED_DB, home / "airflow.db")
    return home


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory) -> Path:
    """An Airflow home with a migrated SQLite DB, shared by the session's DAG tests (of one xdist worker)."""
    return migrated_airflow_home(tmp_path_factory.mktemp("airflow-home"))


def dags_test(
    home: Path,
    conf: dict,
    *,
    logical_date: str | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    mark_success: str | None = None,
    **popen,
) -> subprocess.CompletedProcess:
    """`airflow dags test eagle3_drafter [DATE] --conf JSON`; its exit code is 0 iff the DAG run succeeded.
    mark_success: a regex of task ids Airflow marks successful instead of running (a drill about extraction
    need not train)."""
    argv = [
        AIRFLOW,
        "dags",
        "test",
        "eagle3_drafter",
        *([logical_date] if logical_date else []),
        "--conf",
        json.dumps(conf),
        *(["--mark-success-pattern", mark_success] if mark_success else []),
    ]
    return subprocess.run(
        argv, env={**airflow_env(home), **(env or {})}, capture_output=True, text=True, timeout=timeout, **popen
    )


# -- a running Airflow's API server, as the UI test and the production lane use it --------------------------------


class AirflowClient:
    """The REST API (and any other path) of the API server at `url`, as the admin of SimpleAuthManager, whose
    generated passwords lie in `home` (the Airflow home). Mixed into the UI test's standalone and the lane's stack."""

    def __init__(self, url: str, home: Path) -> None:
        self.url, self.home = url, home
        self._token: str | None = None

    def password_of(self, user: str = "admin") -> str:
        return json.loads((self.home / "simple_auth_manager_passwords.json.generated").read_text())[user]

    def request(
        self, path: str, body: dict | None = None, token: str | None = None, method: str | None = None
    ) -> bytes:
        """`method` (default: POST with a body, else GET) `path` with a JSON `body`, with a bearer `token`."""
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.read()

    @property
    def token(self) -> str:
        if self._token is None:
            self._token = json.loads(
                self.request("/auth/token", {"username": "admin", "password": self.password_of()})
            )["access_token"]
        return self._token

    def api(self, path: str, body: dict | None = None, method: str | None = None) -> dict:
        """GET (or POST `body` to, or `method`) a REST API path as the admin."""
        return json.loads(self.request("/api/v2" + path, body, token=self.token, method=method))

    def fetch(self, path: str, authorized: bool = True) -> bytes:
        """Any path of the API server (a plugin's), with the admin's token or without any."""
        return self.request(path, token=self.token if authorized else None)

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
        """A try's task log as the UI shows it: its events' messages, one a line, and a failure's exception."""
        content = self.api(
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
            f"?full_content=true&map_index={map_index}"
        )["content"]

        def lines(item) -> list[str]:
            if not isinstance(item, dict):
                return [str(item)]
            return [
                item.get("event", ""),
                *(
                    f"{error.get('exc_type')}: {error.get('exc_value')}"
                    for error in item.get("error_detail") or []
                    if isinstance(error, dict)
                ),
            ]

        return "\n".join(line for item in content for line in lines(item))


HEALTH_PARTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")


def all_healthy(url: str) -> bool:
    """The API server's health endpoint reports every component healthy."""
    import urllib.request

    with urllib.request.urlopen(url + "/api/v2/monitor/health", timeout=5) as resp:
        health = json.loads(resp.read())
    return all(health.get(part, {}).get("status") == "healthy" for part in HEALTH_PARTS)


def dags_serialized(api, dag_ids, tail=lambda: "") -> bool:
    """Every DAG of `dag_ids` is serialized (api: GET a REST path -> JSON); an import error fails at once."""
    import urllib.error

    try:
        return all(api(f"/dags/{dag_id}")["dag_id"] == dag_id for dag_id in dag_ids)
    except urllib.error.HTTPError as err:
        if err.code != 404:
            raise
        errors = api("/importErrors").get("import_errors", [])
        if errors:
            raise AssertionError(f"the DAG file does not import: {errors}\n{tail()}") from None
        return False


def expect_report_plots(report, count: int = 3) -> None:
    """The run's EAGLE-3 report tab (a Playwright frame) shows `count` plots, each loaded (the demo's: training loss
    and accuracy, acceptance per position)."""
    from playwright.sync_api import expect

    plots = report.locator("img")
    expect(plots).to_have_count(count)
    for index in range(count):
        expect(plots.nth(index)).to_have_js_property("complete", True)
        assert plots.nth(index).evaluate("img => img.naturalWidth") > 100, f"plot {index} did not load"


def poll_until(ready, what: str, deadline: float, stopped, tail, every_s: float = 0.5) -> None:
    """Call ready() every `every_s` until it is true. Fail when stopped() names a process that exited (it returns
    None while all run) or `deadline` (a time.monotonic() value) passes, with tail() (the logs) in the message."""
    import urllib.error

    timeout_s, last = deadline - time.monotonic(), None
    while True:
        if (why := stopped()) is not None:
            raise AssertionError(f"{why} while waiting for {what}\n{tail()}")
        try:
            if ready():
                return
        except (OSError, ValueError, KeyError, urllib.error.URLError) as err:
            last = err
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last})\n{tail()}")
        time.sleep(every_s)


def stop_process_groups(procs: list[subprocess.Popen], wait_s: float = 20) -> None:
    """Stop process groups started with start_new_session: SIGTERM to all at once, SIGKILL to what is left after
    wait_s (one at a time: a Celery worker's warm shutdown alone took 20 s)."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


# -- `airflow standalone`: SQLite, LocalExecutor, every component, the local box ---------------------------------


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time in clock ticks, command line) for every process we can read."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        out[int(entry.name)] = (int(fields[1]), fields[19], cmdline)
    return out


def _ours(root_pid: int, marker: str) -> dict[int, str]:
    """pid -> start time of root_pid's descendants and of every process whose command line names `marker` (the
    test's own temp dir: the box-side jobs detach into their own sessions, out of standalone's tree)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = procs[child][1]
                todo.append(child)
    for pid, (_, started, cmdline) in procs.items():
        if marker in cmdline and pid != os.getpid():
            found[pid] = started
    return found


def _kill_all(proc: subprocess.Popen, marker: str) -> None:
    """Stop standalone's process group, then SIGKILL whatever of ours is left (same pid and start time)."""
    ours = _ours(proc.pid, marker)
    stop_process_groups([proc], wait_s=30)
    ours.update(_ours(proc.pid, marker))
    alive = _processes()
    for pid, started in ours.items():
        if pid in alive and alive[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Standalone(AirflowClient):
    """A running `airflow standalone`: its URL, home, log, and a REST client for setup and final checks."""

    def __init__(self, url: str, home: Path, log: Path, proc: subprocess.Popen) -> None:
        super().__init__(url, home)
        self.log, self.proc = log, proc

    def tail(self, lines: int = 60) -> str:
        """The log's last lines, without the api server's access log (one line per request the UI makes)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        kept = [line for line in text.splitlines() if "[http.access]" not in line]
        return f"--- last {lines} lines of {self.log} (access log left out) ---\n" + "\n".join(kept[-lines:])

    def wait_until(self, ready, what: str, deadline: float, every_s: float = 0.5) -> None:
        """Poll `ready()` every `every_s` until it is true, failing if standalone exits or `deadline` (a
        time.monotonic() value) passes."""
        poll_until(
            ready,
            what,
            deadline,
            lambda: None if self.proc.poll() is None else f"airflow standalone exited ({self.proc.returncode})",
            self.tail,
            every_s,
        )


@contextlib.contextmanager
def airflow_standalone(
    root: Path, log: Path, dag_ids: list[str], startup_timeout_s: float, **env_extra: str
) -> Iterator[Standalone]:
    """`airflow standalone` (SQLite, LocalExecutor: api server, scheduler, dag-processor, triggerer) with this repo's
    DAGs, its home in root/airflow, its output in `log`, `env_extra` in its environment (EAGLE3_DAG_SETTINGS...):
    yielded once every component is healthy, `dag_ids` are serialized, the Execution API's routes are built and the
    DAG's pool exists. At the end it is killed with everything it started, and every process whose command line
    names `root` (the box-side jobs detach into sessions of their own), pass or fail."""
    from tests.sshd import free_port

    home = root / "airflow"
    home.mkdir()
    port = free_port()
    env = airflow_env(
        home,
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://localhost:{port}/execution/",
        AIRFLOW__CORE__PARALLELISM="4",  # LocalExecutor forks this many workers: 32 by default, on 2 cores
        # The settings file is fixed for the test, so the DAG file needs parsing once: every 30 s (the default)
        # the dag-processor forked a parse of it, for nothing, through a test's minutes under load.
        AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="3600",
        **env_extra,
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # it spawns `airflow ...`
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [AIRFLOW, "standalone"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=root,
        )
    server = Standalone(f"http://localhost:{port}", home, log, proc)
    try:
        deadline = time.monotonic() + startup_timeout_s
        server.wait_until(
            lambda: all_healthy(server.url),
            "the api server's health endpoint to report every component healthy",
            deadline,
        )
        server.wait_until(
            lambda: dags_serialized(server.api, dag_ids, server.tail),
            f"the dag-processor to serialize {', '.join(dag_ids)}",
            deadline,
        )
        # The Execution API builds its versioned routes (Cadwyn) on its first request, holding the api server's
        # one worker for about 10 CPU-seconds. The first task's start call paid for it: inside the suite the whole
        # api server stood still for 40 s, the call's five tries at 5 s each timed out and `validate` failed. Pay
        # for it here, as a deployment's health check would, before anything runs (with time to spare: under
        # load it is the 40 s above, more than the REST client's 30 s). Any first request builds every version's
        # routes, as `make airflow` and the compose healthcheck rely on too.
        urllib.request.urlopen(server.url + "/execution/health", timeout=startup_timeout_s).close()
        # The DAG's pool, as make airflow and the compose init create it: its tasks wait for a pool that exists.
        subprocess.run(
            [sys.executable, "-m", "eagle3_airflow.deployment", "create-pool", "--airflow", AIRFLOW],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        print(f"airflow standalone on {server.url}: ready in {time.monotonic() - started:.1f} s")
        yield server
    finally:
        _kill_all(proc, str(root))
