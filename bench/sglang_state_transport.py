"""Benchmark: what handing captured hidden states out of SGLang costs per token on the CPU side, at Kimi-K2.5 width:
the public list path against the capture plugin's files (eagle3/capture/sglang_plugin.py).

    python bench/sglang_state_transport.py [--hidden-size 7168 --tokens 2048 --sink /dev/shm]

SGLang 0.5.23 hands captured states to a request as Python lists (scheduler: `.cpu().clone().tolist()`),
which cross process boundaries pickled (ZMQ send_pyobj), and the capture backend turns them back into a
tensor (eagle3.capture.sglang.states_from_output). No GPU is involved in any of that, so this machine can
time it. Per step, tokens/s for one sample of --tokens tokens:
  tolist        bf16 [T, W] tensor -> nested lists (what the scheduler does)
  pickle hop    pickle.dumps + pickle.loads of those lists (one inter-process hop; there may be more)
  to tensor     states_from_output: lists -> fp32 tensor -> bf16 (our side)
  copy          a plain tensor copy of the same bytes, for scale
for the aux pass (W = 3H) and the final-state pass (W = H), and the hours one pass over 87.8M tokens (the
real run's dataset, docs/decisions/2026-12-01-sglang-capture-plugin.md) would spend in these steps alone, on one
core.

The plugin's hand-off, for the same sample, is what happens between the model's output and a tensor the store
takes: the plugin's writer (the request's aux [T, 3H] and final [T, H] rows into one safetensors file in the sink),
and the backend reading it back (shape checks, bf16) and deleting it. Both states, so against both passes of the
list path. The last line is the ratio of the two, per token: `plugin hand-off / list path: NN.Nx`. Figures, not
asserts; the sink is --sink (default /dev/shm where it exists: the run's sink is on the run directory's disk).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "include"))
from eagle3.capture.sglang import SglangCapture, states_from_output  # noqa: E402
from eagle3.capture.sglang_plugin import write_request_states  # noqa: E402

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


def measure_plugin(tokens: int, hidden_size: int, repeats: int, sink: Path) -> dict:
    """The plugin's hand-off of one request: its writer, then the backend's read (and the file's removal)."""
    aux = torch.randn(tokens, 3 * hidden_size).to(torch.bfloat16)
    last = torch.randn(tokens, hidden_size).to(torch.bfloat16)
    reader = object.__new__(SglangCapture)  # only _read_states' two attributes are needed
    reader.num_aux, reader.hidden_size = 3, hidden_size

    def hand_off():
        path = write_request_states(sink, "bench-0", aux, last)
        reader._read_states(path, tokens)
        path.unlink()

    seconds = timed(hand_off, repeats)
    return {
        "sink": str(sink),
        "file_bytes_per_token": (4 * hidden_size) * 2,
        "tokens_per_s": round(tokens / seconds),
        "hours_for_real_run": round(REAL_RUN_TOKENS / (tokens / seconds) / 3600, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=7168, help="Kimi-K2.5 / DeepSeek-V3: 7168")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the timed sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sink",
        type=Path,
        default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None,
        help="directory for the plugin's files (default /dev/shm, else a temporary directory)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the scheduler's conversion runs on one thread
    h = args.hidden_size
    report = {
        "hidden_size": h,
        "tokens": args.tokens,
        "aux_pass": measure(args.tokens, 3 * h, args.repeats),
        "final_state_pass": measure(args.tokens, h, args.repeats),
    }
    with tempfile.TemporaryDirectory(dir=args.sink) as sink:
        report["plugin_hand_off"] = measure_plugin(args.tokens, h, args.repeats, Path(sink))
    # Per token, both states: the list path needs both passes, the plugin one file.
    aux_pass, final_pass = (report[name]["list_path_tokens_per_s"] for name in ("aux_pass", "final_state_pass"))
    list_path = 1 / (1 / aux_pass + 1 / final_pass)
    report["list_path_both_passes_tokens_per_s"] = round(list_path)
    print(json.dumps(report, indent=2))
    print(f"plugin hand-off / list path: {report['plugin_hand_off']['tokens_per_s'] / list_path:.1f}x")


if __name__ == "__main__":
    main()
