"""Run in the real-sglang environment (.cache/sglang-env) by tests/test_layer_ids.py: SGLang's own code reads EAGLE-3
aux layer ids, and this prints what it made of them as JSON on stdout.

  captured    {family: {ids given: layers_to_capture}}: set_eagle3_layers_to_capture of the DeepSeek-V2/V3, Kimi-K2.5
              and Llama models, called on stand-ins for the model objects (no GPU, no weights: the method only sets
              model.layers_to_capture; the forward passes capture the INPUT of each of those layers)
  drafter     the ids SGLang's spec_aux_hidden_state._resolve_eagle_aux_hidden_state takes from the exported drafter's
              config.json (argv[1]), which serving hands to set_eagle3_layers_to_capture; ModelConfig.from_server_args
              and the runtime context are stand-ins, the drafter's config is read by transformers as SGLang reads it
"""

from __future__ import annotations

import functools
import json
import sys
from types import SimpleNamespace
from unittest import mock

from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from transformers import AutoConfig

NUM_LAYERS = 61
IDS = [[1, 29, 57], [2, 30, 58], [0, 29, 57], [5, 10, 20], [1, 3, 4], [2, 4, 5]]


def model_stub():
    return SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=NUM_LAYERS),
        model=SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )


def captured_by(method, ids: list[int]) -> list[int]:
    model = model_stub()
    method(model, list(ids))
    return list(model.model.layers_to_capture)


def kimi_captured(ids: list[int]) -> list[int]:
    language_model = model_stub()
    kimi = SimpleNamespace(
        language_model=SimpleNamespace(
            set_eagle3_layers_to_capture=functools.partial(
                DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, language_model
            )
        )
    )
    KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture(kimi, list(ids))
    return list(language_model.model.layers_to_capture)


def drafter_ids(drafter_dir: str):
    hf_config = AutoConfig.from_pretrained(drafter_dir)
    draft = SimpleNamespace(
        hf_config=hf_config,
        num_nextn_predict_layers=None,
        is_hybrid_swa=False,
        is_deepseek_v4_arch=False,
        num_hidden_layers=1,
        num_attention_layers=1,
    )
    config = spec_aux_hidden_state.SpecAuxHiddenStateConfig()
    spec = SimpleNamespace(speculative_draft_model_path=drafter_dir, speculative_draft_model_revision=None)
    with (
        mock.patch.object(spec_aux_hidden_state, "get_spec", return_value=spec),
        mock.patch.object(spec_aux_hidden_state.ModelConfig, "from_server_args", return_value=draft),
    ):
        spec_aux_hidden_state._resolve_eagle_aux_hidden_state(
            config=config,
            server_args=SimpleNamespace(),
            model_config=SimpleNamespace(),
            spec_algorithm=SpeculativeAlgorithm.EAGLE3,
            is_draft_worker=False,
        )
    return config.eagle_aux_hidden_state_layer_ids


result = {
    "captured": {
        "deepseek": {
            json.dumps(ids): captured_by(DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, ids) for ids in IDS
        },
        "kimi": {json.dumps(ids): kimi_captured(ids) for ids in IDS},
        "llama": {json.dumps(ids): captured_by(LlamaForCausalLM.set_eagle3_layers_to_capture, ids) for ids in IDS},
    },
    "drafter": drafter_ids(sys.argv[1]) if len(sys.argv) > 1 else None,
}
print(json.dumps(result))
