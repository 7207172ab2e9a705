"""A real OpenSSH server on 127.0.0.1 for tests that drive "the box" over SSH.

`LoopbackSshd` starts `sshd -D` from a temp dir with its own ed25519 host key, a client key pair and an
sshd_config that allows only that key (no passwords, no PAM). Tests get an Airflow connection that pins the
host key, so host-key verification stays on. `stop()` / `start()` give an SSH-outage drill: the server
comes back on the same port with the same host key.

What stop() does, as observed with OpenSSH 9.2 (Debian 12): the listener forks one sshd per accepted
connection and that child calls setsid(), so it leaves the listener's process group: killpg() on the
listener would leave every open session alive. stop() therefore also kills, by pid, every process holding
a TCP socket on our port (the per-connection sshd processes), so open connections see EOF, as when sshd
dies on a real box. Commands those sessions were running are not killed by stop() (the box keeps working
through an outage); without a pty they lose their stdout and die of SIGPIPE on their next write, if they
write. close() (fixture teardown) also kills the process trees of the sessions it finds. A command that
daemonized itself (setsid/nohup ... &, reparented to init) is out of reach and is the test's to clean up.

`env` sets variables in every session (sshd_config SetEnv), as a box's own environment would: e.g. the project's
stand-ins for the machine's identity (EAGLE3_HOST_ID_FILE, EAGLE3_BOOT_ID_FILE), so that two servers on this machine
are two hosts to the box code.

Expose the fixtures to the suite from tests/conftest.py with `pytest_plugins = ["tests.sshd"]`.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil  # a dependency of apache-airflow-core
import pytest

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
PRIVSEP_DIR = Path("/run/sshd")  # Debian's sshd refuses to start as root without it


def find_sshd() -> str | None:
    """Absolute path of sshd (it refuses to re-exec from a relative path), or None."""
    found = shutil.which("sshd") or next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)
    return os.path.abspath(found) if found else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for the sshd, stand-in servers, airflow standalone)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )


def _wait_dead(procs: list[psutil.Process], timeout: float) -> None:
    """Wait until each process is gone or a zombie (dead, its sockets closed, not yet reaped)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


