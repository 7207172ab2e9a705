"""The serving engines' side of a stage: how a server is launched, and how what speculation did is counted.

The launch tests hand the argv eagle3.engines builds to each engine's own argument parser (sglang 0.5.23 and
vllm 0.32, in their test environments), so a value a trigger put in server.extra_args is shown to stay a value:
one `--name=value` token per flag, whatever the value holds.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from eagle3.config import RunConfig, ServerConfig
from eagle3.engines import GREEDY, Sampling, Speculation, engine_for, reached_per_step, reached_total
from tests.conftest import REPO
from tests.test_layer_ids import ENVS

HOSTILE = "--host=0.0.0.0"  # what a trigger once got SGLang to listen on, after a flag with an optional value


def unchecked(cfg: RunConfig, engine: str, extra_args: dict) -> RunConfig:
    """cfg with server settings the run config's validation would refuse: the launch must contain them anyway."""
    server = ServerConfig.model_construct(
        **{**cfg.server.model_dump(), "engine": engine, "extra_args": extra_args, "python": "/opt/engine/bin/python"}
    )
    return cfg.model_copy(update={"server": server})


def parsed_by(engine: str, argv: list[str]) -> dict:
    python = ENVS[engine]
    if not python.exists():
        pytest.fail(f"{python} is missing: `make {engine}-env` builds the real-{engine} test environment")
    flags = argv[argv.index("-m") + 2 :] if "-m" in argv else argv[2:]
    proc = subprocess.run(
        [str(python), str(REPO / "tests" / f"{engine}_real" / "parse_server_args.py")],
        input=json.dumps(flags),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO / "tests",
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine, optional_value_flag", [("sglang", "model-checksum"), ("vllm", "reasoning-parser")])
def test_each_flag_is_one_argv_element(make_config, engine, optional_value_flag, monkeypatch):
    monkeypatch.delenv("EAGLE3_SERVER_LAUNCHER", raising=False)
    cfg = unchecked(make_config(), engine, {optional_value_flag: HOSTILE, "enable-metrics": True, "off": False})
    argv = engine_for(cfg).launch_argv(cfg, Speculation(REPO / "drafter", 3))
    assert f"--{optional_value_flag}={HOSTILE}" in argv and HOSTILE not in argv
    assert "--enable-metrics" in argv and not any(a.startswith("--off") for a in argv)
    assert "--host=127.0.0.1" in argv and f"--port={cfg.server.port}" in argv


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, optional_value_flag, where",
    [
        ("sglang", "model-checksum", "model_checksum"),  # nargs="?" in sglang 0.5.23: a bare next token was its value
        ("vllm", "reasoning-parser", "reasoning_parser"),
    ],
)
def test_the_engines_own_parser_reads_a_hostile_value_as_a_value(
    make_config, engine, optional_value_flag, where, monkeypatch
):
    monkeypatch.delenv("EAGLE3_SERVER_LAUNCHER", raising=False)
    cfg = unchecked(make_config(), engine, {optional_value_flag: HOSTILE})
    settings = parsed_by(engine, engine_for(cfg).launch_argv(cfg))
    assert settings["host"] == "127.0.0.1" and settings["port"] == cfg.server.port
    assert settings["trust_remote_code"] is False
    assert settings.get("model_path", settings.get("model")) == cfg.target.model_path
    assert settings[where] == HOSTILE  # a value, however flag-like


def test_vllm_is_told_the_drafter_and_to_report_each_verify_step(make_config):
    cfg = make_config(server={"engine": "vllm", "python": "/opt/vllm/bin/python"})
    argv = engine_for(cfg).launch_argv(cfg, Speculation(REPO / "drafter", 7))
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(next(a for a in argv if a.startswith("--speculative-config=")).split("=", 1)[1])
    assert spec == {"method": "eagle3", "model": str(REPO / "drafter"), "num_speculative_tokens": 7}
    assert "--per-request-spec-decode-metrics=detailed" in argv


