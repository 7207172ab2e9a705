"""Shared fixtures. The tiny target is built once per machine into .cache/tiny-target (the same cache
`make demo` uses); building it takes about 15 minutes on 2 cores, reusing it a second.

The suite runs on three pytest-xdist workers (pyproject.toml). What is expensive to make and only read afterwards
is made once for all: the tiny target (under a file lock beside it) and the baseline DAG run (tests/dagruns.py,
under a lock in the directory the workers' temp dirs share). Tests go out one at a time, the longest first (see
pytest_collection_modifyitems), so that the last test to start is a short one and no worker waits long for the
others at the end."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# Airflow modules imported by tests (params, operators) read their home at import: keep it out of ~/airflow, in a
# directory of this process's own that goes when it ends (every run of the suite left two behind in /tmp).
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="airflow-home-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], ignore_errors=True)

# One CPU thread per torch process (this worker's and every stage, DAG run and torchrun rank it starts: the variable
# is inherited, and the loopback sshd sets it for the SSH box). The suite keeps both cores busy with its three
# workers; a thread team per process then spins waiting on a core another worker holds. Measured on 2 cores: a
# training stage took 36.8 CPU-seconds with two threads on an idle machine, 97 inside the suite, 26.4 with one.
# Results are compared within the suite only (every run of it uses the same setting); the tiny target's bytes do not
# depend on it (eagle3.demo.tiny_target pins its own thread count).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The key run plans are sealed with (eagle3_airflow/seal.py), for tests that call tasks in this process: the Task
# SDK reads Variables from AIRFLOW_VAR_* first. airflow_env() hands the DAG runs' `airflow` processes this same key,
# as a deployment's environment does.
os.environ.setdefault("AIRFLOW_VAR_EAGLE3_PLAN_SECRET", "tests-plan-secret-" + os.urandom(8).hex())

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO / ".cache" / "tiny-target"


def run_eagle3(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the box-side CLI in a fresh interpreter, as the DAG does."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"eagle3 {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def chunk_count(store: Path, shard: int = 0) -> int:
    """How many chunks a store's shard has committed (its manifest's intact records): what kill drills watch for
    progress."""
    from eagle3.data.store import read_manifest

    manifest = Path(store) / f"shard-{shard:05d}" / "manifest.jsonl"
    return len(read_manifest(manifest)[0]) if manifest.exists() else 0


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    from filelock import FileLock

    from eagle3.demo.tiny_target import TinyTargetSpec, build

    TINY_TARGET.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(TINY_TARGET.parent / "tiny-target.lock"):  # the other workers wait, then reuse it
        return build(TINY_TARGET, TinyTargetSpec())


# The longest tests (each a whole DAG run, or the browser's), longest first as `--durations` measured them on 2
# cores. The first three need different shared fixtures, one for each of the three workers: the browser's run,
# the baseline run (built in the reboot drill's setup) and the extract drill, which needs neither. The vLLM engine
# test (four vLLM starts, about 4.5 minutes; 2026-12-04) goes next, to whichever worker the short reboot drill frees:
# it makes the trained drafter (`trained_run`, about a minute) that test_evaluate.py, test_export.py and
# test_train.py read, early, while other long tests run. The SSH run, which needs the baseline, follows.
LONGEST_FIRST = (
    "tests/ui/test_web_ui.py",
    "tests/faults/test_fault_reboot.py",
    "tests/faults/test_fault_extract_kill.py",
    "tests/test_engine_vllm.py",
    "tests/test_production_airflow.py",
    "tests/faults/test_fault_ssh_outage.py",
    "tests/test_dag_generate.py",
    "tests/faults/test_fault_train_kill.py",
    "tests/test_evaluate.py",
)


def pytest_collection_modifyitems(config, items):
    """The order xdist hands tests out in (pyproject.toml: --dist loadgroup, one test, or one xdist_group, at a
    time to whichever worker is free): LONGEST_FIRST, then the other slow tests (marked so: real subprocesses,
    servers, drills), then the rest, each part in its usual order."""

    def rank(item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        if path in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(path)
        return (1 if item.get_closest_marker("slow") else 2), 0

    items.sort(key=rank)


@pytest.fixture(autouse=True)
def xdist_grouped(request):
    """Fails a test of an `xdist_group` that xdist did not group. xdist 3.8 marks a test's group by appending
    "@group" to its node id, which pytest 9.2 ignores (pytest-dev/pytest-xdist#1386): nothing fails by itself, the
    tests of a group spread over the workers and each worker starts the group's module-scoped servers again
    (measured with bench/suite_cpu.py: test_sglang_plugin.py 43 CPU-seconds spread, 14 grouped; test_generate.py 68
    and 55; the suite is CPU-bound on 2 cores). requirements.txt pins a pytest that works; this says so when it
    does not."""
    config = request.config
    if (
        hasattr(config, "workerinput")
        and config.getvalue("loadgroup")
        and request.node.get_closest_marker("xdist_group")
        and "@" not in request.node.nodeid.rpartition("::")[2]
    ):
        pytest.fail(
            "pytest-xdist's --dist loadgroup did not group this test: this pytest and pytest-xdist do not "
            "work together (pytest-dev/pytest-xdist#1386). Install the versions requirements.txt pins "
            "(make install)"
        )


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


def tiny_run_data(tiny_target: Path, workdir: Path, run_name: str) -> dict:
    """A run config (as JSON data) on the tiny target: 200 samples, small chunks, a 512-token draft vocabulary."""
    return {
        "run_name": run_name,
        "workdir": str(workdir),
        "target": {"model_path": str(tiny_target), "dtype": "float32"},
        "data": {"path": str(tiny_target / "prompts.jsonl"), "max_samples": 200},
        "vocab": {"draft_vocab_size": 512},
        "extract": {"batch_tokens": 1024, "chunk_mib": 1, "progress_interval_s": 0.5},
    }


@pytest.fixture
def make_config(tmp_path, tiny_target):
    """A RunConfig on the tiny target in a fresh workdir; keyword sections override the defaults."""
    from eagle3.config import parse_run_config
    from eagle3.target import resolve_target_facts

    def make(run_name: str = "test-run", workdir: Path | None = None, **sections):
        data = tiny_run_data(tiny_target, workdir or tmp_path / "work", run_name)
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        return resolve_target_facts(parse_run_config(data))

    return make


def shared_dir(tmp_path_factory, worker_id: str) -> Path:
    """The directory all xdist workers' temp dirs live in (this session's own temp dir without xdist): where
    what is made once for the whole session goes, under a FileLock."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


