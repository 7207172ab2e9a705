"""A box is a resource: each box's Airflow pool, whose slots are its GPUs, and the GPUs each task holds there.

The settings file's `box_pools` names the boxes, their GPUs and, over the settings' `run` and `box`, each box's own:

    "box_pools": {"gpu-box-1": {"gpus": 8}, "gpu-box-2": {"gpus": 8, "shard_gpus": 8,
                                                          "run": {"workdir": "/scratch/eagle3"}}}

Each box gets a DAG that runs on it alone, in its pool (`eagle3_box_<box>`, or the entry's `pool`). The default box
(the form's default box.conn_ids, else the first) has `eagle3_drafter` and alone runs `schedule` and
`schedule_assets`; every other box's DAG is `eagle3_drafter__<box>`, triggered by hand. Without `box_pools`, one DAG
`eagle3_drafter` may use any allowed box, in the pool `pool` of `pool_slots` GPUs.

What a task holds, in GPUs (fixed when the DAG is parsed):
  the whole box   generate, train, evaluate, benchmark, gpus_idle and gpus_released
  shard_gpus      each extract shard (1 for the hf backend, extract.sglang.tp_size for sglang)
  none            vocab, export, disk_space, box_reachable and the light tasks (the default pool)
validate refuses a run that would use more than its DAG holds (train.gpus or a server wider than the box, an sglang
shard wider than shard_gpus), naming the setting to change.
Why: docs/decisions/2026-12-04-box-is-a-pool.md, docs/decisions/2026-12-04-one-dag-per-box.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from eagle3_airflow import DAG_ID

if TYPE_CHECKING:
    from airflow.sdk import Param

    from eagle3.config import RunConfig

PoolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,256}$")]
WHOLE_BOX = ("generate", "train", "evaluate", "benchmark", "gpus_idle", "gpus_released")  # tasks holding every GPU


class BoxPool(BaseModel):
    """One box of `box_pools`: its GPUs, and the pool they are counted in."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(ge=1, le=1024, description="The box's GPUs: its pool's slots.")
    shard_gpus: int = Field(
        1,
        ge=1,
        le=1024,
        description="GPUs each extract shard holds (its GPU group): 1 for the "
        "hf backend, extract.sglang.tp_size for sglang.",
    )
    pool: PoolName | None = Field(None, description="The Airflow pool's name; default eagle3_box_<connection id>.")
    run: dict[str, Any] = Field(
        default_factory=dict,
        description="This box's own facts over the settings' `run` "
        "(its workdir, engine flags, ...), by dotted run-config name.",
    )
    box: dict[str, Any] = Field(
        default_factory=dict,
        description="This box's BoxSettings over the settings' `box` (its python, services, thresholds).",
    )


class BoxResource(BaseModel):
    """What one generated DAG holds: its id, the box its runs use (None: any allowed box, the one DAG without
    box_pools), the pool, the GPUs each task holds in it, and whether the settings' schedule starts its runs (one DAG
    does)."""

    model_config = ConfigDict(frozen=True)

    dag_id: str
    conn_id: str | None
    pool: str
    gpus: int
    shard_gpus: int
    scheduled: bool = True

    def slots(self, task_id: str) -> int:
        return self.gpus if task_id in WHOLE_BOX else self.shard_gpus

    def task_kwargs(self, task_id: str) -> dict[str, Any]:
        """pool and pool_slots for a task that holds GPUs of the box (see the module docstring)."""
        return {"pool": self.pool, "pool_slots": self.slots(task_id)}

    def overuse(self, config: RunConfig) -> list[str]:
        """Why a run would use more GPUs than this DAG's tasks hold in the pool; empty when it fits."""
        if self.conn_id is None:  # the one DAG without box_pools: its runs may span boxes, the pool bounds them
            return []
        where = f"box_pools.{self.conn_id} in the settings file"
        problems = []
        if config.train_gpus > self.gpus:
            problems.append(
                f"train: uses {config.train_gpus} GPUs (train.gpus / train.nproc_per_node) but box "
                f"{self.conn_id} has {self.gpus} ({where}.gpus)"
            )
        if config.gpus_per_shard > self.shard_gpus:
            problems.append(
                f"extract: each shard uses {config.gpus_per_shard} GPUs (extract.sglang.tp_size) but holds "
                f"{self.shard_gpus} in the pool ({where}.shard_gpus): set it to {config.gpus_per_shard}"
            )
        if config.server_gpus > self.gpus:
            problems.append(
                f"server.tp_size: {config.server.tp_size} GPUs but box {self.conn_id} has {self.gpus} ({where}.gpus)"
            )
        return problems


def box_params(params: dict[str, Param], conn_id: str | None) -> dict[str, Param]:
    """The form's Params for one box's DAG: `params` (built once for all of them: about 20 ms of the parse each)
    with box.conn_ids offering and defaulting to that box alone."""
    if conn_id is None:
        return params
    from airflow.sdk import Param

    boxes = params["box.conn_ids"]
    schema = {**boxes.schema, "items": {**boxes.schema.get("items", {}), "enum": [conn_id]}}
    schema.pop("maxItems", None)
    return {**params, "box.conn_ids": Param([conn_id], description=boxes.description, **schema)}


def is_drafter_dag(dag_id: str) -> bool:
    """One of the DAGs the drafter DAG file makes: `eagle3_drafter`, or `eagle3_drafter__<box>` per box."""
    return dag_id == DAG_ID or dag_id.startswith(DAG_ID + "__")
