"""Capture backends: run the target over token sequences and return its EAGLE-3 hidden states.

A backend is built with `open_backend(cfg, shard, gpu_group, is_stored)` and offers
    prepare(batches: Iterable[list[TokenizedSample]], total: int)   work over the whole shard first
    capture(batch: list[TokenizedSample]) -> list[CapturedStates]    (same order, whole samples, no padding)
    release_stored()                                                 drop what it kept for stored samples
    stats() -> dict                                                  how it captured, for extract_stats.json
    close()
extract calls prepare once with every batch it will capture, then capture batch by batch, same batches,
and release_stored after each. `is_stored(sample_id)` says whether the store has committed a sample; a
partly stored batch (the data changed since a crash) is captured whole, and its stored samples may come
back without a final state (None): extract drops them.
  aux_hidden_states  [T, 3H]  HF layers extract.aux_layers, low|mid|high, concatenated
  last_hidden_state  [T, H]   the final post-norm state (lm_head input)

  hf      transformers, CPU or GPU: the reference; small and mid-size targets.
  sglang  SGLang's own EAGLE-3 capture (no source patch), for TP-sharded giants; imported only when chosen.
          prepare chooses its path: the capture plugin (one engine, one prefill) or, failing that, SGLang's
          list path, whose final-state pass it then runs; see eagle3/capture/sglang.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3.capture.base import CapturedStates, check_gpu_group

if TYPE_CHECKING:
    from eagle3.config import RunConfig

__all__ = ["CapturedStates", "check_gpu_group", "open_backend"]


def open_backend(cfg: RunConfig, shard: int = 0, gpu_group: int = 0, is_stored=lambda sample_id: False):
    """The configured backend for one shard. `cfg` is a RunConfig with target facts resolved. `gpu_group`:
    which group of the box's GPUs the shard uses (hf: one GPU, sglang: extract.sglang.tp_size of them). Each
    backend is imported only when chosen: hf loads transformers, sglang needs the sglang package on the box."""
    if cfg.extract.backend == "hf":
        from eagle3.capture.hf import HfCapture

        return HfCapture(cfg, gpu_group)
    if cfg.extract.backend == "sglang":
        from eagle3.capture.sglang import SglangCapture

        return SglangCapture(cfg, shard, gpu_group, is_stored)
    raise ValueError(f"extract.backend: unknown backend {cfg.extract.backend!r}")
