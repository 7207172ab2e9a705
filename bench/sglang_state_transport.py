"""Benchmark: what SGLang's public hidden-state path costs per token on the CPU side, at Kimi-K2.5 width.

    python bench/sglang_state_transport.py [--hidden-size 7168 --tokens 4096]

SGLang 0.5.23 hands captured states to a request as Python lists (scheduler: `.cpu().clone().tolist()`),
which cross process boundaries pickled (ZMQ send_pyobj), and the capture backend turns them back into a
tensor (eagle3.capture.sglang.states_from_output). No GPU is involved in any of that, so this machine can
time it. Per step, tokens/s for one sample of --tokens tokens:
  tolist        bf16 [T, W] tensor -> nested lists (what the scheduler does)
  pickle hop    pickle.dumps + pickle.loads of those lists (one inter-process hop; there may be more)
  to tensor     states_from_output: lists -> fp32 tensor -> bf16 (our side)
  copy          a plain tensor copy of the same bytes, for scale
for the aux pass (W = 3H) and the final-state pass (W = H), and the hours one pass over 87.8M tokens (the
real run's dataset, ARCHITECTURE.md) would spend in these steps alone, on one core. Figures, not asserts.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "include"))
from eagle3.capture.sglang import states_from_output  # noqa: E402

REAL_RUN_TOKENS = 87.8e6


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(tokens: int, width: int, repeats: int) -> dict:
    states = torch.randn(tokens, width).to(torch.bfloat16)
    rows = states.clone().tolist()
    blob = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
    output = {"meta_info": {"hidden_states": [rows]}}
    seconds = {
        "tolist": timed(lambda: states.clone().tolist(), repeats),
        "pickle_hop": timed(lambda: pickle.loads(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)), repeats),
        "to_tensor": timed(lambda: states_from_output(output, tokens, width).to(torch.bfloat16), repeats),
        "copy": timed(lambda: states.clone(), repeats),
    }
    list_path = seconds["tolist"] + seconds["pickle_hop"] + seconds["to_tensor"]
    return {
        "width": width,
        "pickled_bytes_per_token": round(len(blob) / tokens),
        "tensor_bytes_per_token": width * 2,
        "tokens_per_s": {step: round(tokens / s) for step, s in seconds.items()},
        "list_path_tokens_per_s": round(tokens / list_path),
        "list_path_hours_for_real_run": round(REAL_RUN_TOKENS / (tokens / list_path) / 3600, 1),
        "list_path_vs_copy": round(list_path / seconds["copy"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=7168, help="Kimi-K2.5 / DeepSeek-V3: 7168")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the timed sample")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the scheduler's conversion runs on one thread
    h = args.hidden_size
    report = {
        "hidden_size": h,
        "tokens": args.tokens,
        "aux_pass": measure(args.tokens, 3 * h, args.repeats),
        "final_state_pass": measure(args.tokens, h, args.repeats),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
