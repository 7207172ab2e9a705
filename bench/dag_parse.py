"""Parse time of dags/eagle3_drafter.py as Airflow's DagBag records it, against a trivial DAG in the same run.

Two figures per DAG file, each the median of several fresh interpreters that have already imported
Airflow (as the dag-processor has):
  cold  the first parse: our modules (eagle3.config, eagle3_airflow) are imported during it;
  warm  a second parse in the same interpreter: the DAG file's own work (building ~60 Params from
        the run-config model and ~16 tasks, each of which deep-copies the DAG's params);
and the dag-processor's whole job for the file: the first parse plus DagSerialization (where Airflow
re-validates every param of every task), which is what the UI shows as the DAG's last parse duration
(that figure also counts the child process's start and the imports of our own modules).
Each twice: as the dag-processor's parse child has it (its manager froze the objects it had loaded, gc.freeze(),
before forking), and in a plain interpreter, where building our pydantic models triggers full collections over
Airflow's objects. The contract (under 0.25 s) is judged on the first.

    .venv/bin/python bench/dag_parse.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRIVIAL_DAG = """
from datetime import datetime
from airflow.sdk import DAG, task
with DAG(dag_id="trivial", schedule=None, start_date=datetime(2026, 1, 1)):
    @task
    def one():
        return 1
    one()
"""
MEASURE = """
import json, sys, time
from airflow.dag_processing.dagbag import DagBag
from airflow.serialization.serialized_objects import DagSerialization
from airflow.sdk import DAG, BaseOperator, task  # the dag-processor has these loaded before it parses
# ... and these, which serializing any DAG's task dependencies imports once (0.18 s: SQLAlchemy models). Measured
# cold in this fresh process they were charged to whichever DAG came first.
import airflow.models.serialized_dag, airflow.providers.standard.operators.trigger_dagrun  # noqa: E401,F401
# The dag-processor's manager calls gc.freeze() before it forks a parse child (airflow/dag_processing/manager.py,
# before_run), so the child's collections never walk what the manager had loaded. Without it, building our pydantic
# models triggers full collections over all of Airflow's objects, which cost more than the parse itself.
if sys.argv[2] == "frozen":
    import gc
    gc.freeze()
times = []
for _ in range(2):
    started = time.perf_counter()
    bag = DagBag(dag_folder=sys.argv[1])
    assert not bag.import_errors, bag.import_errors
    serialized = [json.dumps(DagSerialization.to_dict(dag)) for dag in bag.dags.values()]
    times.append((bag.dagbag_stats[0].duration.total_seconds(), time.perf_counter() - started))
print(json.dumps({"cold": times[0][0], "warm": times[1][0], "processor": times[0][1], "torch": "torch" in sys.modules}))
"""


def measure(dag_file: Path, env: dict, gc_mode: str, repeats: int = 5) -> dict:
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", MEASURE, str(dag_file), gc_mode],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        for _ in range(repeats)
    ]
    return {key: statistics.median(r[key] for r in runs) for key in ("cold", "warm", "processor")} | {
        "torch": any(r["torch"] for r in runs)
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as home:
        # Bytecode written and read as a deployment's would be: compiling our modules from source at every parse
        # (PYTHONDONTWRITEBYTECODE, set in some shells and CI images) would add ~0.05 s a parse; the image ships
        # its bytecode (Dockerfile).
        env = {**os.environ, "AIRFLOW_HOME": home, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        trivial = Path(home) / "trivial_dag.py"
        trivial.write_text(TRIVIAL_DAG)
        measure(REPO / "dags" / "eagle3_drafter.py", env, "frozen", repeats=1)  # writes __pycache__ once
        for gc_mode, what in (
            ("frozen", "as the dag-processor's child (the manager's objects frozen)"),
            ("unfrozen", "in a plain interpreter (e.g. `airflow dags test`)"),
        ):
            base = measure(trivial, env, gc_mode)
            ours = measure(REPO / "dags" / "eagle3_drafter.py", env, gc_mode)
            print(f"-- {what}")
            print(f"trivial DAG        cold {base['cold']:.3f} s   warm {base['warm']:.3f} s")
            print(
                f"eagle3_drafter.py  cold {ours['cold']:.3f} s   warm {ours['warm']:.3f} s   "
                f"torch imported: {ours['torch']}"
            )
            print(
                f"ratio to trivial   cold {ours['cold'] / base['cold']:.1f}x   warm {ours['warm'] / base['warm']:.1f}x"
            )
            print(
                f"dag-processor work (parse + serialize, as its child does): trivial {base['processor']:.3f} s, "
                f"eagle3_drafter.py {ours['processor']:.3f} s"
            )
            if gc_mode == "frozen":
                print(
                    f"contract (< 0.25 s): parse {'met' if ours['cold'] < 0.25 else 'NOT met'}, "
                    f"parse + serialize {'met' if ours['processor'] < 0.25 else 'NOT met'}"
                )


if __name__ == "__main__":
    main()
