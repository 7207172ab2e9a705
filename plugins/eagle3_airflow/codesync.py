"""Code sync: the box runs exactly the eagle3 package this DAG was parsed with.

The package (include/eagle3, and eagle3_capture-1.0.dist-info beside it, by which SGLang finds the capture plugin)
is packed into a deterministic tarball named by its sha256 and unpacked on the box into {workdir}/code/{digest}/
through a temp dir and a rename. Every remote job syncs before it starts, so a box that lost its code gets it back.

The directory's name is not trusted (the workdir may be shared): each sync compares it with the archive, file by
file, owned by the box user and writable by no one else, and deletes bytecode caches. One that differs is moved to
`.untrusted-<digest>-<time>` and unpacked again; a code root not the user's own, or writable by others, is refused.

A run keeps the code it started with: validate pins the worker's digest in the run plan, and every try of every task
syncs that digest. The box keeps each archive it was sent (`code/.archives/<digest>.tar.gz`) and, once the worker
has other code, unpacks from that copy after checking its digest. To move a run to new code, clear its validate
task with downstream.

The script runs as `python -I`. A box python older than 3.11 or whose tarfile lacks the extraction filter
(UNUSABLE_PYTHON_EXIT), or a pinned digest the box has no sound copy of (CODE_GONE_EXIT), fails the task without a
retry (AirflowFailException); any other failure raises RemoteCommandError.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from airflow.sdk.exceptions import AirflowFailException

import eagle3
from eagle3_airflow.transport import Box, RemoteCommandError

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(eagle3.__file__).resolve().parent
# Beside the package: the metadata whose entry point lets SGLang's scheduler processes find the capture plugin on
# PYTHONPATH (eagle3/capture/sglang_plugin.py), so nothing needs pip-installing on the box.
PLUGIN_METADATA_DIR = PACKAGE_DIR.parent / "eagle3_capture-1.0.dist-info"
SYNCED_DIRS = (PACKAGE_DIR, PLUGIN_METADATA_DIR)
UNUSABLE_PYTHON_EXIT = 3  # the unpack script's answer for a box python it refuses: no retry helps
CODE_GONE_EXIT = 4  # ... for a pinned digest the box has no copy of, which the worker no longer has either

# Runs on the box as `python -I -c UNPACK_SCRIPT ROOT DIGEST` with only the standard library (the package is not
# there yet); stdin: the gzipped tarball. Prints the code directory; a note on stderr when it re-unpacks.
UNPACK_SCRIPT = r"""
import gzip, hashlib, io, os, shutil, stat, sys, tarfile, tempfile, time
if sys.version_info < (3, 11) or not hasattr(tarfile, "data_filter"):
    sys.stderr.write("box.python %s is Python %s, whose tarfile lacks the extraction filter (or -P): a crafted "
                     "archive could write outside the code directory; point box.python at Python 3.11.4 or newer\n"
                     % (sys.executable, sys.version.split()[0]))
    sys.exit(3)
root, digest = sys.argv[1], sys.argv[2]
final = os.path.join(root, digest)
kept = os.path.join(root, ".archives", digest + ".tar.gz")
sent = sys.stdin.buffer.read()
if sent:
    gzipped = sent
else:  # the worker has other code now: the archive this box kept when the run's code was first synced
    try:
        with open(kept, "rb") as f:
            gzipped = f.read()
    except FileNotFoundError:
        sys.stderr.write("the box keeps no copy of code %s (%s is missing)\n" % (digest, kept))
        sys.exit(4)
tar_bytes = gzip.decompress(gzipped)
if hashlib.sha256(tar_bytes).hexdigest()[:16] != digest:  # the digest came from the worker: the copy is checked
    if sent:
        sys.exit("code sync: the archive arrived damaged (digest mismatch); retry")
    sys.stderr.write("the box's copy of code %s (%s) was altered: it does not hash to its name\n" % (digest, kept))
    sys.exit(4)
with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
    expected = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}

def untrusted(path, st):
    if st.st_uid != os.getuid():
        return "%s is owned by uid %d, not this user (%d)" % (path, st.st_uid, os.getuid())
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "%s is writable by others (mode %o)" % (path, stat.S_IMODE(st.st_mode))
    if stat.S_ISLNK(st.st_mode):
        return "%s is a symlink" % path

def difference(top):
    # Why `top` is not exactly the archive, or None.
    found = set()
    for dirpath, dirnames, filenames in os.walk(top):
        if "__pycache__" in dirnames:
            # Bytecode would run instead of the source it claims to be compiled from. The stages never write it
            # (PYTHONDONTWRITEBYTECODE), so whatever is here came from elsewhere: removed, the sources are used.
            dirnames.remove("__pycache__")
            try:
                shutil.rmtree(os.path.join(dirpath, "__pycache__"))
            except OSError as err:
                return "cannot remove %s: %s" % (os.path.join(dirpath, "__pycache__"), err)
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            problem = untrusted(path, os.lstat(path))
            if problem:
                return problem
        rel_dir = os.path.relpath(dirpath, top)
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel not in expected:
                return "%s is not part of the package" % rel
            with open(os.path.join(top, rel), "rb") as f:
                if f.read() != expected[rel]:
                    return "%s differs from the package" % rel
            found.add(rel)
    missing = sorted(set(expected) - found)
    return "%s is missing" % missing[0] if missing else None

