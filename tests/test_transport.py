"""Reaching the box: the local transport and SSH through the provider's hooks against a real sshd on loopback,
with host keys verified; shell syntax in values stays data; code sync is content-addressed and heals; files come
back by SFTP (a local read on the local box), only regular files of the size the box's manifest gave."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from eagle3_airflow.codesync import PACKAGE_DIR, code_dir, ensure_code, package_archive
from eagle3_airflow.tasks import validate_run, write_config
from eagle3_airflow.transport import BoxUnreachable, FileRefused, LocalBox, RemoteCommandError, SSHBox
from tests.conftest import RUN
from tests.sshd import LoopbackSshd


@pytest.fixture
def ssh_box(sshd, monkeypatch) -> SSHBox:
    monkeypatch.setenv("AIRFLOW_CONN_GPU_BOX", sshd.airflow_conn_json())
    return SSHBox("gpu_box")


def hostile(tmp_path: Path) -> str:
    """A value that would create files if any shell ever interpreted it."""
    return f"{tmp_path}/$(touch {tmp_path}/pwned1)`touch {tmp_path}/pwned2`;touch {tmp_path}/pwned3 #"


def assert_nothing_executed(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("pwned*")), "a value was executed by a shell"


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_argv_elements_reach_the_command_verbatim(transport, tmp_path, request):
    box = LocalBox() if transport == "local" else request.getfixturevalue("ssh_box")
    value = hostile(tmp_path)
    result = box.run(["printf", "%s", value])
    assert (result.returncode, result.stdout) == (0, value)
    result = asyncio.run(box.arun(["printf", "%s", value]))
    assert (result.returncode, result.stdout) == (0, value)
    assert_nothing_executed(tmp_path)


@pytest.mark.slow
def test_stdin_reaches_the_remote_command(ssh_box):
    data = bytes(range(256)) * 1000
    assert ssh_box.run(["wc", "-c"], input=data).stdout.strip() == str(len(data))


@pytest.mark.slow
def test_a_wrong_host_key_is_refused(sshd, monkeypatch):
    other_key = " ".join(Path(f"{sshd.client_key}.pub").read_text().split()[:2])  # a valid key, not the host's
    monkeypatch.setenv("AIRFLOW_CONN_IMPOSTOR", sshd.airflow_conn_json(host_key=other_key))
    box = SSHBox("impostor")
    with pytest.raises(BoxUnreachable):
        box.run(["true"])
    with pytest.raises(BoxUnreachable):  # the report files' SFTP rides the same verified connection
        box.fetch({str(other_key): 1})
    with pytest.raises(BoxUnreachable):
        asyncio.run(box.arun(["true"]))


@pytest.mark.slow
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


@pytest.mark.slow
def test_hostile_paths_travel_as_data_through_ssh(ssh_box, tmp_path, tiny_target, monkeypatch):
    """Every string with shell syntax, from the form (data.path) or the settings (vocab.reuse_from), goes through
    validate -> write_config over SSH: stored verbatim."""
    from eagle3_airflow.deployment import Deployment

    deployment = Deployment(
        allowed_boxes=["local", "gpu_box"],
        allowed_workdirs=[str(tmp_path)],
        allowed_pythons=[sys.executable],
        box={"python": sys.executable},
        run={"workdir": str(tmp_path / "work"), "vocab.reuse_from": hostile(tmp_path), "vocab.draft_vocab_size": 512},
    )
    params = {k: p.value for k, p in deployment.form().items() if p.has_value}
    params.update({"target.model_path": str(tiny_target), "data.path": hostile(tmp_path), "box.conn_ids": ["gpu_box"]})
    settings = tmp_path / "dag-settings.json"
    settings.write_text(deployment.model_dump_json(exclude_defaults=True))
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))  # what write_config checks the plan against
    run = validate_run(params, {}, set(deployment.form()), RUN, deployment)
    ensure_code(ssh_box, sys.executable, run["plan"]["config"]["workdir"])
    config_path = write_config(run["plan"], dag_run=RUN)
    written = json.loads(Path(config_path).read_text())
    assert written["data"]["path"] == hostile(tmp_path) and written["vocab"]["reuse_from"] == hostile(tmp_path)
    assert_nothing_executed(tmp_path)


# -- the box runs exactly the code that was synced ---------------------------------------------------------


def plan_for(workdir: Path):
    from tests.conftest import plain_config, run_plan

    return run_plan(plain_config(workdir), require_gpus=False, gpu_max_used_mib=0)


PLANTED = 'open({marker!r}, "w").write("planted code ran")\n'


@pytest.mark.slow
def test_a_code_dir_planted_under_the_digest_name_is_moved_aside_and_never_runs(tmp_path, caplog):
    """Someone with write access to a shared workdir creates code/<digest>/ first, with an eagle3 of their own
    (the digest is public: it names the directory). The sync compares the directory with the archive, moves it
    aside and unpacks the real package; a planted bytecode cache is deleted as well."""
    marker = tmp_path / "pwned"
    planted = Path(code_dir(str(tmp_path / "work"))) / "eagle3"
    shutil.copytree(PACKAGE_DIR, planted, ignore=shutil.ignore_patterns("__pycache__"))
    (planted / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    synced = ensure_code(LocalBox(), sys.executable, str(tmp_path / "work"))
    assert "did not match the package (eagle3/__init__.py differs" in caplog.text
    assert [p.name.startswith(".untrusted-") for p in Path(synced).parent.iterdir()].count(True) == 1

    (Path(synced) / "eagle3" / "__pycache__").mkdir()
    (Path(synced) / "eagle3" / "__pycache__" / "config.cpython-311.pyc").write_bytes(b"planted bytecode")
    ensure_code(LocalBox(), sys.executable, str(tmp_path / "work"))
    assert not (Path(synced) / "eagle3" / "__pycache__").exists()

    result = LocalBox().run(plan_for(tmp_path / "work").eagle3("--help"))
    assert result.returncode == 0 and "extract" in result.stdout
    assert not marker.exists()
    assert not (Path(synced) / "eagle3" / "__pycache__").exists()  # the stages write no bytecode there


@pytest.mark.slow
def test_an_eagle3_package_in_the_login_directory_does_not_shadow_the_synced_one(tmp_path, monkeypatch):
    """`python -m eagle3` puts the working directory (over SSH: the login directory) first on the path; a
    package planted there would run as the box user. Safe-path mode (-P) leaves it out; the code sync runs
    isolated (-I), so a planted gzip.py or tarfile.py is not imported by its unpack script either."""
    marker = tmp_path / "pwned"
    home = tmp_path / "home"
    (home / "eagle3").mkdir(parents=True)
    (home / "eagle3" / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    (home / "eagle3" / "__main__.py").write_text(PLANTED.format(marker=str(marker)))
    for module in ("gzip", "tarfile", "hashlib"):
        (home / f"{module}.py").write_text(PLANTED.format(marker=str(marker)))
    monkeypatch.chdir(home)
    ensure_code(LocalBox(), sys.executable, str(tmp_path / "work"))
    result = LocalBox().run(plan_for(tmp_path / "work").eagle3("--help"))
    assert result.returncode == 0 and "extract" in result.stdout
    assert not marker.exists()


def test_a_box_python_whose_tarfile_lacks_the_extraction_filter_is_refused(tmp_path):
    """Older Pythons (before 3.11.4 / 3.10.12) extract whatever paths an archive names, outside the code directory
    included. TEST STAND-IN for such a Python (none is installed here): a wrapper that runs this Python with
    tarfile.data_filter deleted before the unpack script starts."""
    from airflow.sdk.exceptions import AirflowFailException

    old_python = tmp_path / "python3.10"
    old_python.write_text(
        f"#!/bin/sh\nexec {sys.executable} -I -c 'import sys, tarfile; del tarfile.data_filter; "
        'exec(compile(sys.argv.pop(1), "<unpack>", "exec"))\' "$3" "$4" "$5"\n'
    )
    old_python.chmod(0o755)
    with pytest.raises(AirflowFailException, match="lacks the extraction filter .* point box.python at Python 3.11.4"):
        ensure_code(LocalBox(), str(old_python), str(tmp_path / "work"))
    assert not Path(code_dir(str(tmp_path / "work"))).exists()


def test_a_code_root_others_can_write_is_refused(tmp_path):
    """Whoever can write {workdir}/code could swap a verified directory for their own after the check."""
    root = tmp_path / "work" / "code"
    root.mkdir(parents=True)
    root.chmod(0o777)
    with pytest.raises(Exception, match=r"writable by others \(mode 777\).*chmod go-w"):
        ensure_code(LocalBox(), sys.executable, str(tmp_path / "work"))


@pytest.fixture
def deploy(tmp_path, monkeypatch):
    """Deploys new code to the worker: its package gets a changed file, so another digest (undone afterwards)."""
    from eagle3_airflow import codesync

    def deploy_new_code() -> str:
        new = tmp_path / "deployed" / "eagle3"
        shutil.copytree(PACKAGE_DIR, new, ignore=shutil.ignore_patterns("__pycache__"))
        (new / "__init__.py").write_text((new / "__init__.py").read_text() + "# a fix deployed mid-run\n")
        monkeypatch.setattr(codesync, "SYNCED_DIRS", (new, codesync.PLUGIN_METADATA_DIR))
        codesync.package_archive.cache_clear()
        return package_archive().digest

    yield deploy_new_code
    codesync.package_archive.cache_clear()


@pytest.mark.slow
def test_a_retry_after_a_deploy_runs_the_code_its_run_was_validated_with(tmp_path, deploy, caplog):
    """The code dir used to be named by the worker's package on every try: a retry after a deploy resumed a
    half-done stage under new code. The plan pins the digest at validate; the box's kept archive serves later tries."""
    from airflow.sdk.exceptions import AirflowFailException

    pinned = package_archive().digest
    plan = plan_for(tmp_path / "work")  # validate pins the worker's code
    assert plan.code_digest == pinned
    first = plan.ensure_code()
    assert first.endswith(pinned)
    assert deploy() != pinned

    assert plan.ensure_code() == first == plan.code_dir  # the run goes on with its own code
    assert f"this run's code is {pinned} (pinned when it was validated)" in caplog.text
    shutil.rmtree(first)  # a reimaged box lost the directory: unpacked again from the box's copy
    assert (
        plan.ensure_code() == first
        and (Path(first) / "eagle3" / "__init__.py").read_text() == (PACKAGE_DIR / "__init__.py").read_text()
    )
    result = LocalBox().run(plan.eagle3("--help"))
    assert result.returncode == 0 and "extract" in result.stdout

    kept = tmp_path / "work" / "code" / ".archives" / f"{pinned}.tar.gz"
    original = kept.read_bytes()
    kept.write_bytes(gzip.compress(b"not the package"))
    with pytest.raises(AirflowFailException, match="was altered: it does not hash to its name"):
        plan.ensure_code()
    kept.write_bytes(original)
    kept.unlink()
    with pytest.raises(
        AirflowFailException,
        match=rf"validated with code {pinned}, the worker's package is \w+ now.*"
        "clear this run's validate task with its downstream tasks",
    ):
        plan.ensure_code()
    # Clearing validate pins the new code: a run validated now syncs and runs it.
    assert (
        plan.model_copy(update={"code_digest": package_archive().digest})
        .ensure_code()
        .endswith(package_archive().digest)
    )


