"""The hf capture backend: transformers forward passes with hooks on exactly the layers we keep.

Reference implementation: its states equal transformers' output_hidden_states (hidden_states[i + 1]
for aux layer i, and the model's post-norm last_hidden_state), which a test checks. Forward hooks
keep only the three aux layers and the final norm instead of all L + 1 hidden states, and the base
model is called without its lm_head, so no [T, vocab] logits are ever built.
Batches are right-padded for the forward pass; padding never reaches the store.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from eagle3.capture.base import CapturedStates, check_gpu_group

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)


def pick_device(setting: str, gpu_group: int = 0) -> torch.device:
    """extract.device: "auto" is GPU `gpu_group` of the box (one per extraction shard on it), or the CPU
    without CUDA; anything else is taken as given."""
    if setting != "auto":
        return torch.device(setting)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    check_gpu_group(gpu_group, 1, torch.cuda.device_count())
    return torch.device(f"cuda:{gpu_group}")


class HfCapture:
    def __init__(self, cfg: RunConfig, gpu_group: int = 0):
        from transformers import AutoModelForCausalLM

        self.device = pick_device(cfg.extract.device, gpu_group)
        self.aux_layers = cfg.resolved_aux_layers()
        model = AutoModelForCausalLM.from_pretrained(
            cfg.target.model_path,
            dtype=getattr(torch, cfg.target.dtype),
            trust_remote_code=cfg.target.trust_remote_code,
        )
        self.decoder = model.get_decoder().to(self.device).eval()
        self.lm_head = model.get_output_embeddings().to(self.device).eval()  # only evaluate uses it
        self.pad_id = model.config.pad_token_id or 0
        self._captured: dict[str, torch.Tensor] = {}
        for i in self.aux_layers:
            self.decoder.layers[i].register_forward_hook(self._keep(f"layer{i}"))
        self.decoder.norm.register_forward_hook(self._keep("final_norm"))
        log.info("hf capture: %s on %s, aux layers %s", cfg.target.model_path, self.device, self.aux_layers)

    def _keep(self, name: str):
        def hook(module, args, output):
            self._captured[name] = output[0] if isinstance(output, tuple) else output

        return hook

    def prepare(self, batches, total: int) -> None:
        """Nothing to do ahead: one forward pass gives every state."""

    def release_stored(self) -> None:
        """Nothing is kept between batches."""

    def stats(self) -> dict:
        return {"capture_path": "hf"}

    @torch.inference_mode()
    def capture(self, batch) -> list[CapturedStates]:
        lengths = self._forward_right_padded([s.input_ids for s in batch])
        # Straight into the store's dtype and layout, one pass per layer: the fp32 layer outputs are
        # read once and never concatenated in fp32. On a GPU this happens on the device.
        first = self._captured[f"layer{self.aux_layers[0]}"]
        h = first.shape[-1]
        aux = torch.empty(*first.shape[:-1], h * len(self.aux_layers), dtype=torch.bfloat16, device=first.device)
        for k, i in enumerate(self.aux_layers):
            aux[..., k * h : (k + 1) * h].copy_(self._captured[f"layer{i}"])
        last = self._captured["final_norm"].to(torch.bfloat16)
        aux, last = aux.cpu(), last.cpu()  # one device->host copy per batch
        return [CapturedStates(aux[row, :n], last[row, :n]) for row, n in enumerate(lengths)]

    def _forward_right_padded(self, seqs: list) -> list[int]:
        """One forward pass over the sequences, right-padded (the decoder is causal: a row never reads its padding),
        keeping the hooked layers' outputs. Returns the sequences' lengths."""
        lengths = [len(seq) for seq in seqs]
        ids = torch.full((len(seqs), max(lengths)), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(ids)
        for row, seq in enumerate(seqs):
            ids[row, : lengths[row]] = torch.as_tensor(seq)
            attention_mask[row, : lengths[row]] = 1
        self._captured.clear()
        self.decoder(input_ids=ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False)
        return lengths

    @torch.inference_mode()
    def logits_and_aux_rows(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Sequences in one forward pass, right-padded: per sequence the target's logits (fp32, from the unrounded
        final state) and its aux states as the store holds them (bf16). For the evaluate stage's decoding."""
        lengths = self._forward_right_padded(seqs)
        logits = self.lm_head(self._captured["final_norm"]).float().cpu()
        aux = torch.cat([self._captured[f"layer{i}"] for i in self.aux_layers], dim=-1).to(torch.bfloat16).cpu()
        return [(logits[row, :n], aux[row, :n]) for row, n in enumerate(lengths)]

    def logits_and_aux(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits_and_aux_rows of one sequence."""
        return self.logits_and_aux_rows([input_ids])[0]

    def close(self) -> None:
        self.decoder = None
        self._captured.clear()
