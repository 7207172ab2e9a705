"""The stage's environment: an allowlist (STAGE_ENV_NAMES, STAGE_ENV_PREFIXES, `start --pass-env`), and the
PYTHONPATH that runs this code in the supervisor and the stage."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from eagle3.jobs.jobdir import JobError

ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# The caller's environment variables a stage gets (and the supervisor between them), by exact name ...
STAGE_ENV_NAMES = frozenset(
    {
        # a working process: where programs and the home directory are, who runs it, its shell and scratch space
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "TMPDIR",
        # text and time: the locale (decoding of tokenizer files, log timestamps) and the time zone
        "LANG",
        "TZ",
        # the Python the stage runs: its venv, import path and how it writes bytecode and output
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONSAFEPATH",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        # native libraries and CPU threads (CUDA and MKL libraries outside the default paths, BLAS thread counts)
        "LD_LIBRARY_PATH",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        # where Hugging Face, torch and triton keep their caches when no *_HOME or *_CACHE_DIR says otherwise
        "XDG_CACHE_HOME",
    }
)

# ... and by prefix.
STAGE_ENV_PREFIXES = (
    "LC_",  # the locale's categories, as LANG
    "CUDA_",
    "NVIDIA_",  # which GPUs (CUDA_VISIBLE_DEVICES), where CUDA is (CUDA_HOME), the container runtime's view
    "HF_",
    "TRANSFORMERS_",  # the model and data caches, offline mode, the hub's settings
    "NCCL_",
    "TORCH_",
    "PYTORCH_",
    "TORCHINDUCTOR_",
    "TRITON_",  # multi-GPU transport, allocator and compiler caches
    "SGLANG_",
    "SGL_",
    "FLASHINFER_",  # the inference server the extract and generate stages start, and its kernels
    "VLLM_",  # the other engine a stage may start (server.engine vllm: VLLM_MLA_DISABLE on a CPU box, ...)
    "EAGLE3_",  # this project's own hooks (EAGLE3_SERVER_LAUNCHER, EAGLE3_BOOT_ID_FILE, ...)
)


def stage_environment(pass_env: Iterable[str] = ()) -> dict[str, str]:
    """The part of this process's environment that the supervisor and its stage get: the variables the allowlist
    names (STAGE_ENV_NAMES, STAGE_ENV_PREFIXES) and those named in pass_env, where they are set."""
    extra = set()
    for name in pass_env:
        if not ENV_NAME_PATTERN.fullmatch(name):
            raise JobError(
                f"--pass-env {name!r} is not an environment variable's name: it must match {ENV_NAME_PATTERN.pattern}"
            )
        extra.add(name)
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name in STAGE_ENV_NAMES or name.startswith(STAGE_ENV_PREFIXES) or name in extra
    }


def package_root() -> str:
    """The directory holding this eagle3 package: first on the supervisor's PYTHONPATH, so that it runs this code."""
    return str(Path(__file__).resolve().parents[2])


def supervisor_python_path(stage_path: str | None) -> str:
    return os.pathsep.join(filter(None, [package_root(), stage_path]))


def stage_python_path(supervisor_path: str) -> str | None:
    """The PYTHONPATH the caller of start had (None: none), from the supervisor's (supervisor_python_path)."""
    root = package_root()
    if supervisor_path.startswith(root + os.pathsep):
        return supervisor_path[len(root) + 1 :]
    return None if supervisor_path in ("", root) else supervisor_path
