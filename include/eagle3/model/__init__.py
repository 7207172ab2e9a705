"""The drafter (an EAGLE-3 decoder layer over the target's hidden states), its TTT attention and RoPE, how acceptance is
counted, and how each engine is told the aux layers (layer_ids)."""
