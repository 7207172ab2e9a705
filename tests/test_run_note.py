"""The DAG run's note (eagle3_airflow.run_note): the report task's summary in a few markdown lines.

That a finished run gets it, in the real scheduler, is tests/ui/test_web_ui.py's; these check what it says.
"""

from __future__ import annotations

from eagle3_airflow.run_note import NOTE_LIMIT, NOTE_TITLE, failure_markdown, note_markdown

SUMMARY = {
    "run_dir": "/data/eagle3/runs/week-48",
    "drafter": "/data/eagle3/runs/week-48/drafter",
    "offline_accept_length": {"3": 2.744, "7": 3.317},
    "ceiling_accept_length": {"3": 3.48, "7": 5.79},
    "accept_length_interval95": {"3": [2.61, 3.02], "7": [3.1, 3.7]},
    "measured_accept_length": {"3": 2.821, "7": 3.406},
    "hidden_states": {"store": "/data/eagle3/stores/ab12", "samples": 1078, "extracted": 98, "reused": 980},
    "promotion": {
        "promoted": True,
        "reason": "better at k=3: 2.821 against the current 2.538 (margin 0.05)",
        "current": "/data/eagle3/drafters/f209/current",
        "current_before": {"version": "week-47-1a2b3c4d", "run": "week-47", "accept_length": {"3": 2.538, "7": 2.351}},
    },
}


def test_a_promoted_run_says_so_with_both_drafters_figures_and_where_the_drafter_is():
    note = note_markdown(SUMMARY)
    assert note.startswith(f"{NOTE_TITLE}: promoted\n")
    assert SUMMARY["promotion"]["reason"] in note
    assert "| 3 | 2.821 | 2.538 |" in note and "| 7 | 3.406 | 2.351 |" in note
    # each measured figure beside its noise, its ceiling (and the share of it reached) and training's prediction
    assert "| 3 | 2.821 | 2.538 | 2.610-3.020 | 3.480 (81%) | 2.744 |" in note
    assert "98 extracted, 980 reused" in note
    assert "`/data/eagle3/runs/week-48/drafter`" in note and "`/data/eagle3/drafters/f209/current`" in note


def test_the_first_drafter_and_a_refused_one_read_differently():
    first = {
        **SUMMARY,
        "promotion": {"promoted": True, "reason": "the lineage's first drafter (k=3: 2.821)", "current_before": None},
    }
    assert "| 3 | 2.821 | - |" in note_markdown(first)  # no current drafter to compare with
    why = "not better at k=3 by more than 0.05: 2.560 against the current 2.538"
    refused = {**SUMMARY, "promotion": {**SUMMARY["promotion"], "promoted": False, "reason": why}}
    assert note_markdown(refused).startswith(f"{NOTE_TITLE}: not promoted\n\nnot better at k=3")


def test_a_run_that_proposed_its_drafter_says_it_awaits_approval():
    """approve_promotion: the training run ends with its proposal; the promotion DAG asks a person."""
    proposed = {
        **SUMMARY,
        "promotion": {
            **SUMMARY["promotion"],
            "promoted": False,
            "pending_approval": True,
            "reason": "better at k=3; proposed for approval (the promotion DAG asks)",
        },
    }
    assert note_markdown(proposed).startswith(f"{NOTE_TITLE}: proposed, awaiting approval\n\nbetter at k=3")


def test_a_run_that_changed_nothing_names_the_run_it_matches():
    summary = {
        "run_dir": "/w/runs/r2",
        "nothing_changed_since": "week-47",
        "drafter": "/w/drafters/f209/current",
        "measured_accept_length": {"3": 2.538},
        "promotion": {"promoted": False, "reason": "nothing changed since run week-47"},
    }
    note = note_markdown(summary)
    assert note.startswith(f"{NOTE_TITLE}: nothing changed since run week-47\n")
    assert "| 3 | 2.538 | - |" in note


def test_a_failure_after_the_report_is_said_too():
    assert "the run failed after its report: retention" in note_markdown(SUMMARY, ["retention"])
    assert failure_markdown(["extract", "train"]).startswith(f"{NOTE_TITLE}: run failed\n\nfailed: extract, train")


