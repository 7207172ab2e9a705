"""The trigger form: what a person chooses per run, in a dozen fields; and the way from a trigger to a run config.

A run's config is built in layers, each a set of dotted run-config names (`train.epochs`, `extract.sglang.tp_size`),
a later layer winning:

    RunConfig's defaults < the deployment's `run` < the chosen preset < the form

The deployment's settings file (eagle3_airflow/deployment.py) holds the first two a person does not choose: `run`,
the box's facts (its workdir, the serving engine and its flags, endpoints), and `presets`, named sets of the
training knobs a person rarely touches. The form holds FORM_FIELDS: the run's name, the preset, the target and the
data, and the few knobs people change per run. Each form field is generated from the model field it names (title,
description, type, enum, range, pattern), so the form explains itself, Airflow refuses an out-of-range value before
a run exists, and an error from the box names the same dotted field the user sees. A trigger's conf may carry
nothing else: every other field is a door no trigger opens.

`BoxSettings` is how the DAG works a box (which python, the watchers' thresholds): the settings' `box`, except the
two a run chooses, which boxes (`box.conn_ids`, among those the deployment allows) and `box.redo_from`.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from eagle3.config import ABS_PATH_PATTERN, RUN_NAME_PATTERN, RunConfig, format_validation_error, parse_run_config
from eagle3.contracts import STALE_AFTER_S
from eagle3_airflow import DAG_ID

if TYPE_CHECKING:
    from airflow.sdk import Param

ConnId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,200}$")]
# Not starting with '-': a unit name reaches systemctl after "--" all the same, but "--all" is never a unit.
SystemdUnit = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9@_][A-Za-z0-9@._:-]{0,199}$")]


class BoxSettings(BaseModel):
    """The GPU box(es) and how the DAG watches them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an infinite timeout would mean "never"

    conn_ids: list[ConnId] = Field(
        default_factory=lambda: ["local"],
        min_length=1,
        title="Box connections",
        description="Airflow SSH connection ids of the GPU boxes ('local' = the Airflow worker itself), among those "
        "the deployment allows. Extraction shards are spread over them; they must share the work directory (NFS, "
        "Lustre).",
    )
    python: str = Field(
        "python3",
        title="Box python",
        description="Python on the box that has requirements-box.txt installed (absolute path or a name on PATH).",
        pattern=r"^[A-Za-z0-9_./+-]{1,200}$",
    )
    require_gpus: bool = Field(True, title="Require GPUs", description="Off only for CPU demos: no GPU check.")
    gpu_max_used_mib: int = Field(
        1024,
        ge=0,
        le=1 << 24,
        title="GPU memory counted as idle (MiB)",
        description="A GPU with more memory in use than this, or with any compute process, is busy.",
    )
    stop_services: list[SystemdUnit] = Field(
        default_factory=list,
        title="Services to stop first",
        description="systemd units stopped before the GPU check, e.g. a vLLM server that starts at boot; only "
        "those the deployment allows.",
    )
    disk_margin: float = Field(
        1.2,
        ge=1.0,
        le=10.0,
        title="Disk estimate margin",
        description="The disk sensor waits for this many times the estimated hidden-state bytes to be free.",
    )
    poll_interval_s: float = Field(
        10.0,
        ge=0.2,
        le=600,
        title="Job poll interval (s)",
        description="How often a waiting task asks the box for its job's state (one SSH command each).",
    )
    ssh_grace_s: float = Field(
        900.0,
        ge=0,
        le=7 * 24 * 3600,
        title="SSH outage tolerated (s)",
        description="While a job runs, SSH failures are retried with backoff for this long before the task fails "
        "(the job keeps running; a retry re-attaches).",
    )
    stale_after_s: float = Field(
        STALE_AFTER_S,
        ge=1,
        le=24 * 3600,
        title="Heartbeat timeout (s)",
        description="A job whose heartbeat is older is dead.",
    )
    stall_timeout_s: float = Field(
        900.0,
        ge=0,
        le=7 * 24 * 3600,
        title="Stall limit (s)",
        description="A stage that reports no progress (a batch, a step, a conversation) for this long is hung (an "
        "NCCL hang, a stuck filesystem): it is killed and the try fails; the retry resumes. 0: never.",
    )
    first_progress_timeout_s: float = Field(
        3600.0,
        ge=0,
        le=7 * 24 * 3600,
        title="Limit before the first progress (s)",
        description="The same, until a stage's first progress report: loading the target comes first. (Starting an "
        "SGLang server or engine allows its own startup time.)",
    )
    stage_timeout_h: float = Field(
        168.0,
        gt=0,
        le=24 * 90,
        title="Stage time limit (h)",
        description="How long a task waits for its stage at most (the deferral's timeout), however it progresses.",
    )
    # "none", not "": the web form's select takes an empty string for no value at all, and refuses the run.
    redo_from: Literal["none", "vocab", "train", "export", "evaluate", "benchmark"] = Field(
        "none",
        title="Redo from stage",
        description="Run this stage and every later one again from scratch, even where an earlier Airflow run of "
        "this run_name finished them (a clear only re-attaches to a finished stage): their outputs (vocab_mapping/, "
        "train/, drafter/, evaluate/, benchmark/) are renamed aside to NAME.before-redo-<time>, never mixed with the "
        "new ones, and 'nothing changed' does not skip them. none: finished stages are kept.",
    )


