"""Run in the vLLM environment by tests/test_engines.py: vLLM's own completion request model reads each request body
of the JSON list on stdin as its OpenAI server would, and this prints the sampling it makes of each, and any field it
does not know (which the server would ignore with a warning), as a JSON list."""

import json
import sys

from vllm.entrypoints.openai.completion.protocol import CompletionRequest

read = []
for body in json.load(sys.stdin):
    params = CompletionRequest.model_validate(body).to_sampling_params(max_tokens=body["max_tokens"])
    read.append(
        {
            "unknown": sorted(set(body) - set(CompletionRequest.model_fields)),
            **{name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "seed", "max_tokens")},
        }
    )
print(json.dumps(read))
