"""Run in the SGLang environment by tests/test_engines.py: SGLang's own SamplingParams reads the sampling_params of
each /generate request body of the JSON list on stdin and checks them as its tokenizer manager does, and this prints
what it made of each as a JSON list (a field it does not know fails here, as it fails the request)."""

import json
import sys

from sglang.srt.sampling.sampling_params import SamplingParams

read = []
for body in json.load(sys.stdin):
    params = SamplingParams(**body["sampling_params"])
    params.verify(vocab_size=1000)
    read.append(
        {name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "sampling_seed", "max_new_tokens")}
    )
print(json.dumps(read))
