"""docker-compose.yaml, Dockerfile, .env.example and .dockerignore, checked without a docker engine.

`docker-compose config` (Debian's docker-compose 1.29; .ci/run installs it) interpolates a .env made from
.env.example, resolves anchors and paths and validates the file; the tests read what it prints. The parsing
also accepts Compose v2's output (lists instead of strings, long volume syntax), in case a developer's
`docker-compose` is the v2 binary.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yaml"
KEY_TARGET = "/opt/airflow/secrets/gpu_box_key"
JWT_SECRET = "test-jwt-secret-shared-by-all"
# One worker runs the module: `docker-compose config` (module-scoped `rendered`) runs once.
pytestmark = pytest.mark.xdist_group("test_compose")

AIRFLOW_SERVICES = {
    "airflow-apiserver": ["api-server"],
    "airflow-scheduler": ["scheduler"],
    "airflow-dag-processor": ["dag-processor"],
    "airflow-triggerer": ["triggerer"],
    "airflow-worker": ["celery", "worker"],
}
HEALTHCHECKS = {
    "postgres": ["CMD", "pg_isready", "-U", "airflow"],
    "redis": ["CMD", "redis-cli", "ping"],
    "airflow-apiserver": ["CMD-SHELL", "curl --fail --silent http://localhost:8080/api/v2/version && "
                                       "curl --fail --silent http://localhost:8080/execution/health"],
    "airflow-scheduler": ["CMD", "curl", "--fail", "http://localhost:8974/health"],
    "airflow-dag-processor": [
        "CMD-SHELL", 'airflow jobs check --job-type DagProcessorJob --hostname "${HOSTNAME}"'
    ],
    "airflow-triggerer": ["CMD-SHELL", 'airflow jobs check --job-type TriggererJob --hostname "${HOSTNAME}"'],
    "airflow-worker": [
        "CMD-SHELL",
        'celery --app airflow.providers.celery.executors.celery_executor.app inspect ping -d "celery@${HOSTNAME}"',
    ],
}
# The services that open SSH sessions to the box: tasks run on the worker, deferred jobs poll from the triggerer.
KEY_MOUNTED_IN = {"airflow-worker", "airflow-triggerer"}


def _docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing: .ci/run installs it (Debian package docker-compose)")
        pytest.skip("docker-compose not installed (apt-get install docker-compose)")
    return path


def _env_file(directory: Path, **overrides: str | None) -> Path:
    """.env.example with dummy secrets and a real key file; overrides replace a variable (None drops it)."""
    key = directory / "gpu_box_key"
    key.write_text("not a real key\n")
    values = {"AIRFLOW_JWT_SECRET": JWT_SECRET, "AIRFLOW_FERNET_KEY": "test-fernet-key", "GPU_BOX_SSH_KEY": str(key)}
    values.update(overrides)
    lines = []
    for line in (REPO / ".env.example").read_text().splitlines():
        name = line.split("=", 1)[0] if re.match(r"^[A-Z_][A-Z0-9_]*=", line) else None
        if name in values:
            if values[name] is not None:
                lines.append(f"{name}={values[name]}")
        else:
            lines.append(line)
    path = directory / "test.env"
    path.write_text("\n".join(lines) + "\n")
    return path


def _compose_config(env_file: Path, cwd: Path) -> subprocess.CompletedProcess:
    # A clean environment: variables exported in the caller's shell would take precedence over the env file.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    return subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), "--env-file", str(env_file), "config"],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
    )


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("compose")
    proc = _compose_config(_env_file(work), work)
    assert proc.returncode == 0, f"docker-compose config failed:\n{proc.stderr}"
    config = yaml.safe_load(proc.stdout)
    config["_key_source"] = str(work / "gpu_box_key")
    return config


def _argv(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def _unescape(argv: list[str]) -> list[str]:
    # `config` prints $$ for a literal $ (the container's shell expands ${HOSTNAME}, not compose).
    return [part.replace("$$", "$") for part in argv]


def _mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only), from short ("src:dst:mode") or long (dict) volume entries."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
        else:
            source, target, *mode = volume.split(":")
            mounts[target] = (source, mode == ["ro"])
    return mounts


def test_services_and_commands(rendered):
    services = rendered["services"]
    assert set(services) == {"postgres", "redis", "airflow-init", *AIRFLOW_SERVICES}
    for name, command in AIRFLOW_SERVICES.items():
        assert _argv(services[name]["command"]) == command, name
        assert services[name]["build"]["context"] == str(REPO), name
        assert services[name]["restart"] == "always", name
    ports = [p if isinstance(p, str) else f"{p['published']}:{p['target']}"
             for p in services["airflow-apiserver"]["ports"]]
    assert ports == ["8080:8080"]

    init = services["airflow-init"]
    assert _argv(init["entrypoint"]) == ["/bin/bash"]
    script = _argv(init["command"])[-1]
    assert "airflow db migrate" in script
    assert "python -m eagle3_airflow.deployment create-pool" in script  # the DAG's pool, counting deferred tasks
    assert "SIMPLE_AUTH_MANAGER_PASSWORDS_FILE" in script
    assert "restart" not in init and "healthcheck" not in init


def test_healthchecks(rendered):
    services = rendered["services"]
    for name, expected in HEALTHCHECKS.items():
        assert _unescape(_argv(services[name]["healthcheck"]["test"])) == expected, name
    assert services["airflow-worker"]["environment"]["DUMB_INIT_SETSID"] == "0"


def test_startup_order(rendered):
    services = rendered["services"]
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        conditions = {dep: spec["condition"] for dep, spec in services[name]["depends_on"].items()}
        assert conditions["postgres"] == conditions["redis"] == "service_healthy", name
        if name != "airflow-init":
            assert conditions["airflow-init"] == "service_completed_successfully", name
    assert services["airflow-worker"]["depends_on"]["airflow-apiserver"]["condition"] == "service_healthy"


def test_shared_airflow_environment(rendered):
    services = rendered["services"]
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        env = services[name]["environment"]
        assert env["AIRFLOW__API_AUTH__JWT_SECRET"] == JWT_SECRET, name
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CORE__FERNET_KEY"] == "test-fernet-key", name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://"), name
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql://"), name
        assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://:@redis:6379/0", name
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/", name
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "false", name
        assert env["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"] == "true", name
        assert env["PYTHONPATH"] == "/opt/airflow/include", name
        assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] == "admin:admin", name
        assert env["EAGLE3_DAG_SETTINGS"] in ("", None), name


def test_code_mounts_and_auth_volume(rendered):
    services = rendered["services"]
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        mounts = _mounts(services[name])
        for folder in ("dags", "plugins", "include"):
            assert mounts[f"/opt/airflow/{folder}"][0] == str(REPO / folder), (name, folder)
        assert mounts["/opt/airflow/logs"][0] == "airflow-logs", name
    # The passwords file airflow-init writes must be the one the api-server reads.
    passwords = services["airflow-apiserver"]["environment"]["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]
    auth_dir = str(Path(passwords).parent)
    assert _mounts(services["airflow-apiserver"])[auth_dir] == _mounts(services["airflow-init"])[auth_dir]


def test_gpu_box_connection_and_key(rendered):
    services = rendered["services"]
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        mounts = _mounts(services[name])
        if name in KEY_MOUNTED_IN:
            assert mounts[KEY_TARGET] == (rendered["_key_source"], True), name
        else:
            assert KEY_TARGET not in mounts, name
    for name in KEY_MOUNTED_IN:
        conn = json.loads(services[name]["environment"]["AIRFLOW_CONN_GPU_BOX"])
        assert conn["conn_type"] == "ssh" and conn["host"] and conn["login"], name
        extra = conn["extra"]
        assert extra["key_file"] == KEY_TARGET, name
        assert re.match(r"^ssh-ed25519 AAAA\S+$", extra["host_key"]), name
        assert "no_host_key_check" not in extra and "ignore_hostkey_verification" not in extra, name


@pytest.mark.parametrize("variable", ["AIRFLOW_JWT_SECRET", "AIRFLOW_FERNET_KEY", "AIRFLOW_CONN_GPU_BOX",
                                      "GPU_BOX_SSH_KEY"])
@pytest.mark.parametrize("how", ["missing", "empty"])
def test_required_variables(tmp_path, variable, how):
    proc = _compose_config(_env_file(tmp_path, **{variable: None if how == "missing" else ""}), tmp_path)
    assert proc.returncode != 0
    assert f"set {variable} in .env" in proc.stderr


def test_env_example_documents_every_variable():
    # ${VAR} is compose's (from .env); $${VAR} is left to the container's shell (HOSTNAME, the init script's).
    code = "\n".join(line for line in COMPOSE_FILE.read_text().splitlines() if not line.lstrip().startswith("#"))
    compose_vars = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", code))
    example = (REPO / ".env.example").read_text()
    example_vars = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", example, re.MULTILINE))
    assert compose_vars <= example_vars, compose_vars - example_vars
    # Each variable (or group of adjacent ones) has a comment right above it.
    above = ""
    for line in example.splitlines():
        if re.match(r"^[A-Z_][A-Z0-9_]*=", line):
            assert above.startswith("#"), f"{line!r} has no comment"
        else:
            above = line


def test_dockerfile_and_build_context():
    dockerfile = (REPO / "Dockerfile").read_text()
    instructions = [line for line in dockerfile.splitlines() if line.strip() and not line.startswith("#")]
    airflow_pin = re.search(r"^apache-airflow==(\S+)$", (REPO / "requirements.txt").read_text(), re.MULTILINE)
    assert instructions[0] == "FROM apache/airflow:3.3.2"
    assert airflow_pin and airflow_pin.group(1) == "3.3.2", "the image tag and requirements.txt's Airflow pin differ"
    assert re.search(r"^COPY requirements\.txt (\S+)$", dockerfile, re.MULTILINE)
    assert re.search(r"pip install --no-cache-dir -r /requirements\.txt", dockerfile)
    assert "USER root" not in dockerfile

    # The build context is an allowlist: only what the Dockerfile copies gets in (never .env or secrets/).
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile, re.MULTILINE))
    assert patterns[0] == "*"
    assert {p[1:] for p in patterns if p.startswith("!")} == copied