BOX_PREFIX = "box"
# What a person chooses per run: the trigger form, in this order. Every name but PRESET and NOTES is a field of
# RunConfig (or, under box., of BoxSettings) and gets that field's schema and help.
PRESET, NOTES = "preset", "notes"
FORM_FIELDS = (
    "run_name",
    PRESET,
    NOTES,
    "target.model_path",
    "data.path",
    "train.epochs",
    "train.learning_rate",
    "train.ttt_length",
    "evaluate.draft_lengths",
    "seed",
    "box.conn_ids",
    "box.redo_from",
)
BOX_FORM_FIELDS = ("conn_ids", "redo_from")  # the BoxSettings a run chooses; the deployment's `box` sets the rest
DEFAULT_PRESET = "default"  # always offered: the settings' `run` alone
NOTES_MAX = 500
# Run-config fields the deployment's settings file decides at its top level, never a layer: left out of the form,
# of `run` and of presets, refused in a trigger's conf (naming the settings key), filled in by Deployment.settle.
SETTINGS_ONLY = {"evaluate.keep_versions": "keep_versions"}
JSON_SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"
# run_name may be left empty in the form: the run is then named after its DAG id and Airflow run id.
RUN_NAME_OR_EMPTY = f"^$|{RUN_NAME_PATTERN}"
RUN, DATA, RECIPE, WHERE = (
    "run: its name, preset and why",
    "data: the target and the conversations",
    "recipe: the knobs people change per run",
    "box: where it runs",
)
SECTIONS = {
    "run_name": RUN,
    PRESET: RUN,
    NOTES: RUN,
    "target.model_path": DATA,
    "data.path": DATA,
    "box.conn_ids": WHERE,
    "box.redo_from": WHERE,
}  # the rest: RECIPE


# -- model -> params ---------------------------------------------------------------------------


# JSON schemas (pydantic's, Airflow's form's) are JSON objects: dict[str, Any].
def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return defs[ref.rsplit("/", 1)[1]] if ref else schema


def _leaf_schema(prop: dict[str, Any]) -> dict[str, Any]:
    """A pydantic property schema as Airflow's form likes it: `anyOf [X, null]` becomes X with a nullable type."""
    prop = dict(prop)
    for key in ("title", "description", "default"):
        prop.pop(key, None)
    options = prop.pop("anyOf", None)
    if options:
        non_null = [o for o in options if o.get("type") != "null"]
        if len(non_null) == 1:
            prop.update(non_null[0])
            prop["type"] = [non_null[0]["type"], "null"]
        else:
            prop["anyOf"] = options
    return prop


def _walk(model: type[BaseModel], prefix: str, section_of_top: str) -> list[tuple[str, str, dict[str, Any], Any]]:
    """(dotted name, section title, property schema, default or ...) for every leaf field."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    out: list[tuple[str, str, dict[str, Any], Any]] = []

    def visit(obj: dict[str, Any], path: str, section: str) -> None:
        for name, prop in obj["properties"].items():
            dotted = f"{path}.{name}" if path else name
            target = _resolve(prop, defs)
            if target.get("type") == "object" and "properties" in target:
                doc = (target.get("description") or "").strip().split("\n")[0].rstrip(".")
                visit(target, dotted, f"{dotted}: {doc}" if doc else dotted)
                continue
            required = name in obj.get("required", [])
            default = ... if required else _field_default(model, dotted.removeprefix(prefix).lstrip("."))
            out.append((dotted, section, {**prop, "_required": required}, default))

    visit(schema, prefix, section_of_top)
    return out


def _field_default(model: type[BaseModel], dotted: str) -> Any:
    """The default of a nested field, default factories included (the JSON schema leaves those out)."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        nested = model.model_fields[part].annotation
        if not (isinstance(nested, type) and issubclass(nested, BaseModel)):  # _walk descends into models alone
            raise TypeError(f"{dotted}: {part} is not a model")
        model = nested
    value = model.model_fields[leaf].get_default(call_default_factory=True)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


