"""Helpers and fixtures for tests that run the whole DAG with `airflow dags test` on the tiny target.

Registered as a plugin in tests/conftest.py, so every test file gets the fixtures:

  settings      EAGLE3_DAG_SETTINGS env for quick retries (retry_delay_s 1, retries 2); `settings_env` makes others
  baseline_run  ONE uninterrupted local DAG run per session (the run directory): the reference every DAG-level
                comparison uses (bit-identical drafter, equal store digest), computed once

and the helpers tiny_layers and tiny_run (a small run's conf and settings), job_state, sha256, assert_succeeded,
wait_for, killing_python (a box whose training dies on every try), start_dag_run and copy_through_vocab (a run
directory where extract and vocab already succeeded, for drills about training).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.airflow_env import AIRFLOW, airflow_env, migrated_airflow_home

BASELINE_RUN_NAME = "baseline"
# For drills about training: the stages after export are marked successful instead of run (`--mark-success-pattern`);
# the drafter (export) is what they compare.
LATER_STAGES = "evaluate|benchmark|report|promoted"
# For drills about one stage: the box checks are marked successful too. A run's `box info` and `box disk` cost
# about 6 CPU-seconds (torch, a tokenizer); the baseline and the SSH run check the box for real.
BOX_CHECKS = "box_reachable|gpus_idle|disk_space|gpus_released"


def tiny_layers(tiny_target: Path, workdir: Path, **overrides) -> tuple[dict, dict]:
    """A small but complete run, as (conf, layers): the trigger's conf (the form's fields) and the deployment
    settings' layers (`run`, `box`) it needs: 2 extraction shards, 24 training steps, 2 evaluation prompts. With the
    defaults (and any workdir) its outputs are bit-identical to the baseline run's. `overrides` are dotted names;
    each goes where it belongs: a form field to the conf, box.* to `box`, the rest to `run`."""
    from eagle3_airflow.params import BOX_PREFIX, FORM_FIELDS

    values = {
        "run_name": BASELINE_RUN_NAME,
        "workdir": str(workdir),
        "target.model_path": str(tiny_target),
        "target.dtype": "float32",
        "data.path": str(tiny_target / "prompts.jsonl"),
        "data.max_samples": 48,
        "vocab.draft_vocab_size": 512,
        "extract.batch_tokens": 1024,
        "extract.chunk_mib": 1,
        "extract.num_shards": 2,
        "extract.progress_interval_s": 1,
        "train.batch_tokens": 256,
        "train.epochs": 2,
        "train.save_every_steps": 4,
        "train.learning_rate": 0.001,
        "train.progress_interval_s": 1,
        "evaluate.num_prompts": 2,
        "evaluate.max_new_tokens": 16,
        "evaluate.draft_lengths": [3],
        "evaluate.progress_interval_s": 1,
        "box.python": sys.executable,
        "box.require_gpus": False,
        # Each poll is a `python -m eagle3 job poll` of about 0.1 CPU-second: at 0.3 s the polls took a fifth of
        # a DAG run's CPU time (baseline: 55.8 user-seconds at 0.3 s, 44.7 at 1 s, the same wall time).
        "box.poll_interval_s": 1.0,
        **overrides,
    }
    conf = {name: value for name, value in values.items() if name in FORM_FIELDS}
    box = {
        name.removeprefix(BOX_PREFIX + "."): value
        for name, value in values.items()
        if name.startswith(BOX_PREFIX + ".") and name not in FORM_FIELDS
    }
    run = {
        name: value
        for name, value in values.items()
        if name not in FORM_FIELDS and not name.startswith(BOX_PREFIX + ".")
    }
    return conf, {"run": run, "box": box}


def tiny_run(
    tiny_target: Path,
    workdir: Path,
    run_name: str = BASELINE_RUN_NAME,
    *,
    settings_dir: Path,
    settings: dict | None = None,
    **overrides,
) -> tuple[dict, dict[str, str]]:
    """tiny_layers' run as (conf, env): its layers written into a settings file in `settings_dir` with `settings`
    (default: quick retries and the loopback sshd's box, as the `settings` fixture), the env naming it."""
    conf, layers = tiny_layers(tiny_target, workdir, run_name=run_name, **overrides)
    top = {"retry_delay_s": 1, "retries": 2, "allowed_boxes": ["local", "gpu_box"]} if settings is None else settings
    return conf, settings_env(settings_dir, **layers, **top)


def settings_env(directory: Path, **values) -> dict[str, str]:
    """Write a deployment settings file (EAGLE3_DAG_SETTINGS) into `directory`; return the env that names it.
    Unless `values` say otherwise, runs may use any workdir under pytest's temp root for this session (two levels
    above a test's temp dir: every test's, and the baseline's, workdir lies under it), and this interpreter as the
    box's python."""
    path = Path(directory) / "dag-settings.json"
    values.setdefault("allowed_workdirs", [str(Path(directory).resolve().parents[1])])
    values.setdefault("allowed_pythons", [sys.executable])  # tiny_layers' box.python
    path.write_text(json.dumps(values))
    return {"EAGLE3_DAG_SETTINGS": str(path)}


@pytest.fixture(scope="session")
def settings(tmp_path_factory) -> dict[str, str]:
    """Deployment settings through EAGLE3_DAG_SETTINGS: retries wait 1 s (then 2, 4, ...) instead of a minute, and
    runs may use the loopback sshd's box (tests/sshd.py) besides this machine."""
    return settings_env(
        tmp_path_factory.mktemp("settings"), retry_delay_s=1, retries=2, allowed_boxes=["local", "gpu_box"]
    )


def job_state(run_dir: Path, key: str) -> dict:
    return json.loads((run_dir / "jobs" / key / "state.json").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_succeeded(proc: subprocess.CompletedProcess) -> None:
    output = f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"DAG run failed (exit {proc.returncode}):\n{output}"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def killing_python(wrapper: Path, while_exists: Path, checkpoints: Path) -> Path:
    """Write `wrapper`, a box.python that is this interpreter, except that while `while_exists` exists, each `eagle3
    train` is SIGKILLed as soon as `checkpoints` holds a checkpoint (at once when it holds one already): a box whose
    training dies on every try, after the first one saved what a later try resumes from."""
    wrapper.write_text(
        "#!/bin/sh\n"  # argv: python -P -m eagle3 <stage> ...
        f'if [ "$4" = train ] && [ -e {while_exists} ]; then\n'
        f'  {sys.executable} "$@" &\n'
        "  stage=$!\n"
        f'  until [ -n "$(ls -d {checkpoints}/step-* 2>/dev/null)" ] || ! kill -0 $stage 2>/dev/null; do\n'
        "    sleep 0.2\n"
        "  done\n"
        "  kill -9 $stage\n"
        "  exit 137\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def start_dag_run(
    home: Path,
    conf: dict,
    output: Path,
    *,
    logical_date: str | None = None,
    env: dict[str, str] | None = None,
    mark_success: str | None = None,
) -> subprocess.Popen:
    """`airflow dags test` in the background, in a session of its own (so a drill can SIGKILL the whole Airflow
    side with killpg), stdout and stderr into `output`."""
    argv = [
        AIRFLOW,
        "dags",
        "test",
        "eagle3_drafter",
        *([logical_date] if logical_date else []),
        "--conf",
        json.dumps(conf),
        *(["--mark-success-pattern", mark_success] if mark_success else []),
    ]
    with open(output, "ab") as out:
        return subprocess.Popen(
            argv, env={**airflow_env(home), **(env or {})}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


# What an Airflow worker's environment holds on the docker-compose stack, where the local box is the worker itself.
# The baseline runs with them; test_dag.py checks that none reaches a stage, a file on the box, a log or XCom.
WORKER_SECRETS = {
    "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
    "AIRFLOW__API_AUTH__JWT_SECRET": f"jwt-secret-{secrets.token_hex(16)}",
    "AWS_SECRET_ACCESS_KEY": f"aws-secret-{secrets.token_hex(16)}",
    # the key run plans are sealed with (eagle3_airflow/seal.py), set in the worker's environment as compose does
    "AIRFLOW_VAR_EAGLE3_PLAN_SECRET": f"plan-secret-{secrets.token_hex(24)}",
}


@pytest.fixture(scope="session")
def baseline_run(tiny_target, tmp_path_factory, worker_id) -> Path:
    """One uninterrupted DAG run through the local transport, shared by the whole session: the reference the
    DAG tests and fault drills compare against. Returns its run directory; nobody may write into it.

    Made once for all xdist workers: the first to need it runs it under a lock in the directory their temp
    dirs share, with an Airflow home of its own beside it (airflow-home/); the others wait and find it made, or
    find that it failed (and fail the same way without running it again).

    It runs the way `make demo` does (scripts/demo.py run_dag): what the demo's console showed, with the
    moment each line came, is kept beside the run in console.json for the test of that console."""
    from filelock import FileLock

    from scripts.demo import run_dag

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    workdir = shared / "baseline-box"
    outcome_file = workdir / "outcome.json"
    with FileLock(shared / "baseline-box.lock"):
        if not outcome_file.exists():
            home = migrated_airflow_home(workdir / "airflow-home")
            started = time.monotonic()
            console: list[tuple[float, str]] = []
            log = workdir / "dag-test.log"
            conf, env = tiny_run(tiny_target, workdir, settings_dir=workdir)
            code = run_dag(
                conf,
                workdir / "runs" / BASELINE_RUN_NAME,
                {**airflow_env(home), **env, **WORKER_SECRETS},
                log,
                lambda text: console.append((time.monotonic() - started, text)),
            )
            print(f"uninterrupted DAG run (local transport): {time.monotonic() - started:.1f} s")
            (workdir / "console.json").write_text(json.dumps({"lines": console, "ended_s": time.monotonic() - started}))
            outcome_file.write_text(json.dumps({"exit_code": code, "log_tail": log.read_text().splitlines()[-60:]}))
    outcome = json.loads(outcome_file.read_text())
    assert outcome["exit_code"] == 0, f"DAG run failed (exit {outcome['exit_code']}):\n" + "\n".join(
        outcome["log_tail"]
    )
    return workdir / "runs" / BASELINE_RUN_NAME


THROUGH_VOCAB = (
    "hidden_states",
    "extract",
    "vocab_mapping",
    "disk_estimate_tokens.json",
    "jobs/extract.0",
    "jobs/extract.1",
    "jobs/vocab",
)


def copy_through_vocab(baseline: Path, workdir: Path) -> Path:
    """The baseline's run directory as it was when vocab had succeeded, under another workdir: store, vocab
    mapping and the succeeded extract and vocab jobs. config.json is left out (it names the workdir; the DAG
    writes it again). A DAG run on it re-attaches to those succeeded jobs at once (exactly what a cleared run
    does) and spends its time on training and after."""
    run_dir = Path(workdir) / "runs" / baseline.name
    for part in THROUGH_VOCAB:
        source, target = baseline / part, run_dir / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # the store, shared in {workdir}/stores/: copied there, linked the same way
            store = Path(workdir) / "stores" / source.resolve().name
            shutil.copytree(source.resolve(), store)
            target.symlink_to(source.readlink())
        elif source.is_dir():
            shutil.copytree(source, target, symlinks=True)
        else:
            shutil.copy2(source, target)
    return run_dir
