"""
### EAGLE-3 drafter: from conversations to an SGLang-ready draft model, on a remote GPU box

Trigger it from the form: a dozen fields (the target, the data, a preset and the knobs people change per run), each
with its help text, range and pattern; the box's facts and the recipe's other knobs are the deployment's settings
(docs/params.md). One run writes one run directory,
`{workdir}/runs/{run_name}/`, on the box: config.json, hidden states, vocab mapping, checkpoints,
the drafter, report and plots.

preflight: validate -> box reachable -> code synced -> config written -> GPUs idle -> disk enough;
then generate (regenerate the answers with the target; skipped unless generate.enabled) -> extract (one
mapped task per shard) -> GPUs released -> vocab -> inputs changed? (else: nothing changed since the lineage's
current drafter, so training is skipped) -> train -> export -> evaluate -> benchmark (SGLang with
the drafter against the plain target; skipped unless benchmark.enabled) -> report -> promoted (an event on
the drafter Asset when this run's drafter was promoted over the lineage's current one; skipped otherwise)
-> retention (old run directories removed, with the settings' keep_runs).

With the settings' approve_promotion, evaluate only proposes, and `promoted` is `propose_promotion`: an event on
the proposals Asset, which starts the DAG eagle3_promotion. There a person approves (approve_promotion, under
Required Actions), then promote switches the lineage's drafter and promoted puts the drafter Asset's event. The
box trains the next run meanwhile.

**Resume = clear the failed task.** Every stage is a detached job on the box that a retry or a clear
re-attaches to while it runs, and restarts (the stage resumes where it stopped) when it died.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Asset, chain, conf, task, task_group

from eagle3_airflow import approvals, notify, tasks
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.pools import BoxResource, box_params
from eagle3_airflow.remote_job import RemoteJobOperator
from eagle3_airflow.sensors import BoxReachableSensor, DiskSpaceSensor, GpuIdleSensor

# The deployment's settings without editing code (eagle3_airflow/deployment.py): schedule, form defaults, and
# which boxes, services, endpoint hosts and box variables a trigger may use. A JSON file of the DAG bundle:
# eagle3_settings.json beside this file, or the one EAGLE3_DAG_SETTINGS names (relative: to this folder). Read here
# only: validate checks each run against them and seals what later tasks need into the run plan, so a run keeps the
# settings it started with.
DEPLOYMENT = Deployment.from_env(Path(__file__).parent)
# A local reports folder under an executor whose workers share no disk: an import error naming the fix.
DEPLOYMENT.check_reports_store(conf.get("core", "executor"))
SENSOR_TIMEOUT = timedelta(hours=DEPLOYMENT.sensor_timeout_h)
DRAFTER = Asset(DEPLOYMENT.drafter_asset)  # updated when a run promotes its drafter: deployments schedule on it
PROPOSALS = Asset(approvals.proposals_asset_name(DEPLOYMENT.drafter_asset))  # approve_promotion: what is asked


def dag_schedule(settings: Deployment):
    """`schedule` alone (time), `schedule_assets` alone (any of them updated), or both (whichever comes first:
    Airflow's AssetOrTimeSchedule, the cron read in UTC)."""
    if not settings.schedule_assets:
        return settings.schedule
    from airflow.sdk import AssetAny, AssetOrTimeSchedule, CronTriggerTimetable

    assets = AssetAny(*(Asset(name) for name in settings.schedule_assets))
    if settings.schedule is None:
        return assets
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(settings.schedule, timezone="UTC"), assets=assets)