@functools.cache  # the models' JSON schemas, built once per process: each build costs the DAG parse ~15 ms
def model_leaves() -> dict[str, tuple[str, dict[str, Any], Any]]:
    """Every leaf of RunConfig, and of BoxSettings under box.: dotted name -> (section, schema, default or ...).
    Shared: copy a schema before changing it."""
    leaves = _walk(RunConfig, "", "run") + _walk(BoxSettings, BOX_PREFIX, BOX_PREFIX)
    return {dotted: (section, prop, default) for dotted, section, prop, default in leaves}


def run_layer_fields() -> list[str]:
    """The run-config fields the settings' `run` and presets may set: all but the form's and the settings' own."""
    return [
        name
        for name in model_leaves()
        if not name.startswith(BOX_PREFIX + ".") and name not in FORM_FIELDS and name not in SETTINGS_ONLY
    ]


def box_layer_fields() -> list[str]:
    """The BoxSettings fields the settings' `box` sets: all but those a run chooses."""
    return [name for name in BoxSettings.model_fields if name not in BOX_FORM_FIELDS]


def build_params(
    defaults: dict[str, Any] | None = None,
    choices: dict[str, list[str]] | None = None,
    presets: list[str] | None = None,
) -> dict[str, Param]:
    """Airflow Params for the trigger form (FORM_FIELDS); `defaults` (dotted names) override the models' defaults,
    `choices` (dotted names of list params) limit what their items may be (the deployment's allowed boxes), and
    `presets` are the names the preset field offers."""
    from airflow.sdk import Param

    defaults, choices = defaults or {}, choices or {}
    unknown = sorted(set(defaults) - set(FORM_FIELDS))
    if unknown:  # a typo, or a field that is the deployment's: the form's default would silently stay
        raise ParamsError(
            f"the settings' params: {unknown} are not form fields; params sets the form's "
            f"defaults for {list(FORM_FIELDS)}. A box's facts and the other run-config fields go in "
            'the settings\' "run" or a preset, BoxSettings in its "box"'
        )
    leaves = model_leaves()
    params: dict[str, Param] = {}
    for dotted in FORM_FIELDS:
        schema: dict[str, Any]
        prop: dict[str, Any]
        if dotted == PRESET:
            names = presets or [DEFAULT_PRESET]
            schema = {"type": "string", "enum": names}
            prop = {
                "title": "Preset",
                "description": "The recipe: a named set of the knobs a person rarely "
                'touches, from the deployment\'s settings (their "presets"; default: their "run" alone).',
            }
            default = defaults.get(PRESET, names[0])
        elif dotted == NOTES:
            schema = {"type": ["string", "null"], "maxLength": NOTES_MAX}
            prop = {"title": "Notes", "description": "Why this run, in a few words: the run's note shows them."}
            default = defaults.get(NOTES, "")
        else:
            _, prop, default = leaves[dotted]
            prop = dict(prop)
            prop.pop("_required")
            schema = _leaf_schema(prop)
            default = defaults.get(dotted, default)
        if dotted == "run_name":
            # Empty: named after its DAG and Airflow run (so a scheduled DAG gets a new run directory each time).
            # Nullable too: the web form sends an emptied field as null, and treats a non-nullable param as required.
            schema["pattern"] = RUN_NAME_OR_EMPTY
            schema["type"] = ["string", "null"]
            default = defaults.get(dotted, "")
        if dotted in choices:  # Airflow refuses anything else at trigger time, before a run exists
            schema["items"] = {**schema.get("items", {}), "enum": list(choices[dotted])}
            if not choices[dotted]:
                schema["maxItems"] = 0
        # Draft-07 rather than jsonschema's default 2020-12: Airflow re-validates every param each time it
        # serializes the DAG (every parse), and checking a value against a draft-07 schema is about 3x cheaper
        # (its meta-schema is one document, 2020-12's a tree of vocabularies). pydantic's keywords (numeric
        # exclusiveMinimum, pattern, enum) are draft-07 keywords. See also the end of dags/eagle3_drafter.py.
        schema["$schema"] = JSON_SCHEMA_DRAFT
        description = _describe(prop, default is ...)
        if dotted == "run_name":
            description += " Empty: named after its DAG id and Airflow run id."
        kwargs: dict[str, Any] = dict(
            title=prop.get("title", dotted), description=description, section=SECTIONS.get(dotted, RECIPE)
        )
        # A required field with no default (a path on the box) gets no default: the form then demands a
        # value, and a scheduled run needs one from the settings file's params.
        params[dotted] = Param(**kwargs, **schema) if default is ... else Param(default, **kwargs, **schema)
    return params


