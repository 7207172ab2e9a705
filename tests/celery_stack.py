"""Airflow as a team deploys it, for tests: CeleryExecutor with a Redis broker and a PostgreSQL metadata database,
each Airflow component a process of its own (api-server, scheduler, dag-processor, triggerer, Celery workers), all
from the Debian and PyPI packages this machine has (scripts/system-packages.sh, requirements.txt), started and
stopped by the tests.

The stack listens on an address of its own: the host side of a veth pair whose other side lies in a network
namespace. A second Celery worker runs in that namespace, a machine of its own as far as the network and its
hostname (a UTS namespace) go, and reaches the broker, the database, the API server and the box through that
address, as a worker on another host would. The filesystem is shared (task logs, the box's workdir), as a
deployment's shared log volume and the box's disk are.

PostgreSQL refuses to run as root; as root (this machine, CI) it runs as the `postgres` user Debian's package
creates. Its data lives in a temp dir with fsync off: a test database, thrown away with the stack.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from tests.airflow_env import (
    AIRFLOW,
    AirflowClient,
    airflow_env,
    all_healthy,
    dags_serialized,
    poll_until,
    stop_process_groups,
)
from tests.sshd import LoopbackSshd, free_port

# Two boxes in the settings' box_pools (the loopback sshd under two connection ids): a DAG and a pool for each.
BOXES = ("gpu_box", "gpu_box_2")
# The default box (the form's default box.conn_ids) keeps the single DAG's id; each other box's is named after it.
DAG_ID, DAG_ID_2 = "eagle3_drafter", f"eagle3_drafter__{BOXES[1]}"
STARTUP_TIMEOUT_S = 300
WORKER_2_HOSTNAME = "celery-worker-2"


def _postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise FileNotFoundError(
            "PostgreSQL is missing (/usr/lib/postgresql/*/bin/postgres): the production-topology "
            "tests run its metadata database. Install it with `make system-packages` (Debian's "
            "postgresql)"
        )
    return found[-1].parent


def _require(command: str, package: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise FileNotFoundError(
            f"{command} is missing: the production-topology tests run it. Install it with "
            f"`make system-packages` (Debian's {package})"
        )
    return path


def _as_postgres() -> list[str]:
    """The prefix that runs a command as an unprivileged user when we are root (initdb and postgres refuse root)."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _wait(ready, what: str, timeout: float, procs: dict[str, subprocess.Popen], logs: Path, every_s: float = 0.5):
    """Poll ready() until true; fail naming the component that exited, or the timeout, with the logs' tails."""

    def stopped() -> str | None:
        return next(
            (f"{name} exited ({proc.returncode})" for name, proc in procs.items() if proc.poll() is not None), None
        )

    poll_until(
        ready,
        what,
        time.monotonic() + timeout,
        stopped,
        lambda: "\n".join(tail(log, 15) for log in sorted(logs.glob("*.log"))),
        every_s,
    )


def tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    kept = [line for line in text.splitlines() if "[http.access]" not in line and "GET /api/v2" not in line]
    return f"--- last {lines} lines of {log} ---\n" + "\n".join(kept[-lines:])