def drafter_dag(box: BoxResource, settings: Deployment, form: dict) -> DAG:
    """The drafter DAG of one box (eagle3_airflow/pools.py): its runs on that box, its GPU tasks in that box's pool."""
    params = box_params(form, box.conn_id)  # the form, its box.conn_ids that box alone
    settings.check_schedulable(params)  # a schedule whose defaults cannot make a run is an import error, not silence

    with DAG(
        dag_id=box.dag_id,
        description="Train an EAGLE-3 drafter for a target model on a remote GPU box"
        + (f" ({box.conn_id})" if box.conn_id else "")
        + (
            ""
            if box.scheduled or not (DEPLOYMENT.schedule or DEPLOYMENT.schedule_assets)
            else "; triggered only: the schedule starts runs of the default box's DAG"
        ),
        # time, the data's or target's Asset updated, or either; None for every box's DAG but the default one's
        schedule=dag_schedule(settings),
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,  # one box, one run: gpus_idle would see another run's stages as foreign processes
        max_consecutive_failed_dag_runs=settings.max_consecutive_failed_runs,  # a broken schedule pauses itself
        default_args={
            "retries": settings.retries,
            "retry_delay": timedelta(seconds=settings.retry_delay_s),
            "retry_exponential_backoff": settings.retry_exponential_backoff,
            "max_retry_delay": timedelta(minutes=30),
            # None without the settings' notify: an empty list still makes Airflow schedule callback runs
            "on_failure_callback": notify.task_failure_callbacks(settings) or None,  # a task failed for good
        },
        on_failure_callback=notify.run_failure_callbacks(settings) or None,  # ... and the run failed
        deadline=notify.deadline(settings),  # ... and a run is late (notify.late_after_h)
        doc_md=__doc__,
        tags=["eagle3", "llm", "speculative-decoding"],
    ) as dag:
        # The settings reach validate as this parse read them (a default argument: never serialized), and no other
        # task: what those need of them is in the plan validate seals.
        @task(retries=0, multiple_outputs=True)
        def validate(params=None, dag_run=None, settings=settings, known=frozenset(params)) -> dict:
            """Refuse unknown keys and bad values (fields named, fixes given) before anything runs; seal the plan,
            the run config inside it."""
            return tasks.validate_run(dict(params), dict(dag_run.conf or {}), set(known), dag_run, settings)

        run = validate()
        plan = run["plan"]

        # What holds the box's GPUs holds them in its pool (pool, pool_slots); the rest holds none.
        box_reachable = BoxReachableSensor(task_id="box_reachable", plan=plan, poke_interval=30, timeout=SENSOR_TIMEOUT)
        code_synced = task(tasks.sync_code, task_id="sync_code")(plan)
        config_written = task(tasks.write_config, task_id="write_config")(plan)
        gpus_idle = GpuIdleSensor(
            task_id="gpus_idle", plan=plan, timeout=SENSOR_TIMEOUT, **box.task_kwargs("gpus_idle")
        )
        disk_space = DiskSpaceSensor(task_id="disk_space", plan=plan, timeout=SENSOR_TIMEOUT)

        shards = task(tasks.shard_list, task_id="shards")
        generate = RemoteJobOperator(
            task_id="generate", stage="generate", plan=plan, only_if="generate", **box.task_kwargs("generate")
        )
        extract = RemoteJobOperator.partial(
            task_id="extract",
            stage="extract",
            plan=plan,
            **box.task_kwargs("extract"),
            trigger_rule="none_failed",  # runs after generate, or on the data as given when generate was skipped
        ).expand(shard=shards(plan))
        gpus_released = GpuIdleSensor(
            task_id="gpus_released",
            plan=plan,
            poke_interval=30,
            timeout=SENSOR_TIMEOUT,
            **box.task_kwargs("gpus_released"),
        )
        vocab = RemoteJobOperator(task_id="vocab", stage="vocab", plan=plan)  # CPU only
        # Nothing new since the lineage's current drafter (same samples, vocab, settings): train, export, evaluate
        # and benchmark are skipped; report (none_failed) still runs and says so.
        inputs_changed = task.short_circuit(
            tasks.inputs_changed, task_id="inputs_changed", ignore_downstream_trigger_rules=False
        )(plan)
        train = RemoteJobOperator(task_id="train", stage="train", plan=plan, **box.task_kwargs("train"))
        export = RemoteJobOperator(task_id="export", stage="export", plan=plan)  # CPU only
        # With the settings' approve_promotion, evaluate only proposes; a person approves before `current` switches.
        hold = ["--hold-promotion"] if settings.approve_promotion else []
        evaluate = RemoteJobOperator(
            task_id="evaluate", stage="evaluate", plan=plan, stage_args=hold, **box.task_kwargs("evaluate")
        )
        benchmark = RemoteJobOperator(
            task_id="benchmark", stage="benchmark", plan=plan, only_if="benchmark", **box.task_kwargs("benchmark")
        )
        summary = task(tasks.report, task_id="report", trigger_rule="none_failed")(plan)
        if settings.approve_promotion:  # evaluate only proposed: the promotion DAG below asks a person
            announce = task(approvals.propose_promotion, task_id=approvals.PROPOSE_TASK, outlets=[PROPOSALS])(
                plan, PROPOSALS.name
            )
        else:
            announce = task(approvals.announce_promotion, task_id="promoted", outlets=[DRAFTER])(plan, DRAFTER.name)
        # keep_runs as the plan carries it; a run whose proposal still awaits approval is kept.
        retention = task(tasks.prune_runs, task_id="retention", trigger_rule="none_failed")(plan)

        chain(
            run,
            box_reachable,
            code_synced,
            config_written,
            gpus_idle,
            disk_space,
            generate,
            extract,
            gpus_released,
            vocab,
            inputs_changed,
            train,
            export,
            evaluate,
            benchmark,
            summary,
            announce,
            retention,
        )

    # The form's params go on the DAG after its tasks exist. Passed to DAG(...), Airflow would copy them into every
    # task, then re-validate every copy when it serializes the DAG (0.5 s per parse when the form had 107 fields),
    # for nothing, since tasks read DAG params at run time anyway (dag params, then task params, then the run's conf).
    dag.params.update(params)
    return dag


