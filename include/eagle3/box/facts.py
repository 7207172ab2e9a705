"""Facts about the box, as JSON, for the Airflow sensors: `python -m eagle3 box <info|gpus|disk>`.

The sensors run these over SSH and decide from the JSON; nothing here decides to fail a run. So a
missing nvidia-smi, a missing package or a full disk is reported (exit 0), not raised. Only inputs a
person must fix (a bad run config, unreadable data) raise, and the CLI turns those into exit code 2.

  gpus   nvidia-smi's view: GPUs with memory used/total and MIG mode, and the compute processes on them.
         `judge_gpus` turns a report into (idle, problems) for a sensor that waits for free GPUs.
  info   the protocol this code speaks (eagle3.contracts), python, host, boot id, versions of the packages the
         stages need, torch's CUDA view, the GPUs.
  disk   whether the run's extraction fits on its disk: tokens x bytes per token x margin, less what the
         store already holds, against the free space of the run directory's file system.

This module runs on the box and is imported by the Airflow side (judge_gpus), so it imports neither
airflow nor, at module level, torch.
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from eagle3.config import ConfigError, RunConfig
from eagle3.contracts import PROTOCOL, BoxInfo
from eagle3.data.samples import (
    TOKENIZING_VERSION,
    DataError,
    SampleTokenizer,
    TokenizeStats,
    conversation_id_of,
    read_conversations,
)
from eagle3.disk.fsutil import atomic_write_text
from eagle3.jobs.job import poll_job
from eagle3.jobs.processes import read_boot_id
from eagle3.jobs.progress import format_bytes, format_count

log = logging.getLogger(__name__)

GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total", "mig.mode.current")
PROCESS_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")
NVIDIA_SMI_TIMEOUT_S = 60  # nvidia-smi can hang on a wedged GPU; a sensor must get an answer

# Every stage needs these; sglang only the sglang capture backend (ask for it with `--require sglang`).
REQUIRED_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic")
REPORTED_PACKAGES = (*REQUIRED_PACKAGES, "sglang")


TOKEN_CACHE_NAME = "disk_estimate_tokens.json"
# Bytes per hidden-state value by extract.state_dtype, and per state row (one token's layer): fp8's float32
# scale. As eagle3.data.store.StoreMeta.bytes_per_token counts them, which imports torch: the sensor must not.
STATE_BYTES = {"bf16": 2, "fp8_e4m3": 1}
SCALE_BYTES = {"bf16": 0, "fp8_e4m3": 4}
IDS_AND_MASK_BYTES = 5  # an int32 token id and a uint8 loss-mask entry per token


# -- nvidia-smi ------------------------------------------------------------------------------


def _value(raw: str) -> str | None:
    """nvidia-smi's text for "no value": "[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "", ..."""
    text = raw.strip()
    if not text or text in ("N/A", "Not Supported") or (text.startswith("[") and text.endswith("]")):
        return None
    return text


def _int(raw: str) -> int | None:
    text = _value(raw)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _split_row(line: str, width: int, free_text_column: int) -> list[str] | None:
    """The fields of one CSV row, or None if it is not a row. nvidia-smi does not quote fields, so a comma
    inside a name (a process's command line may have one) makes extra fields: they are joined back into
    the one free-text column, since every other column is known not to contain commas."""
    fields = next(csv.reader([line], skipinitialspace=True), [])
    if len(fields) < width:
        return None
    extra = len(fields) - width
    if extra:
        name = ", ".join(fields[free_text_column : free_text_column + extra + 1])
        fields = [*fields[:free_text_column], name, *fields[free_text_column + extra + 1 :]]
    return fields


def _is_notice(line: str) -> bool:
    """Lines nvidia-smi prints instead of rows, e.g. "No devices were found", "No running processes found"."""
    return line.strip().lower().startswith("no ")


def parse_gpus(text: str) -> tuple[list[dict], list[str]]:
    """Parse `nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,mig.mode.current
    --format=csv,noheader,nounits`. Returns (gpus, lines that could not be parsed)."""
    gpus, unparsed = [], []
    for line in text.splitlines():
        if not line.strip() or _is_notice(line):
            continue
        fields = _split_row(line, len(GPU_FIELDS), GPU_FIELDS.index("name"))
        index = _int(fields[0]) if fields else None
        if fields is None or index is None:
            unparsed.append(line)
            continue
        gpus.append(
            {
                "index": index,
                "uuid": _value(fields[1]),
                "name": _value(fields[2]),
                "memory_used_mib": _int(fields[3]),  # N/A at the GPU level when MIG is enabled
                "memory_total_mib": _int(fields[4]),
                "mig": (_value(fields[5]) or "").lower() == "enabled",
            }
        )
    return gpus, unparsed


