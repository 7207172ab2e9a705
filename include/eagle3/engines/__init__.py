"""Serving engines behind one small interface: SGLang (the GPU box's engine) and vLLM (which also runs on a CPU).

generate (generate.launch_server), evaluate (evaluate.backend "server") and benchmark start the target with one,
with or without the drafter, and talk to it the same way; `server.engine` in the run config picks it:

    engine = engine_for(cfg)
    with serving(cfg, log_path, Speculation(drafter_dir, draft_length=3)) as base_url:   # eagle3.engines.server
        completion = await engine.complete(client, base_url, prompt_ids, max_new_tokens)

Each engine says how it is launched (an argv of `--name=value` tokens, nothing a later token could re-read as a
flag) and how a completion of token ids (greedy, or sampled: Sampling) comes back with what speculation did,
counted the one way this project counts: drafts that reached the output. Engines also count drafts they verified
after the stop token (or past max_tokens), which their schedulers then cut; those are not accepted for anyone
reading the answer.

Light on purpose (no torch): the DAG's plugins may import eagle3.config, which names the engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3.engines.base import (
    GREEDY,
    Completion,
    Sampling,
    Speculation,
    flag_tokens,
    reached_per_step,
    reached_total,
)
from eagle3.engines.sglang import SglangEngine
from eagle3.engines.vllm import VllmEngine
from eagle3.model.layer_ids import DEEPSEEK_FAMILY

if TYPE_CHECKING:
    from eagle3.config import RunConfig

__all__ = [
    "GREEDY",
    "Completion",
    "Sampling",
    "Speculation",
    "engine_for",
    "flag_tokens",
    "reached_per_step",
    "reached_total",
    "served_config_gaps",
]


def engine_for(cfg: RunConfig):
    """The engine of the run config's `server.engine`."""
    return {"sglang": SglangEngine, "vllm": VllmEngine}[cfg.server.engine]()


# What the engines' DeepSeek-V2/V3 code reads from a target's config.json with no default, or with one that differs
# from what transformers computes (read in sglang 0.5.23 models/deepseek_v2.py and vllm 0.32
# model_executor/models/deepseek_v2.py). DeepSeek-V3's and Kimi-K2.5's own config.json carry them all; a config
# written by transformers' DeepseekV3Config (a converted or home-made checkpoint) lacks the first three.
SERVED_CONFIG_FIELDS = {
    "deepseek": {
        "topk_method": 'SGLang reads it with no default; vLLM without "noaux_tc" creates no '
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
    fields = SERVED_CONFIG_FIELDS["deepseek"] if architecture in DEEPSEEK_FAMILY else {}
    return {name: why for name, why in fields.items() if name not in text_config}
