"""Trigger-form params generated from the run-config model, and the way back from params to a config.

`eagle3.config.RunConfig` is the single source of truth: every leaf field becomes one Airflow Param
named by its dotted path (`train.epochs`, `extract.sglang.tp_size`), with the field's title,
description, type, enum, range and pattern, in a form section per config section. So the form
explains itself, Airflow refuses an out-of-range or mistyped value before a run exists, and an error
from the box names the same dotted field the user sees in the form.

Box-side operations that are not part of a run's outputs (which connection, which python, sensor
thresholds) live in `BoxSettings` and become params the same way, under `box.`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from eagle3.config import ABS_PATH_PATTERN, RUN_NAME_PATTERN, RunConfig, format_validation_error, parse_run_config

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
        1024, ge=0, le=1 << 24, title="GPU memory counted as idle (MiB)",
        description="A GPU with more memory in use than this, or with any compute process, is busy.",
    )
    stop_services: list[SystemdUnit] = Field(
        default_factory=list,
        title="Services to stop first",
        description="systemd units stopped before the GPU check, e.g. a vLLM server that starts at boot; only "
        "those the deployment allows.",
    )
    disk_margin: float = Field(
        1.2, ge=1.0, le=10.0, title="Disk estimate margin",
        description="The disk sensor waits for this many times the estimated hidden-state bytes to be free.",
    )
    poll_interval_s: float = Field(
        10.0, ge=0.2, le=600, title="Job poll interval (s)",
        description="How often a waiting task asks the box for its job's state (one SSH command each).",
    )
    ssh_grace_s: float = Field(
        900.0, ge=0, le=7 * 24 * 3600, title="SSH outage tolerated (s)",
        description="While a job runs, SSH failures are retried with backoff for this long before the task fails "
        "(the job keeps running; a retry re-attaches).",
    )
    stale_after_s: float = Field(
        120.0, ge=1, le=24 * 3600, title="Heartbeat timeout (s)", description="A job whose heartbeat is older is dead."
    )
    stall_timeout_s: float = Field(
        900.0, ge=0, le=7 * 24 * 3600, title="Stall limit (s)",
        description="A stage that reports no progress (a batch, a step, a conversation) for this long is hung (an "
        "NCCL hang, a stuck filesystem): it is killed and the try fails; the retry resumes. 0: never.",
    )
    first_progress_timeout_s: float = Field(
        3600.0, ge=0, le=7 * 24 * 3600, title="Limit before the first progress (s)",
        description="The same, until a stage's first progress report: loading the target comes first. (Starting an "
        "SGLang server or engine allows its own startup time.)",
    )
    stage_timeout_h: float = Field(
        168.0, gt=0, le=24 * 90, title="Stage time limit (h)",
        description="How long a task waits for its stage at most (the deferral's timeout), however it progresses.",
    )
    # "none", not "": the web form's select takes an empty string for no value at all, and refuses the run.
    redo_from: Literal["none", "vocab", "train", "export", "evaluate", "benchmark"] = Field(
        "none", title="Redo from stage",
        description="Run this stage and every later one again from scratch, even where an earlier Airflow run of "
        "this run_name finished them (a clear only re-attaches to a finished stage): their outputs (vocab_mapping/, "
        "train/, drafter/, evaluate/, benchmark/) are renamed aside to NAME.before-redo-<time>, never mixed with the "
        "new ones, and 'nothing changed' does not skip them. none: finished stages are kept.",
    )


BOX_PREFIX = "box"
# Run-config fields the deployment's settings file decides, never a trigger: left out of the form, refused in a
# trigger's conf (naming the settings key), filled in by the validate task (Deployment.settle).
SETTINGS_ONLY = {"evaluate.keep_versions": "keep_versions"}
JSON_SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"
# run_name may be left empty in the form: the run is then named after the Airflow run id.
RUN_NAME_OR_EMPTY = f"^$|{RUN_NAME_PATTERN}"


# -- model -> params ---------------------------------------------------------------------------


def _resolve(schema: dict, defs: dict) -> dict:
    ref = schema.get("$ref")
    return defs[ref.rsplit("/", 1)[1]] if ref else schema


def _leaf_schema(prop: dict) -> dict:
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


def _walk(model: type[BaseModel], prefix: str, section_of_top: str) -> list[tuple[str, str, dict, Any]]:
    """(dotted name, section title, property schema, default or ...) for every leaf field."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    out = []

    def visit(obj: dict, path: str, section: str) -> None:
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
        model = model.model_fields[part].annotation
    value = model.model_fields[leaf].get_default(call_default_factory=True)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def build_params(defaults: dict[str, Any] | None = None, choices: dict[str, list] | None = None) -> dict[str, Any]:
    """Airflow Params for the whole trigger form; `defaults` (dotted names) override the models' defaults, and
    `choices` (dotted names of list params) limit what their items may be (the deployment's allowed boxes)."""
    from airflow.sdk import Param

    defaults, choices = defaults or {}, choices or {}
    params: dict[str, Any] = {}
    leaves = _walk(RunConfig, "", "run: name, work directory, seed") + _walk(BoxSettings, BOX_PREFIX, "")
    for dotted, section, prop, default in leaves:
        if dotted in SETTINGS_ONLY:
            continue
        if dotted.startswith(BOX_PREFIX + "."):
            section = "box: " + BoxSettings.__doc__.strip().splitlines()[0].rstrip(".")
        required = prop.pop("_required")
        schema = _leaf_schema(prop)
        default = defaults.get(dotted, default)
        if dotted == "run_name":
            # Empty: named after the Airflow run (so a scheduled DAG gets a new run directory each time). Nullable
            # too: the web form sends an emptied field as null, and treats a non-nullable param as required.
            schema["pattern"] = RUN_NAME_OR_EMPTY
            schema["type"] = ["string", "null"]
            default = defaults.get(dotted, "")
        # Draft-07 rather than jsonschema's default 2020-12: Airflow re-validates every param each time it
        # serializes the DAG (every parse), and checking a value against a draft-07 schema is about 3x cheaper
        # (its meta-schema is one document, 2020-12's a tree of vocabularies). pydantic's keywords (numeric
        # exclusiveMinimum, pattern, enum) are draft-07 keywords. See also the end of dags/eagle3_drafter.py.
        if dotted in choices:  # Airflow refuses anything else at trigger time, before a run exists
            schema["items"] = {**schema.get("items", {}), "enum": list(choices[dotted])}
            if not choices[dotted]:
                schema["maxItems"] = 0
        schema["$schema"] = JSON_SCHEMA_DRAFT
        description = _describe(prop, required and dotted != "run_name")
        if dotted == "run_name":
            description += " Empty: named after the Airflow run id."
        kwargs = dict(title=prop.get("title", dotted), description=description, section=section)
        # A required field with no default (a path on the box) gets no default: the form then demands a
        # value, and a scheduled run needs one from the DAG settings file.
        params[dotted] = Param(**kwargs, **schema) if default is ... else Param(default, **kwargs, **schema)
    settings_only = sorted(set(defaults) & set(SETTINGS_ONLY))
    if settings_only:
        raise ParamsError(f"EAGLE3_DAG_SETTINGS params: {settings_only} are not form params; set "
                          f"{[SETTINGS_ONLY[name] for name in settings_only]} at the top level of the settings file")
    unknown = sorted(set(defaults) - set(params))
    if unknown:  # a typo in the settings file would otherwise leave the form's default silently unchanged
        raise ParamsError(f"EAGLE3_DAG_SETTINGS params: unknown key(s) {unknown}; use the form's dotted names, "
                          "e.g. 'train.epochs' or 'box.conn_ids'")
    return params