def parse_processes(text: str, gpus: list[dict]) -> tuple[list[dict], list[str]]:
    """Parse `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits`
    and place each process on a GPU index by uuid. Under MIG a process may carry a MIG instance's uuid
    ("MIG-..."); with exactly one MIG-enabled GPU that is where it runs, otherwise its index stays None."""
    index_of_uuid = {gpu["uuid"]: gpu["index"] for gpu in gpus if gpu["uuid"]}
    mig_gpus = [gpu["index"] for gpu in gpus if gpu["mig"]]
    processes, unparsed = [], []
    for line in text.splitlines():
        if not line.strip() or _is_notice(line):
            continue
        fields = _split_row(line, len(PROCESS_FIELDS), PROCESS_FIELDS.index("process_name"))
        if fields is None:
            unparsed.append(line)
            continue
        uuid = _value(fields[0])
        gpu_index = index_of_uuid.get(uuid)
        if gpu_index is None and uuid and uuid.startswith("MIG-") and len(mig_gpus) == 1:
            gpu_index = mig_gpus[0]
        processes.append(
            {
                "gpu_index": gpu_index,
                "gpu_uuid": uuid,
                "pid": _int(fields[1]),
                "name": _value(fields[2]),
                "used_mib": _int(fields[3]),  # N/A for processes in MIG instances on some drivers
            }
        )
    return processes, unparsed


