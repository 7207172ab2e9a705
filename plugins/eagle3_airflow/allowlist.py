"""What a run may reach on the boxes: the settings' allow-lists, each left out meaning only what the settings
themselves name, and the check every run passes before anything starts (validate).

Whoever may trigger the DAG chooses the form's fields, nothing more; the settings file names the rest, and these
lists bound even what it names: which machines a run logs in to (allowed_boxes), which systemd units it stops
(allowed_services), which hosts generate sends conversations to (allowed_endpoint_hosts), where an API key may go
(api_key_endpoints), which workdirs and interpreters it uses (allowed_workdirs, allowed_pythons) and which of the
box's environment variables reach a stage (box_env). A refusal names the field, what is allowed and where it is set.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from eagle3.config import GenerateConfig, redact_url
from eagle3_airflow.params import BoxSettings, ParamsError

if TYPE_CHECKING:
    from eagle3.config import RunConfig
    from eagle3_airflow.pools import BoxPool, BoxResource


class Settings(Protocol):
    """What of the settings (eagle3_airflow.deployment.Deployment) the allow-lists read."""

    allowed_boxes: list[str] | None
    allowed_services: list[str] | None
    allowed_endpoint_hosts: list[str] | None
    allowed_workdirs: list[str] | None
    allowed_pythons: list[str] | None
    api_key_endpoints: dict[str, list[str]]
    box_env: list[str]
    box_pools: dict[str, BoxPool]
    keep_versions: int

    @property
    def source(self) -> str: ...

    @property
    def resource(self) -> BoxResource | None: ...

    def box_layers(self) -> list[tuple[str, dict[str, Any], dict[str, Any]]]: ...

    def default_list(self, dotted: str, model_default: list[str]) -> list[str]: ...


LOOPBACK_HOSTS = ["127.0.0.1", "localhost"]
DEFAULT_PORTS = {"http": 80, "https": 443}
SETTINGS_KEYS = (
    "allowed_boxes, allowed_services, allowed_endpoint_hosts, api_key_endpoints, allowed_workdirs, "
    "allowed_pythons, box_env"
)


def normal_dir(path: str) -> str:
    """An absolute directory as the box's kernel would name it, without following links: '.' and repeated or
    trailing slashes gone. Refuses '..', which only the box could resolve."""
    if ".." in path.split("/"):
        raise ValueError(f"{path!r} has a '..' component; name the directory itself")
    return "/" + posixpath.normpath(path).lstrip("/")


def endpoint_key(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, path) with the scheme's default port filled in and no trailing slash: two spellings of
    one endpoint compare equal."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # a port beyond 65535
        port = None
    return (
        parts.scheme.lower(),
        parts.hostname or "",
        port or DEFAULT_PORTS.get(parts.scheme.lower()),
        parts.path.rstrip("/"),
    )


class Allowlist:
    """The allow-lists of one settings file (Deployment.allowed)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def boxes(self) -> list[str]:
        if self.settings.allowed_boxes is not None:
            return self.settings.allowed_boxes
        if self.settings.box_pools:
            return list(self.settings.box_pools)
        return self.settings.default_list("box.conn_ids", BoxSettings().conn_ids)

    def services(self) -> list[str]:
        if self.settings.allowed_services is not None:
            return self.settings.allowed_services
        return sorted({unit for _, _, box in self.settings.box_layers() for unit in box.get("stop_services") or []})

    def endpoint_hosts(self) -> list[str]:
        if self.settings.allowed_endpoint_hosts is not None:
            return self.settings.allowed_endpoint_hosts
        endpoints = {
            run.get("generate.endpoint") or GenerateConfig().endpoint for _, run, _ in self.settings.box_layers()
        }
        return sorted({*LOOPBACK_HOSTS, *(urlsplit(url).hostname or "" for url in endpoints)} - {""})

    def pythons(self) -> list[str]:
        if self.settings.allowed_pythons is not None:
            return self.settings.allowed_pythons
        return sorted({box.get("python") or BoxSettings().python for _, _, box in self.settings.box_layers()})

    def workdirs(self) -> list[str]:
        if self.settings.allowed_workdirs is not None:
            return self.settings.allowed_workdirs
        workdirs = set()
        for _, run, _ in self.settings.box_layers():
            try:
                if isinstance(run.get("workdir"), str) and run["workdir"].startswith("/"):
                    workdirs.add(normal_dir(run["workdir"]))
            except ValueError:
                pass
        return sorted(workdirs)

    def workdir_problem(self, workdir: str) -> str | None:
        """Why a run may not use `workdir`, or None."""
        try:
            normal = normal_dir(workdir)
        except ValueError as err:
            return f"workdir: {err}"
        if ":" in workdir:  # the stages run with PYTHONPATH={workdir}/code/<digest>: a ':' would add other entries
            return (
                f"workdir: {workdir!r} has a ':', which would split the stages' PYTHONPATH ({workdir}/code/...) "
                "into entries that are not the synced code; name a directory without one"
            )
        if any(normal == allowed or normal.startswith(allowed.rstrip("/") + "/") for allowed in self.workdirs()):
            return None
        return f"workdir: {workdir!r} is not under a directory this deployment allows; it allows {self.workdirs()}"

    def endpoint_allowed(self, endpoint: str) -> bool:
        """The endpoint's host is allowed, on any port or on the port its entry names."""
        scheme, host, port, _ = endpoint_key(endpoint)
        for entry in self.endpoint_hosts():
            name, _, only_port = entry.partition(":")
            if name.lower() == host and (not only_port or int(only_port) == port):
                return True
        return False

    def key_endpoint_problem(self, api_key_env: str, endpoint: str) -> str | None:
        """Why the key in `api_key_env` may not go to `endpoint`, or None."""
        allowed = self.settings.api_key_endpoints.get(api_key_env, [])
        if endpoint_key(endpoint) in {endpoint_key(url) for url in allowed}:
            return None
        where = f"only to {allowed}" if allowed else "to no endpoint (api_key_endpoints lists none for it)"
        return (
            f"generate.api_key_env: the key in {api_key_env} may be sent {where}, not to generate.endpoint "
            f"{redact_url(endpoint)}"
        )

    def check(
        self,
        conn_ids: list[str],
        services: list[str],
        endpoint: str | None,
        api_key_env: str | None,
        source: str = "the run",
        workdir: str | None = None,
        box_env: list[str] | None = None,
        pythons: dict[str, str | None] | None = None,
    ) -> None:
        """Refuse a run that reaches past what this deployment allows; the message names the field, the allowed
        values and where they are set. `endpoint`: the one generate sends conversations to (None when the stage
        starts its own server); `box_env`: the variables a plan passes to the stages; `pythons`: field -> the
        interpreter it names (box.python, server.python)."""
        problems: list[str | None] = []  # None: a check that found nothing
        for field, chosen, allowed in (
            ("box.conn_ids", conn_ids, self.boxes()),
            ("box.stop_services", services, self.services()),
            ("box_env", box_env or [], self.settings.box_env),
            *((field, [python], self.pythons()) for field, python in (pythons or {}).items() if python),
        ):
            outside = [value for value in chosen if value not in allowed]
            if outside:
                problems.append(f"{field}: {outside} not allowed here; this deployment allows {allowed}")
        if endpoint is not None and not self.endpoint_allowed(endpoint):
            scheme, host, port, _ = endpoint_key(endpoint)
            problems.append(
                f"generate.endpoint: {host}:{port} not allowed here; this deployment allows {self.endpoint_hosts()}"
            )
        if api_key_env is not None and api_key_env not in self.settings.box_env:
            problems.append(
                f"generate.api_key_env: {api_key_env!r} is not a variable this deployment passes to the "
                f"stages; it passes {self.settings.box_env}"
            )
        elif api_key_env is not None and endpoint is not None:
            problems.append(self.key_endpoint_problem(api_key_env, endpoint))
        if workdir is not None:
            problems.append(self.workdir_problem(workdir))
        found = [problem for problem in problems if problem]
        if found:
            raise ParamsError(
                "\n  ".join([f"{source} reaches past what this deployment allows:", *found])
                + f"\nThe deployment sets these in {self.settings.source} ({SETTINGS_KEYS}); ask "
                "whoever runs this Airflow."
            )

    def check_run(
        self,
        config: RunConfig,
        conn_ids: list[str],
        services: list[str],
        box_env: list[str] | None = None,
        source: str = "the run",
        python: str | None = None,
    ) -> None:
        """`check` for a whole run config (and `python`, the plan's box.python); the keep_versions it carries must
        keep at least the settings' versions."""
        gen = config.generate
        uses_endpoint = gen.enabled and gen.backend == "server" and not gen.launch_server
        self.check(
            conn_ids,
            services,
            gen.endpoint if uses_endpoint else None,
            gen.api_key_env,
            source=source,
            workdir=config.workdir,
            box_env=box_env,
            pythons={"box.python": python, "server.python": config.server.python},
        )
        resource = self.settings.resource
        overuse = resource.overuse(config) if resource else []
        if resource is not None and overuse:
            raise ParamsError(
                "\n  ".join(
                    [
                        f"{source} uses more GPUs than the DAG {resource.dag_id} holds in the pool {resource.pool}:",
                        *overuse,
                    ]
                )
                + "\nChange the run, or ask whoever runs this Airflow to change box_pools."
            )
        if config.evaluate.keep_versions < self.settings.keep_versions:
            raise ParamsError(
                f"{source}: evaluate.keep_versions {config.evaluate.keep_versions} keeps fewer promoted "
                f"drafters than this deployment's keep_versions ({self.settings.keep_versions})"
            )
