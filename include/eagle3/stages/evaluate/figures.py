"""The figures of one measurement: acceptance length per verify step and per cycle, acceptance per position, a 95%
interval and the ceiling, whether speculation was lossless; and the acceptance plot."""

from __future__ import annotations

import logging
import math

from eagle3.engines import GREEDY, Completion, Sampling
from eagle3.model import acceptance

log = logging.getLogger(__name__)


def lossless(outputs: list[list[int]], baseline: list[list[int]], sampling: Sampling) -> tuple[dict, str]:
    """Whether speculation changed the answers, as report figures and a phrase for the log. Greedy: every answer must
    equal the plain one token for token. Sampled: the answers must follow plain sampling's distribution
    (acceptance.same_distribution_p; a p-value under 0.01 is logged as a warning)."""
    if sampling.greedy:
        identical = f"{sum(tokens == expected for tokens, expected in zip(outputs, baseline))}/{len(baseline)}"
        return {"identical_to_greedy": identical}, f"{identical} outputs equal greedy"
    p_value = acceptance.same_distribution_p(baseline, outputs)
    if p_value < 0.01:
        log.warning(
            "evaluate: the answers with the drafter do not follow plain sampling's distribution (p=%.4f): the "
            "verification is not exact",
            p_value,
        )
    return (
        {"identical_to_greedy": None, "same_distribution_as_plain_p": p_value},
        f"answers vs plain sampling: p={p_value:.3f} (same distribution)",
    )


def figures_of(
    answers: list[tuple[list[int], list[int]]],
    baseline: list[list[int]],
    k: int,
    label: str,
    sampling: Sampling = GREEDY,
) -> dict:
    """Acceptance figures of one draft length from (answer, drafts of each verify step that reached it) per prompt,
    and whether the answers are those of plain decoding (lossless)."""
    cycles = [a for _, accepted in answers for a in accepted]
    first_cycles = [accepted[0] for _, accepted in answers if accepted]
    checked, checked_text = lossless([tokens for tokens, _ in answers], baseline, sampling)
    per_prompt = [(committed(tokens), len(accepted)) for tokens, accepted in answers]
    figures = acceptance.figures(cycles, first_cycles, k, sum(c for c, _ in per_prompt))
    figures["completion_tokens_per_verify_step"] = sum(len(tokens) for tokens, _ in answers) / max(len(cycles), 1)
    # verify steps with fewer than k answer tokens left: there not even a perfect drafter could show k
    figures["cycles_capped_by_answer_end"] = sum(
        capped_by_answer_end(len(tokens), accepted, k) for tokens, accepted in answers
    )
    figures.update(noise_and_ceiling(per_prompt, baseline, k, figures["accept_length"]))
    figures.update(checked)
    log.info(
        "evaluate: %sk=%d: acceptance length %.3f %s over %d cycles (SGLang's count %.3f, N/S %.3f; first cycle "
        "%.3f); %s; %s",
        label,
        k,
        figures["accept_length"],
        interval_text(figures),
        len(cycles),
        figures["sglang_accept_length"],
        figures["completion_tokens_per_verify_step"],
        figures["first_cycle_accept_length"],
        ceiling_text(figures),
        checked_text,
    )
    return figures


