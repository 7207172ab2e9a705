"""Shared fixtures. The tiny target is built once per machine into .cache/tiny-target (the same cache
`make demo` uses); building it takes about two minutes on 2 cores, reusing it a second."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Airflow modules imported by tests (params, operators) read their home at import: keep it out of ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="airflow-home-"))

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


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    from eagle3.tiny_target import TinyTargetSpec, build

    return build(TINY_TARGET, TinyTargetSpec())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture
def make_config(tmp_path, tiny_target):
    """A RunConfig on the tiny target in a fresh workdir; keyword sections override the defaults."""
    from eagle3.config import parse_run_config, resolve_target_facts

    def make(run_name: str = "test-run", workdir: Path | None = None, **sections):
        data = {
            "run_name": run_name,
            "workdir": str(workdir or tmp_path / "work"),
            "target": {"model_path": str(tiny_target), "dtype": "float32"},
            "data": {"path": str(tiny_target / "prompts.jsonl"), "max_samples": 200},
            "vocab": {"draft_vocab_size": 512},
            "extract": {"batch_tokens": 1024, "chunk_mib": 1, "progress_interval_s": 0.5},
        }
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        return resolve_target_facts(parse_run_config(data))

    return make


@pytest.fixture
def train_config(make_config):
    """A run on the tiny target with its store and vocab mapping built, ready to train."""
    from eagle3.config import write_run_config
    from eagle3.extract import run_extract
    from eagle3.vocab import run_vocab

    cfg = make_config(run_name="train", train={"batch_tokens": 512, "save_every_steps": 4, "epochs": 2,
                                               "learning_rate": 1e-3, "progress_interval_s": 0.5, "keep_last": 2})
    run_extract(cfg)
    run_vocab(cfg)
    write_run_config(cfg)
    return cfg

pytest_plugins = [
    "tests.sshd",  # the loopback sshd fixtures (`sshd`, `fresh_sshd`)
    "tests.airflow_env",  # a throwaway Airflow home with a migrated SQLite DB (`airflow_home`)
]
