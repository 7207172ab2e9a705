"""Reaching the box: the local transport and SSH through the provider's hooks against a real sshd on loopback,
with host keys verified; shell syntax in values stays data; code sync is content-addressed and heals."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from eagle3_airflow.codesync import code_dir, ensure_code, package_archive
from eagle3_airflow.tasks import validate_run, write_config
from eagle3_airflow.transport import BoxUnreachable, LocalBox, SSHBox


@pytest.fixture
def ssh_box(sshd, monkeypatch) -> SSHBox:
    monkeypatch.setenv("AIRFLOW_CONN_GPU_BOX", sshd.airflow_conn_json())
    return SSHBox("gpu_box")


def hostile(tmp_path: Path) -> str:
    """A value that would create files if any shell ever interpreted it."""
    return f"{tmp_path}/$(touch {tmp_path}/pwned1)`touch {tmp_path}/pwned2`;touch {tmp_path}/pwned3 #"


def assert_nothing_executed(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("pwned*")), "a value was executed by a shell"


@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_argv_elements_reach_the_command_verbatim(transport, tmp_path, request):
    box = LocalBox() if transport == "local" else request.getfixturevalue("ssh_box")
    value = hostile(tmp_path)
    result = box.run(["printf", "%s", value])
    assert (result.returncode, result.stdout) == (0, value)
    result = asyncio.run(box.arun(["printf", "%s", value]))
    assert (result.returncode, result.stdout) == (0, value)
    assert_nothing_executed(tmp_path)


def test_stdin_reaches_the_remote_command(ssh_box):
    data = bytes(range(256)) * 1000
    assert ssh_box.run(["wc", "-c"], input=data).stdout.strip() == str(len(data))


def test_a_wrong_host_key_is_refused(sshd, monkeypatch):
    other_key = " ".join(Path(f"{sshd.client_key}.pub").read_text().split()[:2])  # a valid key, not the host's
    monkeypatch.setenv("AIRFLOW_CONN_IMPOSTOR", sshd.airflow_conn_json(host_key=other_key))
    box = SSHBox("impostor")
    with pytest.raises(BoxUnreachable):
        box.run(["true"])
    with pytest.raises(BoxUnreachable):
        asyncio.run(box.arun(["true"]))


def test_code_sync_is_content_addressed_idempotent_and_heals(ssh_box, tmp_path):
    workdir = str(tmp_path / "work")
    first = ensure_code(ssh_box, sys.executable, workdir)
    assert first == code_dir(workdir) and first.endswith(package_archive().digest)
    assert (Path(first) / "eagle3" / "__main__.py").exists()
    assert not [p for p in Path(first).parent.iterdir() if p.name.startswith(".tmp-")]
    mtime = Path(first).stat().st_mtime_ns
    assert ensure_code(ssh_box, sys.executable, workdir) == first
    assert Path(first).stat().st_mtime_ns == mtime  # already there: not rewritten
    shutil.rmtree(first)  # a reimaged box, or a cleanup by hand
    assert ensure_code(ssh_box, sys.executable, workdir) == first
    out = ssh_box.run(["env", f"PYTHONPATH={first}", sys.executable, "-m", "eagle3", "--help"])
    assert out.returncode == 0 and "extract" in out.stdout


def test_package_archive_is_reproducible():
    package_archive.cache_clear()
    first = package_archive()
    package_archive.cache_clear()
    assert package_archive() == first


def test_hostile_paths_travel_as_data_through_ssh(ssh_box, tmp_path, tiny_target, monkeypatch):
    """Every string param with shell syntax goes through validate -> write_config over SSH: stored verbatim."""
    from eagle3_airflow.params import build_params

    params = {k: p.value for k, p in build_params().items() if p.has_value}
    params.update({
        "workdir": str(tmp_path / "work"), "target.model_path": str(tiny_target),
        "data.path": hostile(tmp_path), "vocab.reuse_from": hostile(tmp_path),
        "vocab.draft_vocab_size": 512, "box.conn_ids": ["gpu_box"], "box.python": sys.executable,
    })
    run = validate_run(params, {}, set(params), "manual__1")
    ensure_code(ssh_box, sys.executable, run["plan"]["workdir"])
    config_path = write_config(run["plan"], run["config"])
    written = json.loads(Path(config_path).read_text())
    assert written["data"]["path"] == hostile(tmp_path) and written["vocab"]["reuse_from"] == hostile(tmp_path)
    assert_nothing_executed(tmp_path)
