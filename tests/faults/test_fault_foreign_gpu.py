"""Fault drill 5: a foreign process holds the box's GPU (played by the stand-in nvidia-smi, tests/fakes; the
`plan`, `gpus` fixtures and `poke` are in tests/conftest.py). Figure printed: what the sensor logged on each
poke while the GPU was busy, and the poke that passed."""

from __future__ import annotations

import pytest

from eagle3_airflow.sensors import GpuIdleSensor
from tests.conftest import H200, VLLM, poke


@pytest.mark.slow
def test_gpus_busy_with_a_foreign_process_is_named_until_it_is_gone(plan, gpus, capsys):
    """The gpus_idle sensor against a box whose GPU a vLLM server holds (70 GB, pid 4242). Proves: each poke
    answers "not yet" (the sensor keeps waiting) and names the process by pid, command and memory; once it is
    gone, the next poke passes. Through the real `python -m eagle3 box gpus` on this machine as the box."""
    gpus([{**H200, "memory.used": 70500}], [VLLM])
    pokes = [poke(GpuIdleSensor, plan, capsys) for _ in range(2)]
    gpus([{**H200, "memory.used": 3}])  # someone killed it
    idle, log = poke(GpuIdleSensor, plan, capsys)
    named = [line.strip() for _, text in pokes for line in text.splitlines() if "4242" in line]
    print(
        f"\ndrill 5 (foreign GPU process): pokes while busy -> {[p[0] for p in pokes]}, naming it: {named}; "
        f"after it is gone -> {idle}"
    )
    for busy, text in pokes:
        assert not busy
        assert "pid 4242 python3 -m vllm.entrypoints.openai.api_server (70000 MiB)" in text
    assert idle and "pid 4242" not in log
