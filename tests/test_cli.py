"""The box-side command line as the DAG and a person use it: help, init, and errors with exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_eagle3


def test_help_lists_every_command():
    out = run_eagle3("--help").stdout
    for command in ("make-tiny-target", "init", "config", "extract", "store"):
        assert command in out


@pytest.mark.slow
def test_a_stages_help_is_its_modules_docstring_and_loads_no_torch():
    """One place describes a stage: its module's docstring is what `python -m eagle3 STAGE --help` prints, read without
    importing the stage (the parser is built for every command, `job poll` too)."""
    import eagle3.stages.train

    first = eagle3.stages.train.__doc__.strip().splitlines()[0]
    out = run_eagle3("train", "--help").stdout
    assert "python -m eagle3 train --config RUN_DIR/config.json" in out and "TTT step i" in out
    assert first.rstrip(".") in " ".join(run_eagle3("--help").stdout.split())
    probe = "import sys; from eagle3.__main__ import build_parser; build_parser(); print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
        ).stdout.strip()
        == "False"
    )


@pytest.mark.slow
def test_init_writes_the_run_config_with_target_facts(tmp_path, tiny_target):
    draft = tmp_path / "draft.json"
    draft.write_text(
        json.dumps(
            {
                "run_name": "cli",
                "workdir": str(tmp_path / "work"),
                "target": {"model_path": str(tiny_target)},
                "data": {"path": str(tiny_target / "prompts.jsonl")},
                "vocab": {"draft_vocab_size": 512},
            }
        )
    )
    path = Path(run_eagle3("init", "--config", str(draft)).stdout.strip())
    assert path == tmp_path / "work" / "runs" / "cli" / "config.json"
    written = json.loads(path.read_text())
    assert written["target"]["num_hidden_layers"] == 8 and written["extract"]["backend"] == "hf"


@pytest.mark.slow
def test_bad_config_exits_2_with_the_field_named(tmp_path):
    draft = tmp_path / "draft.json"
    draft.write_text(
        json.dumps(
            {
                "run_name": "x; touch /tmp/pwned",
                "workdir": "relative/dir",
                "target": {"model_path": "/m"},
                "data": {"path": "/d.jsonl"},
            }
        )
    )
    proc = run_eagle3("init", "--config", str(draft), check=False)
    assert proc.returncode == 2
    assert "run_name: 'x; touch /tmp/pwned' does not match" in proc.stderr
    assert "workdir: 'relative/dir' does not match" in proc.stderr and "absolute path" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_store_verify_on_a_non_store_says_so(tmp_path):
    proc = run_eagle3("store", "verify", str(tmp_path), check=False)
    assert proc.returncode == 2 and "is not a hidden-state store" in proc.stderr


def test_box_side_never_imports_airflow():
    pattern = re.compile(r"^\s*(import|from)\s+airflow\b", re.M)
    offenders = [p for p in (REPO / "include").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
