"""Where the SGLang stand-in (tests/fakes/sglang_server.py) is, and which of its processes are alive."""

from __future__ import annotations

import contextlib
from pathlib import Path

STAND_IN = Path(__file__).parent / "fakes" / "sglang_server.py"


def stand_in_processes(port: int | None = None) -> list[int]:
    """Pids of live stand-in servers (on `port`, if given), read from their command lines."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            argv = cmdline.read_bytes().split(b"\0")
            on_port = port is None or str(port).encode() in argv or f"--port={port}".encode() in argv
            if STAND_IN.name.encode() in b" ".join(argv) and on_port:
                pids.append(int(cmdline.parent.name))
    return pids