os.makedirs(root, mode=0o755, exist_ok=True)
problem = untrusted(root, os.lstat(root))
if problem:
    sys.exit("code sync: refusing %s: %s; make it this user's own directory (chmod go-w)" % (root, problem))
if os.path.isdir(final) or os.path.islink(final):
    problem = untrusted(final, os.lstat(final)) or difference(final)
    if problem:
        aside = os.path.join(root, ".untrusted-%s-%d" % (digest, time.time()))
        os.rename(final, aside)
        sys.stderr.write("code sync: %s did not match the package (%s); moved it to %s and unpacked again\n"
                         % (final, problem, aside))
if not os.path.isdir(final):
    tmp = tempfile.mkdtemp(prefix=".tmp-" + digest + "-", dir=root)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        tar.extractall(tmp, filter="data")
    for dirpath, dirnames, filenames in os.walk(tmp):
        os.chmod(dirpath, 0o755)  # whatever the umask: readable, and writable by this user only
        for name in filenames:
            path = os.path.join(dirpath, name)
            os.chmod(path, 0o644)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    try:
        os.rename(tmp, final)
    except OSError:  # another task synced the same digest first
        shutil.rmtree(tmp, ignore_errors=True)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
def kept_differs():
    try:
        with open(kept, "rb") as f:
            return f.read() != sent
    except FileNotFoundError:
        return True

if sent and kept_differs():  # for a later try of this run after the worker's code changed
    os.makedirs(os.path.dirname(kept), mode=0o755, exist_ok=True)
    tmp = "%s.tmp-%d" % (kept, os.getpid())
    with open(tmp, "wb") as f:
        f.write(sent)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, kept)
print(final)
"""


@dataclass(frozen=True)
class CodeArchive:
    digest: str
    gzipped: bytes


@lru_cache(maxsize=1)
def package_archive() -> CodeArchive:
    """The eagle3 package as a reproducible .tar.gz and its digest (same files -> same digest)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for top in SYNCED_DIRS:
            for path in sorted(top.rglob("*")):
                if "__pycache__" in path.parts or path.suffix == ".pyc" or not path.is_file():
                    continue
                info = tarfile.TarInfo(str(Path(top.name) / path.relative_to(top)))
                data = path.read_bytes()
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
    tar_bytes = buffer.getvalue()
    return CodeArchive(hashlib.sha256(tar_bytes).hexdigest()[:16], gzip.compress(tar_bytes, mtime=0))


def code_dir(workdir: str, digest: str | None = None) -> str:
    """Where the package of digest `digest` (default: the worker's own) lives on the box."""
    return f"{workdir.rstrip('/')}/code/{digest or package_archive().digest}"


def ensure_code(box: Box, python: str, workdir: str, digest: str | None = None) -> str:
    """Make sure the box has the package of digest `digest` (a run's pinned code; default: the worker's own) and
    return its directory. The worker's own package is uploaded, and the box keeps a copy of the archive; a digest
    the worker no longer has (deployed since the run started) is checked against, and if need be unpacked from,
    that copy."""
    archive = package_archive()
    digest = digest or archive.digest
    root = f"{workdir.rstrip('/')}/code"
    if digest != archive.digest:
        log.info(
            "%s: this run's code is %s (pinned when it was validated); the worker's package is %s now, so the box "
            "uses its copy of %s",
            box.conn_id,
            digest,
            archive.digest,
            digest,
        )
    payload = archive.gzipped if digest == archive.digest else b""
    result = box.run([python, "-I", "-c", UNPACK_SCRIPT, root, digest], input=payload, timeout=300)
    if result.returncode == UNUSABLE_PYTHON_EXIT:
        raise AirflowFailException(result.stderr.strip())
    if result.returncode == CODE_GONE_EXIT:
        raise AirflowFailException(
            f"{result.stderr.strip()}: this run was validated with code {digest}, the worker's package is "
            f"{archive.digest} now, and {box.conn_id} no longer has {digest}. To go on with the new code, clear this "
            "run's validate task with its downstream tasks: validate pins the worker's code again, and stages that "
            "finished stay finished (their jobs succeeded)"
        )
    for line in result.stderr.splitlines():  # a directory that did not match and was unpacked again
        log.warning("%s: %s", box.conn_id, line)
    if result.returncode != 0:  # (the message leaves out the script, which check() would print whole)
        raise RemoteCommandError(
            f"code sync to {root} on {box.conn_id} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    return result.stdout.strip()
