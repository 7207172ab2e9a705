"""The compose stack's FAB roles and first users; airflow-init runs `python /opt/airflow/deploy/fab_roles.py`.

Two roles on top of FAB's Viewer (read DAGs, runs, task instances and their logs; read, never edit, XCom and
approvals), each limited to one DAG for what it may change:

- Eagle3Trigger may trigger eagle3_drafter. FAB checks a new run as "can_create on DAG Runs" plus "can_edit on the
  DAG". It gets no can_edit on HITL Detail (answering an approval or a required action), no create/edit/delete on
  XComs, and no edit on Task Instances (clearing or marking tasks).
- Eagle3Approver may answer the approvals of eagle3_promotion, the DAG that asks them (can_edit on HITL Detail,
  which FAB also checks against can_edit on the DAG), and sees the Required Actions menu; it may not trigger, and
  it changes nothing of eagle3_drafter.

FAB's own User and Op roles would not do: both may answer every DAG's approvals and clear tasks, Op may edit XCom.

Each run makes the two roles hold exactly Viewer's permissions and those below (what the file does not list is
removed, so narrowing a role here takes effect at the next `up`), and creates the users named in the environment
that do not exist yet. Runs where the apache-airflow-providers-fab package is installed; this module's data is
importable without it (tests/test_compose.py checks it).
"""

from __future__ import annotations

import os
import sys

DAG_ID = "eagle3_drafter"
PROMOTION_DAG_ID = "eagle3_promotion"  # eagle3_airflow.promotion: where the settings' approve_promotion asks
DAG_RESOURCE = f"DAG:{DAG_ID}"  # FAB's per-DAG resource (airflow.providers.fab.www.security.permissions)
PROMOTION_DAG_RESOURCE = f"DAG:{PROMOTION_DAG_ID}"
BASE_ROLE = "Viewer"

# (action, resource) pairs on top of the base role's, FAB's names.
ROLES: dict[str, list[tuple[str, str]]] = {
    "Eagle3Trigger": [
        ("can_create", "DAG Runs"),
        ("can_edit", DAG_RESOURCE),
    ],
    "Eagle3Approver": [
        ("can_edit", "HITL Detail"),
        ("can_access_menu", "HITL Detail"),
        ("can_edit", PROMOTION_DAG_RESOURCE),
    ],
}

# (role, the environment variables naming the user and the password); the admin's is required by the compose file.
USERS = [
    ("Admin", "AIRFLOW_ADMIN_USER", "AIRFLOW_ADMIN_PASSWORD"),
    ("Eagle3Trigger", "AIRFLOW_TRIGGER_USER", "AIRFLOW_TRIGGER_PASSWORD"),
    ("Eagle3Approver", "AIRFLOW_APPROVER_USER", "AIRFLOW_APPROVER_PASSWORD"),
]


def wanted_users(environ: dict[str, str]) -> list[tuple[str, str, str]]:
    """(role, user name, password) for each user the environment names; a name without a password is an error."""
    users = []
    for role, user_var, password_var in USERS:
        name, password = environ.get(user_var, ""), environ.get(password_var, "")
        if not name:
            continue
        if not password:
            raise SystemExit(f"fab_roles: {user_var}={name!r} is set but {password_var} is empty; set it in .env "
                             f"(or empty {user_var} to create no {role} user)")
        users.append((role, name, password))
    return users


def sync(security_manager, environ: dict[str, str]) -> None:
    sm = security_manager
    base = sm.find_role(BASE_ROLE)
    if base is None:
        raise SystemExit(f"fab_roles: FAB's {BASE_ROLE} role is missing; run `airflow sync-perm` first")
    base_perms = {(p.action.name, p.resource.name) for p in base.permissions}
    for name, extra in ROLES.items():
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
    # The app context FAB's own `airflow roles`/`airflow users` commands use (the same security manager).
    from airflow.providers.fab.auth_manager.cli_commands.utils import get_application_builder

    with get_application_builder() as appbuilder:
        sync(appbuilder.sm, environ)


if __name__ == "__main__":
    sys.exit(main())