TRAIN_SETTINGS = {
    "batch_tokens": 512,
    "save_every_steps": 4,
    "epochs": 2,
    "learning_rate": 1e-3,
    "progress_interval_s": 0.5,
    "keep_last": 2,
}


@pytest.fixture
def train_config(make_config):
    """A run on the tiny target with its store and vocab mapping built, ready to train."""
    from eagle3.config import write_run_config
    from eagle3.stages.extract import run_extract
    from eagle3.stages.vocab import run_vocab

    cfg = make_config(run_name="train", train=TRAIN_SETTINGS)
    run_extract(cfg)
    run_vocab(cfg)
    write_run_config(cfg)
    return cfg


@pytest.fixture(scope="session")
def trained_run(tiny_target, tmp_path_factory, worker_id) -> tuple[Path, dict]:
    """train_config's run, trained once for the session (all workers) by `python -m eagle3 train`, as the DAG
    runs it: (its workdir, train's summary). Read it only; `trained_config` gives a copy to write in."""
    from filelock import FileLock

    from eagle3.config import parse_run_config, write_run_config
    from eagle3.stages.extract import run_extract
    from eagle3.stages.vocab import run_vocab
    from eagle3.target import resolve_target_facts

    shared = shared_dir(tmp_path_factory, worker_id)
    workdir = shared / "trained-work"
    summary_file = workdir / "train-summary.json"
    with FileLock(shared / "trained-work.lock"):
        if not summary_file.exists():
            cfg = resolve_target_facts(
                parse_run_config({**tiny_run_data(tiny_target, workdir, "train"), "train": TRAIN_SETTINGS})
            )
            run_extract(cfg)
            run_vocab(cfg)
            write_run_config(cfg)
            summary_file.write_text(run_eagle3("train", "--config", str(cfg.config_path)).stdout)
    return workdir, json.loads(summary_file.read_text())


@pytest.fixture
def trained_config(trained_run, make_config, tmp_path):
    """A copy of the trained run in this test's own workdir, and its config: for tests that export or evaluate."""
    from eagle3.config import write_run_config

    run_config = trained_run[0] / "runs" / "train" / "config.json"
    shutil.copytree(
        trained_run[0],
        tmp_path / "work",
        symlinks=True,  # hidden_states: the link into stores/
        ignore=lambda directory, names: ["config.json"] if Path(directory) == run_config.parent else [],
    )
    cfg = make_config(run_name="train", train=TRAIN_SETTINGS)
    write_run_config(cfg)  # (the copy's own: the trained run's names the other workdir)
    return cfg


# -- sensors on this machine as the box, its GPUs played by a stand-in nvidia-smi (tests/fakes/nvidia-smi) ---------

FAKES = REPO / "tests" / "fakes"

H200 = {"index": 0, "uuid": "GPU-0a1b", "name": "NVIDIA H200", "memory.total": 143771, "mig.mode.current": "Disabled"}
VLLM = {
    "gpu_uuid": "GPU-0a1b",
    "pid": 4242,
    "process_name": "python3 -m vllm.entrypoints.openai.api_server",
    "used_memory": 70000,
}


# The DAG run the tests' plans are sealed for, as a task's context hands it over (the Task SDK's DagRun has these).
RUN = SimpleNamespace(
    dag_id="eagle3_drafter", run_id="manual__2026-12-04T08:00:00+00:00", conf={}, triggering_user_name="trigger-user"
)
CONTEXT = {"dag_run": RUN}