@pytest.mark.slow
def test_a_command_killed_under_the_async_transport_counts_as_an_outage(ssh_box):
    """When sshd goes down during a job poll, the poll dies by a signal (exit status -1 in asyncssh): CI saw that
    fail a trigger as "polling failed on the box" instead of riding out the outage. Every async command is safe to
    repeat, so a killed one is BoxUnreachable, which the trigger retries within its grace period."""
    with pytest.raises(BoxUnreachable, match="killed by TERM"):
        asyncio.run(ssh_box.arun(["sh", "-c", "kill -TERM $$"]))
    assert asyncio.run(ssh_box.arun(["sh", "-c", "exit 3"])).returncode == 3  # a plain failure stays one


# -- files back from the box: SFTP, or a plain read on the local box -----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["local", "ssh"])
def test_fetch_reads_regular_files_of_the_given_size_and_refuses_links_pipes_and_other_sizes(
    transport, tmp_path, request
):
    """What the report's manifest named is fetched: exactly that many bytes of a regular file (a missing one is
    None). A link (to a secret), a pipe (no hang), a file of another size than the manifest gave: refused, the
    link and the larger file without their bytes being read."""
    box = LocalBox() if transport == "local" else request.getfixturevalue("ssh_box")
    plot = tmp_path / "loss.png"
    plot.write_bytes(b"\x89PNG" + bytes(range(256)) * 400)  # > one SFTP read request
    (tmp_path / "empty.json").write_bytes(b"")
    secret = tmp_path / "id_ed25519"
    secret.write_text("SECRET")
    (tmp_path / "linked.png").symlink_to(secret)
    os.mkfifo(tmp_path / "pipe.png")
    size = plot.stat().st_size
    assert box.fetch({str(plot): size, str(tmp_path / "empty.json"): 0, str(tmp_path / "gone.png"): 3}) == {
        str(plot): plot.read_bytes(),
        str(tmp_path / "empty.json"): b"",
        str(tmp_path / "gone.png"): None,
    }
    for name, said, refusal in (
        ("linked.png", 6, "link"),
        ("pipe.png", 0, "not a regular file"),
        ("loss.png", size - 1, f"{size} bytes where the box's manifest said {size - 1}"),
        ("loss.png", size + 1, "bytes where the box's manifest said"),
    ):
        with pytest.raises(FileRefused, match=refusal):
            box.fetch({str(tmp_path / name): said}, timeout=10)


