"""What converting stored states to float32 costs on the host, per 4096-token sample at Kimi width (3 x 7168 aux
values per token): the work HiddenStateStore.batch leaves to the device. Prints one line per stored dtype and the
ratio of the two.

    .venv/bin/python bench/state_conversion.py [--tokens 4096] [--width 21504] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3.data.store import dequantize_fp8, quantize_fp8


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults are not the conversion
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=3 * 7168, help="values per token (3 aux layers x H)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    states = torch.randn(args.tokens, args.width)
    bf16 = states.to(torch.bfloat16)
    payload, scales = quantize_fp8(states, 3)
    bf16_s = seconds(lambda: bf16.float(), args.repeats)
    fp8_s = seconds(lambda: dequantize_fp8(payload, scales), args.repeats)
    print(f"{torch.get_num_threads()} threads, {args.tokens} tokens x {args.width} values per sample")
    print(f"bf16 -> float32 on the host: {bf16_s * 1000:.0f} ms per sample")
    print(
        f"fp8 payload x scale -> float32 on the host: {fp8_s * 1000:.0f} ms per sample ({fp8_s / bf16_s:.1f}x bf16's)"
    )


if __name__ == "__main__":
    main()
