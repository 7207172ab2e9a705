"""docker-compose.yaml, Dockerfile, .env.example, .dockerignore and deploy/, checked without a docker engine.

`docker-compose config` (Debian's docker-compose 1.29; .ci/run installs it) interpolates a .env made from
.env.example, resolves anchors and paths and validates the file; the tests read what it prints. The parsing
also accepts Compose v2's output (lists instead of strings, long volume syntax), in case a developer's
`docker-compose` is the v2 binary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import ParamsError

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yaml"
KEY_TARGET = "/opt/airflow/secrets/gpu_box_key"
JWT_SECRET = "test-jwt-secret-shared-by-all"
DB_PASSWORD = "test-db-password-from-env"
PLAN_SECRET = "test-plan-secret-only-the-worker-holds"
DEPLOY_DIR = "/opt/airflow/deploy"  # where the Dockerfile copies deploy/ (fab_roles.py)
SETTINGS_DIR = "/opt/airflow/settings"  # where the compose file mounts deploy/settings/
CODE_DIRS = ("dags", "plugins", "include", "deploy")
FAB = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"
FAB_ENV_PYTHON = REPO / ".cache" / "fab-env" / "bin" / "python"
TEST_TOOLS = {"pytest", "pytest-timeout", "pytest-xdist", "playwright", "ruff", "aiosmtpd", "psutil", "filelock"}
# One worker runs the module: `docker-compose config` (module-scoped `rendered`) runs once.
pytestmark = pytest.mark.xdist_group("test_compose")

AIRFLOW_SERVICES = {
    "airflow-apiserver": ["api-server"],
    "airflow-scheduler": ["scheduler"],
    "airflow-dag-processor": ["dag-processor"],
    "airflow-triggerer-1": ["triggerer"],
    "airflow-triggerer-2": ["triggerer"],
    "airflow-worker": ["celery", "worker"],
}
TRIGGERERS = ("airflow-triggerer-1", "airflow-triggerer-2")
HEALTHCHECKS = {
    "postgres": ["CMD", "pg_isready", "-U", "airflow", "-d", "airflow"],  # .env.example's POSTGRES_USER, _DB
    "redis": ["CMD", "redis-cli", "ping"],
    "airflow-apiserver": [
        "CMD-SHELL",
        "curl --fail --silent http://localhost:8080/api/v2/version && "
        "curl --fail --silent http://localhost:8080/execution/health",
    ],
    "airflow-scheduler": ["CMD", "curl", "--fail", "http://localhost:8974/health"],
    "airflow-dag-processor": ["CMD-SHELL", 'airflow jobs check --job-type DagProcessorJob --hostname "${HOSTNAME}"'],
    # Each triggerer asks for its own job: ${HOSTNAME} is the container id, which the job records.
    **{
        name: ["CMD-SHELL", 'airflow jobs check --job-type TriggererJob --hostname "${HOSTNAME}"']
        for name in TRIGGERERS
    },
    "airflow-worker": [
        "CMD-SHELL",
        'celery --app airflow.providers.celery.executors.celery_executor.app inspect ping -d "celery@${HOSTNAME}"',
    ],
}
# The services that open SSH sessions to the box: tasks run on the worker, deferred jobs poll from the triggerer.
KEY_MOUNTED_IN = {"airflow-worker", *TRIGGERERS}


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
    values = {
        "AIRFLOW_JWT_SECRET": JWT_SECRET,
        "AIRFLOW_FERNET_KEY": "test-fernet-key",
        "GPU_BOX_SSH_KEY": str(key),
        "AIRFLOW_API_SECRET_KEY": "test-api-secret-key",
        "POSTGRES_PASSWORD": DB_PASSWORD,
        "AIRFLOW_ADMIN_PASSWORD": "test-admin-password",
        "AIRFLOW_VAR_EAGLE3_PLAN_SECRET": PLAN_SECRET,
    }
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


def _compose_config(env_file: Path, cwd: Path, *more_files: Path) -> subprocess.CompletedProcess:
    # A clean environment: variables exported in the caller's shell would take precedence over the env file.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    files = [arg for path in (COMPOSE_FILE, *more_files) for arg in ("-f", str(path))]
    return subprocess.run(
        [_docker_compose(), *files, "--env-file", str(env_file), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
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


def _published(service: dict) -> list[str]:
    """host_ip:published:target of each TCP port, from the short syntax (Compose v1, which may add /tcp) or the long
    one (v2)."""
    return [
        port.removesuffix("/tcp")
        if isinstance(port, str)
        else f"{port.get('host_ip', '0.0.0.0')}:{port['published']}:{port['target']}"
        for port in service.get("ports", [])
    ]


@pytest.mark.slow
def test_services_and_commands(rendered):
    services = rendered["services"]
    assert set(services) == {"postgres", "redis", "airflow-init", *AIRFLOW_SERVICES}
    for name, command in AIRFLOW_SERVICES.items():
        assert _argv(services[name]["command"]) == command, name
        assert services[name]["build"]["context"] == str(REPO), name
        assert services[name]["restart"] == "always", name
    assert _published(services["airflow-apiserver"]) == ["127.0.0.1:8080:8080"]  # this machine only: plain HTTP

    init = services["airflow-init"]
    assert _argv(init["entrypoint"]) == ["/bin/bash"]
    script = _argv(init["command"])[-1]
    assert "airflow db migrate" in script
    assert "python -m eagle3_airflow.deployment create-pool" in script  # the DAG's pool, counting deferred tasks
    # FAB's roles and resources first, then ours and the users from .env (tests below check the roles).
    assert script.index("airflow sync-perm") < script.index(f"python {DEPLOY_DIR}/fab_roles.py")
    assert "SIMPLE_AUTH_MANAGER" not in script
    assert "restart" not in init and "healthcheck" not in init


@pytest.mark.slow
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
        assert env["AIRFLOW__API__SECRET_KEY"] == "test-api-secret-key", name
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CORE__FERNET_KEY"] == "test-fernet-key", name
        assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://:@redis:6379/0", name
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/", name
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "false", name
        assert env["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"] == "true", name
        # Users and roles: not the SimpleAuthManager, where every user may edit XCom and answer approvals.
        assert env["AIRFLOW__CORE__AUTH_MANAGER"] == FAB, name
        assert not any("SIMPLE_AUTH_MANAGER" in variable for variable in env), name
        # The settings file mounted from deploy/settings/ (no rebuild to change it), which allows gpu_box.
        assert env["EAGLE3_DAG_SETTINGS"] == f"{SETTINGS_DIR}/dag-settings.json", name
    for name in AIRFLOW_SERVICES:
        assert services[name]["environment"]["PYTHONPATH"] == "/opt/airflow/include", name


def test_database_credentials_come_from_the_env_file(rendered):
    """postgres creates the role with .env's POSTGRES_*; every Airflow container connects with the same ones."""
    services = rendered["services"]
    assert services["postgres"]["environment"] == {
        "POSTGRES_USER": "airflow",
        "POSTGRES_PASSWORD": DB_PASSWORD,
        "POSTGRES_DB": "airflow",
    }
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        env = services[name]["environment"]
        assert (
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
            == f"postgresql+psycopg2://airflow:{DB_PASSWORD}@postgres/airflow"
        ), name
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"] == f"db+postgresql://airflow:{DB_PASSWORD}@postgres/airflow", name
    # No password written into the files themselves: the literal airflow:airflow of the official file, or any.
    for path in (COMPOSE_FILE, REPO / ".env.example"):
        text = path.read_text()
        assert ":airflow@" not in text and "airflow:airflow" not in text, path
        assert re.search(r"^(POSTGRES|AIRFLOW_\w*)_PASSWORD=\S", text, re.MULTILINE) is None, path
    assert "POSTGRES_PASSWORD: ${POSTGRES_PASSWORD}" in COMPOSE_FILE.read_text()


