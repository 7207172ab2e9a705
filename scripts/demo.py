"""`make demo`: the whole Airflow DAG, end to end, on this machine (SQLite Airflow, CPU, no download).

1. builds the tiny DeepSeek-V3-shaped target (cached in .cache/tiny-target),
2. migrates a throwaway Airflow home in demo-work/airflow (SQLite),
3. runs `airflow dags test eagle3_drafter` with this machine as the box (connection "local"): preflight,
   generate (the tiny target answers the prompts itself, in transformers: the drafter learns the target's own
   answers, as on a real box), extract (2 shards), vocab, train, export, evaluate, report, every stage a
   detached box-side job,
4. prints a summary from the run directory: stage durations, store, vocab, accuracy, acceptance length,
   and where the drafter, its report and plots are. The last line is `run directory: <path>`.

Running it again finds every job of run "demo" finished (about 45 s, all Airflow and Python start-up); delete
demo-work/runs/demo to start over.

    python scripts/demo.py [--state-dtype {bf16,fp8_e4m3}]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from eagle3.demo.tiny_target import BUILD_REPORT, MIN_EXACT_MATCH
from eagle3.disk import layout

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO / ".cache" / "tiny-target"
WORKDIR = REPO / "demo-work"
AIRFLOW = str(Path(sys.executable).with_name("airflow"))

# The trigger's conf: the form's fields (eagle3_airflow/params.py).
CONF = {
    "run_name": "demo",
    "target.model_path": str(TINY_TARGET),
    "data.path": str(TINY_TARGET / "prompts.jsonl"),
    # On the target that answers its prompts (docs/results.md, one seed each): 8 epochs 3.433 / 5.650 at k=3 / 7 in a
    # 1109 s DAG, 5 epochs 3.369 / 5.421 in 916 s, 4 epochs 3.352 / 5.421 in 848 s (93% / 87% of the ceiling): the
    # whole DAG under 15 minutes on 2 cores. Not yet decided over seeds with bench/train_recipe.py.
    "train.epochs": 4,
    "train.learning_rate": 1e-3,
    "evaluate.draft_lengths": [3, 7],
    "box.conn_ids": ["local"],
}
# The deployment's settings for this machine as the box: its facts and the demo's recipe (`run`), how the DAG works
# the box (`box`). Also read by `make airflow`: its trigger form then starts filled in for the tiny target.
RUN = {
    "workdir": str(WORKDIR),
    "target.dtype": "float32",
    "generate.enabled": True,
    "generate.backend": "hf",
    "generate.max_tokens": 64,
    "generate.concurrency": 256,  # transformers' batches: 768 first turns at 683 tokens/s, 556 at 64 (2 CPU cores)
    "generate.progress_interval_s": 10,
    "vocab.draft_vocab_size": 512,
    "extract.batch_tokens": 4096,
    "extract.chunk_mib": 32,
    "extract.num_shards": 2,
    "extract.progress_interval_s": 5,
    "train.batch_tokens": 256,  # a few samples a step: nearly the one-sample default's drafter, 5x faster here
    "train.save_every_steps": 250,  # each validation replays decoding on ~800 conversations
    "train.val_fraction": 0.3,  # its lower half pins the evaluation prompts: enough for an interval of +-0.05 at k=3
    "train.progress_interval_s": 10,
    "evaluate.num_prompts": 1000,
    "evaluate.max_new_tokens": 48,
}
BOX = {
    "python": sys.executable,
    "require_gpus": False,  # a CPU demo: the GPU sensor would wait forever
    "poll_interval_s": 1,
}


def airflow_env(state_dtype: str = "bf16") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    # Also read by `make airflow`: its trigger form then starts filled in for the tiny target on this machine
    # (run_name left empty: each UI run gets its own run directory, named after its DAG id and Airflow run id).
    settings = WORKDIR / "dag-settings.json"
    form_defaults = {key: value for key, value in CONF.items() if key != "run_name"}
    settings.write_text(
        json.dumps(
            {
                "retry_delay_s": 5,
                "params": form_defaults,
                "run": {**RUN, "extract.state_dtype": state_dtype},
                "box": BOX,
            },
            indent=2,
        )
    )
    env.update(
        AIRFLOW_HOME=str(WORKDIR / "airflow"),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
        AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        EAGLE3_DAG_SETTINGS=str(settings),
        PYTHONUNBUFFERED="1",
        # The key run plans are sealed with, as a deployment sets it (docs/deployment.md): no task creates one. A new
        # one each time suits `airflow dags test`, which plans and runs the whole run in this one call.
        AIRFLOW_VAR_EAGLE3_PLAN_SECRET=secrets.token_urlsafe(32),
    )
    return env


class Console:
    """What a person watching `make demo` needs from the task log: one line when a stage's job starts and one
    when it ends (stage, try, box, seconds), the stages' own log lines (progress: done/total, ETA) as they come,
    and for a failed stage the last lines of its job log and where that log is. Airflow's own lines are left
    to the log file."""

    JOB_STARTED = re.compile(r"\] (?:started|attached to) \S+ job (?P<key>\S+) on (?P<box>\S+): try (?P<try>\d+)")
    JOB_ENDED = re.compile(r"\] \[(?P<key>[^\]\s]+)\] ==== eagle3 job \S+ try (?P<try>\d+) (?P<how>(?!started)\w+)")
    STAGE_SAYS = re.compile(
        r"\] \[(?P<key>[^\]\s]+)\] (?:\S+ \S+ (?:INFO|WARNING|ERROR) eagle3[\w.]*: )?"
        r"(?P<message>(?<=: ).*?|error: .*?)\s+\[eagle3_airflow"
    )

    def __init__(self, run_dir: Path, echo: Callable[[str], None] = print):
        self.run_dir, self.echo, self.started = run_dir, echo, {}

    def feed(self, line: str) -> None:
        if match := self.JOB_STARTED.search(line):
            self.started[match["key"]] = time.monotonic()
            self.echo(f"[demo] {match['key']:<10} started on {match['box']} (try {match['try']})")
        elif match := self.JOB_ENDED.search(line):
            seconds = time.monotonic() - self.started.get(match["key"], time.monotonic())
            self.echo(f"[demo] {match['key']:<10} {match['how']} after {seconds:.0f}s (try {match['try']})")
            if match["how"] != "succeeded":
                self.failed(match["key"])
        elif match := self.STAGE_SAYS.search(line):
            stage, message = match["key"].split(".")[0], match["message"]
            self.echo(f"         {message}" if message.startswith(stage) else f"         {match['key']}: {message}")

    def failed(self, key: str) -> None:
        log = self.run_dir / layout.JOBS / key / "log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        self.echo(
            "\n".join(
                [
                    "         last lines of its job log:",
                    *(f"           {t}" for t in tail),
                    f"         the whole job log: {log}",
                ]
            )
        )


def run_dag(conf: dict, run_dir: Path, env: dict[str, str], log_path: Path, echo: Callable[[str], None] = print) -> int:
    """`airflow dags test eagle3_drafter` with the whole task log in `log_path` and a Console view of it (the run
    directory's jobs: `run_dir`) on the console while it runs. Returns the exit code."""
    console = Console(run_dir, echo)
    argv = [AIRFLOW, "dags", "test", "eagle3_drafter", "--conf", json.dumps(conf)]
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as proc,
    ):
        for line in proc.stdout:
            log.write(line)
            log.flush()
            console.feed(line)
    return proc.returncode


