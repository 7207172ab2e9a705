"""What every serving engine shares: the drafter it is started with, the answer it gives back, and how the drafts
that reached the answer are counted (eagle3.engines says how the engines are used)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Speculation:
    """A drafter the server loads: greedy chains of `draft_length` tokens, verified in one step."""

    drafter: Path
    draft_length: int


@dataclass(frozen=True)
class Sampling:
    """How answers are drawn: greedy (temperature 0, the default), or at a temperature with top_p / top_k (top_k None:
    no limit), each answer seeded by its request. At a temperature, engines verify a chain of drafts by the
    speculative sampling rule, which keeps every answer a sample of the target's own sampling
    (eagle3.stages.evaluate)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k or 'unlimited'}"


GREEDY = Sampling()


@dataclass
class Completion:
    """One answer (greedy unless its request sampled). With speculation: its verify steps, and the drafts of each that
    reached the output (where the engine reports steps) or only their sum (where it reports totals)."""

    output_ids: list[int]
    verify_steps: int | None = None
    accepted_per_step: list[int] | None = None
    accepted: int | None = None


def reached_per_step(accepted_per_step: list[int], output_length: int) -> list[int]:
    """The drafts of each verify step that reached an answer of `output_length` tokens. Step i commits its accepted
    drafts and then the target's own token; prefill committed the answer's first. A stop token among the drafts (or
    max_tokens) cuts the answer there, and what the engine accepted after it never reached anyone."""
    reached, position = [], 1
    for accepted in accepted_per_step:
        reached.append(max(0, min(accepted, output_length - position)))
        position += accepted + 1
    return reached


def reached_total(accepted: int, output_length: int, verify_steps: int) -> int:
    """The same from totals alone. An answer of N tokens after S verify steps holds N - 1 - S drafts when its last
    token was a step's own (a stop token the target chose, or the cut at max_tokens), N - S when it was a draft (the
    last step committed no token of its own). Drafts verified past the end show as more than that: capped."""
    return min(accepted, output_length - verify_steps)


def flag_tokens(flags: dict) -> list[str]:
    """`--name=value` per flag (a bare `--name` for true, nothing for false or None): one argv element per flag, so no
    value is ever read as a flag of its own, whatever it holds."""
    tokens = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        tokens.append(f"--{name}" if value is True else f"--{name}={value}")
    return tokens
