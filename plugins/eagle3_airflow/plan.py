"""The run plan: what every task of one DAG run needs to know, the run config included, made once by validate.

It travels between tasks as XCom (a plain dict: paths, connection ids, thresholds, the validated run config; never a
secret), so the remote-job operator and the sensors do not re-read params, and a retried task sees exactly what its
first try saw.

One plan, validated once per side: validate checks the trigger against the deployment's settings and validates the
run config (the control plane's only validation of it); the box validates the config once more in `eagle3 init`.
What a later task needs from the settings travels in the plan too (the reports store, keep_runs), so a run in flight
keeps the settings it was validated with, whatever the settings file says by then and whichever worker parsed which
version of it: no task reads the settings file (eagle3_airflow/deployment.py says how to stop a run in flight).

XCom is writable by whoever may trigger the DAG, so the plan is sealed (eagle3_airflow/seal.py) and bound to its run.
Every task reads it through `verified_plan`: the seal must hold for this run, and the plan must have the fields this
code needs. `RunPlan.from_trusted` is for what did not come through XCom: a plan built here, or the one a verified
task handed to its trigger.

Keys the plan does not know are tolerated once the seal holds: the seal proves this deployment's validate wrote
them (newer code, and this worker runs older code after a rollback), and a key that is not a field changes nothing
this code does. An unsealed plan is refused whole, known keys or not.
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, asdict, dataclass, field, fields

from airflow.sdk.exceptions import AirflowFailException

from eagle3.config import RunConfig
from eagle3.runlayout import REDO_OUTPUTS
from eagle3_airflow.codesync import code_dir, ensure_code, package_archive
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import BoxSettings
from eagle3_airflow.seal import TRIGGER_AGAIN, RunRef, Tampered, is_sealed, seal, task_key
from eagle3_airflow.transport import Box, box_for

log = logging.getLogger(__name__)
# The remote stages a run may redo (box.redo_from), in pipeline order: redoing one redoes every later one, so that no
# output is left from before the redo beside one made after it. (generate and extract write shared stores, keyed by
# what decides them: a redo there would be another key, or deleting the store.)
# What each writes in the run directory, which a redo renames aside (job start --set-aside): runlayout.REDO_OUTPUTS.
REDO_ORDER = tuple(REDO_OUTPUTS)
PLAN_XCOM = "the run plan in XCom (task `validate`, key `plan`)"
# Keys of plans made by older code that this code reads no more: ignored without a warning. config_sha256 was the
# digest of the run config validate kept beside the plan, before the plan carried the config itself.
RETIRED_KEYS = {"config_sha256"}


@dataclass(frozen=True)
class RunPlan:
    run_name: str
    workdir: str
    run_dir: str
    conn_ids: list[str]
    python: str
    num_shards: int
    generate: bool
    benchmark: bool
    require_gpus: bool
    gpu_max_used_mib: int
    stop_services: list[str] = field(default_factory=list)
    disk_margin: float = 1.2
    poll_interval_s: float = 10.0
    ssh_grace_s: float = 900.0
    stale_after_s: float = 120.0
    stall_timeout_s: float = 900.0
    first_progress_timeout_s: float = 3600.0
    stage_timeout_h: float = 168.0
    gpus_per_shard: int = 1  # extract: 1 (hf, device auto), tp_size (sglang), 0 (hf on a device the user named)
    train_gpus: int = 1  # GPUs the first box must have for training: highest train.gpus index + 1, or its ranks
    server_gpus: int = 0  # server.tp_size when the run starts SGLang servers (generate, benchmark) on the first box
    box_env: list[str] = field(default_factory=list)  # box variables the stages get besides job.py's built-in ones
    # The package digest the run was validated with; every try of the run uses that code (eagle3_airflow.codesync).
    # Empty in plans made before pinning existed: the worker's current code.
    code_digest: str = ""
    # The run config as validate validated it (RunConfig, as JSON): what write_config hands to the box's `init`.
    # Empty in plans made before the plan carried it (run_config() refuses those).
    config: dict = field(default_factory=dict)
    # What later tasks need from the settings, as they were when validate planned the run (see the module docstring):
    # the store the report task publishes to (None: $AIRFLOW_HOME/eagle3-reports), and the retention task's limits.
    reports_url: str | None = None
    reports_conn_id: str | None = None
    keep_runs: int | None = None  # None: every run directory is kept
    keep_proposals_h: float = 0.0  # a run whose proposal may still be approved within this many hours is kept
    # box.redo_from: this remote stage and every later one run again from scratch (RemoteJobOperator, job start --redo)
    redo_from: str = ""
    notes: str = ""  # the form's notes: why this run (the run's note shows them)

    @classmethod
    def build(cls, config: RunConfig, box: BoxSettings, box_env: list[str] | None = None, notes: str = "",
              settings: Deployment | None = None) -> RunPlan:
        """The plan of a validated run; `settings`: those it was validated under, whose reports store and retention
        limits the plan carries (none: the fields' defaults)."""
        carried = {} if settings is None else {
            "reports_url": settings.reports_url, "reports_conn_id": settings.reports_conn_id,
            "keep_runs": settings.keep_runs,
            "keep_proposals_h": settings.approval_timeout_h if settings.approve_promotion else 0.0}
        if config.extract.backend == "sglang":
            gpus_per_shard = config.extract.sglang.tp_size
        else:
            gpus_per_shard = 1 if config.extract.device == "auto" else 0
        return cls(
            run_name=config.run_name, workdir=config.workdir, run_dir=str(config.run_dir),
            conn_ids=list(box.conn_ids), python=box.python, num_shards=config.extract.num_shards,
            generate=config.generate.enabled, benchmark=config.benchmark.enabled, require_gpus=box.require_gpus,
            gpu_max_used_mib=box.gpu_max_used_mib, stop_services=list(box.stop_services),
            disk_margin=box.disk_margin, poll_interval_s=box.poll_interval_s, ssh_grace_s=box.ssh_grace_s,
            stale_after_s=box.stale_after_s, stall_timeout_s=box.stall_timeout_s,
            first_progress_timeout_s=box.first_progress_timeout_s, stage_timeout_h=box.stage_timeout_h,
            gpus_per_shard=gpus_per_shard,
            train_gpus=max(config.train.gpus) + 1 if config.train.gpus else config.train.ranks,
            server_gpus=config.server.tp_size
            if (config.generate.enabled and config.generate.launch_server) or config.benchmark.enabled else 0,
            box_env=list(box_env or []),
            code_digest=package_archive().digest,
            config=config.model_dump(mode="json"),
            redo_from="" if box.redo_from == "none" else box.redo_from,
            notes=notes,
            **carried,
        )

    @classmethod
    def from_trusted(cls, data: dict) -> RunPlan:
        """A plan from a source no user can edit (see the module docstring); never from XCom without verified_plan."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - RETIRED_KEYS - {"seal"})
        if unknown:
            log.warning("the run plan has keys this code does not know (planned by newer code?): %s; ignored", unknown)
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise Tampered(f"{PLAN_XCOM} lacks {', '.join(missing)}, which this code needs (planned by older code?). "
                           + TRIGGER_AGAIN)
        return cls(**{key: value for key, value in data.items() if key in known})

    def to_xcom(self) -> dict:
        return asdict(self)

    def sealed(self, dag_run, key: bytes) -> dict:
        """The plan as validate hands it to XCom: sealed for its run."""
        body = self.to_xcom()
        return {**body, "seal": seal("plan", body, RunRef.of(dag_run), key)}

    def run_config(self) -> dict:
        """The run config validate validated, for the tasks that use it (sync_code, write_config); a plan made before
        plans carried it fails the task, saying to trigger again."""
        if not self.config:
            raise AirflowFailException(
                f"{PLAN_XCOM} carries no run config: validate planned this run with older code, which kept the config "
                "beside the plan; this code takes it from the sealed plan alone. " + TRIGGER_AGAIN)
        return self.config

    @property
    def config_path(self) -> str:
        return f"{self.run_dir}/config.json"

    @property
    def jobs_dir(self) -> str:
        # Under the run dir, so deleting a run directory to start over also forgets its jobs.
        return f"{self.run_dir}/jobs"

    @property
    def code_dir(self) -> str:
        return code_dir(self.workdir, self.code_digest or None)

    def ensure_code(self, conn_id: str | None = None) -> str:
        """Sync this run's code to a box (the first by default); returns its directory there."""
        return ensure_code(self.box(conn_id), self.python, self.workdir, self.code_digest or None)

    def redoes(self, stage: str) -> bool:
        """Whether this run runs `stage` again from scratch (box.redo_from names it or an earlier stage)."""
        return bool(self.redo_from) and stage in REDO_ORDER and \
            REDO_ORDER.index(stage) >= REDO_ORDER.index(self.redo_from)

    def conn_for_shard(self, shard: int) -> str:
        return self.conn_ids[shard % len(self.conn_ids)]

    def gpus_needed(self, conn_id: str) -> tuple[int, str]:
        """How many GPUs `conn_id` must have for this run, and why (for the message when it has fewer)."""
        shards = sum(self.conn_for_shard(s) == conn_id for s in range(self.num_shards))
        needs = [(shards * self.gpus_per_shard,
                  f"{shards} extraction shard(s) x {self.gpus_per_shard} GPU(s) each (extract.num_shards, "
                  "extract.sglang.tp_size with the sglang backend)")]
        if conn_id == self.conn_ids[0]:
            needs.append((self.train_gpus, "training (train.gpus / train.nproc_per_node)"))
            needs.append((self.server_gpus, "the SGLang servers of generate / benchmark (server.tp_size)"))
        return max(needs)

    def gpu_group_for_shard(self, shard: int) -> int:
        """Shards go round-robin over the boxes; on its box, a shard is number shard // boxes, and takes that
        group of the box's GPUs, so shards sharing a box never share a GPU."""
        return shard // len(self.conn_ids)

    def box(self, conn_id: str | None = None) -> Box:
        return box_for(conn_id or self.conn_ids[0])

    def eagle3(self, *args: str) -> list[str]:
        """argv running the synced package with the box's python; every element is quoted by the transport.

        Safe-path semantics (-P, and PYTHONSAFEPATH for the processes it starts: the job supervisor, the stage,
        torchrun's ranks): `python -m` would otherwise put the working directory, the SSH login directory, first
        on the path, where an `eagle3/` of anyone's would shadow the synced package. No bytecode is written into
        the code directory (PYTHONDONTWRITEBYTECODE), which code sync keeps exactly the archive's files."""
        return ["env", f"PYTHONPATH={self.code_dir}", "PYTHONSAFEPATH=1", "PYTHONDONTWRITEBYTECODE=1", self.python,
                "-P", "-m", "eagle3", *args]


def verified_plan(data, dag_run, *, key: bytes | None = None) -> RunPlan:
    """The plan read from XCom, if validate sealed it for this run and it has the fields this code needs; Tampered
    otherwise (the task fails at once, saying what and what to do). `key`: default, the task's (seal.task_key).
    The settings are not read: validate checked the run against them, and the seal says nothing changed since."""
    if not isinstance(data, dict) or "seal" not in data:
        raise Tampered(f"{PLAN_XCOM} carries no seal: validate did not write it as it is (an XCom edit), or it was "
                       "planned before plans were sealed. " + TRIGGER_AGAIN)
    body = {k: v for k, v in data.items() if k != "seal"}
    if not is_sealed("plan", body, RunRef.of(dag_run), key or task_key(), data["seal"]):
        raise Tampered(f"{PLAN_XCOM} does not match its seal: it was edited after validate planned this run, or it "
                       "is another run's plan. " + TRIGGER_AGAIN)
    return RunPlan.from_trusted(body)
