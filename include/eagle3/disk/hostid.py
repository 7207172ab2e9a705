"""Which host this is: the id that tells apart two boxes sharing a work directory (a shared disk), whatever their boot
ids. Recorded in a job's state.json (eagle3.jobs.job: another host's job is "foreign") and in a run directory's
owner.json (eagle3.jobs.runowner: another host's run is never pruned from here). Light: stdlib only.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

# Where a host's own id is (systemd's, then D-Bus's copy): unique per installed system and kept across reboots, where
# the boot id changes at each. Without either, the hostname stands in.
MACHINE_ID_PATHS = ("/etc/machine-id", "/var/lib/dbus/machine-id")
HOST_ID_FILE_VAR = "EAGLE3_HOST_ID_FILE"  # overrides the path: tests make one machine two hosts


class HostIdError(Exception):
    """EAGLE3_HOST_ID_FILE names no host id: the CLI exits 2 with the message."""


def read_host_id() -> str:
    """This host's id: the machine id (machine-id(5)), else the hostname. EAGLE3_HOST_ID_FILE overrides the path."""
    override = os.environ.get(HOST_ID_FILE_VAR)
    for path in (override,) if override else MACHINE_ID_PATHS:
        try:
            host_id = Path(path).read_text().strip()
        except OSError:
            continue
        if host_id:
            return host_id
    if override:  # a test's stand-in must be there: a typo would quietly make the host "this one" again
        raise HostIdError(f"{HOST_ID_FILE_VAR} {override}: no host id in it")
    return socket.gethostname()
