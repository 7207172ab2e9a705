"""The files of a run that the control plane may read back: its plots and its reports, and nothing else.

The Airflow side (the report task, the approval) asks `python -m eagle3 report manifest --run-dir RUN_DIR --name ...`
which of a run's files it may read, because a run directory may lie in a workdir others can write to. Readable are
only `<stage>/<name>.png` (one directory level: evaluate/acceptance.png, train/loss.png) and the reports
eagle3.disk.layout.READABLE_REPORTS names (evaluate/report.json, benchmark/benchmark.json); only regular files of
at most MAX_FILE_BYTES (8 MiB); only under a run directory that is an absolute path without `..` and no symlink,
each step below it opened with O_NOFOLLOW.

Output is one JSON object on stdout: per name asked for, its size and sha256, `"present": false` when it does not
exist (evaluate was skipped), or `"refused"` and why; with `--plots`, the run's plots (list_plots). The bytes travel
by SFTP (or a local read on the local box), and the control plane refuses any whose size or sha256 differ from the
manifest. A refused run directory exits 2 and says why on stderr, naming the path; a refused file is an entry.
Why: docs/decisions/2026-12-04-report-files-named-by-box.md, docs/decisions/2026-12-05-report-files-by-sftp.md.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat

from eagle3.contracts import FileManifest, ManifestEntry
from eagle3.disk.layout import READABLE_REPORTS

MAX_FILE_BYTES = 8 << 20
STAGE_DIR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
PLOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.png$")


class ReportFileRefused(ValueError):
    """A name or file this module does not hand out; the message names the path and why."""


def allowed_name(name: str) -> bool:
    """`<stage>/<plot>.png` or one of READABLE_REPORTS: the only names `read` accepts."""
    if name in READABLE_REPORTS:
        return True
    parts = name.split("/")
    return len(parts) == 2 and bool(STAGE_DIR.match(parts[0])) and bool(PLOT_NAME.match(parts[1]))


def _open_run_dir(run_dir: str) -> int:
    """A descriptor of the run directory: a real directory, not a link to one."""
    if not os.path.isabs(run_dir) or ".." in run_dir.split("/"):
        raise ReportFileRefused(f"{run_dir}: the run directory must be an absolute path without '..'")
    try:
        return os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ReportFileRefused(f"{run_dir}: no such run directory on this box") from None
    except OSError as err:  # ELOOP / ENOTDIR: a symlink or a file where the run directory should be
        raise ReportFileRefused(
            f"{run_dir}: not a real directory ({os.strerror(err.errno)}); a run directory is never a symlink"
        ) from None


def _open_below(dir_fd: int, name: str, path: str, directory: bool) -> int | None:
    """Open one component below dir_fd without following a link; None if it does not exist."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if directory else os.O_NONBLOCK)
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ReportFileRefused(
            f"{path}: refused ({os.strerror(err.errno)}): only regular files and real "
            "directories of the run are read, never a symlink"
        ) from None


def read_file(run_dir: str, name: str) -> bytes | None:
    """The bytes of RUN_DIR/name, or None if it does not exist; ReportFileRefused for anything else."""
    if not allowed_name(name):
        raise ReportFileRefused(
            f"{name!r}: not a file the report reads (only <stage>/<name>.png and {', '.join(READABLE_REPORTS)})"
        )
    stage, filename = name.split("/")
    path = f"{run_dir.rstrip('/')}/{name}"
    run_fd = _open_run_dir(run_dir)
    try:
        stage_fd = _open_below(run_fd, stage, f"{run_dir.rstrip('/')}/{stage}", directory=True)
        if stage_fd is None:
            return None
        try:
            fd = _open_below(stage_fd, filename, path, directory=False)
        finally:
            os.close(stage_fd)
    finally:
        os.close(run_fd)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ReportFileRefused(f"{path}: not a regular file; refused")
        if info.st_size > MAX_FILE_BYTES:
            raise ReportFileRefused(
                f"{path}: {info.st_size} bytes, more than the {MAX_FILE_BYTES} a report file may have; refused"
            )
        data = file.read(MAX_FILE_BYTES + 1)  # the file may grow after the fstat
    if len(data) > MAX_FILE_BYTES:
        raise ReportFileRefused(f"{path}: grew past the {MAX_FILE_BYTES} bytes a report file may have; refused")
    return data


def list_plots(run_dir: str) -> list[str]:
    """`<stage>/<name>.png` of every regular file of that form and size, sorted; links, other files, files deeper
    down and files over MAX_FILE_BYTES are left out (read_file would refuse them)."""
    run_fd = _open_run_dir(run_dir)
    plots = []
    try:
        with os.scandir(run_fd) as stages:
            for stage in stages:
                if not STAGE_DIR.match(stage.name) or not stage.is_dir(follow_symlinks=False):
                    continue
                stage_fd = _open_below(run_fd, stage.name, f"{run_dir}/{stage.name}", directory=True)
                if stage_fd is None:  # removed meanwhile
                    continue
                try:
                    with os.scandir(stage_fd) as files:
                        plots += [
                            f"{stage.name}/{entry.name}"
                            for entry in files
                            if PLOT_NAME.match(entry.name)
                            and entry.is_file(follow_symlinks=False)
                            and entry.stat(follow_symlinks=False).st_size <= MAX_FILE_BYTES
                        ]
                finally:
                    os.close(stage_fd)
    finally:
        os.close(run_fd)
    return sorted(plots)


def manifest_command(run_dir: str, names: list[str], plots: bool = False) -> FileManifest:
    """What the control plane may fetch of RUN_DIR: per name, its size and sha256 (read through read_file's
    checks), `"present": false`, or `"refused"` and why; with `plots`, list_plots too. ReportFileRefused only for a
    run directory that is refused."""
    os.close(_open_run_dir(run_dir))
    files: list[ManifestEntry] = []
    for name in names:
        try:
            data = read_file(run_dir, name)
        except ReportFileRefused as err:
            files.append({"name": name, "refused": str(err)})
            continue
        files.append(
            {"name": name, "present": False}
            if data is None
            else {"name": name, "present": True, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        )
    answer: FileManifest = {"run_dir": run_dir, "files": files}
    if plots:
        answer["plots"] = list_plots(run_dir)
    return answer
