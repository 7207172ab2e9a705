"""The draft model: SGLang's weight names and shapes, the target's frozen embedding read by key from any
checkpoint layout, the training-time-test attention pattern, and the TTT attention kernel
(eagle3/model/ttt_attention.py) against the dense O(T^2) attention it replaced, in values, gradients and memory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import eagle3.model.ttt_attention as ttt_attention_mod
from eagle3.model.drafter import EMBED_KEYS, DraftConfig, Eagle3Draft, Rows, build_draft_model, load_target_tensor

SGLANG_KEYS = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
}
SMALL = DraftConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=128,
    target_vocab_size=100,
    draft_vocab_size=40,
    aux_layer_ids=(1, 3, 4),
)


def test_config_is_derived_from_the_target(tiny_target):
    cfg = DraftConfig.from_target(tiny_target, 512, [1, 3, 4])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 4, 64)
    target = json.loads((tiny_target / "config.json").read_text())
    assert cfg.intermediate_size == 512 and cfg.target_vocab_size == target["vocab_size"] and cfg.rope_theta == 10000.0


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
    save_file(
        {"language_model.model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"language_model.model.embed_tokens.weight": embedding}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "language_model.model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
                    "language_model.model.embed_tokens.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
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


# -- the TTT attention kernel (eagle3/model/ttt_attention.py) against the dense reference ---------------


def ttt_inputs(steps: int, dtype=torch.float32, device="cpu", t: int = 150, batch: int = 2):
    """q and `steps` steps of keys/values, [B, 3 heads, T, d 16]; q and keys doubled so that the softmax is far
    from uniform."""
    generator = torch.Generator().manual_seed(steps)
    shape = (batch, 3, t, 16)
    tensors = [torch.randn(shape, generator=generator) * (2 if i <= steps else 1) for i in range(2 * steps + 1)]
    tensors = [x.to(device=device, dtype=dtype).requires_grad_() for x in tensors]
    return tensors[0], tensors[1 : steps + 1], tensors[steps + 1 :]


@pytest.mark.slow
@pytest.mark.parametrize("core", [ttt_attention_mod.FusedCPU, ttt_attention_mod.Blocked], ids=lambda c: c.name)
@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_ttt_attention_equals_the_dense_reference_in_output_and_gradients(core, steps):
    """Step `steps - 1` of TTT: the merged kernel's output and the gradients of q and of every step's keys and
    values equal the dense [T, T] reference's, fp32: outputs within 1e-5, gradients (up to 7 here) within 5e-5, as
    fp32 rounding alone puts the dense code 3e-6 and the kernel up to 1.4e-5 off an fp64 run. The length is not a
    multiple of the Blocked core's block."""
    got_inputs, want_inputs = ttt_inputs(steps), ttt_inputs(steps)
    scale = 0.25
    got = ttt_attention_mod.ttt_attention(got_inputs[0], got_inputs[1], got_inputs[2], scale, core=core)
    want = ttt_attention_mod.dense_ttt_attention(want_inputs[0], want_inputs[1], want_inputs[2], scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(99))
    got.backward(grad_out)
    want.backward(grad_out)
    flat = lambda inputs: [inputs[0], *inputs[1], *inputs[2]]  # noqa: E731
    for name, a, b in zip(
        ["q"] + [f"k{j}" for j in range(steps)] + [f"v{j}" for j in range(steps)], flat(got_inputs), flat(want_inputs)
    ):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_the_cpu_training_path_is_the_fused_kernel():
    q = torch.randn(1, 2, 8, 16)
    assert ttt_attention_mod.causal_core(q, q, q) is ttt_attention_mod.FusedCPU


@pytest.mark.slow
def test_the_cuda_kernel_calls_fit_torchs_flash_attention_operators():
    """No GPU in the suite: the CUDA core's forward and backward calls run on meta tensors, which check the
    arguments against this torch's operator schemas and give the shapes and dtypes a GPU would."""
    q, keys, values = ttt_inputs(3, dtype=torch.bfloat16, device="meta", t=64)
    out = ttt_attention_mod.ttt_attention(q, keys, values, 0.25, core=ttt_attention_mod.FusedCUDA)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    out.backward(torch.ones_like(out))
    for x in (q, *keys, *values):
        assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns, forward and backward."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["ttt_attention", "dense_ttt_attention"])
def test_no_ttt_step_makes_a_sequence_by_sequence_tensor_forward_or_backward(attention):
    """The memory the issue is about: the drafter unrolled for 3 TTT steps over 1024 positions, forward and
    backward, never makes a tensor of even T x T / 8 elements (its largest are the MLP's, T x 64; the dense
    reference makes heads x T x T, the control)."""
    torch.manual_seed(0)
    model = Eagle3Draft(SMALL)
    model.midlayer.self_attn.attention = getattr(ttt_attention_mod, attention)
    t = 1024
    ids, hidden = torch.randint(0, 100, (1, t)), torch.randn(1, t, 32)
    with LargestTensor() as mode:
        outs = run_steps(model, ids, hidden, 3)
        sum(out.square().sum() for out in outs).backward()
    if attention == "ttt_attention":
        assert mode.largest < t * t / 8, mode.largest
    else:
        assert mode.largest >= SMALL.num_attention_heads * t * t


