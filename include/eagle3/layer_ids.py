"""EAGLE-3 capture-layer ids: our convention, and how to say it to SGLang.

Our convention everywhere (run config, store, export): HF ids, "output of decoder layer i", i.e.
transformers' hidden_states[i + 1]. Default [1, L//2-1, L-4].

SGLang captures the INPUT of its layer j (= HF output of layer j-1), and the ids handed to a model's
set_eagle3_layers_to_capture (from --return-aux-hidden-state-layer-ids at capture time, or from the
drafter's eagle_config.eagle_aux_hidden_state_layer_ids at serving time) are read differently by model
family (sglang 0.5.23, models/llama.py and models/deepseek_v2.py):
  llama family:        always +1, so HF ids are passed as they are;
  deepseek family:     +1 only if the first id is 1, otherwise the ids are taken as SGLang ids.
A wrong conversion trains the drafter on other layers than it is served with: acceptance collapses and
nothing errors. So the capture backend and the export both call `sglang_layer_ids`, and what cannot be
expressed is refused.
"""

from __future__ import annotations

LLAMA_FAMILY = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
}
DEEPSEEK_FAMILY = {
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "Glm4MoeLiteForCausalLM",
}


class LayerIdError(ValueError):
    pass


def sglang_layer_ids(hf_ids: list[int], architecture: str) -> list[int]:
    """The ids to give SGLang so that it captures HF layers `hf_ids` of a model of `architecture`."""
    if architecture in LLAMA_FAMILY:
        return list(hf_ids)
    if architecture in DEEPSEEK_FAMILY:
        if hf_ids[0] == 1:
            return list(hf_ids)  # SGLang adds 1 to every id: input of layer i+1 = HF output of layer i
        if hf_ids[0] == 0:
            raise LayerIdError(
                f"extract.aux_layers: {hf_ids} starts at HF layer 0, which SGLang cannot capture for {architecture} "
                "(ids starting with 1 get +1 added); start at layer 1 or later"
            )
        return [i + 1 for i in hf_ids]  # taken as SGLang ids: input of layer i+1
    raise LayerIdError(
        f"target architecture {architecture!r}: its SGLang layer-id convention is not known to eagle3; "
        "read set_eagle3_layers_to_capture in sglang/srt/models/ for it and add it to eagle3/layer_ids.py"
    )


def hf_layer_ids_from_sglang(sglang_ids: list[int], architecture: str) -> list[int]:
    """Inverse of sglang_layer_ids: the HF layers SGLang captures when given `sglang_ids`."""
    if architecture in LLAMA_FAMILY or (architecture in DEEPSEEK_FAMILY and sglang_ids[0] == 1):
        return list(sglang_ids)
    if architecture in DEEPSEEK_FAMILY:
        return [i - 1 for i in sglang_ids]
    raise LayerIdError(f"target architecture {architecture!r}: SGLang layer-id convention unknown")