# One DAG per box of the settings' box_pools, each in its box's pool (eagle3_airflow/pools.py): several boxes run
# several runs at once. The default box's DAG is eagle3_drafter and alone runs the schedule (one tick, one run); the
# others are eagle3_drafter__<box>, triggered only. Without box_pools, the one DAG eagle3_drafter, whose runs may
# use any allowed box.
FORM = DEPLOYMENT.form()  # built once for all of them: about 20 ms of the parse each
for BOX in DEPLOYMENT.resources():
    drafter_dag(BOX, DEPLOYMENT.for_box(BOX), FORM)  # (a DAG made in a `with` block registers itself)


def promotion_dag(settings: Deployment) -> DAG:
    """eagle3_promotion: a person approves each drafter a training run proposes (the settings' approve_promotion),
    then the lineage switches to it."""
    with DAG(
        dag_id=approvals.PROMOTION_DAG_ID,
        description="Approve and promote the drafters training runs propose (the settings' approve_promotion)",
        schedule=[PROPOSALS],  # a training run's propose_promotion
        start_date=datetime(2026, 1, 1),
        catchup=False,
        default_args={
            "retries": settings.retries,
            "retry_delay": timedelta(seconds=settings.retry_delay_s),
            "on_failure_callback": notify.task_failure_callbacks(settings) or None,
        },
        doc_md=approvals.__doc__,
        tags=["eagle3", "llm", "speculative-decoding"],
    ) as dag:

        @task(retries=0)
        def proposals(triggering_asset_events=None) -> list[dict]:
            """The triggering events that are proposals sealed by a drafter DAG's propose task; the rest refused."""
            return approvals.proposals_from_events(triggering_asset_events, PROPOSALS.name)

        @task(task_id="promote")
        def promote_held(proposal_item: dict, answer, dag_run=None, deployment=settings) -> dict:
            """Promote on an Approve by one of the settings' approvers (as this parse read them: no task reads the
            settings file)."""
            return approvals.promote_held(proposal_item, answer, dag_run=dag_run, deployment=deployment)

        @task_group(group_id="proposal")
        def decide(proposal):
            """One proposal: a person approves (assigned to the settings' approvers, who are told), then the switch."""
            approve = approvals.PromotionApproval(
                task_id="approve_promotion",
                proposal=proposal,
                approvers=settings.approvers,
                defaults="Reject",
                notifiers=approvals.approval_notifiers(settings),  # the settings' notify channels hear it waits
                response_timeout=timedelta(hours=settings.approval_timeout_h),
            )  # no answer: rejected
            promote = promote_held(proposal, approve.output)
            promoted = task(approvals.announce_approved_promotion, task_id="promoted", outlets=[DRAFTER])(
                proposal, DRAFTER.name
            )
            chain(approve, promote, promoted)

        decide.expand(proposal=proposals())
    return dag


if DEPLOYMENT.approve_promotion:
    promotion_dag(DEPLOYMENT)
