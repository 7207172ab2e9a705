"""Run in the vLLM environment by tests/test_engines.py: vLLM's own OpenAI-server parser reads the argv on stdin (a
JSON list, the interpreter and module left out), and this prints the settings a hostile value could have changed, as
JSON."""

import json
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.load(sys.stdin))
print(
    json.dumps(
        {
            name: getattr(args, name)
            for name in (
                "host",
                "port",
                "model",
                "trust_remote_code",
                "tensor_parallel_size",
                "reasoning_parser",
                "speculative_config",
            )
        },
        default=str,
    )
)
