"""The loopback sshd fixture, exercised through the real Airflow SSH provider with host keys verified.

Connections come from AIRFLOW_CONN_<ID> env vars (JSON), which Airflow resolves through its env-var secrets
backend without a metadata DB.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import asyncssh
import paramiko
import psutil
import pytest

from tests.sshd import LoopbackSshd

pytestmark = pytest.mark.slow


def _use_conn(monkeypatch, server: LoopbackSshd, conn_id: str, **extra) -> str:
    for name, value in server.airflow_env(conn_id, **extra).items():
        monkeypatch.setenv(name, value)
    return conn_id


def _sync_run(conn_id: str, command: str) -> tuple[int, bytes, bytes]:
    from airflow.providers.ssh.hooks.ssh import SSHHook

    # One attempt: the hook retries every connect failure (wrong host key included) 3 times, 3-5 s apart.
    hook = SSHHook(ssh_conn_id=conn_id, conn_retry_attempts=1)
    with hook.get_conn() as client:
        return hook.exec_ssh_client_command(client, command, get_pty=False, environment=None)


def _async_run(conn_id: str, command: str, **kwargs) -> tuple[int, str, str]:
    from airflow.providers.ssh.hooks.ssh import SSHHookAsync

    return asyncio.run(SSHHookAsync(ssh_conn_id=conn_id, **kwargs).run_command(command, timeout=30))


def _other_host_key(tmp_path) -> str:
    key = tmp_path / "impostor"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return " ".join(key.with_suffix(".pub").read_text().split()[:2])


def _remote_sleeps(server: LoopbackSshd) -> list[psutil.Process]:
    """The `sleep` processes the server's sessions are running."""
    procs = []
    for pid in server.session_pids():
        try:
            procs += [c for c in psutil.Process(pid).children(recursive=True) if c.name() == "sleep"]
        except psutil.NoSuchProcess:
            pass
    return procs


def test_sync_hook_runs_a_command(sshd, monkeypatch):
    conn_id = _use_conn(monkeypatch, sshd, "loopback_sync")
    assert _sync_run(conn_id, "echo hello") == (0, b"hello\n", b"")


def test_async_hook_runs_a_command_with_the_host_key_extra(sshd, monkeypatch):
    # The hook passes asyncssh the known_hosts bytes b"127.0.0.1 ssh-ed25519 AAAA..." (no port). asyncssh first
    # looks up "[127.0.0.1]:PORT", finds nothing, and then retries the bare host, so the pinned key is used.
    assert sshd.port != 22
    conn_id = _use_conn(monkeypatch, sshd, "loopback_async")
    assert _async_run(conn_id, "echo hi") == (0, "hi\n", "")


def test_async_hook_with_a_known_hosts_file(sshd, monkeypatch, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd.known_hosts_line + "\n")
    conn = sshd.airflow_conn(known_hosts=str(known_hosts))
    del conn["extra"]["host_key"]  # host_key, when present, replaces the known_hosts extra
    monkeypatch.setenv("AIRFLOW_CONN_LOOPBACK_KNOWN_HOSTS", json.dumps(conn))
    assert _async_run("loopback_known_hosts", "echo hi") == (0, "hi\n", "")


def test_a_wrong_host_key_is_refused(sshd, monkeypatch, tmp_path):
    conn_id = _use_conn(monkeypatch, sshd, "loopback_impostor", host_key=_other_host_key(tmp_path))
    log_before = len(sshd.log_text())
    with pytest.raises(paramiko.BadHostKeyException):
        _sync_run(conn_id, "echo hello")
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        _async_run(conn_id, "echo hi")
    assert "Accepted publickey" not in sshd.log_text()[log_before:]  # the clients gave up before authenticating


def test_outage_drill_stop_then_start(fresh_sshd, monkeypatch):
    from airflow.providers.ssh.hooks.ssh import SSHHook

    server = fresh_sshd
    port, host_key = server.port, server.host_public_key
    conn_id = _use_conn(monkeypatch, server, "loopback_outage")
    assert _sync_run(conn_id, "echo before") == (0, b"before\n", b"")

    # A command in flight when sshd goes down: the connection drops, the hook returns at once without output
    # (paramiko reports exit status -1) instead of waiting for the command.
    hook = SSHHook(ssh_conn_id=conn_id, conn_retry_attempts=1)
    client = hook.get_conn()
    result: list = []

    def run_long_command():
        try:
            result.append(hook.exec_ssh_client_command(client, "sleep 30; echo done", False, None))
        except Exception as exc:
            result.append(exc)

    worker = threading.Thread(target=run_long_command)
    worker.start()
    deadline = time.monotonic() + 10
    while not _remote_sleeps(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _remote_sleeps(server)

    server.stop()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert result == [(-1, b"", b"")]
    assert not client.get_transport().is_active()
    assert server.session_pids() == []
    with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError):
        _sync_run(conn_id, "echo during")
    with pytest.raises(OSError):
        _async_run(conn_id, "echo during")

    server.start()
    assert (server.port, server.host_public_key) == (port, host_key)
    assert _sync_run(conn_id, "echo after") == (0, b"after\n", b"")
    assert _async_run(conn_id, "echo after") == (0, "after\n", "")
