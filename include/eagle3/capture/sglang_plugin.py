"""An SGLang plugin that hands captured hidden states over as files: the sglang backend's fast path.

An AROUND hook in SGLang's plugin framework on HOOK_TARGET (the scheduler's _append_prefill_hidden_states), with
no source patch. For a request of ours (return_hidden_states=True, full capture, a sink set) it writes the aux
[T, 3H] and post-norm final [T, H] states to {sink}/{rid}.safetensors (keys AUX_KEY, LAST_KEY), renamed into place
so a file that exists is complete, from TP rank 0 only; then it calls the original with store=False, so no lists
are returned (the slow path: bench/sglang_state_transport.py). Any other request gets SGLang's own behaviour.

Each scheduler process's load_plugins() finds the entry point (group `sglang.srt.plugins`, PLUGIN_NAME) in
eagle3_capture-1.0.dist-info/ beside the eagle3 package on PYTHONPATH (nothing is pip-installed on the box); the
backend selects it with SGLANG_PLUGINS and names the sink in EAGLE3_CAPTURE_SINK. Without that variable, or when
gate_problem() finds an sglang other than CHECKED_VERSIONS or another signature of the hooked method, it registers
nothing; the backend trusts only its start-up probe (eagle3/capture/sglang.py). tests/test_sglang_plugin.py checks
it against the real sglang 0.5.23 on the CPU; not yet run in a GPU engine: bench/gpu_capture_check.py does that in
one command.
Why: docs/decisions/2026-12-01-sglang-capture-plugin.md.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from pathlib import Path
from pkgutil import resolve_name

PLUGIN_NAME = "eagle3_capture"  # the entry point's name, what SGLANG_PLUGINS selects
SINK_ENV = "EAGLE3_CAPTURE_SINK"  # the directory the engine's scheduler writes states into
HOOK_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._append_prefill_hidden_states"
)
CHECKED_VERSIONS = ("0.5.23",)  # read and tested against these exactly; anything else takes the list path
EXPECTED_PARAMETERS = (
    "self",
    "req",
    "logits_output",
    "hidden_state_offset",
    "capture_hidden_mode",
    "extend_input_len",
    "store",
)
AUX_KEY, LAST_KEY = "aux_hidden_states", "last_hidden_state"
# A request id becomes a file name; the backend makes them of these characters only.
SAFE_RID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")

log = logging.getLogger(__name__)


def states_file(sink: Path, rid: str) -> Path:
    return Path(sink) / f"{rid}.safetensors"


def gate_problem() -> str | None:
    """Why the hook must not be applied to the installed sglang, or None if it may."""
    try:
        import sglang

        version = sglang.__version__
        method = resolve_name(HOOK_TARGET)
    except Exception as err:  # noqa: BLE001 - any import failure means: no plugin
        return f"cannot import the hooked method {HOOK_TARGET}: {type(err).__name__}: {err}"
    if version not in CHECKED_VERSIONS:
        return (
            f"sglang {version} is installed and the capture plugin was checked against sglang "
            f"{', '.join(CHECKED_VERSIONS)} only"
        )
    parameters = tuple(inspect.signature(inspect.unwrap(method)).parameters)
    if parameters != EXPECTED_PARAMETERS:
        return f"{HOOK_TARGET} takes {parameters} in sglang {version}, the plugin was written for {EXPECTED_PARAMETERS}"
    return None


def register() -> None:
    """The entry point: registers the hook in an engine the sglang backend started, else nothing."""
    if not os.environ.get(SINK_ENV):
        log.info("eagle3 capture plugin: %s is not set, so this engine is not an eagle3 capture; not hooking", SINK_ENV)
        return
    problem = gate_problem()
    if problem:
        log.warning("eagle3 capture plugin: not hooking (%s); the states take the list path", problem)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    signature = inspect.signature(inspect.unwrap(resolve_name(HOOK_TARGET)))

    def keep_states_as_files(original, *args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        return write_then_skip_the_lists(original, call.arguments)

    HookRegistry.register(HOOK_TARGET, keep_states_as_files, HookType.AROUND)
    log.info("eagle3 capture plugin: hooked %s; states go to %s", HOOK_TARGET, os.environ[SINK_ENV])


def write_then_skip_the_lists(original, arguments: dict):
    """The hook's body. `arguments`: the original's parameters by name (self, req, logits_output, ...)."""
    req, output, mode = arguments["req"], arguments["logits_output"], arguments["capture_hidden_mode"]
    ours = (
        arguments["store"]
        and req.return_hidden_states is True
        and mode.is_full()
        and output.last_hidden_states is not None
        # a subset of rows (hidden_states_token_indices) would not line up with the request's tokens
        and output.hidden_states_token_indices is None
    )
    if not ours:  # SGLang's own behaviour, lists included; the backend notices that no file came
        return original(**arguments)
    start = arguments["hidden_state_offset"]
    end = original(**{**arguments, "store": False})  # SGLang's row bookkeeping, nothing appended
    if _tp_rank() == 0:
        write_request_states(
            Path(os.environ[SINK_ENV]), req.rid, output.hidden_states[start:end], output.last_hidden_states[start:end]
        )
    return end


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank


def write_request_states(sink: Path, rid: str, aux, last) -> Path | None:
    """One request's aux [T, 3H] and final [T, H] states as {sink}/{rid}.safetensors, complete or absent.

    No fsync: the file lives until the store commits its batch (durably) and a restart starts an empty sink, so
    a power cut can lose it only together with work that is redone anyway."""
    from safetensors.torch import save_file

    if not SAFE_RID.fullmatch(str(rid)):
        log.warning("eagle3 capture plugin: request id %r is not one of the backend's; not writing it", rid)
        return None
    if aux.shape[0] != last.shape[0]:
        raise RuntimeError(
            f"eagle3 capture plugin: request {rid} has {aux.shape[0]} aux rows and {last.shape[0]} "
            "final-state rows; they must be the same tokens"
        )
    final = states_file(sink, rid)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    tensors = {AUX_KEY: aux.detach().cpu().contiguous(), LAST_KEY: last.detach().cpu().contiguous()}
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final
