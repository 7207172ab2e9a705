"""The capture plugin against the real sglang 0.5.23 package: SGLang's plugin loader, hook registry and the
hooked scheduler method itself, on the CPU.

No stand-in here: the test environment (`make sglang-env`, .cache/sglang-env, built by `make test`) holds the
real sglang wheel, installed without its dependencies plus what importing the touched modules needs
(requirements-sglang-env.txt). Only the GPU engine around the method is absent: the method is called the way
SGLang's process_batch_result_prefill calls it, with a real LogitsProcessorOutput, Req and CaptureHiddenMode.
The engine end to end is bench/gpu_capture_check.py's, on a GPU box.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.capture.sglang_plugin import AUX_KEY, LAST_KEY, PLUGIN_NAME, SINK_ENV
from eagle3_airflow.codesync import package_archive
from tests.conftest import REPO

SGLANG_ENV_PYTHON = Path(os.environ.get("EAGLE3_SGLANG_ENV_PYTHON", REPO / ".cache" / "sglang-env" / "bin" / "python"))
# One worker runs the module: the real-sglang child process (module-scoped plugin_run) runs once.
pytestmark = pytest.mark.xdist_group("test_sglang_plugin")


def synced_code_dir(root: Path) -> Path:
    """What code sync unpacks on a box: the DAG's archive, so the test sees the files a box gets."""
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(package_archive().gzipped))) as tar:
        tar.extractall(root, filter="data")
    return root


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory) -> tuple[dict, dict, Path]:
    if not SGLANG_ENV_PYTHON.exists():
        pytest.fail(f"{SGLANG_ENV_PYTHON} is missing: `make sglang-env` builds the real-sglang test environment")
    tmp = tmp_path_factory.mktemp("sglang-plugin")
    code, sink, out = synced_code_dir(tmp / "code"), tmp / "sink", tmp / "out"
    sink.mkdir()
    out.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp),
        "PYTHONPATH": str(code),
        "PYTHONSAFEPATH": "1",
        "SGLANG_PLUGINS": PLUGIN_NAME,
        SINK_ENV: str(sink),
    }
    proc = subprocess.run(
        [str(SGLANG_ENV_PYTHON), str(REPO / "tests" / "sglang_real" / "plugin_child.py"), str(out)],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), load_file(str(out / "inputs.safetensors")), sink


@pytest.mark.slow
def test_the_real_loader_finds_the_plugin_on_pythonpath_and_wraps_the_real_method(plugin_run):
    result, _, _ = plugin_run
    assert result["sglang"] == "0.5.23"
    assert result["gate"] is None, result["gate"]
    assert result["wrapped"], "load_plugins() did not wrap SchedulerBatchResultProcessor._append_prefill_hidden_states"


@pytest.mark.slow
def test_an_unchecked_sglang_version_is_gated_and_nothing_is_registered(plugin_run):
    result, _, _ = plugin_run
    assert "0.6.0" in result["gate_for_0.6.0"] and "0.5.23" in result["gate_for_0.6.0"]
    assert result["registered_for_0.6.0"] is False


@pytest.mark.slow
def test_each_request_of_a_batch_gets_its_own_rows_in_one_file_and_no_lists(plugin_run):
    result, inputs, sink = plugin_run
    start = 0
    written = set()
    for rid, n, wants_states, store in result["requests"]:
        path = sink / f"r0-{rid}.safetensors"
        if wants_states and store:
            states = load_file(str(path))
            assert states[AUX_KEY].shape == (n, inputs["aux"].shape[1])
            assert torch.equal(states[AUX_KEY], inputs["aux"][start : start + n])
            assert torch.equal(states[LAST_KEY], inputs["last"][start : start + n])
            written.add(path.name)
        else:  # a request that asked for no states, or whose output the scheduler does not commit
            assert not path.exists()
        start += n
    assert {p.name for p in sink.iterdir()} - {f"r1-{rid}.safetensors" for rid, *_ in result["requests"]} == written
    # SGLang's own row bookkeeping is kept (every request advances the offset), and the list path is empty.
    lengths = [n for _, n, _, _ in result["requests"]]
    assert result["rank0"]["offsets"] == [sum(lengths[: i + 1]) for i in range(len(lengths))]
    assert set(result["rank0"]["list_entries"].values()) == {0}


@pytest.mark.slow
def test_only_tp_rank_0_writes(plugin_run):
    result, _, sink = plugin_run
    assert not list(sink.glob("r1-*")), "TP rank 1 wrote states: every rank holds the same, rank 0 writes them"
    assert result["rank1"]["offsets"] == result["rank0"]["offsets"]
    assert set(result["rank1"]["list_entries"].values()) == {0}