def sealed(plan, dag_run=RUN) -> dict:
    """A plan (a RunPlan or its dict, with or without an old seal) sealed as validate seals it, for `dag_run`."""
    from eagle3_airflow.plan import RunPlan
    from eagle3_airflow.seal import task_key

    if isinstance(plan, dict):
        plan = RunPlan.from_trusted(plan)
    return plan.sealed(dag_run, task_key())


def run_dir_of(plan: dict) -> Path:
    """The run directory of a plan's XCom dict."""
    from eagle3_airflow.plan import RunPlan

    return Path(RunPlan.from_trusted(plan).run_dir)


def edited(plan: dict, edits: dict) -> dict:
    """The XCom dict of a plan with each dotted field of `edits` set, as a PATCH of the XCom would leave it (its seal
    untouched: `sealed` seals it again, as validate would have)."""
    import copy

    plan = copy.deepcopy(plan)
    for dotted, value in edits.items():
        *parents, leaf = dotted.split(".")
        node = plan
        for part in parents:
            node = node[part]
        node[leaf] = value
    return plan


def plain_config(workdir, run_name: str = "r", **sections):
    """A RunConfig that names a target and data it never reads: for the control plane's tests, where no stage runs."""
    from eagle3.config import parse_run_config

    data = {
        "run_name": run_name,
        "workdir": str(workdir),
        "target": {"model_path": "/models/target"},
        "data": {"path": "/data/conversations.jsonl"},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return parse_run_config(data)


def run_plan(config, **box) -> object:
    """The RunPlan validate would make of `config` on this machine's box (BoxSettings `box` over conn_ids
    ["local"] and this interpreter), pinned to this worker's code."""
    from eagle3.contracts import PROTOCOL
    from eagle3_airflow.codesync import package_archive
    from eagle3_airflow.params import BoxSettings
    from eagle3_airflow.plan import RunPlan

    return RunPlan(
        protocol=PROTOCOL,
        code_digest=package_archive().digest,
        config=config,
        box=BoxSettings(**{"conn_ids": ["local"], "python": sys.executable, **box}),
    )


@pytest.fixture
def trust_settings(tmp_path, monkeypatch) -> Path:
    """Settings (EAGLE3_DAG_SETTINGS) under which the tests' plans verify: this test's tmp_path as the allowed
    workdir root (its runs' workdir tmp_path/work, as the `plan` fixture's), this machine and the loopback sshd's box
    as the allowed boxes, two units as stoppable services, this interpreter as the box's python."""
    path = tmp_path / "dag-settings.json"
    path.write_text(
        json.dumps(
            {
                "allowed_workdirs": [str(tmp_path)],
                "allowed_boxes": ["local", "gpu_box"],
                "allowed_services": ["vllm.service", "other.service"],
                "allowed_pythons": [sys.executable],
                "run": {"workdir": str(tmp_path / "work")},
                "box": {"python": sys.executable},
            }
        )
    )
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(path))
    return path


@pytest.fixture
def plan(tmp_path, make_config, trust_settings) -> dict:
    """A run plan for a run on the tiny target with the package synced to a workdir on this machine, sealed for RUN
    as the validate task seals it."""
    from eagle3.config import write_run_config
    from eagle3_airflow.codesync import ensure_code
    from eagle3_airflow.transport import LocalBox

    cfg = make_config(workdir=tmp_path / "work")
    write_run_config(cfg)
    ensure_code(LocalBox(), sys.executable, cfg.workdir)
    return sealed(run_plan(cfg))


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    """Write the stand-in nvidia-smi's scenario: what the box's GPUs show."""
    monkeypatch.setenv("PATH", f"{FAKES}:{tmp_path}:" + os.environ["PATH"])
    scenario = tmp_path / "nvidia-smi.json"
    monkeypatch.setenv("FAKE_NVIDIA_SMI_STATE", str(scenario))

    def show(gpus: list[dict] | None = None, processes: list[dict] | None = None, **failure) -> None:
        scenario.write_text(json.dumps(failure or {"gpus": gpus or [], "processes": processes or []}))

    return show


def poke(sensor_class, plan: dict, capsys, **kwargs) -> tuple[bool, str]:
    """Poke once; return the answer and what the sensor logged (Airflow's task logger writes to stdout here)."""
    sensor = sensor_class(task_id="sensor", plan=plan, **kwargs)
    capsys.readouterr()
    result = sensor.poke(CONTEXT)
    return result, capsys.readouterr().out


pytest_plugins = [
    "tests.sshd",  # the loopback sshd fixtures (`sshd`, `fresh_sshd`)
    "tests.airflow_env",  # a throwaway Airflow home with a migrated SQLite DB (`airflow_home`)
    # whole DAG runs: tiny_layers, tiny_run, settings, the session's uninterrupted `baseline_run`, helpers
    "tests.dagruns",
]