def test_no_code_is_mounted_and_logs_are_shared(rendered):
    """The code is in the image (test_dockerfile_copies_the_code_and_no_test_tools), so the same image serves a
    KubernetesExecutor deployment: no service mounts the repository or a code folder. The one folder of the
    repository mounted is the settings', read-only: a settings change needs no rebuild (issue 43)."""
    services = rendered["services"]
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        mounts = _mounts(services[name])
        assert mounts.pop(SETTINGS_DIR) == (str(REPO / "deploy" / "settings"), True), name
        for target, (source, _) in mounts.items():
            assert not any(target.startswith(f"/opt/airflow/{folder}") for folder in CODE_DIRS), (name, target)
            assert not source.startswith(str(REPO)), (name, source)
        assert mounts["/opt/airflow/logs"][0] == "airflow-logs", name
    # Runs' published reports: written by the worker's report task, served by the api-server's report tab.
    for name in ["airflow-worker", "airflow-apiserver"]:
        assert _mounts(services[name])["/opt/airflow/eagle3-reports"][0] == "eagle3-reports", name
    # The `local` box's work directory: written by the worker, read by both triggerers.
    for name in ["airflow-worker", *TRIGGERERS]:
        assert _mounts(services[name])["/opt/airflow/eagle3-work"][0] == "local-box-work", name