def _run_nvidia_smi(executable: str, query: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of one CSV query."""
    proc = subprocess.run(
        [executable, query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=NVIDIA_SMI_TIMEOUT_S,
    )
    return proc.returncode, proc.stdout + proc.stderr


def gpu_report(nvidia_smi: str | None = None) -> dict:
    """Run nvidia-smi (default: the one on PATH) and report GPUs and compute processes:

    {"gpus": [{"index", "uuid", "name", "memory_used_mib", "memory_total_mib", "mig"}],
     "processes": [{"gpu_index", "gpu_uuid", "pid", "name", "used_mib"}], "error": str | None}

    Never raises for the box's state: no nvidia-smi, a failing driver, or a hang is an `error` with
    whatever could be listed. A box without GPUs ("No devices were found") is no error, just no GPUs.
    """
    report: dict = {"gpus": [], "processes": [], "error": None}
    executable = nvidia_smi or shutil.which("nvidia-smi")
    if executable is None:
        report["error"] = "nvidia-smi not found on PATH"
        return report
    errors = []
    outputs = {}
    for query in (f"--query-gpu={','.join(GPU_FIELDS)}", f"--query-compute-apps={','.join(PROCESS_FIELDS)}"):
        try:
            code, output = _run_nvidia_smi(executable, query)
        except FileNotFoundError:
            report["error"] = f"nvidia-smi not found at {executable}"
            return report
        except (OSError, subprocess.TimeoutExpired) as err:
            errors.append(f"{executable} {query}: {err}")
            continue
        if code != 0 and "no devices were found" in output.lower():
            return report  # a box without GPUs: nothing else to ask
        if code != 0:
            last_line = output.strip().splitlines()[-1] if output.strip() else "no output"
            errors.append(f"{executable} {query} exited {code}: {last_line}")
            continue
        outputs[query.split("=")[0]] = output
    if "--query-gpu" in outputs:
        report["gpus"], unparsed = parse_gpus(outputs["--query-gpu"])
        errors += [f"unexpected nvidia-smi GPU line: {line!r}" for line in unparsed]
    if "--query-compute-apps" in outputs:
        report["processes"], unparsed = parse_processes(outputs["--query-compute-apps"], report["gpus"])
        errors += [f"unexpected nvidia-smi process line: {line!r}" for line in unparsed]
    report["error"] = "; ".join(errors) or None
    return report


def _describe_process(process: dict) -> str:
    used = f"{process['used_mib']} MiB" if process["used_mib"] is not None else "memory unknown"
    return f"pid {process['pid']} {process['name'] or '(name unknown)'} ({used})"


def mark_job_processes(report: dict, jobs_dir: str | Path) -> dict:
    """Tag each GPU process that belongs to a live job in `jobs_dir` with that job's key (`"job"`).

    A job's stage runs in the job's process group (eagle3.jobs.job), so a process whose group is a live job's is ours:
    the GPU sensor must not wait for the run's own work to go away (a train job still running when a cleared DAG run
    checks the GPUs again). Other processes get `"job": None`.
    """
    live_groups = {}
    root = Path(jobs_dir)
    for job in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            answer = poll_job(root, job.name, 0, 0)
        except Exception:  # not a job directory (or a key the job module refuses): not ours to claim
            continue
        if answer["effective"] == "running":
            live_groups[answer["state"]["pgid"]] = job.name
    for process in report["processes"]:
        try:
            group = os.getpgid(process["pid"]) if process["pid"] is not None else None
        except OSError:  # gone since nvidia-smi listed it, or not visible from here (another container)
            group = None
        process["job"] = live_groups.get(group)
    return report


def judge_gpus(
    report: dict,
    max_used_mib: int,
    allowed_pids: Iterable[int] = (),
    *,
    require_gpus: bool = True,
    gpu_indices: Iterable[int] | None = None,
) -> tuple[bool, list[str]]:
    """Are the GPUs free for us? Returns (idle, problems), one problem per busy GPU, each naming the GPU,
    the memory in use and the foreign processes, e.g.
      "GPU 3 (NVIDIA H200): 71234 MiB used > 1024 MiB allowed; processes: pid 4242 python3 (70000 MiB)"

    Memory of `allowed_pids` (our own processes) is not counted. `gpu_indices` limits the check to
    those GPUs (default all); processes nvidia-smi could not place on a GPU are checked whatever the
    indices, since they may be on one of ours. Where MIG hides a GPU's total, its processes are summed,
    and a foreign process of unknown size counts as busy.
    """
    allowed = set(allowed_pids)
    problems: list[str] = []
    if not report["gpus"]:
        if require_gpus:
            problems.append(f"no GPUs visible ({report.get('error') or 'nvidia-smi lists none'})")
        return not problems, problems
    if report.get("error"):  # e.g. the process query failed: what we cannot see may be busy
        problems.append(f"cannot read the GPUs' state fully: {report['error']}")

    wanted = set(gpu_indices) if gpu_indices is not None else {gpu["index"] for gpu in report["gpus"]}
    known = {gpu["index"] for gpu in report["gpus"]}
    for missing in sorted(wanted - known):
        problems.append(f"GPU {missing}: not visible (nvidia-smi lists {sorted(known)})")

    for gpu in report["gpus"]:
        if gpu["index"] not in wanted:
            continue
        on_gpu = [p for p in report["processes"] if p["gpu_index"] == gpu["index"]]
        label = f"GPU {gpu['index']} ({gpu['name'] or 'unknown model'}{', MIG' if gpu['mig'] else ''})"
        problem = _judge_memory(label, gpu["memory_used_mib"], on_gpu, allowed, max_used_mib)
        if problem:
            problems.append(problem)

    unplaced: dict[str | None, list[dict]] = {}
    for process in report["processes"]:
        if process["gpu_index"] is None:
            unplaced.setdefault(process["gpu_uuid"], []).append(process)
    for uuid, processes in unplaced.items():
        problem = _judge_memory(f"GPU {uuid or '(uuid unknown)'}", None, processes, allowed, max_used_mib)
        if problem:
            problems.append(problem)
    return not problems, problems


def _judge_memory(
    label: str, used_mib: int | None, processes: list[dict], allowed: set[int], max_used_mib: int
) -> str | None:
    """A problem line if the memory used by others exceeds the limit, else None."""
    foreign = [p for p in processes if p["pid"] not in allowed]
    own_mib = sum(p["used_mib"] or 0 for p in processes if p["pid"] in allowed)
    if used_mib is not None:
        others_mib = max(0, used_mib - own_mib)
        unknown = False
    else:  # the GPU's total is hidden (MIG): judge from the processes nvidia-smi lists
        others_mib = sum(p["used_mib"] or 0 for p in foreign)
        unknown = any(p["used_mib"] is None for p in foreign)
    if others_mib <= max_used_mib and not unknown:
        return None
    used_text = f"{others_mib} MiB used" + (" (plus processes of unknown size)" if unknown else "")
    if own_mib:
        used_text += f" not counting {own_mib} MiB of allowed pids"
    # No process listed yet memory in use: a process in another container, or a leaked context.
    listed = ", ".join(_describe_process(p) for p in foreign) or "none visible (another container?)"
    return f"{label}: {used_text} > {max_used_mib} MiB allowed; processes: {listed}"


# -- box info --------------------------------------------------------------------------------


def boot_id_or_none() -> str | None:
    """The kernel's boot id (eagle3.jobs.processes.read_boot_id), or None where it cannot be read (not Linux)."""
    try:
        return read_boot_id() or None
    except OSError:
        return None


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None if it is not installed or its module cannot be found
    (a leftover dist-info without the package is as good as missing). Imports nothing."""
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    if importlib.util.find_spec(name.replace("-", "_")) is None:
        return None
    return version


def cuda_info() -> dict | None:
    """torch's CUDA view, or None without torch. Imports torch (seconds), so only `box info` calls it, and only
    where nvidia-smi lists a GPU."""
    try:
        import torch
    except ImportError:
        return None
    try:
        available = torch.cuda.is_available()
        return {
            "torch_cuda": torch.version.cuda,
            "available": available,
            "device_count": torch.cuda.device_count() if available else 0,
        }
    except Exception as err:  # noqa: BLE001 - a broken driver is a finding to report, not a crash
        return {"torch_cuda": torch.version.cuda, "available": False, "device_count": 0, "error": str(err)}


def box_info(require: Iterable[str] = (), nvidia_smi: str | None = None) -> BoxInfo:
    """Python, host, boot id, package versions, CUDA and GPUs. `missing` lists the required packages
    (REQUIRED_PACKAGES plus `require`, e.g. "sglang") that are not installed. `cuda` is torch's view where
    nvidia-smi lists a GPU, else None: without one there is nothing for torch to see, and asking costs
    seconds of imports on every run's first task."""
    required = list(dict.fromkeys([*REQUIRED_PACKAGES, *require]))
    packages = {name: package_version(name) for name in dict.fromkeys([*REPORTED_PACKAGES, *required])}
    launcher = os.environ.get("EAGLE3_SERVER_LAUNCHER")
    if launcher and packages.get("sglang") is None:  # tests: a stand-in serves in SGLang's place (engines.server)
        packages["sglang"] = f"stand-in {launcher}"
    gpus = gpu_report(nvidia_smi)["gpus"]
    return {
        "protocol": PROTOCOL,  # what the control plane checks before it drives this code (eagle3.contracts)
        "python": sys.version,
        "executable": sys.executable,
        "hostname": socket.gethostname(),
        "boot_id": boot_id_or_none(),
        "packages": packages,
        "cuda": cuda_info() if packages["torch"] and gpus else None,
        "gpus": gpus,
        "missing": [name for name in required if packages[name] is None],
    }


