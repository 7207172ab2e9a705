"""The sglang capture backend's own logic: engine arguments, version gate, and turning results into states.

SGLang cannot run on a CPU machine, so `FakeEngine` stands in for sglang.Engine: it records the
arguments it was built with and answers generate() in the result layout sglang 0.5.23 produces
(meta_info.hidden_states[0] = prefill rows as nested lists). The real engine is checked against the hf
backend by bench/gpu_capture_check.py on a GPU box.
"""

from __future__ import annotations

import pytest
import torch

from eagle3.capture.sglang import SglangCapture, SglangSetupError, check_version, engine_kwargs, states_from_output
from eagle3.data import TokenizedSample


class FakeEngine:
    built: list[dict] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.width = 256 * (3 if kwargs.get("enable_return_aux_hidden_states") else 1)
        self.shut = False
        FakeEngine.built.append(self)

    def generate(self, input_ids, sampling_params, return_hidden_states):
        assert return_hidden_states is True and sampling_params["max_new_tokens"] == 1
        return [
            {"meta_info": {"hidden_states": [[[float(t) + c / 1000 for c in range(self.width)] for t in ids]]}}
            for ids in input_ids
        ]

    def shutdown(self):
        self.shut = True


def test_engine_arguments_for_capture(make_config):
    cfg = make_config(extract={"backend": "sglang", "sglang": {"tp_size": 8, "mem_fraction_static": 0.8,
                                                                "attention_backend": "triton",
                                                                "extra_args": {"cuda_graph_max_bs": 16}}})
    aux = engine_kwargs(cfg, "DeepseekV3ForCausalLM", "aux")
    assert aux["enable_return_aux_hidden_states"] is True and aux["speculative_algorithm"] == "EAGLE3"
    assert aux["return_aux_hidden_state_layer_ids"] == [1, 3, 4]  # HF [1, 3, 4], deepseek family, starts at 1
    assert aux["tp_size"] == 8 and aux["attention_backend"] == "triton" and aux["cuda_graph_max_bs"] == 16
    assert aux["disable_radix_cache"] is True and aux["chunked_prefill_size"] == -1
    assert aux["mem_fraction_static"] == pytest.approx(0.4)
    last = engine_kwargs(cfg, "DeepseekV3ForCausalLM", "last")
    assert last["enable_return_hidden_states"] is True and "speculative_algorithm" not in last


def test_extra_args_cannot_undo_the_capture_settings(make_config):
    cfg = make_config(extract={"backend": "sglang", "sglang": {"extra_args": {"disable_radix_cache": False}}})
    with pytest.raises(SglangSetupError, match="extract.sglang.extra_args: \\['disable_radix_cache'\\]"):
        engine_kwargs(cfg, "DeepseekV3ForCausalLM", "aux")


def test_version_gate_names_the_versions_and_the_fix():
    check_version("0.5.23")
    with pytest.raises(SglangSetupError, match="sglang 0.4.9 is installed.*>=0.5.23,<0.6.*gpu_capture_check"):
        check_version("0.4.9")


def test_wrong_row_count_is_an_error_that_suggests_the_cause():
    output = {"meta_info": {"hidden_states": [[[0.0] * 8] * 3]}}
    assert states_from_output(output, 3, 8).shape == (3, 8)
    with pytest.raises(RuntimeError, match="radix cache or chunked prefill"):
        states_from_output(output, 5, 8)


def test_capture_returns_aux_and_final_states_per_sample(make_config):
    cfg = make_config(extract={"backend": "sglang"})
    backend = SglangCapture(cfg, engine_factory=FakeEngine)
    batch = [TokenizedSample("a" * 16, [5, 6, 7], [0, 1, 1], False), TokenizedSample("b" * 16, [9], [1], False)]
    states = backend.capture(batch)
    assert [s.aux_hidden_states.shape for s in states] == [(3, 768), (1, 768)]
    assert [s.last_hidden_state.shape for s in states] == [(3, 256), (1, 256)]
    assert states[0].aux_hidden_states.dtype == torch.bfloat16
    assert states[0].last_hidden_state[2, 0].item() == 7.0
    backend.close()
    assert all(engine.shut for engine in FakeEngine.built[-2:])