def test_the_note_fits_airflows_column_whatever_the_paths():
    deep = "/" + "/".join(["a-very-long-directory-name"] * 30)
    summary = {**SUMMARY, "drafter": deep + "/drafter", "promotion": {**SUMMARY["promotion"], "current": deep}}
    note = note_markdown(summary)
    assert len(note) <= NOTE_LIMIT
    assert note.startswith(f"{NOTE_TITLE}: promoted") and "| 3 | 2.821 | 2.538 |" in note  # the figures stay


# -- issue 35, item 8: values from a trigger, the box or XCom render as the text they are ----------------------


def render(markdown: str) -> str:
    """As the Airflow UI renders a note: CommonMark with GitHub's tables and strikethrough."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)


def test_markdown_in_a_workdir_a_reason_or_a_forged_figure_renders_as_literal_text():
    """The issue's attack: a workdir with a backtick ended the drafter's code span, and what followed rendered as
    an image and as bold text; a forged summary's figures went into the table as they were."""
    workdir = "/data/w`![x](https://collector.example/p.png)`**Security review: passed, approve**"
    bold, image = "**Security review: passed, approve**", "![ok](https://collector.example/pixel.png)"
    hostile = {
        "drafter": f"{workdir}/runs/r/drafter",
        "measured_accept_length": {"3": 2.821, "<b>7</b>": "**9.999**"},
        "hidden_states": {"extracted": "__98__", "reused": 980},
        "promotion": {
            "promoted": False,
            "reason": f"{bold}\n# Approved\n{image} | cell",
            "current": f"{workdir}/drafters/f209/current",
            "current_before": {"accept_length": {"3": "[2.538](https://x)"}},
        },
    }
    html = render(note_markdown(hostile))
    for markup in ("<img", "<strong>", "<a ", "<h1", "<b>", "<h2"):
        assert markup not in html, markup
    assert html.count("<em>") == 1  # ours: the *EAGLE-3 report* tab
    assert f"<code>{workdir}/runs/r/drafter</code>" in html.replace("&quot;", '"')
    assert "**Security review: passed, approve**" in html and "![ok](https://collector.example/pixel.png)" in html
    assert "<td>**9.999**</td>" in html and "<td>[2.538](https://x)</td>" in html
    nothing = render(note_markdown({"nothing_changed_since": "**x** ![y](z)", "promotion": {}}))
    assert "<strong>" not in nothing and "<img" not in nothing and "**x** ![y](z)" in nothing


def test_the_public_sets_show_in_the_note_and_the_report_tab_beside_the_published_figures():
    """evaluate.benchmarks: report.json's public_sets reach the run's summary (results.summarize), and the note and
    the report tab each show a row per set: prompts (and answers cut at max tokens), k=3 and k=7 with their
    intervals, and the published Kimi drafters' figures at k=3 beside them. A report without public sets shows
    no such table."""
    from types import SimpleNamespace

    from eagle3_airflow.report_view import _summary_html
    from eagle3_airflow.results import summarize

    def figures(mean, low, high):
        return {"accept_length": mean, "accept_length_interval95": [low, high], "ceiling_accept_length": 3.9}

    evaluation = {
        "val_acc_per_position": [0.8, 0.6],
        "offline_accept_length": {"3": 2.7},
        "speculative": {"3": figures(2.821, 2.61, 3.02)},
        "public_sets": {
            "gsm8k": {
                "title": "GSM8K",
                "prompts": 200,
                "answers_cut_at_max_new_tokens": 3,
                "speculative": {"3": figures(3.104, 3.01, 3.2), "7": figures(4.2, 3.9, 4.5)},
                "published_k3": {"TorchSpec K2.5": 3.2, "AQ-MedAI K2": 3.27},
            }
        },
    }
    plan = SimpleNamespace(run_dir="/data/runs/r", box=SimpleNamespace(conn_ids=["gpu-box"]))
    summary = summarize(plan, evaluation, [])
    row = (
        "| GSM8K | 200, 3 cut at max tokens | 3.104 (3.010-3.200) | 4.200 (3.900-4.500) | TorchSpec K2.5 3.20, "
        "AQ-MedAI K2 3.27 |"
    )
    assert row in note_markdown(summary)
    page = _summary_html(summary, {})
    assert "<table id='public-sets'>" in page and "<td>3.104 (3.010-3.200)</td>" in page
    assert "<td>TorchSpec K2.5 3.20, AQ-MedAI K2 3.27</td>" in page

    without = summarize(plan, {**evaluation, "public_sets": {}}, [])
    assert "public set" not in note_markdown(without) and "public-sets" not in _summary_html(without, {})
