"""The contracts between the control plane (plugins/eagle3_airflow) and the box (`python -m eagle3`), imported by both
sides: no torch, no Airflow.

PROTOCOL numbers everything a run carries across a deploy: the commands, flags and JSON replies the control plane
uses on the box, and the run plan it seals into XCom. A run's box code is pinned when the run is validated
(eagle3_airflow.codesync), so a worker deployed since may speak another protocol than the run's code on the box: it
refuses the run, saying what to do, instead of guessing what that code understands. Bump it with any such change.
"""

from __future__ import annotations

from enum import IntEnum

PROTOCOL = 1


class Exit(IntEnum):
    """How `python -m eagle3` ends."""

    OK = 0
    FAILED = 1  # an error a retry may get past: a crash, a lost device, a supervisor that did not come up
    REFUSED = 2  # wrong input (config, data, a file) or a refusal (another run's directory, a usage error): a retry
    #              cannot help
    FOREIGN = 3  # the job runs on another host sharing the work directory: this box can neither wait on it nor start it
