"""Code sync: the box runs exactly the eagle3 package this DAG was parsed with.

The package (include/eagle3) is packed into a deterministic tarball (sorted names, zero mtimes and
owners), named by its sha256, and unpacked on the box into {workdir}/code/{digest}/ through a temp
dir and a rename, so a directory with that name is always complete. The workdir is persistent
storage: the seed run kept its scripts in /tmp and lost them to a VM crash. Syncing is idempotent and
cheap when the directory is there; every remote job calls it before starting, so a box that lost its
code dir (reimaged, or cleaned by hand) gets it back on the next try.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import eagle3
from eagle3_airflow.transport import Box

PACKAGE_DIR = Path(eagle3.__file__).resolve().parent

# Runs on the box with only the standard library (the package is not there yet). Arguments: the code
# root and the expected digest; stdin: the gzipped tarball. Prints the code directory.
UNPACK_SCRIPT = r"""
import hashlib, io, os, shutil, sys, tarfile, tempfile, gzip
root, digest = sys.argv[1], sys.argv[2]
final = os.path.join(root, digest)
blob = sys.stdin.buffer.read()
if not os.path.isdir(final):
    tar_bytes = gzip.decompress(blob)
    if hashlib.sha256(tar_bytes).hexdigest()[:16] != digest:
        sys.exit("code sync: the archive arrived damaged (digest mismatch); retry")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + digest + "-", dir=root)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, filter="data")
        else:
            tar.extractall(tmp)
    for dirpath, _, files in os.walk(tmp):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    try:
        os.rename(tmp, final)
    except OSError:  # another task synced the same digest first
        shutil.rmtree(tmp, ignore_errors=True)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
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
        for path in sorted(PACKAGE_DIR.rglob("*")):
            if "__pycache__" in path.parts or path.suffix == ".pyc" or not path.is_file():
                continue
            info = tarfile.TarInfo(str(Path("eagle3") / path.relative_to(PACKAGE_DIR)))
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tar_bytes = buffer.getvalue()
    return CodeArchive(hashlib.sha256(tar_bytes).hexdigest()[:16], gzip.compress(tar_bytes, mtime=0))


def code_dir(workdir: str) -> str:
    """Where this DAG's package lives on the box."""
    return f"{workdir.rstrip('/')}/code/{package_archive().digest}"


def ensure_code(box: Box, python: str, workdir: str) -> str:
    """Upload the package to the box unless it is already there; return its directory."""
    archive = package_archive()
    root = f"{workdir.rstrip('/')}/code"
    result = box.run([python, "-c", UNPACK_SCRIPT, root, archive.digest], input=archive.gzipped, timeout=300)
    return result.check(f"code sync to {root}").stdout.strip()
