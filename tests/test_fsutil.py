"""eagle3.disk.fsutil.read_small_file: a file a config names is read only if it is a small regular file of its own.

Each refusal is the real thing (a link, a FIFO, a device, /proc and /sys, a file over the cap), refused with the
file named; none of them is read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from eagle3.disk import fsutil
from eagle3.disk.fsutil import UnsafeFile, read_small_file

CAP = 64


def refused(path: Path | str, problem: str):
    return pytest.raises(UnsafeFile, match="^" + re.escape(f"{path}: {problem}"))


def test_a_small_regular_file_is_read_whole_also_through_a_linked_directory(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "t.jinja").write_bytes(b"x" * CAP)
    (tmp_path / "linked").symlink_to(tmp_path / "real")  # only the last component must not be a link
    assert read_small_file(tmp_path / "real" / "t.jinja", CAP) == b"x" * CAP
    assert read_small_file(str(tmp_path / "linked" / "t.jinja"), CAP) == b"x" * CAP
    with pytest.raises(FileNotFoundError):
        read_small_file(tmp_path / "absent", CAP)


def test_a_link_is_refused_not_followed(tmp_path):
    """Attack: the file a config names made a link to a file the box user can read (a key, a token)."""
    (tmp_path / "secret").write_text("hunter2")
    (tmp_path / "t.jinja").symlink_to(tmp_path / "secret")
    with refused(tmp_path / "t.jinja", "a symbolic link, not a regular file"):
        read_small_file(tmp_path / "t.jinja", CAP)


@pytest.mark.timeout(60)  # (signal method: a FIFO opened to read waits for a writer; this stops it, should it be)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "t.jinja")
    with refused(tmp_path / "t.jinja", "a FIFO, not a regular file"):
        read_small_file(tmp_path / "t.jinja", CAP)


def test_a_directory_or_a_device_is_refused_and_no_device_is_opened(tmp_path, monkeypatch):
    with refused(tmp_path, "a directory, not a regular file"):
        read_small_file(tmp_path, CAP)
    opened = []
    monkeypatch.setattr(os, "open", lambda *args, **kwargs: opened.append(args) or pytest.fail("opened"))
    with refused("/dev/zero", "a device, not a regular file"):  # (endless, were it read)
        read_small_file("/dev/zero", CAP)
    assert opened == []


@pytest.mark.parametrize(
    "path", ["/proc/self/pagemap", "/proc/self/status", "/sys/kernel/anything", "/proc/../proc/self/environ"]
)
def test_files_in_proc_and_sys_are_refused(path):
    """Attack: /proc/self/pagemap is a "regular file" of size 0 that never ends (it maps the whole address space);
    /proc/self/environ holds the process's secrets. Refused by the path, before anything is looked at."""
    root = "/sys" if path.startswith("/sys") else "/proc"
    with refused(path, f"a file in {root}, the kernel's view of processes and devices, not a data file"):
        read_small_file(path, CAP)


def test_a_file_in_proc_through_a_linked_directory_is_refused(tmp_path, monkeypatch):
    """A directory on the way is a link into /proc: refused by the resolved path, and, were a link swapped in after
    that check, by the opened file's device."""
    (tmp_path / "me").symlink_to("/proc/self")
    shown = tmp_path / "me" / "status"
    with refused(shown, "a file in /proc, the kernel's view"):
        read_small_file(shown, CAP)
    monkeypatch.setattr(fsutil, "_pseudo_filesystem_of", lambda path: None)  # (as if swapped in after the check)
    with refused(shown, "a file in /proc (through a link in a directory above it), not a data file"):
        read_small_file(shown, CAP)


def test_a_file_over_the_cap_is_refused_by_its_size(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * (CAP + 1))
    with refused(tmp_path / "big", f"{CAP + 1} bytes, more than the {CAP} read here"):
        read_small_file(tmp_path / "big", CAP)


def test_a_file_that_says_it_is_empty_and_never_ends_is_read_no_further_than_the_cap(monkeypatch):
    """/proc/self/pagemap with the /proc checks out of the way: its size says 0, and a read of it never ends. At most
    cap + 1 bytes are read, and the file is refused. (Cap 7: pagemap reads in whole 8-byte entries.)"""
    monkeypatch.setattr(fsutil, "PSEUDO_FILESYSTEMS", ())
    assert os.stat("/proc/self/pagemap").st_size == 0
    with refused(
        "/proc/self/pagemap", "more than the 7 bytes read here (it grew while it was read, or is not the size it says)"
    ):
        read_small_file("/proc/self/pagemap", 7)
