"""The sglang capture backend: SGLang's own EAGLE-3 capture for TP-sharded giants, with no source patch.

Written against sglang 0.5.23's source (see ../shared notes in docs/architecture.md) and NOT yet run on
a GPU: bench/gpu_capture_check.py compares it with the hf backend on a small model, in one command.

How it captures, through public engine arguments only:
  aux states   an Engine with enable_return_aux_hidden_states=True + speculative_algorithm="EAGLE3"
               (the algorithm only names the capture convention: no draft is loaded) and
               return_aux_hidden_state_layer_ids from eagle3.layer_ids (per-family id conversion).
               A request with return_hidden_states=True then gets [T, 3H], layers in ascending order.
  last state   that engine cannot also return the final post-norm state (sglang keeps it for
               in-process consumers only), so a second Engine without aux capture, with
               enable_return_hidden_states=True, returns it. Both engines hold the weights: this fits
               targets up to about half the box's memory, not Kimi-K2.5 on 8 GPUs (open problem,
               noted on the issue).
Every request asks for max_new_tokens=1 (0 returns no states in 0.5.23), with the radix cache off
(cached prefix tokens return no states) and chunked prefill off (only the last chunk returns states).
States travel as Python lists through sglang's IPC: correct, slow at Kimi scale; measure before relying
on it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eagle3.capture import CapturedStates
from eagle3.layer_ids import sglang_layer_ids

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ">=0.5.23,<0.6"  # written for 0.5.23; the capture flags may move in 0.6
# Engine arguments this backend sets for capture to work; extract.sglang.extra_args may not override them.
CAPTURE_ARGS = (
    "skip_tokenizer_init", "disable_radix_cache", "chunked_prefill_size", "enable_return_aux_hidden_states",
    "speculative_algorithm", "return_aux_hidden_state_layer_ids", "enable_return_hidden_states",
)


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


def engine_kwargs(cfg, architecture: str, capture: str) -> dict:
    """Engine arguments for the 'aux' or the 'last' capture engine, from the run config."""
    engine = cfg.extract.sglang
    clash = sorted(set(engine.extra_args) & set(CAPTURE_ARGS))
    if clash:
        raise SglangSetupError(f"extract.sglang.extra_args: {clash} are set by the capture backend; remove them")
    kwargs = {
        "model_path": cfg.target.model_path,
        "tokenizer_path": cfg.tokenizer_dir,
        "trust_remote_code": cfg.target.trust_remote_code,
        "dtype": cfg.target.dtype,
        "tp_size": engine.tp_size,
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
        kwargs["mem_fraction_static"] = engine.mem_fraction_static / 2  # two engines share the GPUs
    if engine.attention_backend is not None:
        kwargs["attention_backend"] = engine.attention_backend
    return kwargs | dict(engine.extra_args)


def states_from_output(output: dict, num_tokens: int, width: int) -> torch.Tensor:
    """The prefill rows of one Engine.generate result as a [num_tokens, width] tensor."""
    rows = output["meta_info"]["hidden_states"][0]
    states = torch.tensor(rows, dtype=torch.float32)
    if states.shape != (num_tokens, width):
        raise RuntimeError(
            f"sglang returned hidden states of shape {tuple(states.shape)} for a {num_tokens}-token prompt, "
            f"expected ({num_tokens}, {width}); is the radix cache or chunked prefill on?"
        )
    return states


class SglangCapture:
    def __init__(self, cfg, engine_factory=None):
        if engine_factory is None:
            try:
                import sglang
            except ImportError:
                raise SglangSetupError(
                    "extract.backend is 'sglang' but sglang is not installed on this box; "
                    "pip install -r requirements-box.txt, or use extract.backend 'hf'"
                ) from None
            check_version(sglang.__version__)
            engine_factory = sglang.Engine
        architecture = target_architecture(cfg.target.model_path)
        self.hidden_size = cfg.target.hidden_size
        self.num_aux = len(cfg.resolved_aux_layers())
        aux_kwargs = engine_kwargs(cfg, architecture, "aux")
        log.info("sglang capture: aux engine %s", aux_kwargs)
        self.aux_engine = engine_factory(**aux_kwargs)
        self.last_engine = engine_factory(**engine_kwargs(cfg, architecture, "last"))

    def capture(self, batch) -> list[CapturedStates]:
        prompts = [list(s.input_ids) for s in batch]
        params = {"max_new_tokens": 1, "temperature": 0.0}
        aux_out = self.aux_engine.generate(input_ids=prompts, sampling_params=params, return_hidden_states=True)
        last_out = self.last_engine.generate(input_ids=prompts, sampling_params=params, return_hidden_states=True)
        h = self.hidden_size
        return [
            CapturedStates(
                states_from_output(a, len(p), self.num_aux * h).to(torch.bfloat16),
                states_from_output(b, len(p), h).to(torch.bfloat16),
            )
            for p, a, b in zip(prompts, aux_out, last_out, strict=True)
        ]

    def close(self) -> None:
        for engine in (self.aux_engine, self.last_engine):
            engine.shutdown()
