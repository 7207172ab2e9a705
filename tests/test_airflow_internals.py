"""The upgrade test: every Airflow internal the project uses is fenced in eagle3_airflow.airflow_internals, and each
still has the attributes and signatures the project relies on. An Airflow upgrade that moves or changes one fails
here, loudly, instead of a 500 in the report tab or a note the listener never writes."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Airflow's own packages that are not its public interface (airflow.sdk, airflow.sdk.exceptions, the providers,
# airflow.triggers.base, airflow.listeners and airflow.plugins_manager are).
INTERNAL = (
    "airflow.models",
    "airflow.utils",
    "airflow.api_fastapi",
    "airflow.jobs",
    "airflow.serialization",
    "airflow.executors",
    "airflow.settings",
    "airflow.configuration",
    "airflow._shared",
)
FENCE = REPO / "plugins" / "eagle3_airflow" / "airflow_internals.py"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_no_module_but_the_fence_imports_an_airflow_internal():
    sources = sorted((REPO / "plugins").rglob("*.py")) + sorted((REPO / "dags").rglob("*.py"))
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in sources
        if path != FENCE
        for line, module in imported_modules(path)
        if module.startswith(INTERNAL)
    ]
    assert offenders == [], "import these through eagle3_airflow.airflow_internals (say why there): " + "; ".join(
        offenders
    )


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.slow
def test_each_fenced_name_has_what_the_project_uses():
    from fastapi.params import Depends
    from sqlalchemy.orm import Session

    from eagle3_airflow import airflow_internals as fenced

    assert sorted(fenced.__all__) == sorted(name for name, _ in imported_names(FENCE)), (
        "every fenced name is listed in __all__"
    )
    # report_view: select(DagRun.id).where(DagRun.dag_id == ..., DagRun.run_id == ...); run_note: dag_run.note;
    # notify.RunFirstQueuedAt: select(DagRun.queued_at)
    for column in ("id", "dag_id", "run_id", "note", "queued_at"):
        assert hasattr(fenced.DagRun, column), f"DagRun.{column}"
    assert parameters(fenced.DagRun.get_task_instances)[:2] == ["self", "state"]
    assert "session" in parameters(fenced.DagRun.get_task_instances)
    # run_note: one XCom row by run, task, map index and key, then its value
    for column in ("dag_run_id", "task_id", "map_index", "key"):
        assert hasattr(fenced.XComModel, column), f"XComModel.{column}"
    assert len(parameters(fenced.XComModel.deserialize_value)) == 1
    # report_view: `session: SessionDep` in a route, and the check that the caller may read the DAG's runs
    session_type, dependency = typing.get_args(fenced.SessionDep)[:2]
    assert session_type is Session and isinstance(dependency, Depends)
    assert parameters(fenced.requires_access_dag)[:2] == ["method", "access_entity"]
    assert callable(fenced.requires_access_dag("GET", fenced.DagAccessEntity.RUN))


def imported_names(path: Path) -> list[tuple[str, str]]:
    return [
        (alias.asname or alias.name, node.module)
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("airflow.")
        for alias in node.names
    ]


@pytest.mark.parametrize(
    "module, names",
    [
        ("airflow.triggers.base", ["BaseTrigger", "TriggerEvent"]),
        ("airflow.listeners", ["hookimpl"]),
        ("airflow.plugins_manager", ["AirflowPlugin"]),
    ],
)
def test_the_public_extension_points_used_are_where_the_public_interface_says(module, names):
    """Public, but outside airflow.sdk: the triggers, the listener and the plugin. What the project calls of them."""
    import importlib

    imported = importlib.import_module(module)
    for name in names:
        assert hasattr(imported, name), f"{module}.{name}"
    if module == "airflow.triggers.base":
        for method in ("serialize", "run", "on_kill", "cleanup"):
            assert hasattr(imported.BaseTrigger, method), f"BaseTrigger.{method}"
        assert imported.TriggerEvent({"status": "ok"}).payload == {"status": "ok"}
    if module == "airflow.plugins_manager":  # plugins/eagle3_ui.py registers the lateness deadline's reference
        assert isinstance(imported.AirflowPlugin.deadline_references, list)
