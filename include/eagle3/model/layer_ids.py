"""EAGLE-3 capture-layer ids: our convention, how each serving engine reads ids, and what to tell each one.

Our convention everywhere (run config, store, lineage): HF ids, "output of decoder layer i", i.e. transformers'
hidden_states[i + 1]. Default [1, L//2-1, L-4].

Every engine captures the INPUT of its layer j (= HF output of layer j-1), but reads the ids it is given by rules of
its own, per model family (held by tests/test_layer_ids.py, and tests/sglang_real/ and tests/vllm_real/ in the
engines' environments):
  sglang 0.5.23, llama family (models/llama.py set_eagle3_layers_to_capture): every id + 1.
  sglang 0.5.23, deepseek family (models/deepseek_v2.py; Kimi-K2.5 delegates): every id + 1 if the first
      is 1, otherwise the ids as given.
  vllm 0.32 (v1/worker/gpu_model_runner.py): the ids as given.
Every place that tells an engine ids (the export, the sglang capture backend) asks `ids_for`, which gives the input
ids (HF + 1) wherever the engine's rule allows, so one list means the same layers to every engine. An architecture
of no known family, or layers an engine's rule cannot express, raise LayerIdError. The export writes each engine's
ids where it reads them in config.json: SGLang eagle_config.eagle_aux_hidden_state_layer_ids only, vLLM a top-level
eagle_aux_hidden_state_layer_ids first (eagle3.stages.export).
Why: docs/decisions/2026-12-04-aux-layer-ids-per-engine.md.
"""

from __future__ import annotations

from collections.abc import Callable

LLAMA_FAMILY = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
}
DEEPSEEK_FAMILY = {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "Glm4MoeLiteForCausalLM",
}
ENGINES = ("sglang", "vllm")


class LayerIdError(ValueError):
    pass


def family(architecture: str) -> str:
    if architecture in LLAMA_FAMILY:
        return "llama"
    if architecture in DEEPSEEK_FAMILY:
        return "deepseek"
    raise LayerIdError(
        f"target architecture {architecture!r}: how serving engines read its EAGLE-3 layer ids is not known to "
        "eagle3; read set_eagle3_layers_to_capture in sglang/srt/models/ and the aux-layer code of vLLM's model for "
        "it, and add it to eagle3/model/layer_ids.py"
    )


# -- each engine's rule, as read in its source: ids given -> the layers whose INPUT it captures -------------------


def sglang_reads(ids: list[int], architecture: str) -> list[int]:
    if family(architecture) == "llama":
        return [i + 1 for i in ids]
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


def vllm_reads(ids: list[int], architecture: str) -> list[int]:
    family(architecture)  # an unknown family is refused here too: its model's forward is unread
    return list(ids)


READS: dict[str, Callable[[list[int], str], list[int]]] = {"sglang": sglang_reads, "vllm": vllm_reads}


def hf_layers_read(ids: list[int], architecture: str, engine: str) -> list[int]:
    """The HF layers (outputs of) that `engine` captures when given `ids` for a target of `architecture`."""
    return [i - 1 for i in READS[engine](ids, architecture)]


def ids_for(hf_ids: list[int], architecture: str, engine: str) -> list[int]:
    """The ids to give `engine` so that it captures HF layers `hf_ids`: the input ids (HF + 1) where its rule reads
    them as given, else the HF ids where its rule adds the 1 itself. Refused when neither reads right."""
    inputs = [i + 1 for i in hf_ids]
    for candidate in (inputs, list(hf_ids)):
        if READS[engine](candidate, architecture) == inputs:
            return candidate
    raise LayerIdError(
        f"extract.aux_layers: {list(hf_ids)} cannot be told to {engine} for {architecture}: its rule reads the "
        f"input ids {inputs} as {READS[engine](inputs, architecture)} and the HF ids as "
        f"{READS[engine](list(hf_ids), architecture)} (layer inputs); "
        + ("start at HF layer 1 or later" if hf_ids and hf_ids[0] == 0 else "pick other layers")
    )


def sglang_layer_ids(hf_ids: list[int], architecture: str) -> list[int]:
    """The ids to give SGLang (capture flag, or a drafter's eagle_config) for HF layers `hf_ids`."""
    return ids_for(hf_ids, architecture, "sglang")


def engines_served(hf_ids: list[int], architecture: str) -> dict[str, list[int] | str]:
    """Per engine: the ids it must be given, or why it cannot capture these layers of this target."""
    served: dict[str, list[int] | str] = {}
    for engine in ENGINES:
        try:
            served[engine] = ids_for(hf_ids, architecture, engine)
        except LayerIdError as err:
            served[engine] = str(err)
    return served
