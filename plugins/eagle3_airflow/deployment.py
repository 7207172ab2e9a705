"""The deployment's settings file: what whoever runs this Airflow decides, and no trigger can change.

A JSON file: `eagle3_settings.json` beside the DAG file, in its bundle, or the file EAGLE3_DAG_SETTINGS names (a
relative path: against the DAG file's folder; docker-compose.yaml names one in deploy/settings/); without either,
the built-in settings. It is read when the DAG file is parsed (and by the report tab and the stack's init), never by
a task. docs/deployment.md describes every key.

A run's config is the trigger form over the chosen preset over `run` (eagle3_airflow/params.py): `params` are the
form's defaults (what a scheduled or Asset-started run takes), `run` the box's facts and every field the form does
not hold, `presets` named recipes, `box` how the DAG works the box. `allowed_*` and `box_env` bound which boxes,
systemd units, generate hosts, interpreters, workdirs and environment variables the settings may name; left out,
each allows only what `run` and `box` use. An unknown key, a layer that makes no valid run, or a name not allowed
raises ParamsError: the DAG's import error, naming the file and the keys.

A run's validate task checks it against the settings once and seals what later tasks need into the run plan
(eagle3_airflow/plan.py): a run in flight keeps the settings it started with, and a changed file applies from the
next run. To stop a run the new settings would refuse, mark it failed: its running job is killed on the box
(eagle3_airflow/remote_job.py).
`python -m eagle3_airflow.deployment create-pool` creates each box's Airflow pool, deferred tasks counted.
Why: docs/decisions/2026-12-05-run-keeps-its-settings.md, docs/decisions/2026-12-05-twelve-field-form.md.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from eagle3.config import (
    ABS_PATH_PATTERN,
    ENDPOINT_PATTERN,
    format_validation_error,
)
from eagle3_airflow import DAG_ID
from eagle3_airflow.allowlist import Allowlist, normal_dir
from eagle3_airflow.params import (
    DEFAULT_PRESET,
    FORM_FIELDS,
    PRESET,
    BoxSettings,
    ConnId,
    ParamsError,
    SystemdUnit,
    box_layer_fields,
    build_params,
    params_to_configs,
    required_params,
    run_layer_fields,
)
from eagle3_airflow.pools import BoxPool, BoxResource

if TYPE_CHECKING:
    from airflow.sdk import Param

    from eagle3.config import RunConfig

EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
Interpreter = Annotated[str, StringConstraints(pattern=r"^(/[^\x00-\x1f:]{1,4095}|[A-Za-z0-9._+-]{1,255})$")]
# A host, or host:port to allow that port only.
HostName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?$")]
Endpoint = Annotated[str, StringConstraints(pattern=ENDPOINT_PATTERN)]
AbsDir = Annotated[str, StringConstraints(pattern=ABS_PATH_PATTERN)]
# An Airflow user as its auth manager names it; passed to the box as one `--approved-by=NAME` token.
UserName = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{1,256}$")]
SETTINGS_FILE = "eagle3_settings.json"  # beside the DAG file, in its bundle
SETTINGS_ENV = "EAGLE3_DAG_SETTINGS"  # names another file instead
# Executors that run every task on the machine of the scheduler (and, in the layouts they are used in, the API server):
# a local reports folder is seen by the report tab. Any other ([core] executor may list several) runs tasks on workers
# of their own, which share no disk unless the deployment says so (reports_shared_disk).
SINGLE_HOST_EXECUTORS = {"LocalExecutor", "SequentialExecutor", "DebugExecutor"}
LOCAL_STORE_SCHEMES = {"file", "local"}


def executor_names(executor: str) -> list[str]:
    """The executors' class names in an Airflow [core] executor value: "CeleryExecutor", "LocalExecutor,EdgeExecutor",
    "alias:my.module.MyExecutor", or per team "LocalExecutor;team1=CeleryExecutor" (Airflow's executor_loader)."""
    names = []
    for team in executor.split(";"):
        for entry in team.split("=", 1)[-1].split(","):
            path = entry.strip().split(":")[-1].strip()
            if path:
                names.append(path.rsplit(".", 1)[-1])
    return names


class Approver(BaseModel):
    """An Airflow user who may approve a promotion: a name (the id SimpleAuthManager and most auth managers give a
    user), or {"id": ..., "name": ...} where the auth manager's user id is another (FAB's is a number)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: UserName
    name: UserName

    @model_validator(mode="before")
    @classmethod
    def _from_a_name(cls, value: Any) -> Any:  # the settings' JSON, before validation
        return {"id": value, "name": value} if isinstance(value, str) else value

    def hitl_user(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name}


AssetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,1500}$")]
PresetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
MailAddress = Annotated[str, StringConstraints(pattern=r"^[^@\s<>,;]+@[^@\s<>,;]+$")]
# A class by its dotted import path: package.module.Class.
DottedClass = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")]
# An absolute directory, or scheme://bucket/prefix (no credentials in it: they belong in reports_conn_id).
ReportsUrl = Annotated[
    str, StringConstraints(max_length=4096, pattern=r"^(/[^\x00-\x1f]*|[a-z][a-z0-9+.-]*://[^\s@]+)$")
]


EXAMPLE_NOTIFIER = (
    '{"class": "airflow.providers.slack.notifications.slack.SlackNotifier", "kwargs": '
    '{"slack_conn_id": "slack_api_default", "channel": "#eagle3", "text": "{subject}\\n{body}"}}'
)


class NotifierEntry(BaseModel):
    """One of notify.notifiers: an Airflow notifier class (any provider's) and the keyword arguments it is made with.
    The message reaches it through markers in those arguments (eagle3_airflow/notify.py)."""

    model_config = ConfigDict(extra="forbid")

    notifier_class: DottedClass = Field(
        alias="class",
        description="A subclass of airflow.sdk.BaseNotifier by dotted path, e.g. "
        "airflow.providers.slack.notifications.slack.SlackNotifier; its provider installed wherever Airflow reads "
        "these settings.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Its keyword arguments, a JSON object; in any string among them, {subject}, "
        "{body} and {body_html} are replaced by the message (plain substitution, never a template).",
    )

    @field_validator("notifier_class")
    @classmethod
    def _is_a_notifier(cls, path: str) -> str:
        from airflow.sdk import BaseNotifier
        from airflow.sdk.module_loading import import_string

        try:
            found = import_string(path)
        except Exception as err:  # noqa: BLE001 - a module that fails on import is as unusable as a missing one
            raise ValueError(
                f"cannot import {path!r} ({type(err).__name__}: {err}); install the provider that has it "
                "on every Airflow machine that reads these settings, or fix the path"
            ) from None
        if not (isinstance(found, type) and issubclass(found, BaseNotifier)):
            raise ValueError(
                f"{path!r} is not an Airflow notifier (a subclass of airflow.sdk.BaseNotifier); name a "
                "notifier class, such as airflow.providers.slack.notifications.slack.SlackNotifier or "
                "airflow.providers.smtp.notifications.smtp.SmtpNotifier"
            )
        return path

    @field_validator("kwargs")
    @classmethod
    def _fit_the_class(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """JSON (the lateness callback carries them through Airflow's database), and taken by the class's __init__:
        a misspelt argument is refused here, not at the first failure."""
        try:
            json.dumps(kwargs, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"not a JSON object ({err})") from None
        if "notifier_class" not in info.data:  # the class was refused: that error says why
            return kwargs
        from airflow.sdk.module_loading import import_string

        try:
            signature = inspect.signature(import_string(info.data["notifier_class"]))
        except (TypeError, ValueError):  # no signature to check against
            return kwargs
        try:
            signature.bind(**kwargs)
        except TypeError as err:
            named = [
                name
                for name, parameter in signature.parameters.items()
                if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
            ]
            raise ValueError(
                f"{info.data['notifier_class']} cannot be made with these arguments ({err}); it takes {named}"
            ) from None
        return kwargs


class NotifySettings(BaseModel):
    """Who hears of a failed or late run (eagle3_airflow/notify.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    to: list[MailAddress] = Field(default_factory=list, description="Mail addresses; none: no mail.")
    smtp_conn_id: ConnId = Field("smtp_default", description="The Airflow SMTP connection the mail goes through.")
    from_email: MailAddress | None = Field(None, description="Sender; default: the SMTP connection's from_email.")
    notifiers: list[NotifierEntry] = Field(
        default_factory=list,
        description='Other channels: Airflow notifier classes, each {"class": dotted path, "kwargs": {...}}, '
        "made anew for each message, the message in their string kwargs' {subject}, {body}, {body_html}.",
    )
    late_after_h: float | None = Field(
        None,
        gt=0,
        le=24 * 60,
        description="Warn when a run is still running this many hours after it was first queued (a clear does not "
        "restart the clock).",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_callables(cls, data: Any) -> Any:  # the settings' JSON, before validation
        if isinstance(data, dict) and "callables" in data:
            raise ValueError(
                "`callables` (module:function channels) is no longer read: each channel is now an Airflow "
                f'notifier class in `notifiers`, e.g. "notifiers": [{EXAMPLE_NOTIFIER}] '
                "(docs/deployment.md); move each callable's channel there, then remove `callables`"
            )
        return data

    def kwargs(self) -> dict[str, Any]:
        """What notify.py's senders take: plain JSON (the lateness callback's kwargs are stored by Airflow)."""
        return {
            "smtp_conn_id": self.smtp_conn_id,
            "to": self.to,
            "from_email": self.from_email,
            "notifiers": [entry.model_dump(by_alias=True) for entry in self.notifiers],
        }


class Deployment(BaseModel):
    """The settings file, validated: an unknown key (a typo) is refused, not ignored. Data and the checks on it
    only: what Airflow runs from it (notifiers, the deadline, the approval's, the schedule, the reports store) is built
    where it is used (notify.py, approvals.py, published.py, the DAG file); the allow-lists' checks in allowlist.py."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schedule: str | None = Field(None, description="Airflow schedule (cron or preset); none: triggered only.")
    schedule_assets: list[AssetName] = Field(
        default_factory=list,
        description="Airflow Assets whose update starts a run: the prompt set and the target (a DAG that refreshes "
        "the data or publishes a checkpoint updates them). With schedule too, a run starts on either (Airflow's "
        "AssetOrTimeSchedule).",
    )
    max_consecutive_failed_runs: int = Field(
        3,
        ge=0,
        le=1000,
        description="Airflow pauses a DAG after this many failed runs in a row (its max_consecutive_failed_dag_runs), "
        "so a broken schedule stops instead of failing every tick; unpause it once fixed. 0: never paused.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="The trigger form's defaults, by its fields' dotted names (run_name, preset, target.model_path, "
        "data.path, train.epochs, ...: docs/params.md); a scheduled run takes them.",
    )
    run: dict[str, Any] = Field(
        default_factory=dict,
        description="The box's facts and every run-config field the form does not hold, by dotted name: workdir, "
        "target.dtype, extract.*, server.* (engine, python, extra_args), generate.endpoint, ... Every run gets them.",
    )
    presets: dict[PresetName, dict[str, Any]] = Field(
        default_factory=dict,
        description="Named recipes the form offers: each sets run-config fields over `run` (the training knobs a "
        "person rarely touches). 'default' is always offered (`run` alone, unless listed here).",
    )
    box: dict[str, Any] = Field(
        default_factory=dict,
        description="How the DAG works the box (BoxSettings but conn_ids and redo_from, which the form chooses): "
        "python, require_gpus, stop_services, the watchers' thresholds.",
    )
    pool: str = Field(
        "eagle3_box",
        pattern=r"^[A-Za-z0-9_.-]{1,256}$",
        description="Airflow pool every remote stage runs in; counts deferred tasks.",
    )
    pool_slots: int = Field(
        8,
        ge=1,
        le=4096,
        description="The GPUs of the box(es) the pool stands for: its slots "
        "(eagle3_airflow/pools.py says what each task holds).",
    )
    box_pools: dict[ConnId, BoxPool] = Field(
        default_factory=dict,
        description='One DAG and one pool per box, e.g. {"gpu-box-1": {"gpus": 8}}: each box\'s runs go on '
        "at once, each holding its own box's GPUs (eagle3_airflow/pools.py). The default box's DAG (params' "
        "box.conn_ids, else the first listed) is eagle3_drafter and alone runs the schedule; each other box's is "
        "eagle3_drafter__<box>, triggered only. Empty: one DAG whose runs may use any allowed box, in `pool`.",
    )
    sensor_timeout_h: float = Field(12, gt=0, le=24 * 14, description="How long a box sensor waits.")
    retries: int = Field(3, ge=0, le=100)
    retry_delay_s: float = Field(60, ge=0, le=24 * 3600)
    retry_exponential_backoff: bool = True
    allowed_boxes: list[ConnId] | None = Field(
        None, description="Airflow SSH connection ids the form's box.conn_ids may name; default: its default's."
    )
    allowed_services: list[SystemdUnit] | None = Field(
        None, description="systemd units box.stop_services may name; default: those `box` names."
    )
    allowed_endpoint_hosts: list[HostName] | None = Field(
        None,
        description="Hosts generate.endpoint may name, each as host (any port) or host:port (that port only); "
        "default: the loopback and the host of `run`'s endpoint.",
    )
    allowed_workdirs: list[AbsDir] | None = Field(
        None,
        description="Directories a run's workdir must equal or lie under (compared as normalised paths; '..' "
        "refused); default: `run`'s workdir only, and none without one.",
    )
    allowed_pythons: list[Interpreter] | None = Field(
        None,
        description="Interpreters box.python and server.python may name on the box (absolute paths, or a "
        "command found on the box's PATH); default: `box`'s python only. A run that could name "
        "any executable would run it with the stage's arguments.",
    )
    box_env: list[EnvName] = Field(
        default_factory=list,
        description="Box environment variables passed to the stages besides the built-in ones (CUDA_*, HF_*, ...); "
        "generate.api_key_env must be one of them.",
    )
    api_key_endpoints: dict[EnvName, list[Endpoint]] = Field(
        default_factory=dict,
        description="For each box_env variable that holds an API key: the exact endpoints (scheme, host, port, path) "
        'generate may send it to, e.g. {"SGLANG_API_KEY": ["http://sglang.internal:30000/v1"]}. A run that names '
        "generate.api_key_env with an endpoint not listed for that variable is refused.",
    )
    keep_versions: int = Field(
        3,
        ge=1,
        le=1000,
        description="Promoted drafter versions each lineage keeps; older ones are removed. Put into every run's "
        "config (evaluate.keep_versions) by the validate task; a trigger cannot set it.",
    )
    approvers: list[Approver] = Field(
        default_factory=list,
        description="Airflow users who may approve a promotion (approve_promotion): the approval task is assigned to "
        "them, and the promote task promotes only on an Approve by one of them who did not trigger the run.",
    )
    notify: NotifySettings | None = Field(None, description="Failure and lateness notifications; none: silent.")
    keep_runs: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Run directories kept on the box after a run (the newest; promoted drafters' and live ones "
        "too); none: all kept. Shared stores stay: `python -m eagle3 store gc` removes unused ones.",
    )
    drafter_asset: AssetName = Field(
        "eagle3_drafter",
        description="The Airflow Asset a promoted drafter updates (its event's extra: lineage, version, figures, "
        "the previous ones, store and code): schedule a deployment DAG on it.",
    )
    approve_promotion: bool = Field(
        False,
        description="A person approves each promotion: evaluate only proposes it, an approval task (Airflow's "
        "human-in-the-loop ApprovalOperator, under Required Actions) waits, and the switch happens on Approve.",
    )
    approval_timeout_h: float = Field(
        72, gt=0, le=24 * 60, description="How long the approval task waits; then the promotion is rejected."
    )
    reports_url: ReportsUrl | None = Field(
        None,
        description="Where the report task publishes each run's report and plots, and the report tab reads them "
        "(Airflow object storage): an absolute local directory, or a URL such as s3://bucket/prefix with "
        "reports_conn_id. Default: $AIRFLOW_HOME/eagle3-reports, which the workers and the API server must share "
        "(one machine, or a shared volume).",
    )
    reports_conn_id: ConnId | None = Field(
        None,
        description="The Airflow connection reports_url's store is opened with (its provider installed); none: "
        "the local filesystem, or the store's own environment credentials.",
    )
    reports_shared_disk: bool = Field(
        False,
        description="The workers and the API server share reports_url's local folder (a volume every Airflow "
        "container of one host mounts, NFS). Without it, an executor whose workers share no disk (CeleryExecutor, "
        "KubernetesExecutor, EdgeExecutor, ...) refuses a local reports_url, the default included: the report tab "
        "would never see what a worker published.",
    )
    _source: str = PrivateAttr(
        f"the built-in settings (no {SETTINGS_FILE} beside the DAG file, and {SETTINGS_ENV} names no file)"
    )
    _resource: BoxResource | None = PrivateAttr(None)  # set on the settings of one generated DAG (for_box)

    @field_validator("allowed_workdirs")
    @classmethod
    def _workdirs_are_normal(cls, workdirs: list[str] | None) -> list[str] | None:
        return None if workdirs is None else [normal_dir(path) for path in workdirs]

    @model_validator(mode="after")
    def _layers_name_their_own_fields(self) -> Deployment:
        """Each layer sets only the fields that are its (a form field in `run` would be overridden silently by the
        form, a typo never read), and together they make a valid run with each preset, on each box."""
        own = set(run_layer_fields())
        problems = (
            [
                f"params: {sorted(set(self.params) - set(FORM_FIELDS))} are not form fields (the form holds "
                f'{list(FORM_FIELDS)}); put run-config fields in "run" or a preset, box ones in "box"'
            ]
            if set(self.params) - set(FORM_FIELDS)
            else []
        )
        if self.params.get(PRESET, DEFAULT_PRESET) not in self.preset_names():
            problems.append(f"params: the default preset {self.params[PRESET]!r} is not one of {self.preset_names()}")
        run_layers = [
            ("run", self.run),
            *((f"presets.{name}", values) for name, values in self.presets.items()),
            *((f"box_pools.{conn_id}.run", pool.run) for conn_id, pool in self.box_pools.items()),
        ]
        for where, layer in run_layers:
            form = sorted(set(layer) & set(FORM_FIELDS))
            if form:
                problems.append(
                    f'{where}: {form} are the form\'s (a trigger sets them); give their defaults in "params"'
                )
            unknown = sorted(set(layer) - own - set(FORM_FIELDS))
            if unknown:
                problems.append(
                    f"{where}: {unknown} are not run-config fields the settings set (docs/params.md lists them)"
                )
        for where, layer in (
            ("box", self.box),
            *((f"box_pools.{conn_id}.box", pool.box) for conn_id, pool in self.box_pools.items()),
        ):
            outside = sorted(set(layer) - set(box_layer_fields()))
            if outside:
                problems.append(
                    f"{where}: {outside} are not box settings (it takes {box_layer_fields()}; which "
                    "boxes a run uses is the form's box.conn_ids, among allowed_boxes)"
                )
        if problems:
            raise ValueError("\n  ".join(problems))
        # Values: each preset over `run`, with stand-ins for what the form gives, must make a run on every box.
        stand_ins = {name: "/form/value" for name in required_params()}
        for where, name, run, box in self.layered_runs():
            try:  # (a missing workdir is refused when a run is made, naming the fix: the DAG still parses)
                params_to_configs(stand_ins, "settings_check", {"workdir": "/settings/workdir", **run}, None, box, name)
            except ParamsError as err:
                raise ValueError(f"{where} with the preset {name!r} do not make a valid run: {err}") from None
        return self

    def box_layers(self) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        """(where, run, box) for the settings and, under box_pools, each box: its own facts over the settings'."""
        return [
            ("the settings' run and box", self.run, self.box),
            *(
                (f"box_pools.{conn_id} (over run and box)", {**self.run, **pool.run}, {**self.box, **pool.box})
                for conn_id, pool in self.box_pools.items()
            ),
        ]

    def layered_runs(self) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any]]]:
        """(where, preset name, run layers with the preset over them, box) for every box and preset: what the
        settings can make of a run, before the form."""
        for where, run, box in self.box_layers():
            for name in self.preset_names():
                yield where, name, {**run, **self.presets.get(name, {})}, box

    @model_validator(mode="after")
    def _defaults_are_allowed(self) -> Deployment:
        unused = sorted(set(self.api_key_endpoints) - set(self.box_env))
        if unused:
            raise ValueError(
                f"api_key_endpoints: {unused} not in box_env {self.box_env}, so no stage gets them; add "
                "them to box_env or remove them"
            )
        outside = [conn_id for conn_id in self.box_pools if conn_id not in self.allowed.boxes()]
        if outside:
            raise ValueError(
                f"box_pools: {outside} not in the allowed boxes {self.allowed.boxes()}; add them to "
                "allowed_boxes "
                "or remove them from box_pools"
            )
        narrow = [
            f"{conn_id}: shard_gpus {box.shard_gpus} > gpus {box.gpus}"
            for conn_id, box in self.box_pools.items()
            if box.shard_gpus > box.gpus
        ]
        if narrow:
            raise ValueError(f"box_pools: a shard cannot hold more GPUs than its box has ({'; '.join(narrow)})")
        if self.approve_promotion and not self.approvers:
            raise ValueError(
                "approvers: approve_promotion is on, but no one may approve; list the Airflow user names "
                'who may ("approvers": ["alice", "bob"]), or turn approve_promotion off'
            )
        # What every run gets (the settings' run and box, each box's own over them) must pass the deployment's own
        # check, with the form's default boxes (with box_pools, each box's DAG makes that box its runs' default).
        for where, name, run, box in self.layered_runs():  # a preset may name what `run` does: checked with each
            self.allowed.check(
                self.default_list("box.conn_ids", list(self.box_pools)[:1] or BoxSettings().conn_ids),
                list(box.get("stop_services") or []),
                run.get("generate.endpoint"),
                run.get("generate.api_key_env"),
                source=f"a run with the preset {name!r} on {where}",
                workdir=run.get("workdir"),
                pythons={"box.python": box.get("python"), "server.python": run.get("server.python")},
            )
        return self

    @classmethod
    def from_env(cls, dag_folder: str | os.PathLike[str] | None = None) -> Deployment:
        """The settings of the DAG file in `dag_folder` (settings_path), or the defaults when there is no file.
        `dag_folder`: default, Airflow's [core] dags_folder (for what has no DAG file of its own: the report tab,
        the stack's init)."""
        path, named_by = settings_path(dag_folder)
        if path is None:
            return cls()
        try:
            settings = cls.model_validate(json.loads(path.read_text(encoding="utf-8")))
        except ValidationError as err:
            raise ParamsError(format_validation_error(err, f"the settings file {path} ({named_by})")) from None
        except (OSError, ValueError) as err:
            raise ParamsError(f"{named_by}: cannot read {path}: {err}") from None
        settings._source = f"the settings file {path} ({named_by})"
        return settings

    def check_reports_store(self, executor: str) -> None:
        """A local reports folder (the default's too) under an executor whose workers share no disk: the report task
        would publish on one worker's disk and the report tab never see it. Refused (when the DAG file is parsed:
        an import error naming the executor and the fix) unless the settings say reports_shared_disk.
        `executor`: Airflow's [core] executor."""
        scheme = urlsplit(self.reports_url).scheme if self.reports_url else ""
        if self.reports_shared_disk or scheme not in LOCAL_STORE_SCHEMES | {""}:
            return
        multi_host = [name for name in executor_names(executor) if name not in SINGLE_HOST_EXECUTORS]
        if multi_host:
            where = self.reports_url or "the default, $AIRFLOW_HOME/eagle3-reports"
            raise ParamsError(
                f"{self._source}: reports_url ({where}) is a folder on each machine's own disk, but the executor "
                f"{', '.join(multi_host)} ([core] executor) runs tasks on workers that need not share one with each "
                "other or the API server: the report tab would not find what the report task published. Set "
                'reports_url to an object store (e.g. "s3://bucket/eagle3-reports" with reports_conn_id), or, '
                "where every worker and the API server mount that folder (one host's volume, NFS), set "
                '"reports_shared_disk": true there.'
            )

    # -- a run's config, from the form over the layers ---------------------------------------------------
    def preset_names(self) -> list[str]:
        """What the form's preset field offers: 'default' first, then the settings' presets."""
        return [DEFAULT_PRESET, *(name for name in self.presets if name != DEFAULT_PRESET)]

    def configs(self, params: dict[str, Any], run_id: str) -> tuple[RunConfig, BoxSettings]:
        """The run config and box settings of a trigger's form values: the form over the chosen preset over `run`
        (eagle3_airflow.params); errors name the field, or the preset, and the fix."""
        preset = params.get(PRESET) or DEFAULT_PRESET
        if preset not in self.preset_names():
            raise ParamsError(f"preset: {preset!r} is not one of this deployment's presets {self.preset_names()}")
        layers = {**self.run, **self.presets.get(preset, {})}
        if not layers.get("workdir"):
            raise ParamsError(
                f'workdir: {self._source} name no work directory on the box; set "run": '
                '{"workdir": "/data/eagle3"} there (or each box\'s under box_pools)'
            )
        return params_to_configs(params, run_id, self.run, self.presets.get(preset), self.box, preset)

    # -- boxes as resources (eagle3_airflow/pools.py) ------------------------------------------------
    def default_box(self) -> str | None:
        """The box of box_pools whose DAG keeps the id eagle3_drafter and alone runs the schedule: the form's default
        box (params' box.conn_ids) when box_pools lists it, else the first of box_pools; None without box_pools.
        So a deployment that adds a box keeps its DAG, its history, permissions and runs in flight, and its
        schedule: the new box gets a DAG of its own beside it (eagle3_airflow/pools.py)."""
        if not self.box_pools:
            return None
        chosen = self.default_list("box.conn_ids", [])[:1]
        return chosen[0] if chosen and chosen[0] in self.box_pools else next(iter(self.box_pools))

    def resources(self) -> list[BoxResource]:
        """One per DAG the drafter DAG file makes: one per box of box_pools (the default box's keeps the id
        eagle3_drafter, each other's is eagle3_drafter__<box>), or the one DAG over `pool`."""
        if not self.box_pools:
            return [BoxResource(dag_id=DAG_ID, conn_id=None, pool=self.pool, gpus=self.pool_slots, shard_gpus=1)]
        default = self.default_box()
        return [
            BoxResource(
                dag_id=DAG_ID if conn_id == default else f"{DAG_ID}__{conn_id}",
                conn_id=conn_id,
                pool=box.pool or f"eagle3_box_{conn_id}",
                gpus=box.gpus,
                shard_gpus=box.shard_gpus,
                scheduled=conn_id == default,
            )
            for conn_id, box in self.box_pools.items()
        ]

    def for_box(self, resource: BoxResource) -> Deployment:
        """The settings of the DAG that holds `resource`: with a box of its own, its runs may use that box only,
        and the form offers it alone; a DAG the schedule does not start (every box's but the default one's) has
        neither `schedule` nor `schedule_assets`, so that one tick, or one Asset update, makes one run."""
        if resource.conn_id is None:
            settings = self.model_copy()
        else:
            pool = self.box_pools[resource.conn_id]
            settings = self.model_copy(
                update={
                    "allowed_boxes": [resource.conn_id],
                    "params": {**self.params, "box.conn_ids": [resource.conn_id]},
                    "run": {**self.run, **pool.run},
                    "box": {**self.box, **pool.box},
                    **({} if resource.scheduled else {"schedule": None, "schedule_assets": []}),
                }
            )
        settings._source = self._source
        settings._resource = resource
        return settings

    def check_schedulable(self, params: dict[str, Param]) -> None:
        """A schedule starts runs from the form's defaults alone, so every required param needs one and together
        they must make a valid run. Otherwise the scheduler fails to create a run on every loop ('Failed creating
        DagRun', in its log only) and the UI shows nothing; raised while the DAG file is parsed, this is an import
        error the UI shows, naming the settings file. `params`: the DAG's Params (eagle3_airflow.params)."""
        if self.schedule is None and not self.schedule_assets:
            return
        what = " and ".join(
            filter(
                None,
                [
                    self.schedule and f"schedule {self.schedule!r}",
                    f"schedule_assets {self.schedule_assets}" if self.schedule_assets else None,
                ],
            )
        )
        why = f"{self._source}: {what} starts runs with the trigger form's defaults"
        missing = [name for name in required_params() if self.params.get(name) is None]
        if missing:
            raise ParamsError(
                f"{why}, and these required params have none: {missing}. Give them defaults in its "
                f'"params" (e.g. "params": {{"{missing[0]}": ...}}), or remove the schedule'
            )
        try:
            self.configs({name: param.value for name, param in params.items()}, "scheduled__check")
        except ParamsError as err:
            raise ParamsError(f"{why}, and they do not make a valid run: {err}") from None

    @property
    def source(self) -> str:
        """Where these settings come from, as a message names them."""
        return self._source

    @property
    def resource(self) -> BoxResource | None:
        """The box and pool of the DAG these settings are for (for_box); None for the settings as a whole."""
        return self._resource

    @property
    def allowed(self) -> Allowlist:
        """What runs of these settings may reach (eagle3_airflow/allowlist.py)."""
        return Allowlist(self)

    # -- what the trigger may choose -------------------------------------------------------------
    def default_list(self, dotted: str, model_default: list[str]) -> list[str]:
        """The form's default for a list param: the settings file's, or the model's."""
        return list(self.params.get(dotted) or model_default)

    def settle(self, config: RunConfig) -> RunConfig:
        """What the deployment, not the trigger, decides in a run config: its workdir spelled as normal_dir spells
        it (so every path of the run, and the box's records of it, spell it one way), and keep_versions."""
        try:
            workdir = normal_dir(config.workdir)
        except ValueError as err:
            raise ParamsError(f"workdir: {err}") from None
        return config.model_copy(
            update={
                "workdir": workdir,
                "evaluate": config.evaluate.model_copy(update={"keep_versions": self.keep_versions}),
            }
        )

    def form_choices(self) -> dict[str, list[str]]:
        """The values the trigger form offers for the list params whose items the deployment chooses."""
        return {"box.conn_ids": self.allowed.boxes()}

    def form(self) -> dict[str, Param]:
        """The trigger form's Params under these settings."""
        return build_params(self.params, self.form_choices(), self.preset_names())


def settings_path(dag_folder: str | os.PathLike[str] | None = None) -> tuple[Path | None, str]:
    """The settings file of the DAG file in `dag_folder`, and what names it: EAGLE3_DAG_SETTINGS when set (a relative
    path resolves against `dag_folder`, so that it names a file of the DAG bundle wherever the bundle is checked
    out), else eagle3_settings.json in `dag_folder` when there is one; (None, ...) for the built-in settings.
    `dag_folder`: default, Airflow's [core] dags_folder."""
    named = os.environ.get(SETTINGS_ENV)
    if named and Path(named).is_absolute():
        return Path(named), SETTINGS_ENV
    if dag_folder is None:
        from airflow.sdk import conf

        dag_folder = conf.get("core", "dags_folder")
    folder = Path(dag_folder).expanduser()
    if named:
        return folder / named, f"{SETTINGS_ENV}, in the DAG folder {folder}"
    beside = folder / SETTINGS_FILE
    return (beside, "beside the DAG file") if beside.is_file() else (None, "")


def create_pool_argvs(settings: Deployment, airflow: str = "airflow") -> list[list[str]]:
    """`airflow pools set` for each box's pool, its slots the box's GPUs. include_deferred: the remote stages defer
    within seconds of starting and wait in the triggerer for hours; a pool that does not count deferred tasks bounds
    nothing."""
    return [
        [
            airflow,
            "pools",
            "set",
            resource.pool,
            str(resource.gpus),
            f"the GPUs of {'box ' + resource.conn_id if resource.conn_id else 'the eagle3 box'}: eagle3 stages hold "
            "those they use (deferred ones count)",
            "--include-deferred",
        ]
        for resource in settings.resources()
    ]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import shutil
    import subprocess

    parser = argparse.ArgumentParser(
        prog="python -m eagle3_airflow.deployment",
        description="Create or update the Airflow pools (one per box of box_pools) of the DAG's settings file "
        f"({SETTINGS_FILE} in [core] dags_folder, or the one {SETTINGS_ENV} names; the built-in "
        "settings without one), counting deferred tasks. make demo, make airflow and the compose file's "
        "airflow-init run it.",
    )
    parser.add_argument("command", choices=["create-pool"])
    parser.add_argument("--airflow", default=shutil.which("airflow") or "airflow", help="the airflow executable")
    args = parser.parse_args(argv)
    for command in create_pool_argvs(Deployment.from_env(), args.airflow):
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
