"""The drafter (an EAGLE-3 decoder layer over the target's hidden states), its attention and RoPE, and
how acceptance is counted."""