def required_params() -> list[str]:
    """The form's fields that have no default of their own (paths on the box): a trigger or the settings' params
    give them."""
    leaves = model_leaves()
    return sorted(name for name in FORM_FIELDS if name in leaves and leaves[name][2] is ... and name != "run_name")


def _describe(prop: dict[str, Any], required: bool) -> str:
    text = prop.get("description") or ""
    if prop.get("pattern") == ABS_PATH_PATTERN:
        text = (text + " Absolute path on the box.").strip()
    if required:
        text = (text + " Required.").strip()
    return text


# -- params -> validated run config ------------------------------------------------------------


class ParamsError(ValueError):
    """Trigger parameters that cannot make a run; the message names every bad key and the fix."""


def check_unknown_keys(conf: dict[str, Any], known: set[str]) -> None:
    """Airflow merges conf keys that are not params into params unvalidated: refuse them here, saying whose they are."""
    decided = sorted(set(conf) & set(SETTINGS_ONLY))
    if decided:
        raise ParamsError(
            "; ".join(
                f"{name!r}: the deployment decides it (its settings file's "
                f"{SETTINGS_ONLY[name]!r}), not a trigger; leave it out"
                for name in decided
            )
        )
    unknown = sorted(set(conf) - known)
    if not unknown:
        return
    deployments = set(model_leaves())
    hints = []
    for key in unknown:
        near = [k for k in sorted(known) if k.split(".")[-1] == key.split(".")[-1]] or difflib.get_close_matches(
            key, sorted(known), n=1, cutoff=0.8
        )
        if near:
            hints.append(f"{key!r} (did you mean {near[0]!r}?)")
        elif key in deployments:
            hints.append(f"{key!r} (the deployment's: its settings' run, box or a preset)")
        else:
            hints.append(repr(key))
    raise ParamsError(
        f"not trigger parameters: {', '.join(hints)}. A trigger chooses only the form's fields "
        f"{sorted(known)}; everything about the box and the recipe is the deployment's settings file "
        "(dags/eagle3_settings.json, or EAGLE3_DAG_SETTINGS), which whoever runs this Airflow reviews."
    )


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """{"train.epochs": 2} -> {"train": {"epochs": 2}}; None values are dropped (the model's default applies)."""
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        if value is None:
            continue
        node = nested
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


RUN_NAME_MAX = 64  # (eagle3.config.RUN_NAME_PATTERN)


def default_run_name(dag_id: str, run_id: str) -> str:
    """The run directory's name when the form leaves run_name empty: the DAG id and the Airflow run id, so that runs
    of two DAGs (two boxes' DAGs share run ids: scheduled__<date>, an Asset's) never share a directory, e.g.
    eagle3_drafter.scheduled__2026-11-29T00-00-00-00-00. A name longer than run_name allows keeps its start and ends
    in a digest of the whole, so it still names one run."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{dag_id}.{run_id}").strip("-.")
    if len(readable) <= RUN_NAME_MAX and re.match(RUN_NAME_PATTERN, readable):
        return readable
    digest = hashlib.sha256(f"{dag_id}\0{run_id}".encode()).hexdigest()[:12]
    return f"{readable[: RUN_NAME_MAX - len(digest) - 1].rstrip('-.') or 'run'}-{digest}"


def params_to_configs(
    params: dict[str, Any],
    run_id: str,
    run: dict[str, Any] | None = None,
    preset: dict[str, Any] | None = None,
    box: dict[str, Any] | None = None,
    preset_name: str = DEFAULT_PRESET,
) -> tuple[RunConfig, BoxSettings]:
    """The form's values over the deployment's layers (`run`, then the chosen `preset`; `box` for BoxSettings),
    validated into a RunConfig and BoxSettings; errors name the dotted field and the fix."""
    form = {key: value for key, value in params.items() if key in FORM_FIELDS and key not in (PRESET, NOTES)}
    run_params = {
        **(run or {}),
        **(preset or {}),
        **{k: v for k, v in form.items() if not k.startswith(BOX_PREFIX + ".")},
    }
    box_params = {
        **(box or {}),
        **{k.removeprefix(BOX_PREFIX + "."): v for k, v in form.items() if k.startswith(BOX_PREFIX + ".")},
    }
    if not run_params.get("run_name"):  # (validate names it after its own DAG first; this is the settings' checks)
        run_params["run_name"] = default_run_name(DAG_ID, run_id)
    source = f"the run (the form over the preset {preset_name!r} and the settings' run)"
    try:
        config = parse_run_config(unflatten(run_params), source)
    except ValueError as err:
        raise ParamsError(str(err)) from None
    try:
        box_settings = BoxSettings.model_validate(unflatten(box_params))
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, "the box settings").replace("\n  ", "\n  box.")) from None
    return config, box_settings
