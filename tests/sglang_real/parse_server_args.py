"""Run in the real-sglang environment by tests/test_engines.py: SGLang's own launch_server parser
(sglang.srt.server_args.prepare_server_args) reads the argv on stdin (a JSON list, the interpreter and module left
out), and this prints the settings a hostile value could have changed, as JSON."""

import json
import sys

from sglang.srt.server_args import prepare_server_args

args = prepare_server_args(json.load(sys.stdin))
print(
    json.dumps(
        {
            name: getattr(args, name)
            for name in (
                "host",
                "port",
                "model_path",
                "trust_remote_code",
                "tp_size",
                "model_checksum",
                "reasoning_parser",
            )
        }
    )
)
