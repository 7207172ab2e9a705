"""The compose stack's FAB roles and first users; airflow-init runs `python /opt/airflow/deploy/fab_roles.py`.

Two roles on top of FAB's Viewer (read DAGs, runs, task instances and their logs; read, never edit, XCom and
approvals), each allowed to change only the DAGs the deployment's settings (the file the DAG file reads, found here
through [core] dags_folder: eagle3_drafter.py's folder in the image) make, by their ids:

- Eagle3Trigger, the operators: trigger, clear and mark the runs and tasks of every drafter DAG (eagle3_drafter, and
  eagle3_drafter__<box> for each other box of box_pools) and of eagle3_promotion, which approve_promotion adds
  (clearing its approval asks the approvers again), and read their logs. FAB grants "can_create on DAG Runs" (a new
  run), "can_edit on DAG Runs" (clear or mark a run) and, with it, "can_edit on Task Instances" (clear or mark a
  task) only on a DAG the user also has can_edit on. No can_edit on HITL Detail (answering an approval), no
  create/edit/delete on XComs, nothing on Variables.
- Eagle3Approver: answer the approvals of eagle3_promotion, the DAG that asks them (can_edit on HITL Detail, which
  FAB checks together with can_edit on the DAG), and see the Required Actions menu; it triggers and clears nothing.
  (can_edit on the DAG also lets FAB's UI pause it.) Which approvers the approval accepts is the settings' list.

Admin alone edits XCom and Variables. FAB's own User and Op roles would not do: both may answer every DAG's
approvals and clear every DAG's tasks, and Op edits XCom and Variables; give people these two roles instead.

Each run makes the two roles hold exactly Viewer's permissions and those below (what they do not list is removed,
so narrowing a role, or a box taken out of box_pools, takes effect at the next `up`), and creates the users named
in the environment that do not exist yet. Runs where the apache-airflow-providers-fab package is installed; the
roles are computed without it (tests/test_compose.py checks them, and checks them again through FAB itself).
"""

from __future__ import annotations

import os
import sys

from eagle3_airflow.approvals import PROMOTION_DAG_ID
from eagle3_airflow.deployment import Deployment
from eagle3_airflow.params import ParamsError

BASE_ROLE = "Viewer"
TRIGGER_ROLE = "Eagle3Trigger"
APPROVER_ROLE = "Eagle3Approver"

# (action, resource) pairs, FAB's names (airflow.providers.fab.www.security.permissions). These are granted for
# every DAG at once; FAB applies them only to a DAG whose own resource (dag_resource) the user may edit.
OPERATE = [
    ("can_create", "DAG Runs"),  # trigger
    ("can_edit", "DAG Runs"),  # clear or mark a run; with the next, clear or mark its task instances
    ("can_edit", "Task Instances"),
]
ANSWER_APPROVALS = [
    ("can_edit", "HITL Detail"),
    ("can_access_menu", "HITL Detail"),  # Required Actions
]

# (role, the environment variables naming the user and the password); the admin's is required by the compose file.
USERS = [
    ("Admin", "AIRFLOW_ADMIN_USER", "AIRFLOW_ADMIN_PASSWORD"),
    (TRIGGER_ROLE, "AIRFLOW_TRIGGER_USER", "AIRFLOW_TRIGGER_PASSWORD"),
    (APPROVER_ROLE, "AIRFLOW_APPROVER_USER", "AIRFLOW_APPROVER_PASSWORD"),
]


def dag_resource(dag_id: str) -> str:
    """FAB's resource for one DAG."""
    return f"DAG:{dag_id}"


def drafter_dag_ids(settings: Deployment) -> list[str]:
    """The training DAGs the DAG file makes under these settings: one per box of box_pools, or eagle3_drafter."""
    return [resource.dag_id for resource in settings.resources()]


def asking_dag_ids(settings: Deployment) -> list[str]:
    """The DAGs that ask approvals: eagle3_promotion when the settings turn approve_promotion on."""
    return [PROMOTION_DAG_ID] if settings.approve_promotion else []


def roles(settings: Deployment) -> dict[str, list[tuple[str, str]]]:
    """Each role's (action, resource) pairs on top of BASE_ROLE's, for the DAGs these settings make."""
    operated = [*drafter_dag_ids(settings), *asking_dag_ids(settings)]
    return {
        TRIGGER_ROLE: [*OPERATE, *(("can_edit", dag_resource(dag_id)) for dag_id in operated)],
        APPROVER_ROLE: [
            *ANSWER_APPROVALS,
            *(("can_edit", dag_resource(dag_id)) for dag_id in asking_dag_ids(settings)),
        ],
    }


def wanted_users(environ: dict[str, str]) -> list[tuple[str, str, str]]:
    """(role, user name, password) for each user the environment names; a name without a password is an error."""
    users = []
    for role, user_var, password_var in USERS:
        name, password = environ.get(user_var, ""), environ.get(password_var, "")
        if not name:
            continue
        if not password:
            raise SystemExit(
                f"fab_roles: {user_var}={name!r} is set but {password_var} is empty; set it in .env "
                f"(or empty {user_var} to create no {role} user)"
            )
        users.append((role, name, password))
    return users


def sync(security_manager, environ: dict[str, str], settings: Deployment) -> None:
    sm = security_manager
    base = sm.find_role(BASE_ROLE)
    if base is None:
        raise SystemExit(f"fab_roles: FAB's {BASE_ROLE} role is missing; run `airflow sync-perm` first")
    base_perms = {(p.action.name, p.resource.name) for p in base.permissions}
    for name, extra in roles(settings).items():
        role = sm.find_role(name) or sm.add_role(name)
        wanted = base_perms | set(extra)
        have = {(p.action.name, p.resource.name): p for p in role.permissions}
        for action, resource in sorted(wanted - set(have)):
            sm.add_permission_to_role(role, sm.create_permission(action, resource))
        for key in sorted(set(have) - wanted):
            sm.remove_permission_from_role(role, have[key])
        print(f"fab_roles: role {name}: {BASE_ROLE}'s permissions and {sorted(extra)}")
    for role_name, user, password in wanted_users(environ):
        if sm.find_user(username=user):
            print(f"fab_roles: user {user!r} exists; left as it is (its password too)")
            continue
        # FAB needs a name and an e-mail; the user can change them under "Your profile".
        created = sm.add_user(user, user, role_name, f"{user}@localhost", sm.find_role(role_name), password)
        if not created:
            raise SystemExit(f"fab_roles: could not create user {user!r} (role {role_name}); see the log above")
        print(f"fab_roles: user {user!r} created with role {role_name}")


def main() -> None:
    environ = dict(os.environ)
    wanted_users(environ)  # a name without a password fails before anything is written
    try:
        settings = Deployment.from_env()  # the DAGs' settings, as the dag-processor reads them ([core] dags_folder)
    except ParamsError as err:
        raise SystemExit(f"fab_roles: {err}") from None
    # The app context FAB's own `airflow roles`/`airflow users` commands use (the same security manager).
    from airflow.providers.fab.auth_manager.cli_commands.utils import get_application_builder

    with get_application_builder() as appbuilder:
        sync(appbuilder.sm, environ, settings)


if __name__ == "__main__":
    sys.exit(main())