@pytest.mark.slow
def test_several_commands_and_fetches_share_one_connection(ssh_box, sshd, tmp_path):
    """`with box.connected():` runs the manifest command and the SFTP fetch over one SSH connection (sshd logs one
    accepted key per connection)."""
    (tmp_path / "a.png").write_bytes(b"a" * 10)
    before = sshd.log_text().count("Accepted publickey")
    with ssh_box.connected():
        assert ssh_box.run(["true"]).returncode == 0
        assert ssh_box.fetch({str(tmp_path / "a.png"): 10}) == {str(tmp_path / "a.png"): b"a" * 10}
        assert ssh_box.run(["true"]).returncode == 0
    assert sshd.log_text().count("Accepted publickey") == before + 1
    assert ssh_box.run(["true"]).returncode == 0  # after the block: a connection of its own again
    assert sshd.log_text().count("Accepted publickey") == before + 2


def test_a_box_whose_sshd_offers_no_sftp_is_named_as_such(tmp_path, monkeypatch):
    """A box whose sshd_config lacks `Subsystem sftp` (stock configs have it) fails the read with what to enable."""
    server = LoopbackSshd(tmp_path / "sshd")
    server.config.write_text(
        "\n".join(line for line in server.config.read_text().splitlines() if not line.startswith("Subsystem")) + "\n"
    )
    with server:
        monkeypatch.setenv("AIRFLOW_CONN_NO_SFTP", server.airflow_conn_json())
        (tmp_path / "a.png").write_bytes(b"a")
        with pytest.raises(RemoteCommandError, match="offers no SFTP.*Subsystem sftp"):
            SSHBox("no_sftp").fetch({str(tmp_path / "a.png"): 1})
