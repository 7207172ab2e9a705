"""Run in the vLLM environment (.cache/vllm-env) by tests/test_layer_ids.py: vLLM's own code reads EAGLE-3 aux layer
ids, and this prints what it made of them as JSON on stdout.

  drafter    the ids GPUModelRunner._get_eagle3_aux_layers_from_config takes from the exported drafter's config.json
             (argv[1]), read by vLLM's own config loader; the runner around the method is a stand-in
  captured   {family: {ids given: the layer whose INPUT each captured state is}}: the DeepSeek-V2/V3 and Llama models'
             own forward loops, run over stand-in layers (layer j leaves j + 1 in the residual stream, the embedding
             leaves 0, so a captured state's value names the layer it entered), with the model's
             set_aux_hidden_state_layers; no weights, no distributed setup (get_pp_group is a one-rank stand-in)
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from unittest import mock

import torch
from vllm.model_executor.models import deepseek_v2, llama
from vllm.model_executor.models.interfaces import EagleModelMixin
from vllm.transformers_utils.config import get_config
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

NUM_LAYERS = 8
IDS = [[1, 3, 4], [2, 4, 5], [2, 4, 8], [1, 4, 6]]
ONE_RANK = SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)


def drafter_ids(drafter_dir: str):
    hf_config = get_config(drafter_dir, trust_remote_code=False)
    runner = SimpleNamespace(
        speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    )
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(runner)
    return list(ids) if ids is not None else None


def marking_layer(j: int):
    def layer(positions, hidden_states, residual, *args, **kwargs):
        return torch.zeros_like(hidden_states), torch.full_like(hidden_states, float(j + 1))

    layer.use_sequence_parallel_moe = False
    return layer


class StandInModel(EagleModelMixin):
    """What the models' forward loops touch, with layer j marking the stream with j + 1."""

    def __init__(self, ids: list[int]):
        self.config = SimpleNamespace()
        self.start_layer, self.end_layer = 0, NUM_LAYERS
        self.layers = [marking_layer(j) for j in range(NUM_LAYERS)]
        self._set_aux_hidden_state_layers(tuple(ids))  # what set_aux_hidden_state_layers hands the model

    def embed_input_ids(self, input_ids):
        return torch.zeros(len(input_ids), 1)

    def norm(self, hidden_states, residual):
        return hidden_states + residual, None


def captured(model_module, forward, ids: list[int]) -> list[int]:
    model = StandInModel(ids)
    parent = SimpleNamespace(model=model)
    model_module_cls = {deepseek_v2: deepseek_v2.DeepseekV2ForCausalLM, llama: llama.LlamaForCausalLM}[model_module]
    model_module_cls.set_aux_hidden_state_layers(parent, tuple(ids))  # the CausalLM's own setter
    with mock.patch.object(model_module, "get_pp_group", return_value=ONE_RANK):
        _, states = forward(model, torch.tensor([7, 7]), torch.tensor([0, 1]), None)
    return [int(state[0, 0]) for state in states]


result = {
    "drafter": drafter_ids(sys.argv[1]) if len(sys.argv) > 1 else None,
    "captured": {
        "deepseek": {json.dumps(ids): captured(deepseek_v2, deepseek_v2.DeepseekV2Model.forward, ids) for ids in IDS},
        "llama": {json.dumps(ids): captured(llama, llama.LlamaModel.forward, ids) for ids in IDS},
    },
}
print(json.dumps(result))
