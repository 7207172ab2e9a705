"""How the control plane reaches the GPU box: run one command (argv, optional stdin), get its output.

That is the whole interface. Files travel as a command's stdin or stdout (code sync pipes a tarball
into a fixed unpack script; config.json goes to `python -m eagle3 init --config -`), so there is no
second channel to secure or to keep consistent.

Two implementations:
- `LocalBox` (connection id "local"): the box is this machine; used by `make demo` and fast tests.
- `SSHBox` (any other id): an Airflow SSH connection through the SSH provider's hooks, `SSHHook`
  (paramiko) in workers and `SSHHookAsync` (asyncssh) in the triggerer. Host keys are verified: set
  `host_key` in the connection's extra (or have the host in the worker's known_hosts); the provider
  refuses unknown hosts unless a connection turns host-key checking off (its no_host_key_check extra),
  which nothing here does.

Every argv element is quoted with `shlex.join` before it reaches the remote shell, so no value (a
path with `$(...)` in it, say) is ever interpreted by it.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass

LOCAL = "local"


class BoxUnreachable(ConnectionError):
    """The box did not answer (connection refused, timeout, authentication or host-key failure)."""


@dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def check(self, what: str) -> CommandResult:
        """Raise with the command's stderr tail unless it exited 0."""
        if self.returncode != 0:
            tail = "\n".join(self.stderr.strip().splitlines()[-20:])
            raise RemoteCommandError(
                f"{what} failed on the box (exit {self.returncode}): {shlex.join(self.argv)}\n{tail}"
            )
        return self

    def json(self, what: str):
        """The command's stdout as JSON, after `check`; a command that printed something else is an error."""
        self.check(what)
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError:
            raise RemoteCommandError(f"{what}: the box printed no JSON:\n{self.stdout[-2000:]}") from None


class RemoteCommandError(RuntimeError):
    """A command ran on the box and failed; the message carries its exit code and stderr tail."""


class Box(ABC):
    """One GPU box (or this machine)."""

    conn_id: str

    @abstractmethod
    def run(self, argv: list[str], *, input: bytes | None = None, timeout: float = 600) -> CommandResult:
        """Run argv on the box and wait for it. Raises BoxUnreachable if the box cannot be reached."""

    @abstractmethod
    async def arun(self, argv: list[str], *, timeout: float = 60) -> CommandResult:
        """The same from an asyncio event loop (the triggerer)."""

    async def aclose(self) -> None:  # noqa: B027 (most boxes hold nothing)
        """Release connections held for `arun`."""


class LocalBox(Box):
    conn_id = LOCAL

    def run(self, argv: list[str], *, input: bytes | None = None, timeout: float = 600) -> CommandResult:
        proc = subprocess.run(argv, input=input, capture_output=True, timeout=timeout)
        return CommandResult(argv, proc.returncode, _text(proc.stdout), _text(proc.stderr))

    async def arun(self, argv: list[str], *, timeout: float = 60) -> CommandResult:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
        except (TimeoutError, asyncio.CancelledError):  # (cancelled: the triggerer stops the trigger) no orphan left
            proc.kill()
            await proc.wait()
            raise
        return CommandResult(argv, proc.returncode, _text(stdout), _text(stderr))


class SSHBox(Box):
    """A box behind an Airflow SSH connection. Hooks are created lazily: building one reads the connection."""

    def __init__(self, conn_id: str, conn_timeout: float = 30):
        self.conn_id = conn_id
        self.conn_timeout = conn_timeout
        self._async_conn = None  # one asyncssh connection reused across polls (sshd MaxStartups friendly)

    def run(self, argv: list[str], *, input: bytes | None = None, timeout: float = 600) -> CommandResult:
        from airflow.providers.ssh.hooks.ssh import SSHHook

        hook = SSHHook(ssh_conn_id=self.conn_id, conn_timeout=int(self.conn_timeout), conn_retry_attempts=1)
        try:
            client = hook.get_conn()
        except Exception as err:  # paramiko raises many types: socket errors, SSHException, BadHostKeyException
            raise BoxUnreachable(f"cannot reach box {self.conn_id!r}: {type(err).__name__}: {err}") from err
        with client:
            try:
                stdin, stdout, stderr = client.exec_command(shlex.join(argv), timeout=timeout)
                if input is not None:
                    stdin.write(input)
                stdin.channel.shutdown_write()
                out = stdout.read()
                err_text = stderr.read()
                status = stdout.channel.recv_exit_status()
            except (OSError, EOFError) as err:
                raise BoxUnreachable(f"connection to box {self.conn_id!r} lost: {err}") from err
        if status == -1:  # paramiko's answer when the connection closed before the command's exit status came
            raise BoxUnreachable(f"connection to box {self.conn_id!r} lost while running {argv[:3]}")
        return CommandResult(argv, status, _text(out), _text(err_text))

    async def arun(self, argv: list[str], *, timeout: float = 60) -> CommandResult:
        import asyncssh
        from airflow.providers.ssh.hooks.ssh import SSHHookAsync

        try:
            if self._async_conn is None:
                hook = SSHHookAsync(ssh_conn_id=self.conn_id)
                self._async_conn = await asyncio.wait_for(hook.get_conn(), self.conn_timeout)
            result = await self._async_conn.run(shlex.join(argv), timeout=timeout, check=False)
        except (OSError, asyncssh.Error, TimeoutError) as err:
            await self.aclose()
            raise BoxUnreachable(f"cannot reach box {self.conn_id!r}: {type(err).__name__}: {err}") from err
        if result.exit_status is None:  # the connection closed before the command reported how it ended
            await self.aclose()
            raise BoxUnreachable(f"connection to box {self.conn_id!r} lost while running {argv[:3]}")
        if result.exit_signal is not None:  # -1: killed by a signal, as when sshd goes down under it
            # Every async command (job polls, box checks) is safe to repeat, so a killed one counts as the box's
            # outage and is retried within the grace period, on a new connection.
            await self.aclose()
            raise BoxUnreachable(f"a command on box {self.conn_id!r} was killed by {result.exit_signal[0]} "
                                 f"while running {argv[:3]} (sshd stopped under it?)")
        return CommandResult(argv, result.exit_status, _text(result.stdout), _text(result.stderr))

    async def aclose(self) -> None:
        conn, self._async_conn = self._async_conn, None
        if conn is not None:
            conn.close()
            try:
                await conn.wait_closed()
            except Exception:  # a dead connection may fail to close; it is gone either way
                pass


def box_for(conn_id: str) -> Box:
    """The box behind a connection id; "local" is this machine."""
    return LocalBox() if conn_id == LOCAL else SSHBox(conn_id)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", errors="replace")