@pytest.mark.slow
def test_the_dev_override_mounts_the_code_read_only(tmp_path):
    """deploy/docker-compose.dev.yaml, named with a second -f, is the only way code gets mounted."""
    proc = _compose_config(_env_file(tmp_path), tmp_path, REPO / "deploy" / "docker-compose.dev.yaml")
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        mounts = _mounts(services[name])
        for folder in CODE_DIRS:
            assert mounts[f"/opt/airflow/{folder}"] == (str(REPO / folder), True), (name, folder)
        assert mounts[SETTINGS_DIR] == (str(REPO / "deploy" / "settings"), True), name
        assert mounts["/opt/airflow/logs"][0] == "airflow-logs", name


def test_two_triggerers(rendered):
    """Two triggerers: one going away hands its triggers to the other; each is checked on its own."""
    services = rendered["services"]
    assert [name for name, spec in services.items() if _argv(spec.get("command", "")) == ["triggerer"]] == list(
        TRIGGERERS
    )
    for name in TRIGGERERS:
        assert services[name]["restart"] == "always"
        # The same settings, box connection and secrets as the scheduler that hands them their triggers.
        assert services[name]["environment"] == services["airflow-scheduler"]["environment"], name


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


def test_the_sealing_key_comes_from_the_env_file_to_the_worker_alone(rendered):
    """The key run plans and approvals are sealed with is set at deploy time, in .env (no task creates one, and one in
    the metadata DB is not read: eagle3_airflow/seal.py), and reaches only the container that runs tasks."""
    services = rendered["services"]
    assert services["airflow-worker"]["environment"]["AIRFLOW_VAR_EAGLE3_PLAN_SECRET"] == PLAN_SECRET
    holding = [
        name
        for name, spec in services.items()
        if name != "airflow-worker" and PLAN_SECRET in json.dumps(spec.get("environment", {}))
    ]
    assert holding == []


