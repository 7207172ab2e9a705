"""How the control plane reaches the GPU box: run one command (argv, optional stdin), get its output; and fetch
files the box's own code named.

Files travel to the box as a command's stdin (code sync pipes a tarball into a fixed unpack script; config.json
goes to `python -m eagle3 init --config -`). From the box, report files (report.json, plots) travel by `fetch`: the
SSH connection's SFTP on an SSH box, a plain read on the local one. `fetch` is read-only, reads at most the size it
is told and refuses what is not a regular file of exactly that size; which files and what bytes are what the box's
own code (`python -m eagle3 report manifest`) decided, and the caller (eagle3_airflow.results) checks each file's
sha256 against that, so a path followed through a link swapped in afterwards yields bytes that are refused.

Two implementations:
- `LocalBox` (connection id "local"): the box is this machine; used by `make demo` and fast tests.
- `SSHBox` (any other id): an Airflow SSH connection through the SSH provider's hooks, `SSHHook`
  (paramiko, its SFTP client for `fetch`) in workers and `SSHHookAsync` (asyncssh) in the triggerer. Host keys
  are verified: set `host_key` in the connection's extra (or have the host in the worker's known_hosts); the
  provider refuses unknown hosts unless a connection turns host-key checking off (its no_host_key_check extra),
  which nothing here does. `with box.connected():` runs several commands and fetches over one connection.

Every argv element is quoted with `shlex.join` before it reaches the remote shell, so no value (a
path with `$(...)` in it, say) is ever interpreted by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import stat
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncssh import SSHClientConnection
    from paramiko import SFTPAttributes, SFTPClient, SSHClient

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

    def json(self, what: str) -> Any:
        """The command's stdout as JSON, after `check`; a command that printed something else is an error. (Any JSON:
        the caller names its shape, a TypedDict of eagle3.contracts where there is one.)"""
        self.check(what)
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError:
            raise RemoteCommandError(f"{what}: the box printed no JSON:\n{self.stdout[-2000:]}") from None


class RemoteCommandError(RuntimeError):
    """A command ran on the box and failed; the message carries its exit code and stderr tail."""


class FileRefused(Exception):
    """A file `fetch` would not read: not a regular file (a link, a pipe) or not of the size it was told."""


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

    @abstractmethod
    def fetch(self, files: dict[str, int], *, timeout: float = 120) -> dict[str, bytes | None]:
        """The bytes of each absolute path on the box, reading at most the size given for it: None where the path
        does not exist; FileRefused where it is not a regular file (a link or a pipe included) or not of exactly
        that size. The caller checks the content (a sha256 the box's code gave). Raises BoxUnreachable if the
        box cannot be reached."""

    @contextlib.contextmanager
    def connected(self) -> Iterator[Box]:
        """The `run`s and `fetch`es inside the block share one connection where the box has one."""
        yield self


class LocalBox(Box):
    conn_id = LOCAL

    def fetch(self, files: dict[str, int], *, timeout: float = 120) -> dict[str, bytes | None]:
        fetched: dict[str, bytes | None] = {}
        for path, size in files.items():
            try:  # never through a link at the last step, never blocking on a pipe
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                fetched[path] = None
                continue
            except OSError as err:
                raise FileRefused(f"{path}: refused, not read ({err.strerror}: a link?)") from None
            with os.fdopen(fd, "rb") as file:
                _check_attributes(path, os.fstat(file.fileno()), size)
                fetched[path] = file.read(size)
        return fetched

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
        assert proc.returncode is not None  # communicate() waited for the process to exit
        return CommandResult(argv, proc.returncode, _text(stdout), _text(stderr))


class SSHBox(Box):
    """A box behind an Airflow SSH connection. Hooks are created lazily: building one reads the connection."""

    def __init__(self, conn_id: str, conn_timeout: float = 30):
        self.conn_id = conn_id
        self.conn_timeout = conn_timeout
        # one asyncssh connection reused across polls (sshd MaxStartups friendly)
        self._async_conn: SSHClientConnection | None = None
        self._shared_client: SSHClient | None = None  # the paramiko client of a `connected()` block

    def _connect(self) -> SSHClient:
        """A paramiko client, the host key verified by the SSH provider's hook."""
        from airflow.providers.ssh.hooks.ssh import SSHHook

        hook = SSHHook(ssh_conn_id=self.conn_id, conn_timeout=int(self.conn_timeout), conn_retry_attempts=1)
        try:
            return hook.get_conn()
        except Exception as err:  # paramiko raises many types: socket errors, SSHException, BadHostKeyException
            raise BoxUnreachable(f"cannot reach box {self.conn_id!r}: {type(err).__name__}: {err}") from err

    @contextlib.contextmanager
    def _client(self) -> Iterator[SSHClient]:
        """The connection of the enclosing `connected()` block, or one for this call alone."""
        if self._shared_client is not None:
            yield self._shared_client
            return
        with self._connect() as client:
            yield client

    @contextlib.contextmanager
    def connected(self) -> Iterator[Box]:
        with self._connect() as client:
            self._shared_client = client
            try:
                yield self
            finally:
                self._shared_client = None

    def fetch(self, files: dict[str, int], *, timeout: float = 120) -> dict[str, bytes | None]:
        import paramiko

        fetched: dict[str, bytes | None] = {}
        with self._client() as client:
            try:
                sftp = client.open_sftp()
            except paramiko.SSHException as err:
                transport = client.get_transport()
                if transport is None or not transport.is_active():
                    raise BoxUnreachable(f"connection to box {self.conn_id!r} lost: {err}") from err
                # the connection is up and the subsystem request was refused: sshd has no `Subsystem sftp`
                raise RemoteCommandError(
                    f"box {self.conn_id!r} offers no SFTP ({err}): the report files come by the "
                    "SSH connection's SFTP; enable sshd's `Subsystem sftp` on the box"
                ) from None
            except (OSError, EOFError) as err:
                raise BoxUnreachable(f"connection to box {self.conn_id!r} lost: {err}") from err
            with sftp:
                sftp.get_channel().settimeout(timeout)  # a pipe swapped in after the lstat blocks the server's open
                try:
                    for path, size in files.items():
                        fetched[path] = _sftp_read(sftp, path, size)
                except (EOFError, ConnectionError, TimeoutError, paramiko.SSHException) as err:
                    raise BoxUnreachable(f"SFTP to box {self.conn_id!r} lost: {type(err).__name__}: {err}") from err
        return fetched

    def run(self, argv: list[str], *, input: bytes | None = None, timeout: float = 600) -> CommandResult:
        with self._client() as client:
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
                connection: SSHClientConnection = await asyncio.wait_for(hook.get_conn(), self.conn_timeout)
                self._async_conn = connection
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
            raise BoxUnreachable(
                f"a command on box {self.conn_id!r} was killed by {result.exit_signal[0]} "
                f"while running {argv[:3]} (sshd stopped under it?)"
            )
        return CommandResult(argv, result.exit_status, _text(result.stdout), _text(result.stderr))

    async def aclose(self) -> None:
        conn, self._async_conn = self._async_conn, None
        if conn is not None:
            conn.close()
            try:
                await conn.wait_closed()
            except Exception:  # a dead connection may fail to close; it is gone either way
                pass


def _check_attributes(path: str, attributes: os.stat_result | SFTPAttributes, size: int) -> None:
    """A regular file of exactly `size` bytes (os.stat_result or paramiko's SFTPAttributes), or FileRefused."""
    if attributes.st_mode is None or not stat.S_ISREG(attributes.st_mode):
        raise FileRefused(f"{path}: not a regular file (a link or a pipe?); refused")
    if attributes.st_size != size:
        raise FileRefused(f"{path}: {attributes.st_size} bytes where the box's manifest said {size}; refused")


def _sftp_read(sftp: SFTPClient, path: str, size: int) -> bytes | None:
    """One file through SFTP: lstat (a link is refused unopened), then the open handle's fstat, then at most `size`
    bytes, requested ahead (prefetch) rather than one round trip per 32 KiB."""
    try:
        _check_attributes(path, sftp.lstat(path), size)
        with sftp.open(path, "rb") as file:
            _check_attributes(path, file.stat(), size)
            if size:
                file.prefetch(size)
            data: bytes = file.read(size)
            return data
    except FileNotFoundError:  # (paramiko raises SFTP's "no such file" as IOError(ENOENT): this class)
        return None
    except (ConnectionError, TimeoutError):  # the connection, not the file: the caller's outage
        raise
    except OSError as err:  # paramiko's IOError for another SFTP status (permission denied, failure)
        raise FileRefused(f"{path}: refused, not read ({err})") from None


def box_for(conn_id: str) -> Box:
    """The box behind a connection id; "local" is this machine."""
    return LocalBox() if conn_id == LOCAL else SSHBox(conn_id)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", errors="replace")
