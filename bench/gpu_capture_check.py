"""Check a box's sglang against the hf reference, in one command (needs a GPU and sglang).

    python bench/gpu_capture_check.py --model /models/Llama-3.2-1B-Instruct [--prompts FILE] [--samples 16]

Captures the same samples with the hf backend (transformers on cuda) and with the sglang backend over each of
its capture paths (--paths, default both): `plugin`, the capture plugin (one engine, states as files; insisted
on, so a plugin that cannot run is an error here, not a fallback), and `lists`, SGLang's public return path (two
engines in turn). Prints, per path, per aux layer and for the final state: max |diff|, mean cosine similarity,
and whether everything agrees (cosine >= 0.99 everywhere). Run it after installing a new sglang version before
extracting a real dataset: a layer-id or post-norm mismatch shows up as a low cosine. Exit status 1 if any path
disagrees. Without --prompts it uses a few built-in conversations.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

BUILTIN = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Sort 5 2 9 1."}, {"role": "assistant", "content": "1 2 5 9."}],
    [
        {"role": "user", "content": "Write a haiku about GPUs."},
        {
            "role": "assistant",
            "content": "Silicon rivers / carry warm light through the night / tensors bloom and fade",
        },
    ],
]


def main() -> None:
    from eagle3.capture.hf import HfCapture
    from eagle3.capture.sglang import SglangCapture
    from eagle3.config import parse_run_config
    from eagle3.data.samples import SampleTokenizer, read_conversations
    from eagle3.target import resolve_target_facts

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", help="JSONL conversations (ShareGPT or OpenAI form)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--device", default="cuda", help="for the hf reference (default cuda)")
    parser.add_argument("--paths", default="plugin,lists", help="sglang capture paths to check (default both)")
    args = parser.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]

    with tempfile.TemporaryDirectory() as tmp:
        prompts = args.prompts
        if prompts is None:
            prompts = str(Path(tmp) / "prompts.jsonl")
            Path(prompts).write_text("".join(json.dumps({"messages": m}) + "\n" for m in BUILTIN))
        base = {
            "run_name": "gpu-capture-check",
            "workdir": tmp,
            "target": {"model_path": str(Path(args.model).resolve()), "trust_remote_code": args.trust_remote_code},
            "data": {"path": str(Path(prompts).resolve()), "max_samples": args.samples},
            "vocab": {"draft_vocab_size": 1},
        }
        hf_cfg = resolve_target_facts(parse_run_config({**base, "extract": {"backend": "hf", "device": args.device}}))
        conversations, _ = read_conversations(hf_cfg.data.path, max_samples=args.samples)
        samples = list(SampleTokenizer.for_run(hf_cfg).iter(conversations))

        hf = HfCapture(hf_cfg)
        reference = [hf.capture([s])[0] for s in samples]
        hf.close()
        del hf
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        candidates = {}
        for path in paths:  # one engine at a time
            engine = {"tp_size": args.tp_size, "capture": path}
            sgl_cfg = resolve_target_facts(
                parse_run_config(
                    {
                        **base,
                        "run_name": f"gpu-capture-check-{path}",
                        "extract": {"backend": "sglang", "sglang": engine},
                    }
                )
            )
            sglang = SglangCapture(sgl_cfg)
            sglang.prepare([samples], len(samples))  # plugin: start and probe; lists: the final-state pass
            candidates[path] = sglang.capture(samples)
            sglang.close()

    report = {path: compare(reference, candidate, hf_cfg) for path, candidate in candidates.items()}
    agree = all(layer["mean_cosine"] >= 0.99 for layers in report.values() for layer in layers.values())
    print(json.dumps({"samples": len(samples), "paths": report, "agree": agree}, indent=2))
    sys.exit(0 if agree else 1)


def compare(reference, candidate, cfg) -> dict:
    """Per aux layer and for the final state: max |diff| and mean cosine of one path's states against hf's."""
    h = cfg.target.hidden_size
    names = [f"aux layer {i}" for i in cfg.resolved_aux_layers()] + ["final (post-norm)"]
    report = {}
    for k, name in enumerate(names):
        diffs, cosines = [], []
        for ref, cand in zip(reference, candidate):
            a = ref.aux_hidden_states if k < 3 else ref.last_hidden_state
            b = cand.aux_hidden_states if k < 3 else cand.last_hidden_state
            if k < 3:
                a, b = a[:, k * h : (k + 1) * h], b[:, k * h : (k + 1) * h]
            a, b = a.float(), b.float()
            diffs.append((a - b).abs().max().item())
            cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item())
        report[name] = {"max_abs_diff": max(diffs), "mean_cosine": sum(cosines) / len(cosines)}
    return report


if __name__ == "__main__":
    main()
