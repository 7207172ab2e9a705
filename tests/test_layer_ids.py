"""EAGLE-3 aux layer ids: each engine's rule as its own code applies it, and what the export tells each engine.

Our convention is HF "output of decoder layer i"; every engine captures the input of its layer j and reads the ids
it is given by rules of its own (eagle3.model.layer_ids). The rules are held twice: as pure functions with hand-made
cases, and against the engines' real code (the sglang 0.5.23 and vllm 0.32 packages, each in its test environment:
`make sglang-env`, `make vllm-env`), so that a convention change in a new engine version fails here instead of
silently training a drafter on other layers than it is served with.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from eagle3.model.drafter import DraftConfig
from eagle3.model.layer_ids import LayerIdError, engines_served, hf_layers_read, ids_for, sglang_reads, vllm_reads
from eagle3.stages.export import drafter_config, engines_of, ids_read_by
from tests.conftest import REPO

ENVS = {
    "sglang": Path(os.environ.get("EAGLE3_SGLANG_ENV_PYTHON", REPO / ".cache" / "sglang-env" / "bin" / "python")),
    "vllm": Path(os.environ.get("EAGLE3_VLLM_ENV_PYTHON", REPO / ".cache" / "vllm-env" / "bin" / "python")),
}
DEEPSEEK, KIMI, LLAMA = "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "LlamaForCausalLM"


# -- the rules, by hand ----------------------------------------------------------------------------------------


def test_sglang_deepseek_adds_one_only_when_the_first_id_is_one():
    assert sglang_reads([1, 29, 57], DEEPSEEK) == [2, 30, 58]
    assert sglang_reads([2, 30, 58], DEEPSEEK) == [2, 30, 58]
    assert sglang_reads([1, 29, 57], KIMI) == [2, 30, 58]


def test_sglang_llama_always_adds_one_and_vllm_never_does():
    assert sglang_reads([2, 30, 58], LLAMA) == [3, 31, 59]
    assert vllm_reads([1, 3, 4], DEEPSEEK) == vllm_reads([1, 3, 4], LLAMA) == [1, 3, 4]


def test_the_input_ids_mean_the_trained_layers_to_both_engines_for_deepseek_targets():
    # HF outputs 1, 3, 4 are the inputs of layers 2, 4, 5: ids both engines read alike for a DeepSeek model.
    assert ids_for([1, 3, 4], DEEPSEEK, "sglang") == ids_for([1, 3, 4], DEEPSEEK, "vllm") == [2, 4, 5]
    assert ids_for([1, 29, 57], KIMI, "sglang") == [2, 30, 58]
    # What the export wrote before: [1, 3, 4] is HF 1, 3, 4 to SGLang but HF 0, 2, 3 to vLLM (the measured drop).
    assert hf_layers_read([1, 3, 4], DEEPSEEK, "sglang") == [1, 3, 4]
    assert hf_layers_read([1, 3, 4], DEEPSEEK, "vllm") == [0, 2, 3]


def test_llama_targets_need_other_ids_per_engine():
    assert ids_for([1, 15, 28], LLAMA, "sglang") == [1, 15, 28]  # SGLang adds the 1 itself
    assert ids_for([1, 15, 28], LLAMA, "vllm") == [2, 16, 29]
    assert ids_for([0, 15, 28], LLAMA, "sglang") == [0, 15, 28]


def test_hf_layer_zero_first_cannot_be_told_to_sglang_for_a_deepseek_target_but_can_to_vllm():
    with pytest.raises(LayerIdError, match="start at HF layer 1 or later"):
        ids_for([0, 29, 57], DEEPSEEK, "sglang")
    served = engines_served([0, 29, 57], DEEPSEEK)
    assert served["vllm"] == [1, 30, 58] and "cannot be told to sglang" in served["sglang"]


def test_unknown_architecture_is_refused_rather_than_guessed():
    with pytest.raises(LayerIdError, match="not known to eagle3"):
        ids_for([1, 2, 3], "MysteryForCausalLM", "vllm")


@pytest.mark.parametrize("arch", [LLAMA, DEEPSEEK, KIMI])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("ids", [[1, 29, 57], [2, 29, 57], [5, 10, 20]])
def test_round_trip(arch, engine, ids):
    assert hf_layers_read(ids_for(ids, arch, engine), arch, engine) == ids


def exported_config(tmp_path: Path, architecture: str, hf_ids: list[int]) -> tuple[Path, dict]:
    draft = DraftConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        target_vocab_size=849,
        draft_vocab_size=512,
        aux_layer_ids=tuple(hf_ids),
    )
    config = drafter_config(draft, architecture, "bfloat16")
    directory = tmp_path / f"drafter-{architecture}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory, config


@pytest.mark.parametrize("arch", [DEEPSEEK, LLAMA])
def test_the_export_tells_each_engine_the_trained_layers_where_it_reads_them(tmp_path, arch):
    _, config = exported_config(tmp_path, arch, [1, 3, 4])
    engines = engines_of(config, arch, [1, 3, 4])
    assert all(reading["served"] for reading in engines.values()), engines
    assert ids_read_by(config, "vllm") == ("eagle_aux_hidden_state_layer_ids", [2, 4, 5])
    expected_sglang = [2, 4, 5] if arch == DEEPSEEK else [1, 3, 4]
    assert ids_read_by(config, "sglang") == ("eagle_config.eagle_aux_hidden_state_layer_ids", expected_sglang)


# -- the rules, as the engines' own code applies them ----------------------------------------------------------


def run_in(engine: str, script: str, *args: str) -> dict:
    python = ENVS[engine]
    if not python.exists():
        pytest.fail(f"{python} is missing: `make {engine}-env` builds the real-{engine} test environment")
    proc = subprocess.run(
        [str(python), str(REPO / "tests" / f"{engine}_real" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "PYTHONSAFEPATH": "1"},
        cwd=REPO / "tests",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sglangs_own_code_reads_the_ids_as_eagle3_layer_ids_says(tmp_path):
    """sglang 0.5.23's set_eagle3_layers_to_capture (DeepSeek-V2/V3, Kimi-K2.5, Llama) and its reading of a drafter's
    config.json, run for real in .cache/sglang-env; only the objects around the methods are stand-ins (no GPU)."""
    drafter, config = exported_config(tmp_path, DEEPSEEK, [1, 3, 4])
    result = run_in("sglang", "aux_layer_rules.py", str(drafter))
    for family, arch in (("deepseek", DEEPSEEK), ("kimi", KIMI), ("llama", LLAMA)):
        for ids, layers in result["captured"][family].items():
            assert layers == sglang_reads(json.loads(ids), arch), (family, ids)
    assert result["drafter"] == ids_read_by(config, "sglang")[1]
    assert hf_layers_read(result["drafter"], DEEPSEEK, "sglang") == [1, 3, 4]


@pytest.mark.slow
def test_vllms_own_code_reads_the_ids_as_eagle3_layer_ids_says(tmp_path):
    """vllm 0.32's reading of a drafter's config.json (GPUModelRunner) and the DeepSeek-V2/V3 and Llama models' own
    forward loops, run for real in .cache/vllm-env over stand-in layers that mark which layer a state entered."""
    for arch in (DEEPSEEK, LLAMA):  # Llama targets: the two engines read different keys of one config.json
        drafter, config = exported_config(tmp_path, arch, [1, 3, 4])
        result = run_in("vllm", "aux_layer_rules.py", str(drafter))
        assert result["drafter"] == ids_read_by(config, "vllm")[1] == [2, 4, 5]
        assert hf_layers_read(result["drafter"], arch, "vllm") == [1, 3, 4]
    for family, arch in (("deepseek", DEEPSEEK), ("llama", LLAMA)):
        for ids, layers in result["captured"][family].items():
            assert layers == vllm_reads(json.loads(ids), arch), (family, ids)
