"""The run plan: what every task of one DAG run needs to know, made once by validate.

It holds the RunConfig and the BoxSettings validate validated, as they are, and the plan's own facts: the code it
pinned, the protocol that code speaks, the settings later tasks need (the reports store, retention). It travels
between tasks as XCom (JSON: paths, connection ids, thresholds, the run config; never a secret), so no task re-reads
params or the settings file, and a retried task sees exactly what its first try saw; a run in flight keeps the
settings it was validated with (eagle3_airflow/deployment.py says how to stop one).

XCom is writable by whoever may trigger the DAG, so the plan is sealed (eagle3_airflow/seal.py) and bound to its run.
Every task reads it through `verified_plan`: the seal must hold for this run, and the plan's protocol must be this
worker's (eagle3.contracts.PROTOCOL: a deploy since the run was validated may have changed what the plan holds or
what the run's pinned box code understands).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowFailException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagle3.config import RunConfig
from eagle3.contracts import PROTOCOL
from eagle3.disk.layout import REDO_OUTPUTS
from eagle3_airflow.codesync import code_dir, ensure_code, package_archive
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import BoxSettings
from eagle3_airflow.seal import TRIGGER_AGAIN, RunIds, RunRef, Tampered, is_sealed, seal, task_key
from eagle3_airflow.transport import Box, box_for

# The remote stages a run may redo (box.redo_from), in pipeline order: redoing one redoes every later one, so that no
# output is left from before the redo beside one made after it. (generate and extract write shared stores, keyed by
# what decides them: a redo there would be another key, or deleting the store.)
# What each writes in the run directory, which a redo renames aside (job start --set-aside):
# eagle3.disk.layout.REDO_OUTPUTS.
REDO_ORDER = tuple(REDO_OUTPUTS)
PLAN_XCOM = "the run plan in XCom (task `validate`, key `plan`)"


class OtherProtocol(AirflowFailException):
    """The plan was sealed by this deployment's validate, but for code that speaks another protocol: no retry helps."""


class RunPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: int = Field(description="eagle3.contracts.PROTOCOL of the code the run was validated with")
    code_digest: str = Field(description="The package the run was validated with; every try uses it (codesync).")
    config: RunConfig
    box: BoxSettings
    box_env: list[str] = Field(default_factory=list, description="Box variables the stages get besides job.py's own.")
    notes: str = Field("", description="The form's notes: why this run (the run's note shows them).")
    # What later tasks need of the settings, as they were when validate planned the run: the store the report task
    # publishes to (None: $AIRFLOW_HOME/eagle3-reports), and the retention task's limits.
    reports_url: str | None = None
    reports_conn_id: str | None = None
    keep_runs: int | None = None  # None: every run directory is kept
    keep_proposals_h: float = 0.0  # a run whose proposal may still be approved within this many hours is kept

    @classmethod
    def build(cls, config: RunConfig, box: BoxSettings, settings: Deployment, notes: str = "") -> RunPlan:
        """The plan of a run validated under `settings`, pinned to this worker's code."""
        return cls(
            protocol=PROTOCOL,
            code_digest=package_archive().digest,
            config=config,
            box=box,
            box_env=list(settings.box_env),
            notes=notes,
            reports_url=settings.reports_url,
            reports_conn_id=settings.reports_conn_id,
            keep_runs=settings.keep_runs,
            keep_proposals_h=settings.approval_timeout_h if settings.approve_promotion else 0.0,
        )

    @classmethod
    def from_trusted(cls, data: dict[str, Any]) -> RunPlan:
        """A plan from a source no user can edit (the one a verified task handed its trigger); never from XCom
        without verified_plan."""
        return cls.model_validate({key: value for key, value in data.items() if key != "seal"})

    def sealed(self, dag_run: RunIds | None, key: bytes) -> dict[str, Any]:
        """The plan as validate hands it to XCom: sealed for its run."""
        body = self.model_dump(mode="json")
        return {**body, "seal": seal("plan", body, RunRef.of(dag_run), key)}

    # -- where the run lives on the box -----------------------------------------------------------
    @property
    def run_dir(self) -> str:
        return str(self.config.run_dir)

    @property
    def config_path(self) -> str:
        return f"{self.run_dir}/config.json"

    @property
    def jobs_dir(self) -> str:
        # Under the run dir, so deleting a run directory to start over also forgets its jobs.
        return f"{self.run_dir}/jobs"

    @property
    def code_dir(self) -> str:
        return code_dir(self.config.workdir, self.code_digest)

    @property
    def redo_from(self) -> str:
        """box.redo_from, or "" when the run redoes nothing."""
        return "" if self.box.redo_from == "none" else self.box.redo_from

    def redoes(self, stage: str) -> bool:
        """Whether this run runs `stage` again from scratch (box.redo_from names it or an earlier stage)."""
        return (
            bool(self.redo_from) and stage in REDO_ORDER and REDO_ORDER.index(stage) >= REDO_ORDER.index(self.redo_from)
        )

    # -- which box does what --------------------------------------------------------------------
    def conn_for_shard(self, shard: int) -> str:
        return self.box.conn_ids[shard % len(self.box.conn_ids)]

    def gpu_group_for_shard(self, shard: int) -> int:
        """Shards go round-robin over the boxes; on its box, a shard is number shard // boxes, and takes that
        group of the box's GPUs, so shards sharing a box never share a GPU."""
        return shard // len(self.box.conn_ids)

    def gpus_needed(self, conn_id: str) -> tuple[int, str]:
        """How many GPUs `conn_id` must have for this run, and why (for the message when it has fewer)."""
        config = self.config
        shards = sum(self.conn_for_shard(s) == conn_id for s in range(config.extract.num_shards))
        needs = [
            (
                shards * config.gpus_per_shard,
                f"{shards} extraction shard(s) x {config.gpus_per_shard} GPU(s) each (extract.num_shards, "
                "extract.sglang.tp_size with the sglang backend)",
            )
        ]
        if conn_id == self.box.conn_ids[0]:
            needs.append((config.train_gpus, "training (train.gpus / train.nproc_per_node)"))
            needs.append(
                (config.server_gpus, "the serving engine that generate, evaluate or benchmark start (server.tp_size)")
            )
        return max(needs)

    # -- reaching the box -----------------------------------------------------------------------
    def remote(self, conn_id: str | None = None) -> Box:
        """The transport to a box of the run (the first by default)."""
        return box_for(conn_id or self.box.conn_ids[0])

    def ensure_code(self, conn_id: str | None = None) -> str:
        """Sync this run's code to a box (the first by default); returns its directory there."""
        return ensure_code(self.remote(conn_id), self.box.python, self.config.workdir, self.code_digest)

    def eagle3(self, *args: str) -> list[str]:
        """argv running the synced package with the box's python; every element is quoted by the transport.

        Safe-path semantics (-P, and PYTHONSAFEPATH for the processes it starts: the job supervisor, the stage,
        torchrun's ranks): `python -m` would otherwise put the working directory, the SSH login directory, first
        on the path, where an `eagle3/` of anyone's would shadow the synced package. No bytecode is written into
        the code directory (PYTHONDONTWRITEBYTECODE), which code sync keeps exactly the archive's files."""
        return [
            "env",
            f"PYTHONPATH={self.code_dir}",
            "PYTHONSAFEPATH=1",
            "PYTHONDONTWRITEBYTECODE=1",
            self.box.python,
            "-P",
            "-m",
            "eagle3",
            *args,
        ]


def verified_plan(data: object, dag_run: RunIds | None, *, key: bytes | None = None) -> RunPlan:
    """The plan read from XCom, if validate sealed it for this run and it speaks this worker's protocol; Tampered
    otherwise (the task fails at once, saying what and what to do). `key`: default, the task's (seal.task_key).
    The settings are not read: validate checked the run against them, and the seal says nothing changed since."""
    if not isinstance(data, dict) or "seal" not in data:
        raise Tampered(
            f"{PLAN_XCOM} carries no seal: validate did not write it as it is (an XCom edit). " + TRIGGER_AGAIN
        )
    body = {k: v for k, v in data.items() if k != "seal"}
    if not is_sealed("plan", body, RunRef.of(dag_run), key or task_key(), data["seal"]):
        raise Tampered(
            f"{PLAN_XCOM} does not match its seal: it was edited after validate planned this run, or it "
            "is another run's plan. " + TRIGGER_AGAIN
        )
    if body.get("protocol") != PROTOCOL:
        raise OtherProtocol(
            f"this run was validated with code {body.get('code_digest')!r}, whose plan and box commands are protocol "
            f"{body.get('protocol')!r}; this worker's code speaks protocol {PROTOCOL}. Clear the run's validate task "
            "with its downstream tasks: validate pins this worker's code, and stages that finished stay finished "
            "(their jobs succeeded). Or let workers of the run's own version finish it."
        )
    try:
        return RunPlan.model_validate(body)
    except ValidationError as err:
        fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
        raise OtherProtocol(
            f"{PLAN_XCOM} is sealed but is not a plan this code reads ({fields}): the code that "
            "planned it changed the plan without changing eagle3.contracts.PROTOCOL. " + TRIGGER_AGAIN
        ) from None
