"""A stand-in for sglang.Engine in capture mode: SGLang cannot run on a CPU machine.

It answers what the capture backend relies on, the way sglang 0.5.23's source says the real engine does,
computing real states of the tiny target with transformers:
  - enable_return_hidden_states: meta_info.hidden_states[0] = the final post-norm state of every prompt
    token, as nested lists;
  - enable_return_aux_hidden_states + speculative_algorithm EAGLE3 + return_aux_hidden_state_layer_ids:
    the same place holds the aux states instead, SGLang ids read as sglang/srt/models/deepseek_v2.py reads
    them (+1 only when the first id is 1; a captured id j is the INPUT of layer j), concatenated in order;
    an id naming no layer's input (the last layer's output) is refused, as SGLang's logits processor does;
  - nothing is returned without return_hidden_states=True and one of those flags, nor with
    max_new_tokens 0, the radix cache on, or chunked prefill on (what the backend must switch off);
  - the capture plugin: an aux engine started with our plugin selected (SGLANG_PLUGINS, EAGLE3_CAPTURE_SINK in
    the environment its schedulers would inherit) and overlap scheduling off hands each request's aux and final
    states to the plugin's own writer (eagle3.capture.sglang_plugin.write_request_states) under the request's
    rid, and returns empty lists, as the hooked scheduler method does (tests/test_sglang_plugin.py checks that
    method against the real sglang package). FAKE_SGLANG_PLUGIN_SILENT=1 plays a hook that failed to apply
    (HookRegistry only logs it); FAKE_SGLANG_PLUGIN_GATE_PROBLEM plays a version the gate refuses.
Prompts are computed as one right-padded batch, exactly like the hf backend, so equal states mean equal
bits. Class attributes let a test see what happened: `live` engines (GPU memory holds ONE copy of a
Kimi-size target: a second engine raises), prefill tokens computed per capture mode, and a crash after
`crash_after_batches` generate calls (a VM dying mid-pass). FAKE_SGLANG_BATCH_DELAY_S slows every batch down,
so that a test can kill a pass in the middle. Selected by EAGLE3_SGLANG_ENGINE (eagle3/capture/sglang.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from eagle3.capture import sglang_plugin

DEEPSEEK_FAMILY = {"DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration"}


class EngineCrashed(RuntimeError):
    pass


class FakeSglangEngine:
    live = 0
    tokens_computed = {"aux": 0, "last": 0}
    started = {"aux": 0, "last": 0}
    crash_after_batches: int | None = None
    batches_served = 0
    on_generate = None  # a test's callback, called with the capture mode before each batch

    @staticmethod
    def plugin_gate_problem() -> str | None:
        return os.environ.get("FAKE_SGLANG_PLUGIN_GATE_PROBLEM") or None

    @classmethod
    def reset(cls) -> None:
        cls.live = 0
        cls.tokens_computed = {"aux": 0, "last": 0}
        cls.started = {"aux": 0, "last": 0}
        cls.crash_after_batches = None
        cls.batches_served = 0
        cls.on_generate = None

    def __init__(self, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM

        if FakeSglangEngine.live:
            raise RuntimeError("CUDA out of memory: another engine holds the GPUs (one copy of the target fits)")
        assert kwargs["skip_tokenizer_init"] is True and kwargs["disable_radix_cache"] is True
        assert kwargs["chunked_prefill_size"] == -1
        self.mode = "aux" if kwargs.get("enable_return_aux_hidden_states") else "last"
        if self.mode == "aux":
            assert kwargs["speculative_algorithm"] == "EAGLE3"
        else:
            assert kwargs.get("enable_return_hidden_states") is True
        config = AutoConfig.from_pretrained(kwargs["model_path"])
        self.input_of_layers = None
        if self.mode == "aux":
            ids = kwargs["return_aux_hidden_state_layer_ids"]
            assert config.architectures[0] in DEEPSEEK_FAMILY, "this stand-in reads ids the DeepSeek way only"
            self.input_of_layers = [i + 1 for i in ids] if ids[0] == 1 else list(ids)
            if max(self.input_of_layers) >= config.num_hidden_layers:
                raise ValueError(
                    "The model captured 2 aux hidden states, but --return-aux-hidden-state-layer-ids "
                    "names 3 layers. A layer this model cannot capture, usually its last layer, ..."
                )
        selected = os.environ.get("SGLANG_PLUGINS", "").split(",")
        self.plugin_sink = None  # what the scheduler processes would read from the environment at start
        if (
            self.mode == "aux"
            and sglang_plugin.PLUGIN_NAME in selected
            and os.environ.get(sglang_plugin.SINK_ENV)
            and not os.environ.get("FAKE_SGLANG_PLUGIN_SILENT")
        ):
            assert kwargs.get("disable_overlap_schedule") is True, "overlap's CPU copy leaves the final states out"
            self.plugin_sink = Path(os.environ[sglang_plugin.SINK_ENV])
        dtype = getattr(torch, kwargs.get("dtype", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=dtype).eval()
        self.pad_id = self.model.config.pad_token_id or 0
        FakeSglangEngine.live += 1
        FakeSglangEngine.started[self.mode] += 1

    @torch.inference_mode()
    def generate(self, input_ids, sampling_params, return_hidden_states=False, rid=None):
        assert sampling_params["max_new_tokens"] >= 1, "sglang 0.5.23 returns no states with max_new_tokens 0"
        if FakeSglangEngine.crash_after_batches is not None:
            if FakeSglangEngine.batches_served >= FakeSglangEngine.crash_after_batches:
                raise EngineCrashed(f"crashed after {FakeSglangEngine.batches_served} batches")
        FakeSglangEngine.batches_served += 1
        if FakeSglangEngine.on_generate is not None:
            FakeSglangEngine.on_generate(self.mode)
        time.sleep(float(os.environ.get("FAKE_SGLANG_BATCH_DELAY_S", "0")))
        lengths = [len(p) for p in input_ids]
        ids = torch.full((len(input_ids), max(lengths)), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(input_ids):
            ids[row, : lengths[row]] = torch.as_tensor(prompt)
            mask[row, : lengths[row]] = 1
        out = self.model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        if self.mode == "aux":
            states = torch.cat([out.hidden_states[j] for j in self.input_of_layers], dim=-1)
        else:
            states = out.last_hidden_state
        FakeSglangEngine.tokens_computed[self.mode] += sum(lengths)
        results = []
        for row, n in enumerate(lengths):
            meta = {"prompt_tokens": n, "completion_tokens": 1}
            if return_hidden_states and self.plugin_sink is not None:
                sglang_plugin.write_request_states(
                    self.plugin_sink, rid[row], states[row, :n], out.last_hidden_state[row, :n]
                )
                meta["hidden_states"] = []  # the list path left empty
            elif return_hidden_states:
                meta["hidden_states"] = [states[row, :n].tolist()]
            results.append({"output_ids": [0], "meta_info": meta})
        return results

    def shutdown(self) -> None:
        FakeSglangEngine.live -= 1
