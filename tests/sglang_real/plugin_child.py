"""Run by tests/test_sglang_plugin.py in the real-sglang environment (python with sglang 0.5.23 importable),
never by pytest itself: the control plane's environment has no sglang.

    python plugin_child.py OUT_DIR      (PYTHONPATH: a synced code directory; SGLANG_PLUGINS, EAGLE3_CAPTURE_SINK set)

Drives SGLang's own code on the CPU: the gate against the installed package, load_plugins() with the entry
point found on PYTHONPATH, HookRegistry's wrapping of the real SchedulerBatchResultProcessor method, and calls
of it the way process_batch_result_prefill makes them, for one prefill batch of several requests, with a real
LogitsProcessorOutput and CaptureHiddenMode. Writes OUT_DIR/inputs.safetensors (the batch's states) and
OUT_DIR/result.json (what the calls returned and left in the requests) for the test to compare with the files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def main(out: Path) -> None:
    import sglang
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling.sampling_params import SamplingParams

    from eagle3.capture import sglang_plugin

    result: dict = {"sglang": sglang.__version__, "gate": sglang_plugin.gate_problem()}

    # A version the plugin was not checked against registers nothing.
    real_version, sglang.__version__ = sglang.__version__, "0.6.0"
    result["gate_for_0.6.0"] = sglang_plugin.gate_problem()
    sglang_plugin.register()
    result["registered_for_0.6.0"] = sglang_plugin.HOOK_TARGET in HookRegistry._hooks
    sglang.__version__ = real_version

    original = SchedulerBatchResultProcessor._append_prefill_hidden_states
    load_plugins()  # what every scheduler process does first
    hooked = SchedulerBatchResultProcessor._append_prefill_hidden_states
    result["wrapped"] = hooked is not original and getattr(hooked, "__wrapped__", None) is original

    # One prefill batch: requests of 5, 1 and 7 tokens, a request that asked for no states, one the scheduler
    # does not commit (store=False), the rows of all of them side by side as the logits processor leaves them.
    torch.manual_seed(0)
    hidden = 8
    requests = [
        ("a-0", 5, True, True),
        ("a-1", 1, True, True),
        ("no-states", 3, False, True),
        ("a-3", 7, True, True),
        ("not-stored", 2, True, False),
    ]
    rows = sum(n for _, n, _, _ in requests)
    aux = torch.randn(rows, 3 * hidden).to(torch.bfloat16)
    last = torch.randn(rows, hidden).to(torch.bfloat16)
    save_file({"aux": aux, "last": last}, str(out / "inputs.safetensors"))
    processor = object.__new__(SchedulerBatchResultProcessor)  # the method reads nothing of the processor

    def prefill(tp_rank: int, mode, prefix: str) -> dict:
        output = LogitsProcessorOutput(next_token_logits=None, hidden_states=aux, last_hidden_states=last)
        offsets, lists = [], {}
        with get_parallel().override(tp_rank=tp_rank):
            offset = 0
            for rid, n, wants_states, store in requests:
                req = Req(
                    f"{prefix}{rid}",
                    "",
                    list(range(n)),
                    SamplingParams(max_new_tokens=1),
                    return_hidden_states=wants_states,
                )
                offset = processor._append_prefill_hidden_states(
                    req=req,
                    logits_output=output,
                    hidden_state_offset=offset,
                    capture_hidden_mode=mode,
                    extend_input_len=n,
                    store=store,
                )
                offsets.append(offset)
                lists[req.rid] = len(req.hidden_states)
        return {"offsets": offsets, "list_entries": lists}

    result["rank0"] = prefill(0, CaptureHiddenMode.FULL, "r0-")
    result["rank1"] = prefill(1, CaptureHiddenMode.FULL, "r1-")
    result["requests"] = [[rid, n, wants, store] for rid, n, wants, store in requests]
    (out / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
