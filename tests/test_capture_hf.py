"""The hf backend is the reference: its states must be transformers' own hidden states."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.capture.hf import HfCapture
from eagle3.data.samples import TokenizedSample
from tests.conftest import CONTEXT, sealed


@pytest.mark.slow
def test_hf_capture_equals_transformers_output_hidden_states(make_config, tiny_target, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    cfg = make_config(extract={"aux_layers": [1, 3, 6]})
    texts = ["What is 12 + 30?", "Sort these numbers: 5 3 9 1 7 2 8", "hi"]
    samples = [
        TokenizedSample(f"{i:016x}", tiny_tokenizer.encode(t, add_special_tokens=False), [1] * 3, False)
        for i, t in enumerate(texts)
    ]
    captured = HfCapture(cfg).capture(samples)  # one padded batch of three different lengths

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for sample, states in zip(samples, captured):
        with torch.no_grad():
            ref = model(torch.tensor([sample.input_ids]), output_hidden_states=True)
        hidden = ref.hidden_states  # [embeddings, layer 0 out, ..., post-norm final]
        expected_aux = torch.cat([hidden[i + 1][0] for i in (1, 3, 6)], dim=-1)
        expected_last = hidden[-1][0]
        assert states.aux_hidden_states.shape == (len(sample.input_ids), 3 * 256)
        assert states.last_hidden_state.shape == (len(sample.input_ids), 256)
        # Stored in bf16: equal to the reference rounded to bf16, up to fp32 batching noise.
        torch.testing.assert_close(states.aux_hidden_states.float(), expected_aux, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(states.last_hidden_state.float(), expected_last, rtol=1e-2, atol=1e-2)
        # And the final state is what lm_head consumes: same logits as the model's own.
        logits = model.lm_head(states.last_hidden_state.float())
        assert (logits.argmax(-1) == ref.logits[0].argmax(-1)).float().mean() > 0.95


def test_shards_sharing_a_box_take_gpus_of_their_own(monkeypatch, tmp_path):
    """Shards are dealt round-robin to the boxes, and each takes its own GPU group there (no GPU here: the
    arithmetic and the refusal are what can be checked)."""
    from eagle3.capture import check_gpu_group
    from eagle3.capture.hf import pick_device
    from eagle3.config import ConfigError
    from eagle3_airflow.remote_job import RemoteJobOperator
    from tests.conftest import plain_config, run_plan

    plan = run_plan(plain_config("/w", extract={"num_shards": 5}), conn_ids=["box_a", "box_b"], python="python")
    settings = tmp_path / "dag-settings.json"  # under which the plan verifies
    settings.write_text(
        json.dumps(
            {"allowed_workdirs": ["/w"], "allowed_boxes": ["local", "box_a", "box_b"], "allowed_pythons": ["python"]}
        )
    )
    monkeypatch.setenv("EAGLE3_DAG_SETTINGS", str(settings))
    placed = [(plan.conn_for_shard(s), plan.gpu_group_for_shard(s)) for s in range(5)]
    assert placed == [("box_a", 0), ("box_b", 0), ("box_a", 1), ("box_b", 1), ("box_a", 2)]
    operator = RemoteJobOperator(task_id="extract", stage="extract", plan=sealed(plan), shard=4)
    operator.verify_plan(CONTEXT)  # what the task does first
    assert operator._stage_argv()[-6:] == ["--shard", "4", "--num-shards", "5", "--gpu-group", "2"]

    check_gpu_group(3, 2, 8)  # GPUs 6..7 of 8
    with pytest.raises(ConfigError) as refused:
        check_gpu_group(4, 2, 8)
    assert refused.value.where == "extract.num_shards" and "needs GPUs 8..9, but the box has 8" in refused.value.fact
    assert pick_device("auto", gpu_group=3) == torch.device("cpu")  # no CUDA on this machine
    assert pick_device("cuda:1", gpu_group=3) == torch.device("cuda:1")  # an explicit device is taken as given
