"""An SGLang plugin that hands captured hidden states over as files: the sglang backend's fast path.

SGLang 0.5.23 returns captured states to a request as Python lists: the scheduler's batch result processor
calls `.cpu().clone().tolist()` on every request's rows (SchedulerBatchResultProcessor.
_append_prefill_hidden_states, its one call site), and the lists cross two process hops. At Kimi width
(3 x 7168 aux + 7168 final values per token) that path moves a few hundred tokens/s per engine
(bench/sglang_state_transport.py). This plugin wraps that method through SGLang's own plugin framework
(srt/plugins: an entry point in the group `sglang.srt.plugins`, an AROUND hook in HookRegistry), with no
source patch:

  - for a request of ours (return_hidden_states=True, full capture, a sink directory configured), it writes
    the request's rows of `logits_output.hidden_states` (the aux states [T, 3H] in aux-capture mode) and of
    `logits_output.last_hidden_states` (the post-norm final state [T, H] that the logits processor keeps in
    that mode "for in-process consumers") to ONE safetensors file, {sink}/{rid}.safetensors, under a
    temporary name renamed into place: a file that exists is complete;
  - it then calls the original method with store=False, so SGLang still does its own row bookkeeping (the
    returned offset) but appends nothing: the list path stays empty;
  - only TP rank 0 writes: the states are replicated across TP ranks.
One engine and one prefill per sample thus give both the aux and the final states.

How it gets there: every SGLang scheduler process calls load_plugins() first, which finds the entry point
in `eagle3_capture-*.dist-info/entry_points.txt` beside the eagle3 package (the synced code directory is on
PYTHONPATH; nothing is pip-installed on the box), and the backend selects it with SGLANG_PLUGINS. Outside an
engine the backend started (no EAGLE3_CAPTURE_SINK in the environment) it registers nothing.

The hooked method is private, so `gate_problem()` checks the exact sglang versions this was read against and
the method's signature; a failing gate registers nothing. HookRegistry only logs a hook that fails to apply,
so the backend never trusts the registration: a start-up probe (one short request must produce its file)
decides, and the backend falls back to the list path when it does not (eagle3/capture/sglang.py).

Checked against the real sglang 0.5.23 package in tests/test_sglang_plugin.py (the real loader, registry and
method, on the CPU); not yet run inside a GPU engine: bench/gpu_capture_check.py does that in one command.
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