def step(what: str, argv: list[str], **kwargs) -> None:
    started = time.monotonic()
    print(f"[demo] {what} ...", flush=True)
    subprocess.run(argv, check=True, **kwargs)
    print(f"[demo] {what}: done in {time.monotonic() - started:.1f}s", flush=True)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--state-dtype",
        choices=("bf16", "fp8_e4m3"),
        default="bf16",
        help="extract.state_dtype: the dtype the store keeps the hidden states in (fp8_e4m3: half the disk, a "
        'scale per token and layer; default %(default)s). Run "demo" keeps the dtype it was extracted with: '
        "delete demo-work/runs/demo to switch",
    )
    return parser.parse_args(argv)


def refuse_a_target_that_did_not_learn(target: Path) -> None:
    """The demo's figures say something about drafting only if the target answers prompts it never saw: a target that
    did not learn its task would have the drafter measured on noise, or on answers learnt by heart."""
    report = read_json(target / BUILD_REPORT)
    matched = report["held_out_exact_match"]
    print(f"[demo] the tiny target answers {matched:.1%} of {report['held_out_prompts']} unseen prompts exactly")
    if matched < MIN_EXACT_MATCH:
        sys.exit(
            f"[demo] {target / BUILD_REPORT}: held_out_exact_match {matched:.3f} is under {MIN_EXACT_MATCH}: the "
            f"target did not learn its task; rebuild it with more steps (python -m eagle3 make-tiny-target "
            f"--train-steps N DIR) and point target.model_path at it"
        )


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    WORKDIR.mkdir(exist_ok=True)
    step("build the tiny target", [sys.executable, "-m", "eagle3", "make-tiny-target", str(TINY_TARGET)])
    refuse_a_target_that_did_not_learn(TINY_TARGET)
    env = airflow_env(args.state_dtype)
    step("migrate the demo's Airflow DB (SQLite)", [AIRFLOW, "db", "migrate"], env=env, stdout=subprocess.DEVNULL)
    step(
        "create the DAG's pool (deferred tasks counted)",
        [sys.executable, "-m", "eagle3_airflow.deployment", "create-pool", "--airflow", AIRFLOW],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    log = WORKDIR / "dag-test.log"
    print(f"[demo] airflow dags test eagle3_drafter (the whole task log goes to {log}):", flush=True)
    run_dir = layout.run_dir_of(WORKDIR, CONF["run_name"])
    returncode = run_dag(CONF, run_dir, env, log, lambda text: print(text, flush=True))
    if returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        sys.exit(f"[demo] the DAG run failed (exit {returncode}); last lines of {log}:\n{tail}")
    print_summary(run_dir, time.monotonic() - started)


def job_seconds(run_dir: Path, key: str) -> str:
    from eagle3.jobs.jobdir import run_seconds

    state = read_json(run_dir / layout.JOBS / key / "state.json")
    seconds = run_seconds(state)
    return f"{seconds:.0f}s (try {state['try']})" if seconds is not None else "?"


def print_summary(run_dir: Path, total_s: float) -> None:
    verify = [sys.executable, "-m", "eagle3", "store", "verify", str(run_dir / layout.HIDDEN_STATES)]
    store = json.loads(subprocess.run(verify, check=True, capture_output=True, text=True).stdout)
    shards = [read_json(p) for p in sorted((run_dir / layout.EXTRACT_DIR).glob("shard-*.stats.json"))]
    vocab = read_json(run_dir / layout.MAPPING_DIR / layout.MAPPING_META)

    print()
    generate = read_json(run_dir / layout.GENERATE_STATS)
    print("stage       duration        figures")
    print(
        f"generate    {job_seconds(run_dir, 'generate'):<15} {generate['regenerated']} conversations answered by the "
        f"target itself ({generate['completion_tokens_now']} tokens, {generate['tokens_per_s']:.0f} tokens/s)"
    )
    print(
        f"extract     {job_seconds(run_dir, 'extract.0'):<15} shard 0; "
        f"{job_seconds(run_dir, 'extract.1')} shard 1; {store['samples']} samples, {store['tokens']} tokens, "
        f"{sum(s.get('duplicates', 0) for s in shards)} duplicate prompts skipped"
    )
    print(
        f"            {'':15} {sum(s['samples_extracted'] for s in shards)} samples extracted, "
        f"{sum(s['samples_stored_before'] for s in shards)} reused from the shared store "
        f"{(run_dir / layout.HIDDEN_STATES).resolve()}"
    )
    print(
        f"store       {'':15} {store['bytes'] / 2**20:.1f} MiB, {store['bytes_per_token']:.1f} bytes/token, "
        f"aux layers {store['aux_layers']}"
    )
    print(
        f"vocab       {job_seconds(run_dir, 'vocab'):<15} draft vocab {vocab.get('draft_vocab_size')} of "
        f"{vocab.get('target_vocab_size')} ids covers {vocab.get('coverage', 0):.2%} of assistant tokens"
    )
    if not (run_dir / layout.REPORT).exists():  # the DAG found nothing new since the current drafter
        print_unchanged(run_dir, total_s)
        return
    train = read_json(run_dir / layout.TRAIN_SUMMARY)
    report = read_json(run_dir / layout.REPORT)
    print(f"train       {job_seconds(run_dir, 'train'):<15} {train['steps']} steps; best step {train['best']['step']}")
    print(
        f"export      {job_seconds(run_dir, 'export'):<15} val acc per position "
        f"{[round(a, 3) for a in report['val_acc_per_position']]}"
    )
    offline = ", ".join(f"k={k} {value:.3f}" for k, value in report["offline_accept_length"].items())
    print(f"            {'':15} offline acceptance length (decoding replayed on the validation split): {offline}")
    served = [
        f"{engine} (reads {reading['ids']} from {reading['reads']}: HF layers {reading['hf_layers']})"
        for engine, reading in (report.get("engines") or {}).items()
        if reading["served"]
    ]
    print(f"            {'':15} serves {', '.join(served) or 'no engine'}")
    for k, result in report["speculative"].items():
        low, high = result["accept_length_interval95"]
        print(
            f"evaluate    {job_seconds(run_dir, 'evaluate'):<15} k={k}: measured acceptance length "
            f"{result['accept_length']:.3f} (95% interval {low:.3f}-{high:.3f}; SGLang's count "
            f"{result['sglang_accept_length']:.3f}, N/S {result['completion_tokens_per_verify_step']:.3f}; first cycle "
            f"{result['first_cycle_accept_length']:.3f}, later {result['later_cycles_accept_length']:.3f}) on "
            f"{report['prompts']} held-out prompts, {result['share_of_ceiling']:.0%} of the ceiling "
            f"{result['ceiling_accept_length']:.3f}; {result['cycles_capped_by_answer_end']}/{result['cycles']} "
            f"verify steps had fewer than {k} answer tokens left; outputs equal to greedy: "
            f"{result['identical_to_greedy']}"
        )
    seen = report["held_out_answers_in_training"]
    print(
        f"            {'':15} held-out answers that training holds: {seen['verbatim']}/{seen['answers']} verbatim, "
        f"{seen['near_duplicates']} more nearly"
    )
    promotion = report["promotion"]
    print(
        f"promotion   {'':15} {'promoted' if promotion['promoted'] else 'not promoted'}: {promotion['reason']}; "
        f"current drafter of the lineage: {promotion.get('current', '-')}"
    )
    print(
        f"target      {'':15} greedy accuracy on the held-out answers "
        f"{report['target_greedy_accuracy_held_out']:.3f} (drafts are accepted only where they match it)"
    )
    disk = sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(run_dir) for f in files)
    print(
        f"total {total_s:.0f}s (the whole DAG, Airflow included); the run directory holds {disk / 2**20:.1f} MiB "
        "besides the store"
    )
    print(
        f'drafter:       {run_dir / layout.DRAFTER_DIR} (serve it with SGLang or vLLM: README, "Serving the drafter")'
    )
    print(f"report:        {run_dir / layout.REPORT}")
    plots = (layout.LOSS_PLOT, layout.ACCURACY_PLOT, layout.ACCEPTANCE_PLOT)
    print(f"plots:         {', '.join(str(run_dir / plot) for plot in plots)}")
    print(f"job logs:      {run_dir / layout.JOBS}/<stage>/log")
    print(f"run directory: {run_dir}")


def print_unchanged(run_dir: Path, total_s: float) -> None:
    check_argv = [sys.executable, "-m", "eagle3", "lineage", "check", "--config", str(run_dir / layout.CONFIG)]
    check = json.loads(subprocess.run(check_argv, check=True, capture_output=True, text=True).stdout)
    figures = ", ".join(f"k={k}: {v:.3f}" for k, v in (check["current_accept_length"] or {}).items())
    print(
        f"train       {'skipped':<15} nothing changed since run {check['unchanged_since']} (same samples, vocab "
        "mapping, settings and seed): training, export and evaluation skipped"
    )
    print(f"drafter     {'':15} the lineage's current one stays: {check['current_drafter']} (measured {figures})")
    print(
        f"total {total_s:.0f}s (the whole DAG, Airflow included). To train anyway: change the seed, or delete "
        f"{Path(check['current_drafter']).parent} to start the lineage over"
    )
    print(f"job logs:      {run_dir / layout.JOBS}/<stage>/log")
    print(f"run directory: {run_dir}")


if __name__ == "__main__":
    main()