class LoopbackSshd:
    """sshd on 127.0.0.1 that accepts one ed25519 client key for the current user.

    Attributes: host, port, user, client_key (private key path), host_public_key ("ssh-ed25519 AAAA..."),
    known_hosts_line ("[127.0.0.1]:PORT ssh-ed25519 AAAA..."), workdir, log_path.
    Use as a context manager, or call start() and close().
    """

    host = "127.0.0.1"

    def __init__(
        self, workdir: str | os.PathLike | None = None, port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        sshd = find_sshd()
        if sshd is None:
            raise FileNotFoundError("sshd not found; install openssh-server (.ci/run does this on CI)")
        self.sshd = sshd
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="sshd-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.user = getpass.getuser()
        self.port = port or free_port(self.host)
        self._port_chosen = port is None
        self.host_key = self.workdir / "ssh_host_ed25519_key"
        self.client_key = self.workdir / "id_ed25519"
        self.authorized_keys = self.workdir / "authorized_keys"
        self.config = self.workdir / "sshd_config"
        self.log_path = self.workdir / "sshd.log"
        self.proc: subprocess.Popen | None = None
        self._orphans: list[psutil.Process] = []  # commands whose sessions stop() killed; close() kills them
        # the suite's one torch thread per process (tests/conftest.py), for the box's processes too; then `env`
        self.env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        for name, value in self.env.items():  # SetEnv takes NAME=VALUE words, unquoted here
            if not name.isidentifier() or any(ch.isspace() or ch in "\"'" for ch in value):
                raise ValueError(f"sshd SetEnv: {name}={value!r} is not a plain NAME=VALUE")

        _keygen(self.host_key, "loopback-sshd-host")
        _keygen(self.client_key, "loopback-sshd-client")
        self.authorized_keys.write_text(self.client_key.with_suffix(".pub").read_text())
        self.authorized_keys.chmod(0o600)
        # "ssh-ed25519 AAAA..." without the comment: the form the SSH connection's `host_key` extra takes.
        self.host_public_key = " ".join(self.host_key.with_suffix(".pub").read_text().split()[:2])
        self._write_config()

    @property
    def known_hosts_line(self) -> str:
        return f"[{self.host}]:{self.port} {self.host_public_key}"

    def _write_config(self) -> None:
        self.config.write_text(
            "\n".join(
                [
                    f"ListenAddress {self.host}",
                    f"Port {self.port}",
                    f"HostKey {self.host_key}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    f"PidFile {self.workdir / 'sshd.pid'}",
                    # as a box's stock sshd_config has it: report files come by SFTP (eagle3_airflow.transport)
                    "Subsystem sftp internal-sftp",
                    "LogLevel VERBOSE",
                    "SetEnv " + " ".join(f"{name}={value}" for name, value in self.env.items()),
                    "",
                ]
            )
        )

    # -- lifecycle -------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> LoopbackSshd:
        """Start the listener (again), on the same port with the same host key; wait until it answers."""
        if self.running:
            return self
        if os.geteuid() == 0 and not PRIVSEP_DIR.is_dir():
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        for attempt in range(3):
            try:
                self._spawn(timeout)
                self._port_chosen = False  # from now on the port is the server's address: restarts keep it
                return self
            except RuntimeError:
                # Someone may take the port free_port picked before sshd binds it: before the first start
                # nothing depends on the port yet, so pick another. A caller's port or a restart's is kept.
                if not (self._port_chosen and attempt < 2 and "Address already in use" in self.log_text()):
                    raise
                self.port = free_port(self.host)
                self._write_config()
        raise AssertionError("unreachable")

    def _spawn(self, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.sshd, "-D", "-e", "-f", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}:\n{self.log_text()}")
            if self._answers():
                return
            if time.monotonic() > deadline:
                self._kill_listener()
                raise RuntimeError(f"sshd did not answer on {self.host}:{self.port} in {timeout}s:\n{self.log_text()}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        """True once something on the port sends an SSH banner (a bare TCP connect could hit another server)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as s:
                return s.recv(64).startswith(b"SSH-")
        except OSError:
            return False

    def session_pids(self) -> list[int]:
        """Per-connection sshd processes: every process but the listener holding a TCP socket on our port."""
        pids = set()
        for c in psutil.net_connections(kind="tcp4"):
            if c.pid and c.laddr and c.laddr.port == self.port and c.laddr.ip == self.host:
                pids.add(c.pid)
        if self.proc is not None:
            pids.discard(self.proc.pid)
        return sorted(pids)

    def stop(self) -> None:
        """Outage drill: kill the listener and drop every open connection (see the module docstring)."""
        self._stop(kill_commands=False)

    def _stop(self, kill_commands: bool) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)  # no new connection forks while we look for sessions
        sessions, commands = [], []
        for pid in self.session_pids():
            try:
                p = psutil.Process(pid)
                sessions.append(p)
                commands += p.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        if kill_commands:
            sessions += commands + self._orphans
            self._orphans = []
        else:
            self._orphans += commands
        sessions = list({p.pid: p for p in sessions}.values())
        for p in sessions:
            try:
                p.kill()  # psutil checks the pid was not reused
            except psutil.NoSuchProcess:
                pass
        self._kill_listener()
        _wait_dead(sessions, timeout=5)

    def _kill_listener(self) -> None:
        """SIGTERM (then SIGKILL) to the listener's process group; by pgid only while the leader is unreaped."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            os.killpg(self.proc.pid, signal.SIGCONT)  # it may be SIGSTOPped by _stop
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Kill everything started: listener, sessions and the commands they run; remove the temp dir."""
        self._stop(kill_commands=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LoopbackSshd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- Airflow ---------------------------------------------------------------------------------------

    def airflow_conn(self, **extra) -> dict:
        """The SSH connection as Airflow's JSON connection format; `extra` adds or overrides extras."""
        return {
            "conn_type": "ssh",
            "host": self.host,
            "port": self.port,
            "login": self.user,
            "extra": {"key_file": str(self.client_key), "host_key": self.host_public_key, **extra},
        }

    def airflow_conn_json(self, **extra) -> str:
        """Value for the env var AIRFLOW_CONN_<CONN_ID> (see airflow_env)."""
        return json.dumps(self.airflow_conn(**extra))

    def airflow_env(self, conn_id: str, **extra) -> dict[str, str]:
        """{"AIRFLOW_CONN_<CONN_ID>": json}, e.g. for monkeypatch.setenv(k, v) over its items()."""
        return {f"AIRFLOW_CONN_{conn_id.upper()}": self.airflow_conn_json(**extra)}


# -- fixtures ------------------------------------------------------------------------------------------------


def _require_sshd() -> None:
    if find_sshd() is not None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail("sshd not found although CI is set; .ci/run installs openssh-server before `make test`")
    pytest.skip("sshd not found (apt-get install openssh-server); CI installs it through .ci/run")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """One LoopbackSshd for the whole session. Do not stop() it; take `fresh_sshd` for outage drills."""
    _require_sshd()
    with LoopbackSshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture
def fresh_sshd(tmp_path):
    """A LoopbackSshd of the test's own, free to stop() and start()."""
    _require_sshd()
    with LoopbackSshd(tmp_path / "sshd") as server:
        yield server
