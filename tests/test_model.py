"""The draft model: SGLang's weight names and shapes, the target's frozen embedding read by key from any
checkpoint layout, and the training-time-test attention pattern."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3.model import EMBED_KEYS, DraftConfig, Eagle3Draft, build_draft_model, load_target_tensor

SGLANG_KEYS = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
}
SMALL = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128, target_vocab_size=100,
                    draft_vocab_size=40, aux_layer_ids=(1, 3, 4))


def test_config_is_derived_from_the_target(tiny_target):
    cfg = DraftConfig.from_target(tiny_target, 512, [1, 3, 4])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 4, 64)
    assert cfg.intermediate_size == 512 and cfg.target_vocab_size == 849 and cfg.rope_theta == 10000.0


def test_weights_carry_sglangs_names_and_shapes_and_only_the_embedding_is_frozen(tiny_target):
    model = build_draft_model(tiny_target, 512, [1, 3, 4])
    trainable = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == SGLANG_KEYS
    assert trainable["fc.weight"] == (256, 3 * 256)
    assert trainable["midlayer.self_attn.q_proj.weight"] == (4 * 64, 2 * 256)  # q/k/v take [embed, hidden]
    assert trainable["lm_head.weight"] == (512, 256)  # draft vocab only
    assert not model.embed_tokens.weight.requires_grad
    target_embedding = load_target_tensor(tiny_target, EMBED_KEYS)
    assert torch.equal(model.embed_tokens.weight, target_embedding.float())


def test_embedding_is_found_in_sharded_and_prefixed_checkpoints(tmp_path):
    """Kimi-K2.5 layout: sharded files with an index, language model weights under `language_model.`."""
    embedding = torch.randn(100, 32)
    save_file({"language_model.model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"language_model.model.embed_tokens.weight": embedding},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "language_model.model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
        "language_model.model.embed_tokens.weight": "model-00002-of-00002.safetensors",
    }}))
    assert torch.equal(load_target_tensor(tmp_path, EMBED_KEYS), embedding)
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_target_tensor(tmp_path, ("lm_head.weight",))


def run_steps(model, ids, hidden0, steps):
    """Unroll `steps` TTT steps as training does; returns each step's output hidden states."""
    cache, outs, hidden = [], [], hidden0
    positions = torch.arange(ids.shape[1])[None]
    for _ in range(steps):
        _, hidden = model.step(ids, hidden, positions, cache)
        outs.append(hidden)
    return outs


def test_step_zero_is_causal_attention():
    torch.manual_seed(0)
    model = Eagle3Draft(SMALL).eval()
    ids, hidden = torch.randint(0, 100, (1, 6)), torch.randn(1, 6, 32)
    base = run_steps(model, ids, hidden, 1)[0]
    changed = hidden.clone()
    changed[0, 4] += 1.0  # a later position
    after = run_steps(model, ids, changed, 1)[0]
    assert torch.allclose(base[0, :4], after[0, :4], atol=1e-6)  # the past cannot see the future
    assert not torch.allclose(base[0, 4], after[0, 4])


def test_later_steps_see_step_zero_causally_and_their_own_position_only():
    torch.manual_seed(0)
    model = Eagle3Draft(SMALL).eval()
    ids, hidden = torch.randint(0, 100, (1, 6)), torch.randn(1, 6, 32)
    cache = []
    positions = torch.arange(6)[None]
    _, h1 = model.step(ids, hidden, positions, cache)  # step 0
    _, h2 = model.step(ids, h1, positions, list(cache))  # step 1, from the same step-0 cache

    # Step 1's keys at position 2 change only position 2 of step 1's output (besides the query itself):
    # perturb the step-1 input at position 2 and compare the other positions.
    poked = h1.clone()
    poked[0, 2] += 1.0
    _, h2_poked = model.step(ids, poked, positions, list(cache))
    others = [0, 1, 3, 4, 5]
    assert torch.allclose(h2[0, others], h2_poked[0, others], atol=1e-6)
    assert not torch.allclose(h2[0, 2], h2_poked[0, 2])

    # And step 1 at position 1 still sees step 0 at position 0: change step 0's input there.
    changed = hidden.clone()
    changed[0, 0] += 1.0
    cache_b = []
    _, h1_b = model.step(ids, changed, positions, cache_b)
    _, h2_b = model.step(ids, h1, positions, cache_b)  # same step-1 input, other step-0 context
    assert not torch.allclose(h2[0, 1], h2_b[0, 1])
