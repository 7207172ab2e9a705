"""The EAGLE-3 draft model: what SGLang runs as LlamaForCausalLMEagle3, in plain PyTorch.

Read bottom-up, like nanoGPT: RMSNorm, the attention that knows training-time test (TTT; its rotary
embedding, with the target's scaling, is eagle3.model.rope), the SwiGLU MLP, the one decoder layer, the config, then the
model.

Data flow of one draft step (names are the export's weight keys, see eagle3/stages/export.py):
    hidden   = fc(aux states low|mid|high)         [T, 3H] -> [T, H]   (step 0; later steps: previous output)
    x        = cat(midlayer.input_layernorm(embed(ids)), midlayer.hidden_norm(hidden))        [T, 2H]
    residual = hidden + midlayer.self_attn(x)      q/k/v take 2H, o gives H
    residual = residual + midlayer.mlp(midlayer.post_attention_layernorm(residual))
    logits   = lm_head(norm(residual))             draft vocab only; `residual` feeds the next step
The token embedding is the target's, loaded by key from its safetensors and frozen.

TTT attention, step i: queries of step i see step 0's keys/values causally, plus, at their own position
only, the keys/values of steps 1..i (what the drafter produced there in the steps before). The caller
keeps the per-step keys/values in a list (`kv_cache`) across steps; the kernel (eagle3/model/ttt_attention.py) never
builds [T, T] scores, in forward or backward.

So a position's chain of steps reads nothing of another position but step 0's keys/values: `step_rows` runs a
step at some positions of the batch only (`Rows`), the rest neither computed nor read. Training runs step i
only where it or a later step is trained (eagle3.stages.train.TTTObjective), a small share of a padded batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.config import DrafterConfig
from eagle3.model.rope import Rotary, apply_rope, rotate_half
from eagle3.model.ttt_attention import ttt_attention, ttt_attention_rows
from eagle3.target import drafter_shape, read_text_config, target_rope


@dataclass(frozen=True)
class Rows:
    """Some positions of a [B, T] batch: `index` their flat positions (b * T + t), ascending. A step at them takes
    and returns one row per position; `queries` (indices into `index`; None: all) are the positions whose output
    is wanted, the others only give keys and values (step 0: every position a later query attends to)."""

    index: torch.Tensor
    shape: tuple[int, int]
    queries: torch.Tensor | None = None

    @property
    def query_index(self) -> torch.Tensor:
        return self.index if self.queries is None else self.index[self.queries]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope's rotation of one tensor, given its cos and sin (rows: [N, heads, d] by [N, 1, d])."""
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class TTTAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary = Rotary(cfg.rope_theta, cfg.rope_scaling)
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        # eagle3/model/ttt_attention.py: O(T) memory; its dense_ttt_attention (O(T^2)) is the reference tests compare
        # with
        self.attention = ttt_attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: list) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, positions, self.rotary)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        kv_cache.append((k, v))

        keys, values = zip(*kv_cache)
        out = self.attention(q, keys, values, 1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def forward_rows(self, x: torch.Tensor, positions: torch.Tensor, rows: Rows, kv_cache: list) -> torch.Tensor:
        """`forward` at `rows` only: x [N, 2H] and positions [N] there; returns [queries, H]. `kv_cache` holds step
        0's keys/values spread over the batch ([B, heads, T, d], zeros elsewhere: the fused causal kernel's layout),
        then steps 1..i's stacked at step i's rows ([N, i, heads, d] each, and those rows' flat positions). The
        caller's part: every key a query reads is computed (step 0's rows hold each query's causal prefix; a later
        step's rows lie within the step before's)."""
        (b, t), d = rows.shape, self.head_dim
        q = self.q_proj(x if rows.queries is None else x[rows.queries]).view(-1, self.heads, d)
        k, v = self.k_proj(x).view(-1, self.kv_heads, d), self.v_proj(x).view(-1, self.kv_heads, d)
        cos, sin = (z[:, None] for z in self.rotary.cos_sin(positions, d))  # [N, 1, d]
        k = rotate(k, cos, sin)
        q = rotate(q, cos, sin) if rows.queries is None else rotate(q, cos[rows.queries], sin[rows.queries])
        repeat = self.heads // self.kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if not kv_cache:  # step 0
            spread = [z.new_zeros(b * t, self.heads, d).index_copy(0, rows.index, z) for z in (k, v)]
            kv_cache.append(tuple(z.view(b, t, self.heads, d).transpose(1, 2) for z in spread))
        elif len(kv_cache) == 1:  # step 1
            kv_cache.append((k[:, None], v[:, None], rows.index))
        else:  # the steps before's at this step's rows (within theirs), then this step's
            before_k, before_v, before = kv_cache[1]
            at = torch.searchsorted(before, rows.index)
            kv_cache[1] = (
                torch.cat([before_k[at], k[:, None]], 1),
                torch.cat([before_v[at], v[:, None]], 1),
                rows.index,
            )
        later_k = later_v = None
        if len(kv_cache) > 1:
            later_k, later_v = kv_cache[1][:2]
            if rows.queries is not None:
                later_k, later_v = later_k[rows.queries], later_v[rows.queries]
        out = ttt_attention_rows(q, rows.query_index, *kv_cache[0], later_k, later_v, 1.0 / math.sqrt(d))
        return self.o_proj(out.reshape(-1, self.heads * d))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The drafter's single decoder layer; its attention input is the embedding and the hidden state."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TTTAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds, hidden, positions, kv_cache):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = hidden + self.self_attn(x, positions, kv_cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))

    def forward_rows(self, embeds, hidden, positions, rows: Rows, kv_cache):
        """`forward` at `rows` (embeds, hidden [N, H]); returns the queries' [queries, H]."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended = self.self_attn.forward_rows(x, positions, rows, kv_cache)
        residual = (hidden if rows.queries is None else hidden[rows.queries]) + attended
        return residual + self.mlp(self.post_attention_layernorm(residual))


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rope_scaling: dict | None = None  # the target's, carried (eagle3.model.rope); None: plain rope_theta
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux state before fc (engines: config.json's fc_norm)
    norm_output: bool = False  # EAGLE-3.1: the next step reads the normed hidden state (engines: norm_output)

    @classmethod
    def from_target(
        cls, model_path: str | Path, draft_vocab_size: int, aux_layer_ids, geometry: dict | None = None
    ) -> DraftConfig:
        """The drafter's shape: hidden size, norms, RoPE and vocab from the target's config.json (Kimi-style
        `text_config` read too); heads, head_dim, MLP width and RoPE choices from `geometry` (the run config's
        drafter section), or derived as eagle3.config.DrafterConfig derives them. Not the target's own head shapes:
        DeepSeek-V3's 128 heads would give head_dim 56, which SGLang's attention backends cannot run. RoPE: the
        target's theta and scaling (eagle3.model.rope), unless the drafter section sets its own theta or no
        scaling."""
        hf = read_text_config(model_path)
        geometry = geometry or drafter_shape(DrafterConfig(), hf)
        theta, scaling = target_rope(hf)
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=geometry["intermediate_size"],
            num_attention_heads=geometry["num_attention_heads"],
            num_key_value_heads=geometry["num_key_value_heads"],
            head_dim=geometry["head_dim"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(geometry.get("rope_theta") or theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            target_vocab_size=hf["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids),
            rope_scaling=scaling if geometry.get("rope_scaling", "target") == "target" else None,
            fc_norm=bool(geometry.get("fc_norm", False)),
            norm_output=bool(geometry.get("norm_output", False)),
        )

    def to_json(self) -> dict:
        return asdict(self)


class AuxProjection(nn.Linear):
    """fc: the target's aux states, concatenated, projected to the drafter's width; with fc_norm (EAGLE-3.1) each
    aux state is RMS-normed first (the layers' scales differ by orders of magnitude in deep targets). The norms'
    weights are `fc.norms.<i>.weight` here and `fc_norm.<i>.weight` in the export, as SGLang and vLLM name them."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(len(cfg.aux_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norms = (
            nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in cfg.aux_layer_ids)
            if cfg.fc_norm
            else None
        )

    def forward(self, aux: torch.Tensor) -> torch.Tensor:
        if self.norms is not None:
            aux = torch.cat([norm(part) for norm, part in zip(self.norms, aux.chunk(len(self.norms), dim=-1))], -1)
        return super().forward(aux)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = AuxProjection(cfg)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def step(self, input_ids, hidden, positions, kv_cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step. `hidden` is fc(aux) for step 0, the previous step's output after that.
        Returns (draft-vocab logits, the hidden state for the next step: the layer's output before the final norm,
        or after it with norm_output, as the engines pass it on)."""
        normed, next_hidden = self.step_states(input_ids, hidden, positions, kv_cache)
        return self.lm_head(normed), next_hidden

    def step_states(self, input_ids, hidden, positions, kv_cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` up to the lm_head: (the normed state the lm_head reads, the hidden state for the next step).
        Training applies the lm_head itself, a chunk of positions at a time (eagle3.stages.train), so that no step's
        [T, draft vocab] logits are kept for backward."""
        out = self.midlayer(self.embed_tokens(input_ids), hidden, positions, kv_cache)
        normed = self.norm(out)
        return normed, normed if self.cfg.norm_output else out

    def step_rows(self, input_ids, hidden, positions, rows: Rows, kv_cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """`step_states` at `rows` of the batch only: input_ids, positions [N] and hidden [N, H] there; returns the
        queries' rows [queries, H]. The same arithmetic row by row as a step over the whole batch; `kv_cache`: as
        TTTAttention.forward_rows keeps it (not `step`'s)."""
        out = self.midlayer.forward_rows(self.embed_tokens(input_ids), hidden, positions, rows, kv_cache)
        normed = self.norm(out)
        return normed, normed if self.cfg.norm_output else out

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


# -- the target's weights, read by key -----------------------------------------------------------

# Where the token embedding and lm_head live in HF checkpoints: plain decoder-only models, and wrappers
# such as Kimi-K2.5 (KimiK25ForConditionalGeneration) that keep the language model under language_model.
EMBED_KEYS = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight", "embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


def load_target_tensor(model_path: str | Path, candidates: tuple[str, ...]) -> torch.Tensor:
    """Read one tensor from the target's safetensors (sharded or not) without loading anything else."""
    from safetensors import safe_open

    model_path = Path(model_path)
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = model_path / "model.safetensors"
        if not single.exists():
            raise FileNotFoundError(f"{model_path}: no model.safetensors or model.safetensors.index.json")
        with safe_open(str(single), framework="pt") as f:
            weight_map = {key: single.name for key in f.keys()}
    for key in candidates:
        if key in weight_map:
            with safe_open(str(model_path / weight_map[key]), framework="pt") as f:
                return f.get_tensor(key)
    raise KeyError(f"{model_path}: none of {list(candidates)} in its safetensors; is this an HF causal LM?")


def build_draft_model(
    model_path: str | Path, draft_vocab_size: int, aux_layer_ids, geometry: dict | None = None
) -> Eagle3Draft:
    """A fresh drafter shaped after the target, with the target's token embedding (frozen)."""
    cfg = DraftConfig.from_target(model_path, draft_vocab_size, aux_layer_ids, geometry)
    model = Eagle3Draft(cfg)
    embedding = load_target_tensor(model_path, EMBED_KEYS)
    if embedding.shape != model.embed_tokens.weight.shape:
        raise ValueError(
            f"{model_path}: embedding shape {tuple(embedding.shape)}, config implies "
            f"{tuple(model.embed_tokens.weight.shape)}"
        )
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding.float())
    return model
