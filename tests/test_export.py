"""Export: the exact key set, shapes and config SGLang's LlamaForCausalLMEagle3 loads, and a round trip
from the export alone back to the same drafter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eagle3.model.drafter import DraftConfig, build_draft_model
from eagle3.records.checkpoint import load_checkpoint
from eagle3.stages.export import EXPORT_KEYS, drafter_config, load_exported_drafter, run_export
from eagle3.target import drafter_shape


def test_the_config_tells_each_engine_the_trained_layers_in_its_own_ids():
    draft = DraftConfig(7168, 18432, 64, 8, 112, 1e-6, 50000.0, 131072, 163840, 32000, (2, 29, 57))
    config = drafter_config(draft, "KimiK25ForConditionalGeneration", "bfloat16")
    # DeepSeek family: the input ids of layers 3, 30, 58 mean HF outputs 2, 29, 57 to SGLang and vLLM alike.
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [3, 30, 58], "use_aux_hidden_state": True}
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 30, 58]
    llama = drafter_config(draft, "LlamaForCausalLM", "bfloat16")
    assert llama["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 29, 57]  # SGLang adds the 1 itself
    assert llama["eagle_aux_hidden_state_layer_ids"] == [3, 30, 58]  # vLLM reads this key first, as given


@pytest.mark.slow
def test_export_has_exactly_the_keys_sglang_loads_and_round_trips(trained_config, tiny_target):
    train_config = trained_config
    report = run_export(train_config)
    drafter = train_config.run_dir / "drafter"

    with safe_open(str(drafter / "model.safetensors"), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    assert set(tensors) == set(EXPORT_KEYS) | {"d2t", "t2d"}  # no embed_tokens
    assert tensors["fc.weight"].shape == (256, 768) and tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (256, 512)
    assert tensors["lm_head.weight"].shape == (512, 256)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (512,)
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 512
    mapping_d2t = np.load(train_config.run_dir / "vocab_mapping" / "d2t.npy")
    assert (tensors["d2t"].numpy() == mapping_d2t).all()

    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    target_vocab = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    assert (config["vocab_size"], config["draft_vocab_size"]) == (target_vocab, 512)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # inputs of layers 2, 4, 5
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert {engine: (reading["served"], reading["hf_layers"]) for engine, reading in report["engines"].items()} == {
        "sglang": (True, [1, 3, 4]),
        "vllm": (True, [1, 3, 4]),
    }

    # The export alone (plus the target's embedding) gives the checkpoint's drafter, up to bf16 rounding.
    loaded, draft_to_target = load_exported_drafter(drafter, tiny_target)
    trained = build_draft_model(tiny_target, 512, [1, 3, 4])
    trained.load_state_dict(load_checkpoint(Path(report["checkpoint"]))["model"], strict=False)
    ids, aux = torch.randint(0, 512, (1, 12)), torch.randn(1, 12, 768)
    positions = torch.arange(12)[None]
    with torch.no_grad():
        want, _ = trained.step(ids, trained.fc(aux), positions, [])
        got, _ = loaded.step(ids, loaded.fc(aux), positions, [])
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    assert (draft_to_target.numpy() == np.flatnonzero(tensors["t2d"].numpy())).all()
    assert run_export(train_config) == report  # a retry finds it done


@pytest.mark.slow
def test_eagle31_norms_are_exported_as_the_engines_name_them_and_round_trip(trained_config, tiny_target):
    """drafter.fc_norm / norm_output (EAGLE-3.1): the per-aux norms go out as fc_norm.<i>.weight and config.json
    says fc_norm / norm_output, the names sglang 0.5.23 and vllm 0.32 read (llama_eagle3.py); the export alone gives
    back the drafter, whose norms do act: an aux state scaled 1000x drafts the same, and the next step reads the
    normed hidden state."""
    from eagle3.disk.layout import CHECKPOINTS
    from eagle3.records.checkpoint import best_checkpoint, read_meta, save_checkpoint

    cfg = trained_config.model_copy(
        update={"drafter": trained_config.drafter.model_copy(update={"fc_norm": True, "norm_output": True})}
    )
    torch.manual_seed(1)
    trained = build_draft_model(
        tiny_target, 512, [1, 3, 4], drafter_shape(cfg.drafter, {"hidden_size": 256, "intermediate_size": 512})
    )
    with torch.no_grad():
        for norm in trained.fc.norms:
            norm.weight.uniform_(0.5, 1.5)
    checkpoint, meta = best_checkpoint(cfg.run_dir / CHECKPOINTS)
    state = {k: v for k, v in trained.state_dict().items() if k != "embed_tokens.weight"}
    save_checkpoint(
        cfg.run_dir / CHECKPOINTS,
        {"model": state, "step": meta["step"] + 1},
        {
            **read_meta(checkpoint),
            "step": meta["step"] + 1,
            "val_offline_accept_length": 1e9,
            "draft_config": trained.cfg.to_json(),
        },
        keep_last=5,
        best_step=meta["step"] + 1,
    )
    run_export(cfg)

    drafter = cfg.run_dir / "drafter"
    config = json.loads((drafter / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(EXPORT_KEYS) | {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "d2t", "t2d"}

    loaded, _ = load_exported_drafter(drafter, tiny_target)
    ids, aux = torch.randint(0, 512, (1, 12)), torch.randn(1, 12, 768)
    loud = aux.clone()
    loud[..., 256:512] *= 1000  # one layer's states far larger, as a deep target's are
    positions = torch.arange(12)[None]
    with torch.no_grad():
        want, want_next = trained.step(ids, trained.fc(aux), positions, [])
        got, got_next = loaded.step(ids, loaded.fc(aux), positions, [])
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
        torch.testing.assert_close(loaded.fc(loud), loaded.fc(aux), atol=1e-3, rtol=1e-3)
        # handed on after the final norm (whose weight is still ones here, so norming it again changes nothing)
        torch.testing.assert_close(got_next, loaded.norm(got_next / 3), atol=1e-4, rtol=1e-4)