@pytest.mark.slow
def test_the_api_server_listens_on_this_machine_unless_the_env_file_widens_it(tmp_path):
    """The API server speaks plain HTTP: by default only this machine reaches it (an SSH tunnel, or a TLS proxy on
    the host); AIRFLOW_API_BIND_IP widens it on purpose."""
    proc = _compose_config(_env_file(tmp_path, AIRFLOW_API_BIND_IP="0.0.0.0"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _published(yaml.safe_load(proc.stdout)["services"]["airflow-apiserver"]) == ["0.0.0.0:8080:8080"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "variable",
    [
        "AIRFLOW_JWT_SECRET",
        "AIRFLOW_FERNET_KEY",
        "AIRFLOW_CONN_GPU_BOX",
        "GPU_BOX_SSH_KEY",
        "AIRFLOW_API_SECRET_KEY",
        "POSTGRES_USER",
        "POSTGRES_PASSWORD",
        "POSTGRES_DB",
        "AIRFLOW_ADMIN_PASSWORD",
        "AIRFLOW_VAR_EAGLE3_PLAN_SECRET",
    ],
)
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


def _requirements(path: Path) -> dict[str, str | None]:
    """name -> pinned version (None: unpinned) of a requirements file; options (-c, -r) left out."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            found[name.strip().lower()] = version.strip() or None
    return found


def test_dockerfile_copies_the_code_and_no_test_tools():
    dockerfile = (REPO / "Dockerfile").read_text()
    airflow_pin = re.search(r"^apache-airflow==(\S+)$", (REPO / "requirements.txt").read_text(), re.MULTILINE)
    stages = re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    assert stages == ["apache/airflow:3.3.2"] * 2, stages  # the code's stage (bytecode) and the image
    assert airflow_pin and airflow_pin.group(1) == "3.3.2", "the image tag and requirements.txt's Airflow pin differ"
    assert "USER root" not in dockerfile
    # The code and the settings, into the folders the compose environment names (and a Kubernetes pod would).
    copies = dict(re.findall(r"^COPY (\S+) (\S+)$", dockerfile, re.MULTILINE))
    compiled = dict(re.findall(r"^COPY --chown=airflow:root (\S+) (\S+)$", dockerfile, re.MULTILINE))
    final = dict(re.findall(r"^COPY --from=code (\S+) (\S+)$", dockerfile, re.MULTILINE))
    for folder in ("dags", "plugins", "include"):
        # compiled in the code stage, then copied owned by root (no --chown): read-only to the airflow user
        assert compiled[f"{folder}/"] == f"/opt/airflow/{folder}/", folder
        assert final[f"/opt/airflow/{folder}/"] == f"/opt/airflow/{folder}/", folder
    assert re.search(
        r"^RUN python -m compileall .*--invalidation-mode checked-hash "
        r"/opt/airflow/dags /opt/airflow/plugins /opt/airflow/include$",
        dockerfile,
        re.MULTILINE,
    )
    assert copies["deploy/fab_roles.py"] == f"{DEPLOY_DIR}/"  # of deploy/, the role script alone: settings are mounted
    assert re.search(r"^ENV PYTHONPATH=/opt/airflow/include\b", dockerfile, re.MULTILINE)
    assert "EAGLE3_DAG_SETTINGS=" not in dockerfile  # no settings baked in: changing them needs no rebuild
    # A slim image: it installs requirements-image.txt, which names no test tool and pins what it names, through
    # requirements.txt (-c) or itself; requirements.txt, which has the test tools, is only a constraint.
    assert re.search(r"pip install --no-cache-dir -r /requirements-image\.txt", dockerfile)
    assert not re.search(r"-r /requirements\.txt", dockerfile)
    image = (REPO / "requirements-image.txt").read_text()
    assert re.search(r"^-c requirements\.txt$", image, re.MULTILINE)
    wanted, pins = _requirements(REPO / "requirements-image.txt"), _requirements(REPO / "requirements.txt")
    assert not set(wanted) & TEST_TOOLS, set(wanted) & TEST_TOOLS
    assert TEST_TOOLS <= set(pins), "TEST_TOOLS names a package requirements.txt does not have"
    assert "torch" not in wanted  # only with EAGLE3_LOCAL_BOX (the `local` box's CPU stack)
    assert {"apache-airflow", "apache-airflow-providers-ssh", "apache-airflow-providers-fab"} <= set(wanted)
    for name, version in wanted.items():
        assert version or pins.get(name), f"{name} is pinned neither in requirements-image.txt nor requirements.txt"
        assert not (version and pins.get(name)), f"{name} is pinned twice"
    local_box = re.search(r"-c /requirements\.txt \\\s+([a-z ]+);", dockerfile).group(1).split()
    assert all(pins.get(name) for name in local_box), local_box

    # The build context is an allowlist: only what the Dockerfile copies gets in (never .env, secrets/, tests/).
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # (COPY --from=code copies from the code stage, not from the context)
    copied = set(re.findall(r"^COPY (?:--chown=\S+ )?([^-\s]\S*) ", dockerfile, re.MULTILINE))
    copied |= {"requirements-image.txt"}
    assert patterns[0] == "*"
    assert {p[1:] for p in patterns if p.startswith("!")} == {c.rstrip("/") for c in copied}
    assert "deploy/settings" not in " ".join(patterns + list(copied))  # mounted, never a stale copy in the image


# -- the DAG's settings in the stack ---------------------------------------------------------------------------


def _settings(name: str) -> Deployment:
    return Deployment.model_validate(json.loads((REPO / "deploy" / "settings" / name).read_text()))


def _run_from_the_form(settings: Deployment, **chosen) -> tuple:
    """The run config and box settings of a trigger that fills in the form's required fields and `chosen`."""
    values = {name: param.value for name, param in settings.form().items() if param.has_value}
    values.update({"target.model_path": "/models/kimi", "data.path": "/data/conversations.jsonl", **chosen})
    return settings.configs(values, "manual__2026-12-04T08:00:00+00:00")


def test_the_stacks_settings_allow_gpu_box_and_make_it_the_default():
    """The quickstart triggers with gpu_box: the built-in settings allow only `local`, so the stack has its own."""
    settings = _settings("dag-settings.json")
    assert settings.allowed.boxes() == ["gpu_box"]
    assert settings.params == {"box.conn_ids": ["gpu_box"]}  # the form's defaults: form fields only
    params = settings.form()
    assert params["box.conn_ids"].value == ["gpu_box"]  # the form's default
    # The box's facts are the settings' run: every run works in /data/eagle3 on the box.
    assert settings.run == {"workdir": "/data/eagle3"} and settings.allowed.workdirs() == ["/data/eagle3"]
    config, box = _run_from_the_form(settings)
    assert (config.workdir, box.conn_ids) == ("/data/eagle3", ["gpu_box"])
    settings.allowed.check_run(config, box.conn_ids, box.stop_services, python=box.python)
    # The worker itself is a box only when the deployment says so.
    with pytest.raises(
        ParamsError,
        match=r"box.conn_ids: \['local'\] not allowed here; this deployment allows "
        r"\['gpu_box'\]",
    ):
        settings.allowed.check(["local"], [], None, None, workdir=settings.run["workdir"])


def test_the_local_box_settings_allow_it_besides_gpu_box():
    settings = _settings("dag-settings-local-box.json")
    assert settings.allowed.boxes() == ["gpu_box", "local"]
    assert settings.params["box.conn_ids"] == ["gpu_box"]
    assert settings.form()["preset"].schema["enum"] == ["default", "local-box"]
    # On gpu_box, the work directory of the settings' run; on `local`, its preset's: the volume the worker and the
    # triggerers share (docker-compose.yaml).
    config, box = _run_from_the_form(settings)
    assert (config.workdir, box.conn_ids) == ("/data/eagle3", ["gpu_box"])
    config, box = _run_from_the_form(settings, preset="local-box", **{"box.conn_ids": ["local"]})
    assert config.workdir == "/opt/airflow/eagle3-work"
    settings.allowed.check_run(config, box.conn_ids, box.stop_services, python=box.python)
    # .env.example names it where the image has it.
    assert f"EAGLE3_DAG_SETTINGS={SETTINGS_DIR}/dag-settings-local-box.json" in (REPO / ".env.example").read_text()


def test_the_stacks_settings_say_its_workers_share_the_reports_volume():
    """The stack runs CeleryExecutor, under which a local reports folder is refused unless the settings say the
    workers and the API server share it: they do, the eagle3-reports volume on one Docker host."""
    for name in ("dag-settings.json", "dag-settings-local-box.json"):
        settings = _settings(name)
        assert settings.reports_url is None and settings.reports_shared_disk is True, name
        settings.check_reports_store("CeleryExecutor")


@pytest.mark.slow
def test_the_dag_parses_under_each_settings_file(airflow_home):
    """What the stack's dag-processor sees with either file, under the stack's executor: the DAG, no import error,
    the form's default box."""
    from tests.airflow_env import airflow_env

    files = [str(REPO / "deploy" / "settings" / name) for name in ("dag-settings.json", "dag-settings-local-box.json")]
    script = f"""
import json, os
from airflow.dag_processing.dagbag import DagBag
found = {{}}
for settings in {files!r}:
    os.environ["EAGLE3_DAG_SETTINGS"] = settings
    bag = DagBag(dag_folder={str(REPO / "dags" / "eagle3_drafter.py")!r})
    dag = bag.dags.get("eagle3_drafter")
    found[settings] = {{"errors": list(map(str, bag.import_errors.values())),
                       "box": dag and dag.params["box.conn_ids"]}}
print(json.dumps(found))
"""
    proc = subprocess.run(
        [os.sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=airflow_env(airflow_home, AIRFLOW__CORE__EXECUTOR="CeleryExecutor"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {path: {"errors": [], "box": ["gpu_box"]} for path in files}


# -- FAB roles (deploy/fab_roles.py) -----------------------------------------------------------------------------


def _fab_roles():
    spec = importlib.util.spec_from_file_location("fab_roles", REPO / "deploy" / "fab_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Settings with two boxes (two drafter DAGs) and approvals (the promotion DAG): every DAG the DAG file can make.
TWO_BOXES_WITH_APPROVAL = {
    "box_pools": {"gpu-box-1": {"gpus": 8}, "gpu-box-2": {"gpus": 8}},
    "params": {"box.conn_ids": ["gpu-box-1"]},
    "run": {"workdir": "/data/eagle3"},
    "approve_promotion": True,
    "approvers": ["alex"],
}
DRAFTER_DAGS = ["eagle3_drafter", "eagle3_drafter__gpu-box-2"]

# FAB's names (airflow.providers.fab.www.security.permissions): what answers an approval or a required action
# (HITL Detail, also checked against can_edit on the DAG), edits XCom or Variables, or clears and marks task
# instances.
ANSWERS_APPROVALS = ("can_edit", "HITL Detail")
EDITS_XCOM = {("can_create", "XComs"), ("can_edit", "XComs"), ("can_delete", "XComs")}
EDITS_VARIABLES = {("can_create", "Variables"), ("can_edit", "Variables"), ("can_delete", "Variables")}
EDITS_TASKS = {("can_edit", "Task Instances"), ("can_delete", "Task Instances"), ("can_create", "Task Instances")}


def _edited_dags(permissions) -> list[str]:
    """The DAGs whose own resource (DAG:<id>) a role may edit: where FAB lets its other edits apply."""
    return sorted(
        resource.removeprefix("DAG:")
        for action, resource in permissions
        if action == "can_edit" and resource.startswith("DAG:")
    )


def test_the_roles_name_every_dag_the_settings_make_and_no_other():
    """Operators trigger and clear every drafter DAG and the promotion DAG; approvers answer there alone; nobody
    but Admin edits XCom or Variables. With no box_pools and no approvals, only eagle3_drafter is named."""
    fab_roles = _fab_roles()
    assert fab_roles.BASE_ROLE == "Viewer"  # FAB's Viewer reads XCom and approvals, never edits them
    roles = fab_roles.roles(Deployment.model_validate(TWO_BOXES_WITH_APPROVAL))
    trigger, approver = set(roles["Eagle3Trigger"]), set(roles["Eagle3Approver"])
    assert _edited_dags(trigger) == sorted([*DRAFTER_DAGS, "eagle3_promotion"])
    assert {("can_create", "DAG Runs"), ("can_edit", "DAG Runs"), ("can_edit", "Task Instances")} <= trigger
    assert ANSWERS_APPROVALS not in trigger
    assert ("can_edit", "DAGs") not in trigger  # every DAG, not these
    assert ANSWERS_APPROVALS in approver and _edited_dags(approver) == ["eagle3_promotion"]  # the DAG that asks
    assert not approver & (EDITS_TASKS | {("can_create", "DAG Runs"), ("can_edit", "DAG Runs")})
    for permissions in (trigger, approver):
        assert not permissions & (EDITS_XCOM | EDITS_VARIABLES)

    plain = fab_roles.roles(Deployment())
    assert (_edited_dags(plain["Eagle3Trigger"]), _edited_dags(plain["Eagle3Approver"])) == (["eagle3_drafter"], [])


class _Named:
    def __init__(self, name):
        self.name = name


class _Perm:
    def __init__(self, action, resource):
        self.action, self.resource = _Named(action), _Named(resource)


class _Role:
    def __init__(self, name, perms=()):
        self.name, self.permissions = name, [_Perm(*p) for p in perms]


class _FakeSecurityManager:
    """The calls fab_roles makes on FAB's security manager, over in-memory roles and users. (The real one is driven
    in test_the_roles_through_fabs_own_authorization; this one lets a test start from roles widened by hand.)"""

    def __init__(self, roles):
        self.roles, self.users = {role.name: role for role in roles}, {}

    def find_role(self, name):
        return self.roles.get(name)

    def add_role(self, name):
        return self.roles.setdefault(name, _Role(name))

    def create_permission(self, action, resource):
        return _Perm(action, resource)

    def add_permission_to_role(self, role, perm):
        role.permissions.append(perm)

    def remove_permission_from_role(self, role, perm):
        role.permissions.remove(perm)

    def find_user(self, username):
        return self.users.get(username)

    def add_user(self, username, first_name, last_name, email, role, password):
        self.users[username] = (role.name, password)
        return True


def _perms(role):
    return {(p.action.name, p.resource.name) for p in role.permissions}


def test_init_narrows_a_widened_trigger_role_back_to_the_settings(capsys):
    """Someone gave the trigger role XCom edits and approvals in the UI, and a box left box_pools: the next `up` takes
    them away again."""
    fab_roles = _fab_roles()
    viewer = [("can_read", "DAGs"), ("can_read", "XComs"), ("can_read", "HITL Detail"), ("can_read", "Task Logs")]
    widened = _Role(
        "Eagle3Trigger",
        [
            *viewer,
            ("can_edit", "XComs"),
            ANSWERS_APPROVALS,
            ("can_create", "DAG Runs"),
            ("can_edit", "DAG:eagle3_drafter__gpu-box-3"),
        ],
    )
    sm = _FakeSecurityManager([_Role("Viewer", viewer), _Role("Admin"), widened])
    settings = Deployment.model_validate(TWO_BOXES_WITH_APPROVAL)
    fab_roles.sync(
        sm,
        {
            "AIRFLOW_ADMIN_USER": "admin",
            "AIRFLOW_ADMIN_PASSWORD": "pw",
            "AIRFLOW_TRIGGER_USER": "alice",
            "AIRFLOW_TRIGGER_PASSWORD": "pw2",
        },
        settings,
    )
    wanted = fab_roles.roles(settings)
    assert _perms(sm.roles["Eagle3Trigger"]) == set(viewer) | set(wanted["Eagle3Trigger"])
    assert _perms(sm.roles["Eagle3Approver"]) == set(viewer) | set(wanted["Eagle3Approver"])
    assert sm.users == {"admin": ("Admin", "pw"), "alice": ("Eagle3Trigger", "pw2")}
    # An existing user keeps its password: init never resets one someone changed.
    fab_roles.sync(sm, {"AIRFLOW_ADMIN_USER": "admin", "AIRFLOW_ADMIN_PASSWORD": "other"}, settings)
    assert sm.users["admin"] == ("Admin", "pw")


def test_a_user_named_without_a_password_stops_init_naming_the_variable():
    with pytest.raises(SystemExit, match="AIRFLOW_APPROVER_USER='bob' is set but AIRFLOW_APPROVER_PASSWORD is empty"):
        _fab_roles().wanted_users({"AIRFLOW_APPROVER_USER": "bob", "AIRFLOW_APPROVER_PASSWORD": ""})


FAB_CHECK = """
import json, sys
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity as E, DagDetails
from airflow.providers.fab.auth_manager.cli_commands.utils import get_application_builder
from airflow.providers.fab.auth_manager.fab_auth_manager import FabAuthManager

# The questions the API server's endpoints ask (airflow/api_fastapi/core_api/routes/public/): a trigger is POST on
# the DAG's runs, clearing or marking a task PUT on its task instances (clearTaskInstances), a run PUT on the run
# (clearDagRuns), answering an approval PUT on its HITL detail; pausing the DAG is PUT on the DAG itself.
CASES = {"trigger": ("POST", E.RUN), "read runs": ("GET", E.RUN), "read logs": ("GET", E.TASK_LOGS),
         "read xcom": ("GET", E.XCOM), "edit xcom": ("PUT", E.XCOM), "add xcom": ("POST", E.XCOM),
         "delete xcom": ("DELETE", E.XCOM), "answer approval": ("PUT", E.HITL_DETAIL),
         "read approval": ("GET", E.HITL_DETAIL), "clear tasks": ("PUT", E.TASK_INSTANCE),
         "clear runs": ("PUT", E.RUN), "read dag": ("GET", None), "pause dag": ("PUT", None)}
found = {}
manager = FabAuthManager()
with get_application_builder() as appbuilder:
    for name in ("tina", "alex", "admin"):
        user = appbuilder.sm.find_user(username=name)
        for dag in sys.argv[1:]:
            found[f"{name} {dag}"] = sorted(
                case for case, (method, entity) in CASES.items()
                if manager.is_authorized_dag(method=method, user=user, access_entity=entity,
                                             details=DagDetails(id=dag)))
        found[f"{name} variables"] = sorted(method for method in ("GET", "POST", "PUT", "DELETE")
                                            if manager.is_authorized_variable(method=method, user=user))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_the_roles_through_fabs_own_authorization(tmp_path):
    """airflow-init's steps on a fresh DB, with settings that make two drafter DAGs and the promotion DAG, then the
    questions the API server asks FAB for each endpoint: the trigger role triggers and clears every drafter DAG (and
    the promotion DAG, to ask again), the approver answers approvals only, and Admin alone edits XCom and Variables.
    In .cache/fab-env (`make fab-env`, built by `make test`): FAB beside the control plane's packages."""
    if not FAB_ENV_PYTHON.exists():
        pytest.fail(f"{FAB_ENV_PYTHON} is missing: `make fab-env` builds it (requirements-fab-env.txt)")
    settings = tmp_path / "dag-settings.json"
    settings.write_text(json.dumps(TWO_BOXES_WITH_APPROVAL))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__AUTH_MANAGER": FAB,
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path}/airflow.db",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        "AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path / "dags"),
        "AIRFLOW__API__SECRET_KEY": "test",
        "AIRFLOW_ADMIN_USER": "admin",
        "AIRFLOW_ADMIN_PASSWORD": "a",
        "AIRFLOW_TRIGGER_USER": "tina",
        "AIRFLOW_TRIGGER_PASSWORD": "t",
        "AIRFLOW_APPROVER_USER": "alex",
        "AIRFLOW_APPROVER_PASSWORD": "x",
        "EAGLE3_DAG_SETTINGS": str(settings),
        "PYTHONPATH": f"{REPO / 'plugins'}{os.pathsep}{REPO / 'include'}",
    }  # as airflow-init's
    python = str(FAB_ENV_PYTHON)
    for argv in (
        [python, "-m", "airflow", "db", "migrate"],
        [python, "-m", "airflow", "sync-perm"],
        [python, str(REPO / "deploy" / "fab_roles.py")],
    ):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-4000:])
    dags = [*DRAFTER_DAGS, "eagle3_promotion", "other_dag"]
    proc = subprocess.run([python, "-c", FAB_CHECK, *dags], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    reads = ["read approval", "read dag", "read logs", "read runs", "read xcom"]
    operates = ["clear runs", "clear tasks", "pause dag", "trigger"]
    for dag in DRAFTER_DAGS:
        assert found[f"tina {dag}"] == sorted([*reads, *operates]), dag  # no XCom edit, no approval answer
        assert found[f"alex {dag}"] == reads, dag
    assert found["tina eagle3_promotion"] == sorted([*reads, *operates])  # clear an approval to ask again
    # Answers, and FAB's can_edit on the DAG that answering needs also pauses it; triggers and clears nothing.
    assert found["alex eagle3_promotion"] == sorted([*reads, "answer approval", "pause dag"])
    assert found["tina other_dag"] == found["alex other_dag"] == reads
    assert found["tina variables"] == found["alex variables"] == []
    everything = sorted([*reads, *operates, "add xcom", "answer approval", "delete xcom", "edit xcom"])
    for dag in dags:
        assert found[f"admin {dag}"] == everything, dag  # Admin alone edits XCom
    assert found["admin variables"] == ["DELETE", "GET", "POST", "PUT"]