def test_sglang_drafts_a_chain_of_the_draft_length_unless_told_a_tree(make_config, monkeypatch):
    monkeypatch.setenv("EAGLE3_SERVER_LAUNCHER", "/stand-in.py")
    cfg = make_config()
    chain = engine_for(cfg).launch_argv(cfg, Speculation(REPO / "drafter", 5))
    assert {
        "--speculative-algorithm=EAGLE3",
        "--speculative-num-steps=5",
        "--speculative-eagle-topk=1",
        "--speculative-num-draft-tokens=6",
    } <= set(chain)
    tree = engine_for(cfg).launch_argv(
        cfg, Speculation(REPO / "drafter", 3), {"num_steps": 3, "eagle_topk": 4, "num_draft_tokens": 8}
    )
    assert {"--speculative-eagle-topk=4", "--speculative-num-draft-tokens=8"} <= set(tree)


# -- drafts that reached the output ----------------------------------------------------------------------------


def test_drafts_verified_after_the_stop_token_did_not_reach_the_answer():
    # Prefill gives token 0; step 1 accepts 2 drafts (tokens 1-2) and adds token 3; step 2 accepts 3 drafts, of which
    # the second is the stop token at position 5: the answer is 6 tokens, and the third draft never reached it.
    assert reached_per_step([2, 3], output_length=6) == [2, 2]
    # The stop token as a step's own token: nothing cut.
    assert reached_per_step([2, 1], output_length=6) == [2, 1]
    # max_tokens cut inside a step's drafts.
    assert reached_per_step([3, 3], output_length=6) == [3, 1]
    assert reached_per_step([], output_length=1) == []


def test_totals_alone_give_the_same_count():
    assert reached_total(5, output_length=6, verify_steps=2) == 4  # the stop token among the drafts
    assert reached_total(3, output_length=6, verify_steps=2) == 3  # the stop token as a step's own
    assert reached_total(6, output_length=6, verify_steps=2) == 4  # max_tokens inside the drafts


def request_body(cfg, engine: str, sampling: Sampling, seed: int | None) -> dict:
    """The body eagle3.engines sends for one completion, caught on its way out (no server)."""
    import asyncio

    import httpx

    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        reply = {"choices": [{"token_ids": [1]}]} if engine == "vllm" else {"output_ids": [1], "meta_info": {}}
        return httpx.Response(200, json=reply)

    async def complete():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await engine_for(unchecked(cfg, engine, {})).complete(client, "http://engine", [5, 6], 32, sampling, seed)

    asyncio.run(complete())
    return sent[0]


def read_by(engine: str, bodies: list[dict]) -> list[dict]:
    """What the engine's own request model makes of each body: one start of its environment for all."""
    proc = subprocess.run(
        [str(ENVS[engine]), str(REPO / "tests" / f"{engine}_real" / "read_request.py")],
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO / "tests",
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("engine, seed_field", [("sglang", "sampling_seed"), ("vllm", "seed")])
def test_each_engine_reads_the_sampling_evaluate_asks_for(make_config, engine, seed_field):
    """evaluate.sampling "serving" sends the target's temperature, top_p, top_k and a seed per answer; each engine's own
    request model (sglang 0.5.23, vllm 0.32, in their environments) reads them as sent, with no field it would ignore.
    Greedy sends temperature 0 and nothing to draw with."""
    cfg = make_config()
    drawn, unlimited, greedy = read_by(
        engine,
        [
            request_body(cfg, engine, Sampling(0.7, 0.9, 40), 1234),
            request_body(cfg, engine, Sampling(1.0, 0.95, None), 7),
            request_body(cfg, engine, GREEDY, None),
        ],
    )
    assert (drawn["temperature"], drawn["top_p"], drawn["top_k"], drawn[seed_field]) == (0.7, 0.9, 40, 1234)
    assert drawn.get("unknown", []) == [] and unlimited.get("unknown", []) == [] and greedy.get("unknown", []) == []
    # no top_k limit, as each engine spells it (vLLM -1 or 0; SGLang's TOP_K_ALL, 2**30): none cuts the vocabulary
    assert unlimited["top_k"] in (-1, 0) or unlimited["top_k"] >= 2**30, unlimited
    # greedy: temperature 0 (SGLang makes it top_k 1 at temperature 1), no seed
    assert (greedy["temperature"] == 0 or greedy["top_k"] == 1) and greedy[seed_field] is None