def figures_of_totals(
    completions: list, baseline: list[list[int]], k: int, label: str, sampling: Sampling = GREEDY
) -> dict:
    """The same from each answer's totals (drafts that reached it, verify steps): no per-position rates, no first
    cycle."""
    steps = sum(c.verify_steps or 0 for c in completions)
    tokens = sum(len(c.output_ids) for c in completions)
    checked, checked_text = lossless([c.output_ids for c in completions], baseline, sampling)
    per_prompt = [(committed(c.output_ids), c.verify_steps or 0) for c in completions]
    figures = {
        "accept_length": sum(c for c, _ in per_prompt) / max(steps, 1),
        "sglang_accept_length": 1 + sum(c.accepted or 0 for c in completions) / max(steps, 1),
        "first_cycle_accept_length": None,
        "later_cycles_accept_length": None,
        "completion_tokens_per_verify_step": tokens / max(steps, 1),
        "accept_rate_per_position": None,
        "cycles": steps,
        "cycles_capped_by_answer_end": None,
        **checked,
    }
    figures.update(noise_and_ceiling(per_prompt, baseline, k, figures["accept_length"]))
    log.info(
        "evaluate: %sk=%d: acceptance length %.3f %s over %d cycles (SGLang's count %.3f, N/S %.3f; the engine "
        "reports totals: no first cycle or per-position rates); %s; %s",
        label,
        k,
        figures["accept_length"],
        interval_text(figures),
        steps,
        figures["sglang_accept_length"],
        figures["completion_tokens_per_verify_step"],
        ceiling_text(figures),
        checked_text,
    )
    return figures


def figures_of_completions(
    completions: list[Completion], baseline: list[list[int]], k: int, label: str, sampling: Sampling = GREEDY
) -> dict:
    """Acceptance figures of one draft length from the answers with the drafter: per verify step where the backend
    reports steps (hf, vLLM), from each answer's totals where it reports only those (SGLang)."""
    if all(c.accepted_per_step is not None or not c.verify_steps for c in completions):
        return figures_of(
            [(c.output_ids, c.accepted_per_step or []) for c in completions], baseline, k, label, sampling
        )
    return figures_of_totals(completions, baseline, k, label, sampling)


def capped_by_answer_end(length: int, accepted: list[int], k: int) -> int:
    """How many of an answer's verify steps started with fewer than k of its tokens left to commit."""
    capped, done = 0, 1  # prefill commits the first token
    for drafts in accepted:
        capped += length - done < k
        done += drafts + 1
    return capped


def committed(answer: list[int]) -> int:
    """The tokens of an answer its verify steps committed: all but prefill's first."""
    return max(len(answer) - 1, 0)


def noise_and_ceiling(per_prompt: list[tuple[int, int]], baseline: list[list[int]], k: int, measured: float) -> dict:
    """Beside a measured acceptance length: its 95% interval over prompts ((tokens committed, verify steps) of each;
    another set of prompts of the same size would differ by about that much), and the ceiling in the same count,
    what a drafter that always agrees with the target would reach on the same answers
    (eagle3.model.acceptance.ceiling_cycles), with the share of it reached."""
    steps = sum(len(acceptance.ceiling_cycles(len(answer), k)) for answer in baseline)
    ceiling_length = sum(committed(answer) for answer in baseline) / max(steps, 1)
    return {
        "accept_length_interval95": list(acceptance.interval95(per_prompt)),
        "ceiling_accept_length": ceiling_length,
        "share_of_ceiling": measured / ceiling_length,
    }


def interval_text(figures: dict) -> str:
    low, high = figures["accept_length_interval95"]
    return f"(95% interval over prompts {low:.3f}-{high:.3f})"


def ceiling_text(figures: dict) -> str:
    return f"{figures['share_of_ceiling']:.0%} of the ceiling {figures['ceiling_accept_length']:.3f}"


def plot_acceptance(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    offline = report.get("offline_accept_length") or {}
    for k, result in report["speculative"].items():
        rates = result["accept_rate_per_position"] or []  # None: an engine that reports totals only
        low, high = result.get("accept_length_interval95") or (math.nan, math.nan)
        ax.plot(
            range(1, len(rates) + 1),
            rates,
            marker="o",
            label=f"k={k}: accept length {result['accept_length']:.2f} [{low:.2f}, {high:.2f}] of "
            f"{result.get('ceiling_accept_length', math.nan):.2f} possible; offline {offline.get(k, math.nan):.2f}"
            + ("" if rates else " (per position: not reported)"),
        )
    ax.set(
        xlabel="draft position",
        ylabel="acceptance rate (given the earlier ones)",
        ylim=(0, 1.05),
        title=f"speculative decoding ({report.get('backend', 'hf')}) on {report['prompts']} held-out prompts",
    )
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