def test_the_model_steps_equal_the_dense_reference():
    """Eagle3Draft with the kernel and with the dense reference: the same hidden states over 7 TTT steps."""
    torch.manual_seed(0)
    model = Eagle3Draft(SMALL).eval()
    ids, hidden = torch.randint(0, 100, (2, 40)), torch.randn(2, 40, 32)
    got = run_steps(model, ids, hidden, 7)
    model.midlayer.self_attn.attention = ttt_attention_mod.dense_ttt_attention
    want = run_steps(model, ids, hidden, 7)
    for step, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")


# -- a step at some positions of the batch only (Eagle3Draft.step_rows, ttt_attention_rows) ---------


def rows_of(mask: torch.Tensor) -> torch.Tensor:
    return mask.flatten().nonzero().squeeze(1)


@pytest.mark.parametrize("core", [ttt_attention_mod.FusedCPU, ttt_attention_mod.Blocked], ids=lambda c: c.name)
def test_ttt_attention_at_some_rows_equals_the_whole_batchs_there(core):
    """ttt_attention_rows: queries at a few positions (one batch row has none, and none reach the end: the causal
    core runs cropped), step 0's keys/values over the batch, the later steps' at the queries: the output and the
    gradients of q, of step 0's keys/values and of the later ones equal ttt_attention's on the whole batch at those
    positions, with a gradient that is zero elsewhere."""
    steps, (b, h, t, d) = 4, (3, 3, 50, 16)
    q, keys, values = ttt_inputs(steps, t=t, batch=b)
    picked = torch.zeros(b, t, dtype=torch.bool)
    picked[0, [3, 17, 30]] = picked[2, [0, 8, 41]] = True  # batch row 1 has no query; none after position 41
    index = rows_of(picked)
    grad_out = torch.randn(len(index), h, d, generator=torch.Generator().manual_seed(5))

    whole = ttt_attention_mod.ttt_attention(q, keys, values, 0.25)
    at = lambda x: x.transpose(1, 2).flatten(0, 1)[index]  # noqa: E731 - [B, h, T, ...] at the rows
    want = at(whole)
    want.backward(grad_out)
    want_grads = [x.grad.clone() for x in (q, *keys, *values)]

    rows_q = at(q).detach().requires_grad_()
    later_k, later_v = (torch.stack([at(x) for x in xs[1:]], 1).detach().requires_grad_() for xs in (keys, values))
    k0, v0 = (x.detach().requires_grad_() for x in (keys[0], values[0]))
    got = ttt_attention_mod.ttt_attention_rows(rows_q, index, k0, v0, later_k, later_v, 0.25, core=core)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward(grad_out)
    torch.testing.assert_close(rows_q.grad, at(want_grads[0]), rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(k0.grad, want_grads[1], rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(v0.grad, want_grads[1 + steps], rtol=1e-4, atol=5e-5)
    for j in range(1, steps):
        torch.testing.assert_close(later_k.grad[:, j - 1], at(want_grads[1 + j]), rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(later_v.grad[:, j - 1], at(want_grads[1 + steps + j]), rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("norm_output", [False, True])
def test_steps_at_some_positions_equal_the_whole_batchs_there(norm_output):
    """Eagle3Draft.step_rows, 4 TTT steps as training unrolls them: step 0's keys at every position of a prefix of
    each row and its queries at some of them, each later step at positions within the step before's (GQA: 4 heads
    on 2 KV heads). Its outputs equal Eagle3Draft.step's over the whole batch at those positions, and so do the
    gradients of every weight for a loss read there."""
    cfg = DraftConfig(**{**SMALL.__dict__, "norm_output": norm_output})
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    b, t = 2, 40
    ids, aux = torch.randint(0, 100, (b, t)), torch.randn(b, t, 96)
    runs = [torch.rand(b, t) < 0.6]
    for _ in range(3):
        runs.append(runs[-1] & (torch.rand(b, t) < 0.7))
    prefix = runs[0].flip(1).cumsum(1).flip(1) > 0
    weights = [torch.randn(b, t, 32) for _ in runs]

    def whole():
        model.zero_grad(set_to_none=True)
        cache, hidden, outs, loss = [], model.fc(aux), [], 0.0
        for i, (run, w) in enumerate(zip(runs, weights)):
            normed, hidden = model.step_states(ids, hidden, torch.arange(t)[None] + i, cache)
            outs.append(normed[run])
            loss = loss + (normed * w * run[..., None]).sum()
        loss.backward()
        return outs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def at_rows():
        model.zero_grad(set_to_none=True)
        kv = rows_of(prefix)
        cache, hidden, outs, loss = [], model.fc(aux.flatten(0, 1)[kv]), [], 0.0
        previous = kv
        for i, (run, w) in enumerate(zip(runs, weights)):
            here = rows_of(run)
            place = torch.searchsorted(previous, here)
            if i == 0:
                rows, at = Rows(kv, (b, t), place), kv
            else:
                rows, at, hidden = Rows(here, (b, t)), here, hidden[place]
            normed, hidden = model.step_rows(ids.flatten()[at], hidden, at % t + i, rows, cache)
            outs.append(normed)
            loss = loss + (normed * w.flatten(0, 1)[here]).sum()
            previous = here
        loss.backward()
        return outs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (want, want_grads), (got, grads) = whole(), at_rows()
    assert set(grads) == set(want_grads) and "midlayer.self_attn.q_proj.weight" in grads
    for step, (a, b_) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, want_grads[name], rtol=0, atol=1e-5 * want_grads[name].abs().max(), msg=lambda m, n=name: f"{n}: {m}"
        )
