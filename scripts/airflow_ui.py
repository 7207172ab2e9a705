"""`make airflow`: the Airflow UI on http://localhost:8080 with this project's DAG, quietly.

`airflow standalone` (SQLite; scheduler, triggerer, dag-processor and api server in one command) logs every
component's every line to the console. This starts it with that output in demo-work/airflow-standalone.log,
waits until its health endpoint reports every component healthy (and the Execution API has answered once),
prints the URL and the login, and then says nothing more until it stops (Ctrl-C stops it; if it dies, its last
log lines are printed). The environment (AIRFLOW_HOME, dags and plugins folders, the demo's form defaults) comes
from the Makefile.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
URL = "http://localhost:8080"
HEALTHY = ("metadatabase", "scheduler", "triggerer", "dag_processor")


def healthy() -> bool:
    try:
        with urllib.request.urlopen(f"{URL}/api/v2/monitor/health", timeout=5) as response:
            health = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return all(health.get(part, {}).get("status") == "healthy" for part in HEALTHY)


def warm_execution_api() -> None:
    """The Execution API builds its versioned routes on its first request (several CPU-seconds holding the api
    server's worker); ask it once now, so the first task's start call, with its 5 s timeout, does not pay."""
    with contextlib.suppress(urllib.error.URLError, OSError):
        urllib.request.urlopen(f"{URL}/execution/health", timeout=120).close()


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def main() -> None:
    # A SIGTERM (a closed terminal, `timeout`, a service manager) must stop standalone too: it runs in a session
    # of its own, so nothing else would.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    home = Path(os.environ["AIRFLOW_HOME"])
    # The key run plans are sealed with comes from the deployment's environment, never from a task
    # (eagle3_airflow/seal.py): a random one for this machine's UI, unless the caller set one.
    os.environ.setdefault("AIRFLOW_VAR_EAGLE3_PLAN_SECRET", secrets.token_urlsafe(32))
    log = REPO / "demo-work" / "airflow-standalone.log"
    log.parent.mkdir(exist_ok=True)
    airflow = str(Path(sys.executable).with_name("airflow"))
    # The DAG's pool must exist before its tasks can run, counting deferred ones (eagle3_airflow.deployment).
    with open(log, "ab") as out:
        subprocess.run([airflow, "db", "migrate"], stdout=out, stderr=subprocess.STDOUT, check=True)
        subprocess.run(
            [sys.executable, "-m", "eagle3_airflow.deployment", "create-pool", "--airflow", airflow],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )
    print(f"[airflow] starting airflow standalone (its log: {log}) ...", flush=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen([airflow, "standalone"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not healthy():
            if proc.poll() is not None:
                sys.exit(f"[airflow] airflow standalone exited ({proc.returncode}); last lines of {log}:\n{tail(log)}")
            time.sleep(1)
        warm_execution_api()
        passwords = home / "simple_auth_manager_passwords.json.generated"
        password = json.loads(passwords.read_text()).get("admin", "?") if passwords.exists() else "(see the log)"
        print(f"[airflow] ready: {URL}  login: admin / {password}  (Ctrl-C stops it)", flush=True)
        proc.wait()
        sys.exit(f"[airflow] airflow standalone exited ({proc.returncode}); last lines of {log}:\n{tail(log)}")
    except KeyboardInterrupt:
        print("\n[airflow] stopping ...", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):  # what of standalone's group outlived it (its api server)
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