# -- disk estimate ---------------------------------------------------------------------------


def nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists: where a not yet created run directory will live."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def count_tokens(cfg: RunConfig) -> dict:
    """Tokens and samples extraction will store, counted by tokenising exactly as extraction does
    (chat template, data.max_length, data.max_samples, data.on_bad_record; samples with no assistant
    token are skipped there, so here too). Can take minutes on a large data file."""
    conversations, read_stats = read_conversations(cfg.data.path, cfg.data.on_bad_record, cfg.data.max_samples)
    stats = TokenizeStats()
    tokens = samples = truncated = 0
    for sample in SampleTokenizer.for_run(cfg).iter(conversations, stats):
        tokens += len(sample.input_ids)
        samples += 1
        truncated += sample.truncated
    return {
        "tokens": tokens,
        "samples": samples,
        "skipped": len(stats.skipped),
        "truncated": truncated,
        "bad_records": len(read_stats.bad),
        # what of a shared store is this data's (store_held_bytes)
        "conversation_ids": sorted(c.sample_id for c in conversations),
    }


def _token_cache_key(cfg: RunConfig) -> dict:
    """What the token count depends on. The data file is identified by size and mtime, not content: a
    sensor pokes every few minutes, and hashing terabytes of JSONL each time is what the cache avoids."""
    try:
        stat = os.stat(cfg.data.path)
    except FileNotFoundError:
        raise DataError(f"data.path: {cfg.data.path} does not exist") from None
    return {
        "data_path": str(cfg.data.path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "max_length": cfg.data.max_length,
        "max_samples": cfg.data.max_samples,
        "on_bad_record": cfg.data.on_bad_record,
        "loss_mask": cfg.data.loss_mask,
        "generation_chat_template": cfg.data.generation_chat_template,
        "chat_template_kwargs": cfg.data.chat_template_kwargs,
        "tokenizer": cfg.tokenizer_dir,
        "samples_of": TOKENIZING_VERSION,  # how conversations become samples (eagle3.data.samples)
        "counts": 2,  # what a count holds: 2 added the conversation ids
    }


def cached_token_count(cfg: RunConfig, cache_path: Path) -> dict:
    """count_tokens, remembered in `cache_path` for as long as its key (data file, limits) still holds."""
    key = _token_cache_key(cfg)
    try:
        cached = json.loads(cache_path.read_text())
        if cached.get("key") == key:
            return cached["counts"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no cache, or an unreadable one: count again
    log.info("counting tokens of %s (cached in %s afterwards)", cfg.data.path, cache_path)
    counts = count_tokens(cfg)
    try:
        atomic_write_text(cache_path, json.dumps({"key": key, "counts": counts}, indent=2) + "\n")
    except OSError as err:  # the estimate stands without the cache; the next poke counts again
        log.warning("cannot cache the token count in %s: %s", cache_path, err)
    return counts


def store_held_bytes(store_dir: Path, conversation_ids: set[str]) -> int:
    """Bytes of the chunks the store's manifests record (0 without a store) for the samples of `conversation_ids`
    (the store is shared with other runs' data), each sample at its share of its chunk's bytes by tokens: what
    extraction has done of this run."""
    shard_dirs = sorted(Path(store_dir).glob("shard-*"))
    if not shard_dirs:
        return 0
    from eagle3.data.store import (
        read_manifest,  # here: it imports torch, and the Airflow side imports this module
    )

    held = 0
    for shard in shard_dirs:
        records, _ = read_manifest(shard / "manifest.jsonl")
        for record in records:
            if not record.get("chunk"):
                continue
            lengths = [n for _, n in record["samples"]]
            ours = sum(n for sid, n in record["samples"] if conversation_id_of(sid) in conversation_ids)
            held += record["bytes"] * ours // max(1, sum(lengths))
    return held


def disk_estimate(cfg: RunConfig, margin: float = 1.2) -> dict:
    """Will the run's extraction fit? `cfg` is a RunConfig with the target facts resolved.

    estimate = tokens x (aux layers + 1) x hidden_size x 2 B (bf16) x margin + 5 B per token (ids, mask);
    with extract.state_dtype fp8_e4m3, hidden_size x 1 B + 4 B (its scale) in place of hidden_size x 2 B;
    the sglang backend's staged final states need no more (they shrink as the store grows, and together
    never exceed the finished store: eagle3/capture/staging.py);
    needed = estimate - bytes the store already holds; enough = needed <= free bytes of the file system
    the run directory is (or will be) on. The margin covers chunk headers and what the estimate misses.
    With generate on, the tokens are counted from data.path: its answers stand in for the regenerated ones.
    """
    if not (margin > 0 and math.isfinite(margin)):
        raise ConfigError("--margin", f"{margin} is not a positive number", "give one, such as 1.1")
    counts = cached_token_count(cfg, cfg.run_dir / TOKEN_CACHE_NAME)
    states_per_token = len(cfg.resolved_aux_layers()) + 1
    hidden_size = cfg.target.hidden_size
    dtype = cfg.extract.state_dtype
    state_bytes_per_token = states_per_token * (hidden_size * STATE_BYTES[dtype] + SCALE_BYTES[dtype])
    tokens = counts["tokens"]
    estimate = math.ceil(tokens * (state_bytes_per_token * margin + IDS_AND_MASK_BYTES))
    # The shared store (RUN_DIR/hidden_states links into {workdir}/stores/) also holds other runs' data: only this
    # data's samples are done. With generate on, data.path's ids stand in for answers not yet written: none held.
    held = store_held_bytes(cfg.store_dir, set(counts["conversation_ids"]))
    needed = max(0, estimate - held)
    where = nearest_existing(cfg.run_dir)
    fs = os.statvfs(where)
    free = fs.f_bavail * fs.f_frsize
    enough = needed <= free
    state_row = f"{hidden_size} x {STATE_BYTES[dtype]} B"
    if SCALE_BYTES[dtype]:
        state_row = f"({state_row} + {SCALE_BYTES[dtype]} B scale, {dtype})"
    message = (
        f"{'enough' if enough else 'not enough'} disk: need {format_bytes(needed)} more for "
        f"{format_count(tokens)} tokens x ({states_per_token} x {state_row} x {margin:g} + {IDS_AND_MASK_BYTES} B) "
        f"(store already holds {format_bytes(held)}); {format_bytes(free)} free on {where}"
    )
    if cfg.generate.enabled:
        message += f"; tokens counted from {cfg.data.path}, standing in for the answers generate will write"
    return {
        "path": str(where),
        "free_bytes": free,
        "tokens": tokens,
        "samples": counts["samples"],
        "bytes_per_token": state_bytes_per_token + IDS_AND_MASK_BYTES,  # without the margin, as stored
        "estimate_bytes": estimate,
        "held_bytes": held,
        "needed_bytes": needed,
        "margin": margin,
        "enough": enough,
        "message": message,
    }
