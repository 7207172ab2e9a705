"""Command line of the box side: `python -m eagle3 <command> ...`. Each command: parse, load, call one function.

Stages read everything from the run config (`--config RUN_DIR/config.json`); no user value is ever
passed on a command line except paths.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

from eagle3.config import ConfigError, load_run_config, parse_run_config, resolve_target_facts, write_run_config

log = logging.getLogger("eagle3")


def cmd_make_tiny_target(args) -> None:
    from eagle3.tiny_target import TinyTargetSpec, build

    spec = TinyTargetSpec(
        hidden_size=args.hidden_size, num_layers=args.num_layers, moe=not args.dense,
        train_steps=args.train_steps, num_prompts=args.num_prompts, seed=args.seed,
    )
    print(build(Path(args.dir), spec))


def cmd_init(args) -> None:
    source = Path(args.config)
    try:
        draft = json.loads(source.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{source}: cannot read it as JSON ({err})") from None
    cfg = resolve_target_facts(parse_run_config(draft, str(source)))
    print(write_run_config(cfg))


def cmd_config_schema(args) -> None:
    from eagle3.config import RunConfig

    print(json.dumps(RunConfig.model_json_schema(), indent=2))


def cmd_extract(args) -> None:
    from eagle3.extract import run_extract

    cfg = resolve_target_facts(load_run_config(args.config))
    print(json.dumps(run_extract(cfg, shard=args.shard, num_shards=args.num_shards), indent=2))


# Stages that take only the run config: name -> (module, function, help, description). Each prints its
# result as JSON on stdout (its log goes to stderr).
STAGES = {
    "vocab": (
        "eagle3.vocab", "run_vocab",
        "build the draft/target vocab mapping from the store (or reuse one after a coverage check)",
        "The mapping is data-dependent: the draft vocab is the target ids the store's assistant tokens use "
        "most. vocab.reuse_from reuses another run's mapping only if it covers at least vocab.min_coverage "
        "of this store's loss-masked tokens.",
    ),
    "train": (
        "eagle3.train", "run_train",
        "train the drafter with training-time test (resumes from the newest checkpoint)",
        "One rank per train.gpus entry (or train.nproc_per_node); with several, it re-runs itself under "
        "torchrun (DDP: nccl, gloo on CPU). Safe to kill and rerun: it continues from the newest checkpoint, "
        "bit-identically.",
    ),
    "export": (
        "eagle3.export", "run_export",
        "write the best checkpoint as an SGLang EAGLE3 drafter (RUN_DIR/drafter)",
        "Serve the result with: python -m sglang.launch_server --model-path TARGET --speculative-algorithm "
        "EAGLE3 --speculative-draft-model-path RUN_DIR/drafter --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
    ),
    "evaluate": (
        "eagle3.evaluate", "run_evaluate",
        "measure acceptance length: speculative decoding with the exported drafter on the HF target",
        "Writes RUN_DIR/evaluate/report.json and acceptance.png.",
    ),
}


def cmd_stage(args) -> None:
    if args.command == "train":
        from eagle3.train import launch_command

        launch = launch_command(resolve_target_facts(load_run_config(args.config)), args.config)
        if launch is not None:  # several ranks: become torchrun, which runs this command once per rank
            os.execvpe(launch[0][0], launch[0], launch[1])
    module, function = STAGES[args.command][:2]
    run = getattr(importlib.import_module(module), function)
    result = run(resolve_target_facts(load_run_config(args.config)))
    if result:  # under torchrun only rank 0 returns a summary
        print(json.dumps(result, indent=2))


def cmd_store_verify(args) -> None:
    from eagle3.store import verify

    print(json.dumps(verify(args.dir), indent=2))


def cmd_store_digest(args) -> None:
    from eagle3.store import digest

    print(digest(args.dir))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-tiny-target", help="build the tiny DeepSeek-V3-shaped target (no download)")
    p.add_argument("dir", help="output directory; reused if already built with the same arguments")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--dense", action="store_true", help="dense MLP in every layer (no MoE); for I/O benchmarks")
    p.add_argument("--train-steps", type=int, default=150, help="0: untrained weights (enough for I/O benchmarks)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_target)

    p = sub.add_parser("init", help="validate a run config, fill in the target's facts, write RUN_DIR/config.json")
    p.add_argument("--config", required=True, help="a run config JSON (see `config schema`)")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("config", help="run-config tools")
    config_sub = p.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    config_sub.add_parser("schema", help="print the run config's JSON schema").set_defaults(func=cmd_config_schema)

    p = sub.add_parser(
        "extract",
        help="capture the target's EAGLE-3 hidden states into the store (resumable)",
        description="Capture hidden states for one shard. Safe to kill and rerun: stored samples are skipped.",
    )
    p.add_argument("--config", required=True, help="RUN_DIR/config.json")
    p.add_argument("--shard", type=int, default=0, help="which shard this process extracts (0-based)")
    p.add_argument("--num-shards", type=int, default=None, help="default: extract.num_shards from the config")
    p.set_defaults(func=cmd_extract)

    for name, (_, _, help_text, description) in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=description)
        p.add_argument("--config", required=True, help="RUN_DIR/config.json")
        p.set_defaults(func=cmd_stage)

    p = sub.add_parser("store", help="inspect a hidden-state store")
    store_sub = p.add_subparsers(dest="store_command", required=True, metavar="SUBCOMMAND")
    v = store_sub.add_parser("verify", help="check every chunk against the manifest; print JSON stats")
    v.add_argument("dir", help="the store directory (RUN_DIR/hidden_states)")
    v.set_defaults(func=cmd_store_verify)
    d = store_sub.add_parser("digest", help="sha256 over all samples in id order (equal digests = equal content)")
    d.add_argument("dir", help="the store directory (RUN_DIR/hidden_states)")
    d.set_defaults(func=cmd_store_digest)
    return parser


def main(argv: list[str] | None = None) -> int:
    from eagle3.data import DataError
    from eagle3.layer_ids import LayerIdError
    from eagle3.vocab import VocabError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, DataError, LayerIdError, VocabError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from eagle3.store import StoreError  # torch-heavy: import only when needed

        if isinstance(err, StoreError):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
