"""HF capture-layer ids -> what SGLang must be told, per model family (sglang 0.5.23 semantics)."""

import pytest

from eagle3.layer_ids import LayerIdError, hf_layer_ids_from_sglang, sglang_layer_ids


def test_llama_family_takes_hf_ids_as_they_are():
    assert sglang_layer_ids([1, 15, 28], "LlamaForCausalLM") == [1, 15, 28]
    assert sglang_layer_ids([0, 15, 28], "LlamaForCausalLM") == [0, 15, 28]


def test_deepseek_family_default_starting_at_one_is_passed_as_is():
    # SGLang adds 1 to every id when the first is 1: inputs of layers 2, 30, 58 = HF outputs of 1, 29, 57.
    assert sglang_layer_ids([1, 29, 57], "KimiK25ForConditionalGeneration") == [1, 29, 57]
    assert sglang_layer_ids([1, 29, 57], "DeepseekV3ForCausalLM") == [1, 29, 57]


def test_deepseek_family_custom_ids_are_shifted_to_sglang_inputs():
    # First id != 1: SGLang takes the ids as inputs of layers, so HF output of layer i is input i+1.
    assert sglang_layer_ids([2, 29, 57], "DeepseekV3ForCausalLM") == [3, 30, 58]


def test_deepseek_family_cannot_express_hf_layer_zero_first():
    with pytest.raises(LayerIdError, match="starts at HF layer 0"):
        sglang_layer_ids([0, 29, 57], "DeepseekV3ForCausalLM")


def test_unknown_architecture_is_refused_rather_than_guessed():
    with pytest.raises(LayerIdError, match="not known to eagle3"):
        sglang_layer_ids([1, 2, 3], "MysteryForCausalLM")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
@pytest.mark.parametrize("ids", [[1, 29, 57], [2, 29, 57], [5, 10, 20]])
def test_round_trip(arch, ids):
    assert hf_layer_ids_from_sglang(sglang_layer_ids(ids, arch), arch) == ids
