"""Fault drill 4: extraction into a disk that fills up (a real 3 MiB tmpfs; mounting it needs root, as CI has).
Figure printed: the error message, samples stored before the disk was full, and after the rerun."""

from __future__ import annotations

import os
import subprocess

import pytest

from eagle3.config import write_run_config
from eagle3.data.store import digest, verify
from eagle3.stages.extract import run_extract
from tests.conftest import run_eagle3

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs, grown on request: a disk that fills up during extraction, then gets room."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the disk-full drill mounts a tmpfs: CI runs as root")
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)

    def grow(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True)

    try:
        yield mount, grow
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_a_clear_error_keeps_nothing_partial_and_the_rerun_completes(make_config, small_disk):
    """`python -m eagle3 extract` into a 3 MiB tmpfs, 80 samples (about 5.5 MiB). Proves: it stops with exit code
    2 (the DAG fails the task at once, no retries) and a one-line error naming the shard directory and the
    figures (what was needed, what is free of the disk's size) and the fix; no temp chunk is left in the shard;
    what the manifest records is whole and readable. After the disk grows (space freed) the same command (what
    clearing the task runs) completes, and the store's digest equals an extraction that had room."""
    mount, grow = small_disk
    reference = make_config(run_name="roomy", data={"max_samples": 80})
    run_extract(reference)

    cfg = make_config(run_name="cramped", workdir=mount / "work", data={"max_samples": 80})
    write_run_config(cfg)
    proc = run_eagle3("extract", "--config", str(cfg.config_path), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    shard = cfg.store_dir / "shard-00000"
    partial = [p.name for p in shard.iterdir() if ".tmp-" in p.name]
    stored = verify(cfg.store_dir)["samples"]  # what is recorded is whole and readable
    grow("64m")  # space freed; the task is cleared
    run_eagle3("extract", "--config", str(cfg.config_path))
    after = verify(cfg.store_dir)["samples"]
    print(
        f"\ndrill 4 (disk full): exit code {proc.returncode}: {message}\n  partial chunks left: {partial}; "
        f"samples stored at the full disk {stored}, after space was freed and the stage rerun {after} "
        f"(of {verify(reference.store_dir)['samples']})"
    )
    assert "no space left on the device" in message and str(shard) in message
    assert "MiB free of 3.00 MiB" in message and "run the stage again" in message
    assert not partial, "a partial chunk was left behind"
    assert 0 < stored < after
    assert digest(cfg.store_dir) == digest(reference.store_dir)
