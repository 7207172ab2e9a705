"""SGLang: `python -m sglang.launch_server`, completions through its native POST /generate: greedy, or sampled with a
seed per request.

/generate takes the prompt as token ids and its meta_info reports what speculation did per request:
spec_verify_ct (verify steps), spec_num_correct_drafts and completion_tokens (sglang 0.5.23,
managers/tokenizer_manager.py). Totals only, no per-step record: per-position rates and the first cycle cannot be
told apart from SGLang's answer. Its counter includes drafts verified after a stop token (its scheduler accepts on
the GPU and cuts the answer afterwards, managers/scheduler_components/batch_result_processor.py), so the drafts that
reached the output are recovered from the answer's length (eagle3.engines.reached_total).

The drafter is served with --speculative-algorithm EAGLE3 (EAGLE loads the same files and silently gives accept
length 1) as a chain: eagle-topk 1, num-steps k, num-draft-tokens k + 1.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import httpx

from eagle3.config import ConfigError, RunConfig
from eagle3.engines.base import GREEDY, Completion, Sampling, Speculation, flag_tokens, reached_total


class SglangEngine:
    name = "sglang"

    def launch_argv(
        self, cfg: RunConfig, speculation: Speculation | None = None, tree: dict | None = None
    ) -> list[str]:
        """The server's argv: the run config's settings, server.extra_args, then the drafter's flags. `tree`
        (benchmark: num_steps, eagle_topk, num_draft_tokens) replaces the chain's shape."""
        server = cfg.server
        flags = {
            "model-path": cfg.target.model_path,
            "tokenizer-path": cfg.target.tokenizer_path,
            "host": "127.0.0.1",
            "port": server.port,
            "tp-size": server.tp_size,
            "dtype": cfg.target.dtype,
            "mem-fraction-static": server.mem_fraction_static,
            "trust-remote-code": cfg.target.trust_remote_code,
            **server.extra_args,
        }
        if speculation is not None:
            shape = tree or {
                "num_steps": speculation.draft_length,
                "eagle_topk": 1,
                "num_draft_tokens": speculation.draft_length + 1,
            }
            flags |= {
                "speculative-algorithm": "EAGLE3",
                "speculative-draft-model-path": str(speculation.drafter),
                "speculative-num-steps": shape["num_steps"],
                "speculative-eagle-topk": shape["eagle_topk"],
                "speculative-num-draft-tokens": shape["num_draft_tokens"],
            }
        return [*self.interpreter(cfg), *flag_tokens(flags)]

    def interpreter(self, cfg: RunConfig) -> list[str]:
        launcher = os.environ.get("EAGLE3_SERVER_LAUNCHER")  # tests: a stand-in, since SGLang cannot run on a CPU
        python = cfg.server.python or sys.executable
        if launcher:
            return [python, launcher]
        if not cfg.server.python and importlib.util.find_spec("sglang") is None:
            raise ConfigError(
                "server.python",
                f"sglang is not installed for {sys.executable}",
                "install it on the box (pip install -r requirements-box.txt), or name the interpreter that has it",
            )
        return [python, "-m", "sglang.launch_server"]

    async def complete(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        seed: int | None = None,
    ) -> Completion:
        drawn = (
            {} if sampling.greedy else {"top_p": sampling.top_p, "top_k": sampling.top_k or -1, "sampling_seed": seed}
        )
        response = await client.post(
            f"{base_url}/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"temperature": sampling.temperature, "max_new_tokens": max_new_tokens, **drawn},
            },
        )
        response.raise_for_status()
        answer = response.json()
        meta = answer["meta_info"]
        output = list(answer.get("output_ids") or [])
        steps = meta.get("spec_verify_ct")
        if not steps:
            return Completion(output)
        correct = meta.get("spec_num_correct_drafts")
        if correct is None:  # an older SGLang: only completion tokens and verify steps
            correct = meta["completion_tokens"] - 1 - steps
        return Completion(output, verify_steps=steps, accepted=reached_total(correct, meta["completion_tokens"], steps))
