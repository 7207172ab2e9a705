"""The sglang capture backend: SGLang's own EAGLE-3 capture for TP-sharded giants, with no source patch.

Written against sglang 0.5.23's source (../shared notes, docs/architecture.md) and NOT yet run on a GPU:
bench/gpu_capture_check.py compares it with the hf backend on a small model, in one command.

Two passes over the shard, ONE engine at a time, so a target that fills the box (Kimi-K2.5, tp 8) fits:
  1. final-state pass  an Engine with enable_return_hidden_states=True returns the final post-norm state
                       [T, H] of every prompt; staged on disk (eagle3/capture/staging.py), then shut down.
  2. aux pass          an Engine with enable_return_aux_hidden_states=True + speculative_algorithm="EAGLE3"
                       (the algorithm only names the capture convention: no draft is loaded) and
                       return_aux_hidden_state_layer_ids from eagle3.layer_ids (per-family id conversion)
                       returns [T, 3H], layers in ascending order; joined with the staged final state,
                       whole samples go to the store.
Why two: the engine that captures aux states cannot also return the final state (sglang keeps it for
in-process consumers only), and the last layer cannot be an aux layer (sglang captures a layer's input).
Cost: the target's prefill runs twice; the staging holds H of every token's 4H state columns when
pass 1 ends and shrinks as pass 2 stores batches (never more disk than the finished store: staging.py).
A pass resumes where it stopped: staged samples are not recomputed, and once all are staged a restart
loads only the aux engine.
Every request asks for max_new_tokens=1 (0 returns no states in 0.5.23), with the radix cache off
(cached prefix tokens return no states) and chunked prefill off (only the last chunk returns states).
States travel as Python lists through sglang's IPC: correct, slow at Kimi scale; measure before relying
on it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from eagle3.capture import CapturedStates, check_gpu_group
from eagle3.capture.staging import StagedStates, staging_dir
from eagle3.layer_ids import sglang_layer_ids
from eagle3.progress import ProgressLog, beat

# A silence the job supervisor allows while an engine loads (eagle3.progress.beat): Kimi-K2.5's 1T parameters
# onto 8 GPUs take 10-30 minutes, far past the usual limit between two batches.
ENGINE_LOAD_ALLOWANCE_S = 3600.0

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ">=0.5.23,<0.6"  # written for 0.5.23; the capture flags may move in 0.6


class SglangSetupError(RuntimeError):
    """sglang missing, of a version this backend was not written for, or misconfigured."""


def check_version(installed: str) -> None:
    from packaging.specifiers import SpecifierSet

    if installed not in SpecifierSet(SUPPORTED_VERSIONS):
        raise SglangSetupError(
            f"sglang {installed} is installed; the sglang capture backend was written for sglang{SUPPORTED_VERSIONS}. "
            "Install a supported version on the box (requirements-box.txt), or validate this one with "
            "bench/gpu_capture_check.py and widen SUPPORTED_VERSIONS in eagle3/capture/sglang.py"
        )


def target_architecture(model_path: str) -> str:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config["architectures"][0]


def engine_kwargs(cfg, architecture: str, capture: str, gpu_group: int = 0) -> dict:
    """Engine arguments for the 'aux' or the 'last' (final-state) capture engine, from the run config.
    Shard number `gpu_group` on its box runs on GPUs gpu_group x tp_size onwards (SGLang's base_gpu_id)."""
    engine = cfg.extract.sglang  # its extra_args cannot override what is set here (checked by the config)
    kwargs = {
        "model_path": cfg.target.model_path,
        "tokenizer_path": cfg.tokenizer_dir,
        "trust_remote_code": cfg.target.trust_remote_code,
        "dtype": cfg.target.dtype,
        "tp_size": engine.tp_size,
        "base_gpu_id": gpu_group * engine.tp_size,
        "skip_tokenizer_init": True,  # we send token ids
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
    }
    if capture == "aux":
        kwargs |= {
            "enable_return_aux_hidden_states": True,
            "speculative_algorithm": "EAGLE3",
            "return_aux_hidden_state_layer_ids": sglang_layer_ids(cfg.resolved_aux_layers(), architecture),
        }
    elif capture == "last":
        kwargs |= {"enable_return_hidden_states": True}
    else:
        raise ValueError(capture)
    if engine.mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = engine.mem_fraction_static
    if engine.attention_backend is not None:
        kwargs["attention_backend"] = engine.attention_backend
    return kwargs | dict(engine.extra_args)


def states_from_output(output: dict, num_tokens: int, width: int) -> torch.Tensor:
    """The prefill rows of one Engine.generate result as a [num_tokens, width] tensor.

    Through numpy: 3x faster than torch.tensor on nested lists, which made this conversion a third of
    the list path's CPU cost (bench/sglang_state_transport.py)."""
    rows = output["meta_info"]["hidden_states"][0]
    try:
        states = torch.from_numpy(np.asarray(rows, dtype=np.float32))
    except ValueError:  # ragged rows
        states = None
    if states is None or states.shape != (num_tokens, width):
        shape = tuple(states.shape) if states is not None else f"{len(rows)} ragged rows"
        raise RuntimeError(
            f"sglang returned hidden states of shape {shape} for a {num_tokens}-token prompt, "
            f"expected ({num_tokens}, {width}); is the radix cache or chunked prefill on?"
        )
    return states


def load_engine_class():
    """sglang.Engine, after checking that sglang is installed and of a version this backend knows.

    EAGLE3_SGLANG_ENGINE=module:Class (or /path/to/file.py:Class) names another class with Engine's
    arguments instead: tests put a stand-in there, since SGLang cannot run on a CPU machine."""
    stand_in = os.environ.get("EAGLE3_SGLANG_ENGINE")
    if stand_in:
        module_name, _, class_name = stand_in.rpartition(":")
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location("eagle3_sglang_engine_stand_in", module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, class_name)
    try:
        import sglang
    except ImportError:
        raise SglangSetupError(
            "extract.backend is 'sglang' but sglang is not installed on this box; "
            "pip install -r requirements-box.txt, or use extract.backend 'hf'"
        ) from None
    check_version(sglang.__version__)
    return sglang.Engine


class SglangCapture:
    """The two-pass capture. `prepare(batches)` runs the final-state pass over the shard's batches;
    `capture(batch)` then runs the aux pass one batch at a time, in the same batches."""

    SAMPLING = {"max_new_tokens": 1, "temperature": 0.0}

    def __init__(self, cfg, shard: int = 0, gpu_group: int = 0, is_stored=lambda sample_id: False):
        self.engine_class = load_engine_class()
        self.is_stored = is_stored
        if torch.cuda.is_available():
            check_gpu_group(gpu_group, cfg.extract.sglang.tp_size, torch.cuda.device_count())
        architecture = target_architecture(cfg.target.model_path)
        self.hidden_size = cfg.target.hidden_size
        self.num_aux = len(cfg.resolved_aux_layers())
        # Both argument sets are built (and so checked) now, before an engine spends minutes loading.
        self.kwargs = {capture: engine_kwargs(cfg, architecture, capture, gpu_group) for capture in ("last", "aux")}
        self.staged = StagedStates(staging_dir(cfg.run_dir, shard), self.hidden_size)
        self.progress_interval_s = cfg.extract.progress_interval_s
        self.label = f"extract shard {shard}"
        self.aux_engine = None

    def _start(self, capture: str):
        log.info("sglang capture: starting the %s engine %s", capture, self.kwargs[capture])
        beat(f"{self.label}: starting the {capture} engine", allowance_s=ENGINE_LOAD_ALLOWANCE_S)
        return self.engine_class(**self.kwargs[capture])

    def _generate(self, engine, batch, width: int) -> list[torch.Tensor]:
        prompts = [list(s.input_ids) for s in batch]
        outputs = engine.generate(input_ids=prompts, sampling_params=self.SAMPLING, return_hidden_states=True)
        return [states_from_output(out, len(p), width) for p, out in zip(prompts, outputs, strict=True)]

    def prepare(self, batches, total: int) -> None:
        """Pass 1: stage the final state of every sample in `batches` (an iterable: a shard's batches are
        tokenised as they are read) that is not staged yet; `total` samples are expected, for the progress
        line. The final-state engine is started only when a batch needs it, and always shut down."""
        progress = ProgressLog(f"{self.label} final-state pass", total, 0, self.progress_interval_s, log,
                               track_bytes=False)
        engine = None
        try:
            for batch in batches:
                if all(self._needs_no_staging(s) for s in batch):
                    progress.done += len(batch)  # staged by an earlier run
                    continue
                if engine is None:
                    engine = self._start("last")
                # A partly staged (or stored) batch is computed whole, as an uninterrupted run would.
                states = self._generate(engine, batch, self.hidden_size)
                fresh = [(s, st) for s, st in zip(batch, states) if not self._needs_no_staging(s)]
                self.staged.add([s for s, _ in fresh], [st for _, st in fresh])
                progress.update(len(batch), sum(len(s.input_ids) for s in batch))
        finally:
            if engine is not None:
                engine.shutdown()
        if engine is None:
            log.info("%s: final-state pass: every sample to extract was staged already", self.label)
        else:
            progress.emit()

    def _needs_no_staging(self, sample) -> bool:
        return sample.sample_id in self.staged or self.is_stored(sample.sample_id)

    def capture(self, batch) -> list[CapturedStates]:
        """Pass 2, one batch: aux states from the aux engine, final states from the staging (none for a
        sample the store already holds: its staged part may be gone)."""
        if self.aux_engine is None:
            self.aux_engine = self._start("aux")
        aux = self._generate(self.aux_engine, batch, self.num_aux * self.hidden_size)
        return [CapturedStates(a.to(torch.bfloat16), self._staged_state(s)) for s, a in zip(batch, aux, strict=True)]

    def _staged_state(self, sample) -> torch.Tensor | None:
        if sample.sample_id not in self.staged and self.is_stored(sample.sample_id):
            return None
        return self.staged.get(sample)

    def release_stored(self) -> None:
        """Staged final states of batches the store has committed can go."""
        self.staged.discard_stored(self.is_stored)

    def close(self) -> None:
        if self.aux_engine is not None:
            self.aux_engine.shutdown()
            self.aux_engine = None