class Namespace:
    """A network namespace joined to this one by a veth pair: `host_ip` here, `ns_ip` there (a /30 of its own)."""

    def __init__(self) -> None:
        _require("ip", "iproute2")
        tag = f"{os.getpid() % 100000}{secrets.token_hex(1)}"
        self.name = f"eagle3-w2-{tag}"
        self.host_if, self.ns_if = f"e3h{tag}"[:15], f"e3n{tag}"[:15]
        # A /30 of 10.213.0.0/16 picked at random: two sessions on one machine rarely pick the same
        block = secrets.randbelow(16384) * 4
        net = f"10.213.{block // 256}"
        self.host_ip, self.ns_ip = f"{net}.{block % 256 + 1}", f"{net}.{block % 256 + 2}"
        self._up = False

    def _ip(self, *args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(
                f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}. The "
                "production-topology tests need root (or CAP_NET_ADMIN) for a network namespace"
            )

    def create(self) -> Namespace:
        self._ip("netns", "add", self.name)
        self._up = True
        self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._ip("link", "set", self.ns_if, "netns", self.name)
        self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        self._ip("link", "set", self.host_if, "up")
        self._ip("-n", self.name, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        self._ip("-n", self.name, "link", "set", self.ns_if, "up")
        self._ip("-n", self.name, "link", "set", "lo", "up")
        return self

    def argv(self, hostname: str, argv: list[str]) -> list[str]:
        """`argv` inside the namespace, under a hostname of its own."""
        return [
            "ip",
            "netns",
            "exec",
            self.name,
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {hostname} && exec "$@"',
            "sh",
            *argv,
        ]

    def delete(self) -> None:
        if self._up:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
            self._up = False


class StackSshd(LoopbackSshd):
    """The loopback sshd's box, listening on the stack's address, where the second worker reaches it too; `env` in
    every session (LoopbackSshd)."""

    def __init__(self, workdir: Path, host: str, env: dict[str, str] | None = None) -> None:
        self.host = host
        super().__init__(workdir, env=env)


class CeleryStack(AirflowClient):
    """PostgreSQL, Redis and the Airflow components on `ip`, the Celery worker 2 in `ns`, with this repo's DAG.

    `env`: what every Airflow process gets (the box's SSH connection and `extra_env` included); `procs`: name ->
    Popen; `logs`: the directory of every component's log; `url`: the API server."""

    def __init__(self, root: Path, ns: Namespace, extra_env: dict[str, str]) -> None:
        self.root, self.ns, self.ip = root, ns, ns.host_ip
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port(self.ip))
        self.pg_port, self.redis_port, self.api_port = sorted(ports)
        super().__init__(f"http://{self.ip}:{self.api_port}", root / "airflow")  # the admin's REST client
        self.home.mkdir(exist_ok=True)
        db = f"airflow@{self.ip}:{self.pg_port}/postgres"
        self.env = airflow_env(
            self.home,
            AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"postgresql+psycopg2://{db}",
            AIRFLOW__CELERY__BROKER_URL=f"redis://{self.ip}:{self.redis_port}/0",
            AIRFLOW__CELERY__RESULT_BACKEND=f"db+postgresql+psycopg2://{db}",
            AIRFLOW__CORE__FERNET_KEY=base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
            AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_hex(32),  # one secret: every component signs and checks
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"{self.url}/execution/",
            AIRFLOW__API__BASE_URL=self.url,
            AIRFLOW__API__WORKERS="1",
            AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin",
            # The DAG file is parsed once, and again only when asked (reparse: the REST API's "Reparse DAG", after a
            # test changed the settings), not every 30 s for nothing.
            AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="3600",
            # A killed triggerer's triggers go to another after this long without a heartbeat (default 30 s).
            AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD="10",
            AIRFLOW__CELERY__WORKER_CONCURRENCY="2",
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            **extra_env,
        )

    # -- processes -------------------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                argv,
                env=env or self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.root,
            )
        self.procs[name] = proc
        return proc

    def start(self, dag_ids: tuple[str, ...] = (DAG_ID, DAG_ID_2)) -> CeleryStack:
        """Start every component; ready once each is healthy and the DAG file's `dag_ids` are serialized."""
        started = time.monotonic()
        self._start_postgres()
        self._start_redis()
        migrate = subprocess.run(
            [AIRFLOW, "db", "migrate"], env=self.env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S
        )
        (self.logs / "db-migrate.log").write_text(migrate.stdout + migrate.stderr)
        assert migrate.returncode == 0, f"airflow db migrate failed:\n{tail(self.logs / 'db-migrate.log')}"
        self.spawn("api-server", [AIRFLOW, "api-server", "--host", self.ip, "--port", str(self.api_port)])
        self.spawn("scheduler", [AIRFLOW, "scheduler", "--skip-serve-logs"])
        self.spawn("dag-processor", [AIRFLOW, "dag-processor"])
        self.start_triggerer("triggerer")
        self.spawn(
            "worker-1",
            [
                AIRFLOW,
                "celery",
                "worker",
                "--celery-hostname",
                "worker-1@%h",
                "--skip-serve-logs",
                "--without-gossip",
                "--without-mingle",
            ],
        )
        self.spawn(
            "worker-2",
            self.ns.argv(
                WORKER_2_HOSTNAME,
                [
                    AIRFLOW,
                    "celery",
                    "worker",
                    "--celery-hostname",
                    "worker-2@%h",
                    "--skip-serve-logs",
                    "--without-gossip",
                    "--without-mingle",
                ],
            ),
        )
        self._wait_ready(dag_ids)
        print(f"Celery stack on {self.url}: ready in {time.monotonic() - started:.1f} s")
        return self

    def start_triggerer(self, name: str) -> subprocess.Popen:
        return self.spawn(name, [AIRFLOW, "triggerer", "--skip-serve-logs"])

    def _start_postgres(self) -> None:
        bin_dir = _postgres_bin()
        # Its own dir under /tmp (pytest's temp dirs are root's, closed to the postgres user)
        self.pg_dir = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.pg_dir, "postgres", "postgres")
        data = self.pg_dir / "data"
        initdb = subprocess.run(
            [
                *_as_postgres(),
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "airflow",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        (self.logs / "initdb.log").write_text(initdb.stdout + initdb.stderr)
        assert initdb.returncode == 0, f"initdb failed:\n{tail(self.logs / 'initdb.log')}"
        with open(data / "pg_hba.conf", "a") as hba:  # both ends of the veth (trust: a throwaway test database)
            hba.write(f"host all all {self.ns.host_ip}/32 trust\nhost all all {self.ns.ns_ip}/32 trust\n")
        self.spawn(
            "postgres",
            [
                *_as_postgres(),
                str(bin_dir / "postgres"),
                "-D",
                str(data),
                "-p",
                str(self.pg_port),
                "-k",
                str(self.pg_dir),
                "-c",
                f"listen_addresses={self.ip}",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=200",
            ],
        )
        pg_isready = str(bin_dir / "pg_isready")
        _wait(
            lambda: (
                subprocess.run([pg_isready, "-h", self.ip, "-p", str(self.pg_port)], capture_output=True).returncode
                == 0
            ),
            "PostgreSQL to accept connections",
            60,
            self.procs,
            self.logs,
            every_s=0.2,
        )

    def _start_redis(self) -> None:
        redis = _require("redis-server", "redis-server")
        # No persistence: a broker for one test module.
        self.spawn(
            "redis",
            [
                redis,
                "--bind",
                self.ip,
                "--port",
                str(self.redis_port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--dir",
                str(self.root),
            ],
        )

        def answers() -> bool:
            import socket

            with socket.create_connection((self.ip, self.redis_port), timeout=2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")

        _wait(answers, "Redis to answer", 30, self.procs, self.logs, every_s=0.2)

    def _wait_ready(self, dag_ids: tuple[str, ...]) -> None:
        _wait(
            lambda: all_healthy(self.url),
            "every component to report healthy",
            STARTUP_TIMEOUT_S,
            self.procs,
            self.logs,
            every_s=1,
        )
        self.wait_serialized(dag_ids)
        # The Execution API builds its routes on its first request (tests/ui/test_web_ui.py says why to pay here).
        urllib.request.urlopen(self.url + "/execution/health", timeout=STARTUP_TIMEOUT_S).close()
        for worker in ("worker-1", "worker-2"):
            _wait(
                lambda worker=worker: " ready." in (self.logs / f"{worker}.log").read_text(errors="replace"),
                f"Celery {worker} to be ready",
                STARTUP_TIMEOUT_S,
                self.procs,
                self.logs,
                1,
            )
        self.create_pools()

    def wait_serialized(self, dag_ids: tuple[str, ...], timeout: float = STARTUP_TIMEOUT_S) -> None:
        _wait(
            lambda: dags_serialized(self.api, dag_ids),
            f"the dag-processor to serialize {', '.join(dag_ids)}",
            timeout,
            self.procs,
            self.logs,
            1,
        )

    def create_pools(self) -> None:
        """The deployment's pools, one per box of the settings (`python -m eagle3_airflow.deployment create-pool`, the
        operator's step when a box is added)."""
        subprocess.run(
            [sys.executable, "-m", "eagle3_airflow.deployment", "create-pool", "--airflow", AIRFLOW],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def reparse(self, dag_id: str) -> None:
        """Ask the dag-processor to parse `dag_id`'s file again now (PUT /parseDagFile/<file token>: the UI's
        "Reparse DAG"), as after a change to the settings beside it."""
        token = self.api(f"/dags/{dag_id}/details")["file_token"]
        self.request(f"/api/v2/parseDagFile/{token}", token=self.token, method="PUT")

    def close(self) -> None:
        stop_process_groups(list(self.procs.values()))
        # What the stack started outside its process groups: the box's jobs (their own sessions), named by root
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if proc.pid != os.getpid() and any(str(self.root) in part for part in proc.info["cmdline"] or []):
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        if hasattr(self, "pg_dir"):
            shutil.rmtree(self.pg_dir, ignore_errors=True)

    def keep_logs(self, where: Path) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        for log in self.logs.glob("*.log"):
            shutil.copy2(log, where / log.name)
        task_logs = self.home / "logs"
        if task_logs.is_dir():
            shutil.copytree(task_logs, where / "task-logs", dirs_exist_ok=True)
        return where