def required_params() -> list[str]:
    """The form's params that have no default of their own (paths on the box): a trigger or the settings file gives
    them."""
    leaves = _walk(RunConfig, "", "") + _walk(BoxSettings, BOX_PREFIX, "")
    return sorted(dotted for dotted, _, _, default in leaves if default is ... and dotted != "run_name")


def _describe(prop: dict, required: bool) -> str:
    text = prop.get("description") or ""
    if prop.get("pattern") == ABS_PATH_PATTERN:
        text = (text + " Absolute path on the box.").strip()
    if required:
        text = (text + " Required.").strip()
    return text


# -- params -> validated run config ------------------------------------------------------------


class ParamsError(ValueError):
    """Trigger parameters that cannot make a run; the message names every bad key and the fix."""


def check_unknown_keys(conf: dict, known: set[str]) -> None:
    """Airflow merges conf keys that are not params into params unvalidated: refuse them here."""
    decided = sorted(set(conf) & set(SETTINGS_ONLY))
    if decided:
        raise ParamsError("; ".join(f"{name!r}: the deployment decides it (its settings file's "
                                    f"{SETTINGS_ONLY[name]!r}, EAGLE3_DAG_SETTINGS), not a trigger; leave it out"
                                    for name in decided))
    unknown = sorted(set(conf) - known)
    if unknown:
        hints = []
        for key in unknown:
            near = [k for k in sorted(known) if k.split(".")[-1] == key.split(".")[-1]]
            hints.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise ParamsError(
            "unknown trigger parameter(s): " + ", ".join(hints)
            + ". Nested settings are written with dots, e.g. 'train.epochs'; the trigger form lists them all."
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


def run_name_from_run_id(run_id: str) -> str:
    """A run-name-safe, readable, unique name for an Airflow run id (e.g. scheduled__2026-11-29T00:00:00+00:00)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", run_id).strip("-.")[:64]
    return name or "run"


def params_to_configs(params: dict[str, Any], run_id: str) -> tuple[RunConfig, BoxSettings]:
    """Validate params into a RunConfig and BoxSettings; errors name the dotted param and the fix."""
    run_params = {k: v for k, v in params.items() if not k.startswith(BOX_PREFIX + ".")}
    box_params = {k.removeprefix(BOX_PREFIX + "."): v for k, v in params.items() if k.startswith(BOX_PREFIX + ".")}
    if not run_params.get("run_name"):
        run_params["run_name"] = run_name_from_run_id(run_id)
    try:
        config = parse_run_config(unflatten(run_params), "the trigger parameters")
    except ValueError as err:
        raise ParamsError(str(err)) from None
    try:
        box = BoxSettings.model_validate(unflatten(box_params))
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, "the box parameters").replace("\n  ", "\n  box.")) from None
    return config, box
