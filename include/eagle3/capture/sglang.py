"""The sglang capture backend: SGLang's own EAGLE-3 capture for TP-sharded giants, with no source patch.

Written for sglang SUPPORTED_VERSIONS (0.5.23) and NOT yet run on a GPU: bench/gpu_capture_check.py compares it
with the hf backend on a small model, in one command. A missing or unsupported sglang raises SglangSetupError.

Every engine captures with enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3" (no draft is
loaded) and return_aux_hidden_state_layer_ids from eagle3.model.layer_ids; every request asks for max_new_tokens=1,
with the radix cache and chunked prefill off. The path (extract.sglang.capture):
  plugin  one engine (overlap scheduling off), one prefill per sample: eagle3/capture/sglang_plugin.py writes each
          request's states to {run dir}/capture-sink/shard-NNNNN/{rid}.safetensors, deleted once the store has
          committed its batch
  lists   SGLang's public return path, one engine at a time: a final-state pass staged on disk
          (eagle3/capture/staging.py), then the aux pass; the prefill twice, states as Python lists
          (bench/sglang_state_transport.py), resumable
  auto    (default) plugin, unless its version gate or start-up probe fails: then lists, the reason logged and in
          RUN_DIR/extract/shard-NNNNN.stats.json (capture_fallback); under 'plugin' that is a SglangSetupError
Why: docs/decisions/2026-12-01-sglang-capture-plugin.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file

from eagle3.capture import sglang_plugin
from eagle3.capture.base import CapturedStates, check_gpu_group
from eagle3.capture.staging import StagedStates, staging_dir
from eagle3.jobs.progress import ProgressLog, beat
from eagle3.model.layer_ids import sglang_layer_ids

if TYPE_CHECKING:
    from eagle3.config import RunConfig

# A silence the job supervisor allows while an engine loads (eagle3.jobs.progress.beat): Kimi-K2.5's 1T parameters onto
# 8 GPUs take 10-30 minutes, far past the usual limit between two batches.
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


def engine_kwargs(cfg: RunConfig, architecture: str, capture: str, gpu_group: int = 0) -> dict:
    """Engine arguments for the 'aux' or the 'last' (final-state) capture engine of the list path, or the 'plugin'
    engine (the aux engine, its final states written by the plugin), from the run config. Shard number
    `gpu_group` on its box runs on GPUs gpu_group x tp_size onwards (SGLang's base_gpu_id)."""
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
    if capture in ("aux", "plugin"):
        kwargs |= {
            "enable_return_aux_hidden_states": True,
            "speculative_algorithm": "EAGLE3",
            "return_aux_hidden_state_layer_ids": sglang_layer_ids(cfg.resolved_aux_layers(), architecture),
        }
        if capture == "plugin":  # overlap's copy to the CPU (GenerationBatchResult.copy_to_cpu) skips final states
            kwargs["disable_overlap_schedule"] = True
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


def plugin_gate_problem(engine_class) -> str | None:
    """The capture plugin's version gate for the engine about to run; a stand-in engine (tests) answers itself."""
    answer = getattr(engine_class, "plugin_gate_problem", None)
    return answer() if answer is not None else sglang_plugin.gate_problem()


def sink_dir(run_dir: Path, shard: int) -> Path:
    """Where the plugin engine of one shard writes its requests' states."""
    return Path(run_dir) / "capture-sink" / f"shard-{shard:05d}"


@contextmanager
def plugin_selected(sink: Path):
    """The environment an engine's scheduler processes inherit at start: the sink, and our plugin selected in
    SGLANG_PLUGINS (added to a selection the box already makes). Restored afterwards, so that an engine started
    later (the list path's) loads no plugin."""
    saved = {name: os.environ.get(name) for name in (sglang_plugin.SINK_ENV, "SGLANG_PLUGINS")}
    selected = [name for name in (saved["SGLANG_PLUGINS"] or "").split(",") if name.strip()]
    os.environ[sglang_plugin.SINK_ENV] = str(sink)
    os.environ["SGLANG_PLUGINS"] = ",".join(dict.fromkeys([*selected, sglang_plugin.PLUGIN_NAME]))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class ProbeFailed(RuntimeError):
    """The plugin engine's start-up request produced no usable states file."""


class SglangCapture:
    """`prepare(batches)` chooses the capture path (extract.sglang.capture): the plugin engine if its gate and
    probe pass, else the list path, whose final-state pass it then runs over the shard's batches. `capture(batch)`
    captures one batch, in the planned order."""

    SAMPLING = {"max_new_tokens": 1, "temperature": 0.0}
    PROBE_TOKENS = 8

    def __init__(self, cfg: RunConfig, shard: int = 0, gpu_group: int = 0, is_stored=lambda sample_id: False):
        self.engine_class = load_engine_class()
        self.is_stored = is_stored
        if torch.cuda.is_available():
            check_gpu_group(gpu_group, cfg.extract.sglang.tp_size, torch.cuda.device_count())
        architecture = target_architecture(cfg.target.model_path)
        self.hidden_size = cfg.target.hidden_size
        self.num_aux = len(cfg.resolved_aux_layers())
        # Every argument set is built (and so checked) now, before an engine spends minutes loading.
        self.kwargs = {
            capture: engine_kwargs(cfg, architecture, capture, gpu_group) for capture in ("plugin", "last", "aux")
        }
        self.capture_setting = cfg.extract.sglang.capture
        self.staged = StagedStates(staging_dir(cfg.run_dir, shard), self.hidden_size)
        self.sink = sink_dir(cfg.run_dir, shard)
        self.shard = shard
        self.progress_interval_s = cfg.extract.progress_interval_s
        self.label = f"extract shard {shard}"
        self.path: str | None = None  # "plugin" or "lists", once prepare has chosen
        self.fallback: str | None = None  # why auto took the list path
        self.engine = None  # the capturing engine: the plugin engine, or the list path's aux engine
        self.files: dict[str, Path] = {}  # sample id -> its states file, until the store holds the sample
        # Request ids, so file names, are new in every try: a file a dead try left can never pass for this one's.
        self.rid_prefix = f"e3-{shard:05d}-{os.urandom(4).hex()}"
        self.requests = 0

    def _start(self, capture: str):
        log.info("sglang capture: starting the %s engine %s", capture, self.kwargs[capture])
        beat(f"{self.label}: starting the {capture} engine", allowance_s=ENGINE_LOAD_ALLOWANCE_S)
        return self.engine_class(**self.kwargs[capture])

    def _generate(self, engine, batch, width: int) -> list[torch.Tensor]:
        prompts = [list(s.input_ids) for s in batch]
        outputs = engine.generate(input_ids=prompts, sampling_params=self.SAMPLING, return_hidden_states=True)
        return [states_from_output(out, len(p), width) for p, out in zip(prompts, outputs, strict=True)]

    def stats(self) -> dict:
        return {
            "capture_path": self.path,
            "capture_fallback": self.fallback,
            "prefill_passes": {"plugin": 1, "lists": 2}.get(self.path),
        }

    # -- choosing the path ---------------------------------------------------------------------------------------

    def prepare(self, batches, total: int) -> None:
        """Choose the capture path; on the list path, run its final-state pass over `batches` (an iterable: a
        shard's batches are tokenised as they are read), `total` samples expected, for the progress line."""
        batches = iter(batches)
        if self.capture_setting != "lists":
            first = next(batches, None)
            if first is None:
                return
            problem = self._start_plugin_engine(first[0])
            if problem is None:
                self.path = "plugin"
                log.info("%s: capturing through the plugin: one engine, one prefill per sample", self.label)
                return
            if self.capture_setting == "plugin":
                raise SglangSetupError(
                    f"extract.sglang.capture is 'plugin', but {problem}. Set extract.sglang.capture to 'auto' (falls "
                    "back to the list path, the prefill twice) or 'lists'; bench/gpu_capture_check.py checks the "
                    "plugin on a GPU box"
                )
            log.warning(
                "%s: the capture plugin cannot be used (%s); falling back to the list path: two engines in "
                "turn, the prefill twice, states as Python lists",
                self.label,
                problem,
            )
            self.fallback = problem
            batches = itertools.chain([first], batches)
        self.path = "lists"
        self._final_state_pass(batches, total)

    def _start_plugin_engine(self, probe_sample) -> str | None:
        """Start the plugin engine and probe it; None when it captures, else why not (no engine left running)."""
        problem = plugin_gate_problem(self.engine_class)
        if problem is not None:
            return problem
        if self.sink.exists():  # a crashed try's files: their batches were never stored and are captured again
            shutil.rmtree(self.sink)
        self.sink.mkdir(parents=True)
        with plugin_selected(self.sink):
            self.engine = self._start("plugin")
        try:
            self._probe(probe_sample)
        except ProbeFailed as failed:
            self.engine.shutdown()
            self.engine = None
            return str(failed)
        return None

    def _probe(self, sample) -> None:
        """One short request must come back as a file with both states of every token: HookRegistry only logs a
        hook that fails to apply, and a plugin that never ran would otherwise look like an engine that lost data."""
        prompt = list(sample.input_ids[: self.PROBE_TOKENS])
        rid = f"{self.rid_prefix}-probe"
        self.engine.generate(input_ids=[prompt], sampling_params=self.SAMPLING, return_hidden_states=True, rid=[rid])
        path = sglang_plugin.states_file(self.sink, rid)
        if not path.exists():
            raise ProbeFailed(
                f"the start-up probe's request produced no states file in {self.sink}: the plugin did "
                f"not run in the engine's scheduler (its log says why: look for 'eagle3 capture plugin')"
            )
        try:
            self._read_states(path, len(prompt))
        except RuntimeError as err:
            raise ProbeFailed(f"the start-up probe's states file is unusable: {err}") from None
        finally:
            path.unlink(missing_ok=True)

    # -- capturing -----------------------------------------------------------------------------------------------

    def capture(self, batch) -> list[CapturedStates]:
        if self.path == "plugin":
            return self._capture_through_plugin(batch)
        return self._capture_aux_pass(batch)

    def _capture_through_plugin(self, batch) -> list[CapturedStates]:
        rids = [f"{self.rid_prefix}-{self.requests + i:09d}" for i in range(len(batch))]
        self.requests += len(batch)
        prompts = [list(s.input_ids) for s in batch]
        self.engine.generate(input_ids=prompts, sampling_params=self.SAMPLING, return_hidden_states=True, rid=rids)
        captured = []
        for sample, rid in zip(batch, rids, strict=True):
            path = sglang_plugin.states_file(self.sink, rid)
            if not path.exists():
                raise RuntimeError(
                    f"sglang capture: the plugin wrote no states for request {rid} (sample "
                    f"{sample.sample_id}) into {self.sink}; the engine's log says why"
                )
            aux, last = self._read_states(path, len(sample.input_ids))
            self.files[sample.sample_id] = path
            captured.append(CapturedStates(aux, last))
        return captured

    def _read_states(self, path: Path, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        states = load_file(str(path))
        aux, last = states.get(sglang_plugin.AUX_KEY), states.get(sglang_plugin.LAST_KEY)
        expected = {"aux": (num_tokens, self.num_aux * self.hidden_size), "final": (num_tokens, self.hidden_size)}
        for name, tensor in (("aux", aux), ("final", last)):
            shape = None if tensor is None else tuple(tensor.shape)
            if shape != expected[name]:
                raise RuntimeError(
                    f"{path}: {name} states of shape {shape}, expected {expected[name]} for a "
                    f"{num_tokens}-token prompt (radix cache or chunked prefill on?)"
                )
        return aux.to(torch.bfloat16), last.to(torch.bfloat16)

    def release_stored(self) -> None:
        """What the store has committed by now needs keeping no longer: states files, or staged final states."""
        for sample_id, path in list(self.files.items()):
            if self.is_stored(sample_id):
                path.unlink(missing_ok=True)
                del self.files[sample_id]
        self.staged.discard_stored(self.is_stored)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        # Called once the store has taken every batch it was given: what is left was never stored, and a
        # restart captures those batches again.
        if self.sink.exists():
            shutil.rmtree(self.sink)

    # -- the list path -------------------------------------------------------------------------------------------

    def _final_state_pass(self, batches, total: int) -> None:
        """Stage the final state of every sample in `batches` that is not staged yet. The final-state engine is
        started only when a batch needs it, and always shut down."""
        progress = ProgressLog(
            f"{self.label} final-state pass", total, 0, self.progress_interval_s, log, track_bytes=False
        )
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

    def _capture_aux_pass(self, batch) -> list[CapturedStates]:
        """Aux states from the aux engine, final states from the staging (none for a sample the store already
        holds: its staged part may be gone)."""
        if self.engine is None:
            self.engine = self._start("aux")
        aux = self._generate(self.engine, batch, self.num_aux * self.hidden_size)
        return [CapturedStates(a.to(torch.bfloat16), self._staged_state(s)) for s, a in zip(batch, aux, strict=True)]

    def _staged_state(self, sample) -> torch.Tensor | None:
        if sample.sample_id not in self.staged and self.is_stored(sample.sample_id):
            return None
        return self.staged.get(sample)
