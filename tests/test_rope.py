"""The drafter's RoPE: the target's scaling carried, computed as the serving engines compute it from the export.

The engine tests run SGLang's and vLLM's own rotary-embedding code (each in its test environment: `make sglang-env`,
`make vllm-env`) on the config.json the export writes, and compare their cos/sin caches with the ones the drafter
trains with, so a drafter is never trained on other rotations than it is served with.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from eagle3.model.drafter import DraftConfig
from eagle3.model.rope import Rotary, apply_rope, exported_scaling
from eagle3.stages.export import drafter_config
from eagle3.target import target_rope
from tests.conftest import REPO
from tests.test_layer_ids import ENVS

# Kimi-K2's text config RoPE (theta 50000, YaRN x32 over 4096 positions, served to 131,072)
KIMI_YARN = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
SCALINGS = {
    "kimi-yarn": KIMI_YARN,
    "yarn-defaults": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # mscale 1.139
    "linear": {"type": "linear", "factor": 2.0},
    "none": None,
}
POSITIONS = [0, 1, 2, 100, 4095, 4096, 30000, 131071]


def test_the_tiny_targets_plain_rope_is_the_old_one_bit_for_bit():
    """No scaling: the same bits as before the scaling was carried (resumes and the demo's figures depend on it)."""
    q, k, positions = torch.randn(2, 4, 9, 64), torch.randn(2, 4, 9, 64), torch.arange(18).view(2, 9) * 37
    new_q, new_k = apply_rope(q, k, positions, Rotary(10000.0))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    angles = positions.float()[:, None, :, None] * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    old_q = q * cos + torch.cat((-q[..., 32:], q[..., :32]), -1) * sin
    assert torch.equal(new_q, old_q) and not torch.equal(new_q, q)


def test_the_targets_rope_is_read_in_both_spellings():
    kimi = {"rope_theta": 50000.0, "rope_scaling": KIMI_YARN}
    assert target_rope(kimi) == (50000.0, KIMI_YARN)
    transformers5 = {
        "rope_parameters": {
            "rope_theta": 50000.0,
            "rope_type": "yarn",
            **{k: v for k, v in KIMI_YARN.items() if k != "type"},
        }
    }
    assert target_rope(transformers5) == (50000.0, KIMI_YARN)
    assert target_rope({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}) == (10000.0, None)


def test_yarn_interpolates_the_low_frequencies_and_keeps_the_high_ones():
    inv_freq, scale = Rotary(50000.0, KIMI_YARN).frequencies(128)
    plain, _ = Rotary(50000.0).frequencies(128)
    assert torch.allclose(inv_freq[:10], plain[:10])  # fast dimensions: rotate many times in 4096 positions, kept
    assert torch.allclose(inv_freq[-10:], plain[-10:] / 32)  # slow ones: interpolated by the factor
    assert scale == 1.0  # Kimi's mscale == mscale_all_dim: the magnitudes' ratio is 1
    assert Rotary(10000.0, SCALINGS["yarn-defaults"]).frequencies(64)[1] == pytest.approx(0.1 * 1.3862943611 + 1)


def exported_drafter(tmp_path, name: str, scaling) -> str:
    draft = DraftConfig(
        hidden_size=7168,
        intermediate_size=18432,
        num_attention_heads=56,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=131072,
        target_vocab_size=163840,
        draft_vocab_size=32000,
        aux_layer_ids=(1, 29, 57),
        rope_scaling=scaling,
    )
    config = drafter_config(draft, "KimiK25ForConditionalGeneration", "bfloat16")
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_the_export_states_the_scaling_the_drafter_trained_with(tmp_path):
    exported_drafter(tmp_path, "kimi", KIMI_YARN)
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    assert config["rope_theta"] == 50000.0 and config["rope_scaling"] == exported_scaling(KIMI_YARN) == KIMI_YARN
    assert target_rope(config) == (50000.0, KIMI_YARN)  # what load_exported_drafter reads back
    exported_drafter(tmp_path, "plain", None)
    assert "rope_scaling" not in json.loads((tmp_path / "plain" / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_engines_rotate_the_exported_drafter_as_it_trained(tmp_path, engine):
    """SGLang's and vLLM's own get_rope, built from the exported config.json as their Llama layer builds it, give
    the cos/sin the drafter trains with, at positions within and far beyond the original 4096 (one engine per test)."""
    python = ENVS[engine]
    if not python.exists():
        pytest.fail(f"{python} is missing: `make {engine}-env` builds the real-{engine} test environment")
    directories = [exported_drafter(tmp_path, name, scaling) for name, scaling in SCALINGS.items()]
    proc = subprocess.run(
        [str(python), str(REPO / "tests" / f"{engine}_real" / "rope_cos_sin.py")],
        input=json.dumps({"configs": directories, "positions": POSITIONS}),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO / "tests",
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    for (name, scaling), theirs in zip(SCALINGS.items(), served):
        cos, sin = Rotary(50000.0, scaling).cos_sin(torch.tensor(POSITIONS), 128)
        assert torch.allclose(cos[:, :64], torch.tensor(theirs["cos"]), atol=1e-5), (engine, name, theirs["type"])
        assert torch.allclose(sin[:, :64], torch.tensor(theirs["sin"]), atol=1e-5), (engine, name, theirs["type"])
    assert [s["type"] for s in served][:3] == ["YaRNScalingRotaryEmbedding"] * 2 + ["LinearScalingRotaryEmbedding"]
