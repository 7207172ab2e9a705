"""Serving engines behind one small interface: SGLang (the GPU box's engine) and vLLM (which also runs on a CPU).

generate (generate.launch_server), evaluate (evaluate.backend "server") and benchmark start the target with one,
with or without the drafter, and talk to it the same way; `server.engine` in the run config picks it:

    engine = engine_for(cfg)
    with serving(cfg, log_path, Speculation(drafter_dir, draft_length=3)) as base_url:   # eagle3.server
        completion = await engine.complete(client, base_url, prompt_ids, max_new_tokens)

Each engine says how it is launched (an argv of `--name=value` tokens, nothing a later token could re-read as a
flag) and how a greedy completion of token ids comes back with what speculation did, counted the one way this
project counts: drafts that reached the output. Engines also count drafts they verified after the stop token (or
past max_tokens), which their schedulers then cut; those are not accepted for anyone reading the answer.

Light on purpose (no torch): the DAG's plugins may import eagle3.config, which names the engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Speculation:
    """A drafter the server loads: greedy chains of `draft_length` tokens, verified in one step."""

    drafter: Path
    draft_length: int


@dataclass
class Completion:
    """One greedy answer. With speculation: its verify steps, and the drafts of each that reached the output (where
    the engine reports steps) or only their sum (where it reports totals)."""

    output_ids: list[int]
    verify_steps: int | None = None
    accepted_per_step: list[int] | None = None
    accepted: int | None = None


def reached_per_step(accepted_per_step: list[int], output_length: int) -> list[int]:
    """The drafts of each verify step that reached an answer of `output_length` tokens. Step i commits its accepted
    drafts and then the target's own token; prefill committed the answer's first. A stop token among the drafts (or
    max_tokens) cuts the answer there, and what the engine accepted after it never reached anyone."""
    reached, position = [], 1
    for accepted in accepted_per_step:
        reached.append(max(0, min(accepted, output_length - position)))
        position += accepted + 1
    return reached


def reached_total(accepted: int, output_length: int, verify_steps: int) -> int:
    """The same from totals alone. An answer of N tokens after S verify steps holds N - 1 - S drafts when its last
    token was a step's own (a stop token the target chose, or the cut at max_tokens), N - S when it was a draft (the
    last step committed no token of its own). Drafts verified past the end show as more than that: capped."""
    return min(accepted, output_length - verify_steps)


def engine_for(cfg):
    """The engine of the run config's `server.engine`."""
    from eagle3.engines.sglang import SglangEngine
    from eagle3.engines.vllm import VllmEngine

    return {"sglang": SglangEngine, "vllm": VllmEngine}[cfg.server.engine]()


def flag_tokens(flags: dict) -> list[str]:
    """`--name=value` per flag (a bare `--name` for true, nothing for false or None): one argv element per flag, so no
    value is ever read as a flag of its own, whatever it holds."""
    tokens = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        tokens.append(f"--{name}" if value is True else f"--{name}={value}")
    return tokens


# What the engines' DeepSeek-V2/V3 code reads from a target's config.json with no default, or with one that differs
# from what transformers computes (read in sglang 0.5.23 models/deepseek_v2.py and vllm 0.32
# model_executor/models/deepseek_v2.py). DeepSeek-V3's and Kimi-K2.5's own config.json carry them all; a config
# written by transformers' DeepseekV3Config (a converted or home-made checkpoint) lacks the first three.
SERVED_CONFIG_FIELDS = {
    "deepseek": {
        "topk_method": "SGLang reads it with no default; vLLM without \"noaux_tc\" creates no "
                       "gate.e_score_correction_bias and fails to load the weights",
        "scoring_func": "SGLang reads it with no default; vLLM falls back to softmax where transformers routes by "
                        "sigmoid",
        "moe_layer_freq": "SGLang reads it with no default",
        "n_group": "SGLang reads it with no default",
        "topk_group": "SGLang reads it with no default",
        "norm_topk_prob": "both read it with no default",
        "routed_scaling_factor": "SGLang reads it with no default; vLLM falls back to 1.0",
    },
}


def served_config_gaps(text_config: dict, architecture: str) -> dict[str, str]:
    """The fields of a target's (text) config.json that the serving engines need and it lacks: name -> what
    happens without it. Empty for families whose engine code this project has not read."""
    from eagle3.layer_ids import DEEPSEEK_FAMILY

    fields = SERVED_CONFIG_FIELDS["deepseek"] if architecture in DEEPSEEK_FAMILY else {}
    return {name: why for name, why in fields.items() if name not in text_config}
