"""`python -m eagle3 box <info|gpus|disk>`: nvidia-smi parsing (real-looking output, N/A, MIG, no GPUs,
no nvidia-smi), the idle judgement the sensors use, and the disk estimate with its token-count cache.

GPUs are played by tests/fakes/nvidia-smi, a stand-in that prints nvidia-smi's CSV for a scenario file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.box import facts as boxinfo
from eagle3.box.facts import judge_gpus, parse_gpus, parse_processes
from eagle3.jobs.progress import format_bytes, format_count
from tests.conftest import REPO

FAKES = REPO / "tests" / "fakes"

H200_UUIDS = [f"GPU-8f6b1c2e-5a4d-7e3f-9b0a-1c2d3e4f5a{i:02d}" for i in range(8)]

# What `nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,mig.mode.current
# --format=csv,noheader,nounits` prints on an 8 x H200 box with a vLLM server on GPU 3.
H200_GPUS_CSV = (
    "\n".join(
        f"{i}, {uuid}, NVIDIA H200, {71234 if i == 3 else 1}, 143771, Disabled" for i, uuid in enumerate(H200_UUIDS)
    )
    + "\n"
)
H200_PROCESSES_CSV = f"{H200_UUIDS[3]}, 4242, python3 -m vllm.entrypoints.openai.api_server, 70000\n"


def box_json(*args: str, env: dict | None = None, path_dirs: list[Path] | None = None) -> tuple[dict, str]:
    """Run `python -m eagle3 box ...` in a fresh interpreter; PATH is `path_dirs` (default: the fakes first)."""
    path = os.pathsep.join(str(d) for d in path_dirs) if path_dirs is not None else f"{FAKES}{os.pathsep}"
    path += os.environ["PATH"] if path_dirs is None else ""
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3", "box", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": path, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout), proc.stderr


def scenario(tmp_path: Path, state: dict) -> dict:
    """Env that makes the fake nvidia-smi play `state`."""
    file = tmp_path / "nvidia-smi-state.json"
    file.write_text(json.dumps(state))
    return {"FAKE_NVIDIA_SMI_STATE": str(file)}


def h200_state(busy: bool = True) -> dict:
    gpus = [
        {
            "index": i,
            "uuid": u,
            "name": "NVIDIA H200",
            "memory.used": 71234 if busy and i == 3 else 1,
            "memory.total": 143771,
            "mig.mode.current": "Disabled",
        }
        for i, u in enumerate(H200_UUIDS)
    ]
    vllm = {
        "gpu_uuid": H200_UUIDS[3],
        "pid": 4242,
        "process_name": "python3 -m vllm.entrypoints.openai.api_server",
        "used_memory": 70000,
    }
    processes = [vllm] if busy else []
    return {"gpus": gpus, "processes": processes}


# -- parsing ---------------------------------------------------------------------------------


def test_parse_real_looking_h200_output():
    gpus, unparsed = parse_gpus(H200_GPUS_CSV)
    assert unparsed == [] and len(gpus) == 8
    assert gpus[3] == {
        "index": 3,
        "uuid": H200_UUIDS[3],
        "name": "NVIDIA H200",
        "memory_used_mib": 71234,
        "memory_total_mib": 143771,
        "mig": False,
    }
    processes, unparsed = parse_processes(H200_PROCESSES_CSV, gpus)
    assert unparsed == []
    assert processes == [
        {
            "gpu_index": 3,
            "gpu_uuid": H200_UUIDS[3],
            "pid": 4242,
            "name": "python3 -m vllm.entrypoints.openai.api_server",
            "used_mib": 70000,
        }
    ]


def test_parse_not_available_values_and_commas_in_names():
    text = (
        "0, GPU-aaaa, NVIDIA GeForce RTX 4090, [N/A], [N/A], [N/A]\n"
        "1, GPU-bbbb, Tesla T4, N/A, [Not Supported], \n"
        "2, GPU-cccc, Vendor, Model X, 10, 20, Disabled\n"  # a comma in the name
    )
    gpus, unparsed = parse_gpus(text)
    assert unparsed == []
    assert gpus[0]["memory_used_mib"] is None and gpus[0]["memory_total_mib"] is None and gpus[0]["mig"] is False
    assert gpus[1]["memory_total_mib"] is None and gpus[1]["name"] == "Tesla T4"
    assert gpus[2]["name"] == "Vendor, Model X" and gpus[2]["memory_used_mib"] == 10
    processes, _ = parse_processes("GPU-aaaa, 17, [Not Found], [N/A]\nGPU-cccc, 18, python3 -c a, b, 512\n", gpus)
    assert processes[0] == {"gpu_index": 0, "gpu_uuid": "GPU-aaaa", "pid": 17, "name": None, "used_mib": None}
    assert processes[1]["name"] == "python3 -c a, b" and processes[1]["used_mib"] == 512


def test_parse_mig_maps_instances_to_their_gpu_when_it_is_the_only_mig_gpu():
    one_mig = (
        "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, [N/A], 81920, Enabled\n"
        "1, GPU-bbbb, NVIDIA A100-SXM4-80GB, 0, 81920, Disabled\n"
    )
    gpus, _ = parse_gpus(one_mig)
    assert gpus[0]["mig"] is True and gpus[0]["memory_used_mib"] is None
    apps = "MIG-11111111-2222-3333-4444-555555555555, 900, /usr/bin/python3, [N/A]\nGPU-aaaa, 901, trainer, 300\n"
    processes, _ = parse_processes(apps, gpus)
    assert [p["gpu_index"] for p in processes] == [0, 0]

    two_mig, _ = parse_gpus(one_mig.replace("Disabled", "Enabled"))
    processes, _ = parse_processes(apps, two_mig)
    assert processes[0]["gpu_index"] is None and processes[0]["gpu_uuid"].startswith("MIG-")  # kept, unplaced


def test_parse_skips_notices_and_reports_garbage():
    assert parse_gpus("No devices were found\n") == ([], [])
    assert parse_gpus("") == ([], [])
    assert parse_processes("No running processes found\n", []) == ([], [])
    gpus, unparsed = parse_gpus("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n")
    assert gpus == [] and len(unparsed) == 1


# -- judging ---------------------------------------------------------------------------------


def report(gpus_csv: str = H200_GPUS_CSV, processes_csv: str = H200_PROCESSES_CSV, error: str | None = None) -> dict:
    gpus, _ = parse_gpus(gpus_csv)
    processes, _ = parse_processes(processes_csv, gpus)
    return {"gpus": gpus, "processes": processes, "error": error}


def test_judge_names_the_busy_gpu_its_memory_and_the_foreign_process():
    idle, problems = judge_gpus(report(), max_used_mib=1024)
    assert not idle
    assert problems == [
        "GPU 3 (NVIDIA H200): 71234 MiB used > 1024 MiB allowed; "
        "processes: pid 4242 python3 -m vllm.entrypoints.openai.api_server (70000 MiB)"
    ]
    assert judge_gpus(report(), max_used_mib=1024, gpu_indices=[0, 1, 2]) == (True, [])
    assert judge_gpus(report(), max_used_mib=100_000) == (True, [])


def test_judge_idle_box_and_our_own_processes():
    idle_csv = H200_GPUS_CSV.replace("71234", "1")
    assert judge_gpus(report(idle_csv, ""), max_used_mib=1024) == (True, [])
    # Our own earlier job (an allowed pid) holds the memory: not a reason to wait.
    assert judge_gpus(report(processes_csv=H200_PROCESSES_CSV), 2000, allowed_pids=[4242]) == (True, [])
    # Memory used but no process visible (another container): busy, and said so.
    idle, problems = judge_gpus(report(processes_csv=""), 1024)
    assert not idle and problems[0].endswith("processes: none visible (another container?)")


def test_judge_without_gpus_and_with_errors():
    none = {"gpus": [], "processes": [], "error": None}
    assert judge_gpus(none, 1024) == (False, ["no GPUs visible (nvidia-smi lists none)"])
    assert judge_gpus(none, 1024, require_gpus=False) == (True, [])
    missing = {"gpus": [], "processes": [], "error": "nvidia-smi not found on PATH"}
    assert judge_gpus(missing, 1024) == (False, ["no GPUs visible (nvidia-smi not found on PATH)"])
    assert judge_gpus(missing, 1024, require_gpus=False) == (True, [])
    idle, problems = judge_gpus(report(error="nvidia-smi --query-compute-apps exited 9: failed"), 10**6)
    assert not idle and "cannot read the GPUs' state fully" in problems[0]
    idle, problems = judge_gpus(report(), 1024, gpu_indices=[7, 8])
    assert problems == ["GPU 8: not visible (nvidia-smi lists [0, 1, 2, 3, 4, 5, 6, 7])"]


def test_judge_mig_gpu_from_its_processes():
    mig_csv = "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, [N/A], 81920, Enabled\n"
    assert judge_gpus(report(mig_csv, ""), 1024) == (True, [])
    idle, problems = judge_gpus(report(mig_csv, "MIG-1111, 900, /usr/bin/python3, [N/A]\n"), 1024)
    assert not idle
    assert problems == [
        "GPU 0 (NVIDIA A100-SXM4-80GB, MIG): 0 MiB used (plus processes of unknown size) > 1024 MiB "
        "allowed; processes: pid 900 /usr/bin/python3 (memory unknown)"
    ]
    # Unplaced instances (two MIG GPUs) are checked whatever gpu_indices says.
    two = mig_csv + "1, GPU-bbbb, NVIDIA A100-SXM4-80GB, [N/A], 81920, Enabled\n"
    idle, problems = judge_gpus(report(two, "MIG-1111, 900, python3, 5000\n"), 1024, gpu_indices=[1])
    assert problems == ["GPU MIG-1111: 5000 MiB used > 1024 MiB allowed; processes: pid 900 python3 (5000 MiB)"]


# -- `box gpus` through the stand-in ----------------------------------------------------------


@pytest.mark.slow
def test_box_gpus_cli_reads_the_stand_in(tmp_path):
    out, _ = box_json("gpus", env=scenario(tmp_path, h200_state()))
    assert out["error"] is None and len(out["gpus"]) == 8
    assert out["gpus"][3]["memory_used_mib"] == 71234
    assert out["processes"] == [
        {
            "gpu_index": 3,
            "gpu_uuid": H200_UUIDS[3],
            "pid": 4242,
            "name": "python3 -m vllm.entrypoints.openai.api_server",
            "used_mib": 70000,
        }
    ]
    assert judge_gpus(out, 1024)[0] is False
    out, _ = box_json("gpus", env=scenario(tmp_path, h200_state(busy=False)))
    assert judge_gpus(out, 1024) == (True, [])


@pytest.mark.slow
def test_box_gpus_cli_no_devices_failure_and_not_installed(tmp_path):
    out, _ = box_json("gpus", env=scenario(tmp_path, {"error": "No devices were found", "exit_code": 6}))
    assert out == {"gpus": [], "processes": [], "error": None}

    failing = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    out, _ = box_json("gpus", env=scenario(tmp_path, {"error": failing, "exit_code": 9}))
    assert out["gpus"] == [] and "exited 9" in out["error"] and failing in out["error"]

    empty_dir = tmp_path / "empty-path"
    empty_dir.mkdir()
    out, _ = box_json("gpus", path_dirs=[empty_dir])
    assert out == {"gpus": [], "processes": [], "error": "nvidia-smi not found on PATH"}
    out, _ = box_json("gpus", "--nvidia-smi", str(empty_dir / "nvidia-smi"))
    assert out["gpus"] == [] and "not found at" in out["error"]


@pytest.mark.slow
def test_box_gpus_cli_with_an_explicit_path_and_units_in_the_stand_in(tmp_path):
    env = scenario(tmp_path, h200_state())
    plain_path = [Path(d) for d in os.environ["PATH"].split(os.pathsep)]  # without fakes/: the flag must win
    out, _ = box_json("gpus", "--nvidia-smi", str(FAKES / "nvidia-smi"), env=env, path_dirs=plain_path)
    assert len(out["gpus"]) == 8
    fake = subprocess.run(
        [str(FAKES / "nvidia-smi"), "--query-gpu=index,memory.used", "--format=csv"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert fake.stdout.splitlines()[:2] == ["index, memory.used [MiB]", "0, 1 MiB"]


@pytest.mark.slow
def test_the_stand_in_refuses_what_it_does_not_know(tmp_path):
    env = {**os.environ, **scenario(tmp_path, h200_state())}
    for args in (["-L"], ["--query-gpu=index", "--format=json"], ["--query-gpu=index"]):
        proc = subprocess.run([str(FAKES / "nvidia-smi"), *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 2, args


# -- `box info` --------------------------------------------------------------------------------


@pytest.mark.slow
def test_box_info_reports_packages_cuda_where_a_gpu_is_listed_boot_id_and_missing(tmp_path):
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("0d6a3a4e-1111-2222-3333-444455556666\n")
    env = {**scenario(tmp_path, h200_state()), "EAGLE3_BOOT_ID_FILE": str(boot_id)}
    out, _ = box_json("info", env=env)
    assert out["boot_id"] == "0d6a3a4e-1111-2222-3333-444455556666"
    assert out["executable"] == sys.executable and out["python"] == sys.version
    import torch

    assert out["packages"]["torch"] == torch.__version__ and out["packages"]["sglang"] is None
    assert out["cuda"] == {
        "torch_cuda": torch.version.cuda,
        "available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
    }
    assert len(out["gpus"]) == 8
    assert out["missing"] == []  # every required package is installed in this venv, sglang is not required
    # No GPU listed: torch is not asked (seconds of imports for a view of nothing).
    out, _ = box_json("info", env=scenario(tmp_path, {"gpus": [], "processes": []}))
    assert out["gpus"] == [] and out["cuda"] is None and out["packages"]["torch"] == torch.__version__

    out, _ = box_json("info", "--require", "sglang", "--require", "no-such-package-xyz", env=env)
    assert out["missing"] == ["sglang", "no-such-package-xyz"]
    assert out["packages"]["no-such-package-xyz"] is None


def test_box_info_without_a_boot_id_file(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_BOOT_ID_FILE", str(tmp_path / "absent"))
    assert boxinfo.boot_id_or_none() is None


# -- `box disk` --------------------------------------------------------------------------------


@pytest.fixture
def disk_config(tmp_path, make_config):
    """A written run config on the tiny target, with its own copy of the data (the tests touch it)."""
    from eagle3.config import write_run_config

    data = tmp_path / "prompts.jsonl"
    shutil.copy(make_config().data.path, data)
    cfg = make_config(data={"path": str(data), "max_samples": 60, "max_length": 64})
    return cfg, write_run_config(cfg)


def expected_tokens(cfg) -> tuple[int, int]:
    from eagle3.data.samples import SampleTokenizer, read_conversations

    conversations, _ = read_conversations(cfg.data.path, cfg.data.on_bad_record, cfg.data.max_samples)
    lengths = [len(s.input_ids) for s in SampleTokenizer.for_run(cfg).iter(conversations)]
    return sum(lengths), len(lengths)


@pytest.mark.slow
def test_box_disk_counts_tokens_like_extraction_and_caches_the_count(disk_config):
    cfg, config_path = disk_config
    out, _ = box_json("disk", "--config", str(config_path))
    tokens, samples = expected_tokens(cfg)
    assert (out["tokens"], out["samples"]) == (tokens, samples) and tokens > 0
    bytes_per_token = 4 * cfg.target.hidden_size * 2 + 5  # 3 aux layers + the last state, bf16; id + mask
    assert out["bytes_per_token"] == bytes_per_token
    assert out["estimate_bytes"] == math.ceil(tokens * (4 * cfg.target.hidden_size * 2 * 1.2 + 5))
    assert out["held_bytes"] == 0 and out["needed_bytes"] == out["estimate_bytes"]
    assert out["enough"] is True and out["path"] == str(cfg.run_dir) and out["margin"] == 1.2
    assert out["message"].startswith("enough disk: need ")

    cache = cfg.run_dir / boxinfo.TOKEN_CACHE_NAME
    written = cache.stat().st_mtime_ns
    out, _ = box_json("disk", "--config", str(config_path), "--margin", "1e9")
    assert cache.stat().st_mtime_ns == written  # reused, not counted again
    assert out["tokens"] == tokens and out["enough"] is False
    assert out["message"].startswith("not enough disk: need ") and str(cfg.run_dir) in out["message"]


@pytest.mark.slow
def test_disk_estimate_subtracts_the_store_and_recounts_when_the_data_changes(disk_config, monkeypatch):
    cfg, _ = disk_config
    first = boxinfo.disk_estimate(cfg, margin=1.0)

    # What the store's manifests record as written of this data counts as done, each sample at its share of its
    # chunk by tokens (the store is shared: another run's sample counts nothing); null-chunk lines (rejects only)
    # hold nothing.
    from eagle3.data.identity import attach_store

    ours = json.loads((cfg.run_dir / boxinfo.TOKEN_CACHE_NAME).read_text())["counts"]["conversation_ids"][0]
    shard = attach_store(cfg) / "shard-00000"
    shard.mkdir(parents=True)
    records = [
        {"chunk": "chunk-000000.safetensors", "bytes": 1000, "samples": [[ours, 30], ["0" * 16, 10]], "rejected": []},
        {"chunk": None, "bytes": 0, "samples": [], "rejected": [["b", "non-finite hidden state"]]},
    ]
    (shard / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def count_tokens_must_not_run(cfg):
        raise AssertionError("tokenised again although the data did not change")

    monkeypatch.setattr(boxinfo, "count_tokens", count_tokens_must_not_run)
    second = boxinfo.disk_estimate(cfg, margin=1.0)
    assert second["held_bytes"] == 750 and second["needed_bytes"] == first["estimate_bytes"] - 750

    monkeypatch.undo()
    data = Path(cfg.data.path)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:10]))  # a new data file: the cached count no longer holds
    assert boxinfo.disk_estimate(cfg, margin=1.0)["samples"] <= 2 * 10 < first["samples"]  # (at most 2 turns each)


def test_disk_estimate_for_the_generate_stage_says_what_it_counted(disk_config, make_config):
    cfg, _ = disk_config
    plain = boxinfo.disk_estimate(cfg, margin=1.0)
    with_generate = boxinfo.disk_estimate(
        make_config(data=cfg.data.model_dump(), generate={"enabled": True}), margin=1.0
    )
    assert with_generate["tokens"] == plain["tokens"]  # the answers to come are not known yet
    assert f"tokens counted from {cfg.data.path}, standing in for the answers generate" in with_generate["message"]
    assert "standing in" not in plain["message"]


def test_disk_estimate_follows_the_state_dtype(disk_config, make_config):
    """extract.state_dtype fp8_e4m3: the estimate asks for what the store itself counts per token for that dtype
    (eagle3.data.store.StoreMeta: the fp8 payload and one float32 scale per token and layer), about half of bf16's."""
    from eagle3.data.store import StoreMeta

    cfg, _ = disk_config
    fp8_cfg = make_config(data=cfg.data.model_dump(), extract={"state_dtype": "fp8_e4m3"})
    bf16, fp8 = (boxinfo.disk_estimate(c, margin=1.0) for c in (cfg, fp8_cfg))
    for run_cfg, out in ((cfg, bf16), (fp8_cfg, fp8)):
        meta = StoreMeta(run_cfg.target.hidden_size, tuple(run_cfg.resolved_aux_layers()), run_cfg.extract.state_dtype)
        assert out["bytes_per_token"] == meta.bytes_per_token
        assert out["estimate_bytes"] == out["tokens"] * meta.bytes_per_token  # margin 1: exactly the payload
    assert fp8["tokens"] == bf16["tokens"] > 0
    assert fp8["bytes_per_token"] < 0.52 * bf16["bytes_per_token"]
    assert f"({cfg.target.hidden_size} x 1 B + 4 B scale, fp8_e4m3)" in fp8["message"]
    assert f"x {cfg.target.hidden_size} x 2 B x 1 +" in bf16["message"] and "scale" not in bf16["message"]


@pytest.mark.slow
def test_box_disk_user_errors_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3", "box", "disk", "--config", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "no such run config" in proc.stderr


def test_format_helpers():
    assert format_bytes(17) == "17 B"
    assert format_bytes(5 * 2**40 + 2**39) == "5.50 TiB"
    assert format_count(87_812_345) == "87.8M" and format_count(512) == "512"


@pytest.mark.slow
def test_boxinfo_does_not_import_torch_at_module_level():
    code = "import sys, eagle3.box.facts; assert 'torch' not in sys.modules and 'airflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
