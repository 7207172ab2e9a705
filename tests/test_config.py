"""The run config: the messages a user sees for bad values, and the write-once run directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.config import (
    ConfigError,
    InvalidConfig,
    default_aux_layers,
    dump_run_config,
    load_run_config,
    parse_run_config,
    write_run_config,
)
from eagle3.target import resolve_target_facts

BASE = {
    "run_name": "kimi-k2.5-eagle3",
    "workdir": "/data/eagle3",
    "target": {"model_path": "/models/kimi-k2.5", "num_hidden_layers": 61},
    "data": {"path": "/data/prompts.jsonl"},
}


def with_changes(**sections) -> dict:
    data = json.loads(json.dumps(BASE))
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return data


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_run_config(data)
    return str(info.value)


def test_default_aux_layers_match_eagle3_convention():
    assert default_aux_layers(61) == [1, 29, 57]  # DeepSeek-V3 / Kimi-K2.5
    assert default_aux_layers(32) == [1, 15, 28]  # Llama-3-8B
    assert parse_run_config(BASE).resolved_aux_layers() == [1, 29, 57]


def test_aux_layer_out_of_range_names_field_range_and_fix():
    message = error_of(with_changes(extract={"aux_layers": [1, 29, 61]}))
    assert "extract.aux_layers: layer 61 out of range for a 61-layer target (valid 0..60)" in message


def test_aux_layers_must_increase():
    assert "strictly increasing" in error_of(with_changes(extract={"aux_layers": [29, 1, 57]}))


def test_unknown_key_is_refused_with_its_path():
    message = error_of(with_changes(extract={"aux_layer": [1, 2, 3]}))
    assert "extract.aux_layer: unknown key" in message


def test_relative_path_is_refused():
    message = error_of(with_changes(data={"path": "prompts.jsonl"}))
    assert "data.path" in message and "absolute path" in message


@pytest.mark.parametrize("name", ["x; touch /tmp/pwned", "$(reboot)", "a`id`", "../escape", "", "a b"])
def test_run_name_with_shell_or_path_characters_is_refused(name):
    assert "run_name" in error_of(with_changes(run_name=name))


def test_training_gpus_pick_the_rank_count():
    assert parse_run_config(with_changes(train={"gpus": [0, 1, 2, 3]})).train.ranks == 4
    assert parse_run_config(with_changes(train={"nproc_per_node": 2})).train.ranks == 2
    assert "train.gpus" in error_of(with_changes(train={"gpus": [1, 1]}))


def test_missing_section_is_named():
    data = with_changes()
    del data["data"]
    assert "data: required" in error_of(data)


def test_draft_vocab_larger_than_target_vocab_is_refused():
    message = error_of(with_changes(target={"vocab_size": 1000}, vocab={"draft_vocab_size": 32000}))
    assert "vocab.draft_vocab_size" in message and "at most 1000" in message


def test_sglang_flag_mistakes_are_named_with_the_fix():
    message = error_of(with_changes(server={"extra_args": {"--reasoning-parser": "kimi_k2"}}))
    assert "server.extra_args" in message and "without '--'" in message
    message = error_of(with_changes(benchmark={"num_steps": 5, "num_draft_tokens": 4}))
    assert "benchmark.num_draft_tokens" in message and "num_steps + 1 = 6" in message


def test_with_generate_on_extract_reads_the_regenerated_conversations():
    assert str(parse_run_config(BASE).conversations_path) == "/data/prompts.jsonl"
    regenerated = parse_run_config(with_changes(generate={"enabled": True}))
    assert regenerated.conversations_path == regenerated.run_dir / "generate" / "conversations.jsonl"


def test_facts_are_filled_from_the_model_and_checked(tiny_target, tmp_path):
    tiny = {"model_path": str(tiny_target), "num_hidden_layers": None}
    cfg = resolve_target_facts(parse_run_config(with_changes(target=tiny, vocab={"draft_vocab_size": 512})))
    assert cfg.target.num_hidden_layers == 8 and cfg.target.hidden_size == 256
    assert cfg.resolved_aux_layers() == [1, 3, 4]

    wrong = parse_run_config(with_changes(target={**tiny, "num_hidden_layers": 61}))
    with pytest.raises(ConfigError) as refused:
        resolve_target_facts(wrong)
    assert refused.value.where == "target.num_hidden_layers"

    too_deep = parse_run_config(with_changes(target=tiny, extract={"aux_layers": [1, 3, 9]}))
    with pytest.raises(InvalidConfig) as refused:
        resolve_target_facts(too_deep)
    assert refused.value.fields == ["extract.aux_layers"] and "layer 9" in refused.value.fact


def test_generation_samples_as_the_target_is_served_unless_the_config_says_otherwise(tiny_target, tmp_path):
    """Empty generate.temperature / top_p / top_k take the target's generation_config.json, what SGLang and vLLM
    serve it with by default (a thinking model served at temperature 1 is trained on sampled answers, not greedy
    ones); a file that names no temperature (the tiny target's) keeps generation greedy; a value in the config
    wins; top_k <= 0 is no limit; a value out of bounds is refused naming the file."""

    def target_with(sampling: dict | None) -> Path:
        target = tmp_path / f"target-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_target, target, ignore=shutil.ignore_patterns("*.safetensors", "prompts.jsonl"))
        if sampling is None:
            (target / "generation_config.json").unlink()
        else:
            (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 4, **sampling}))
        return target

    def sampling(target: Path, **generate) -> tuple:
        cfg = resolve_target_facts(
            parse_run_config(
                with_changes(
                    target={"model_path": str(target), "num_hidden_layers": None},
                    vocab={"draft_vocab_size": 512},
                    generate=generate,
                )
            )
        )
        return cfg.generate.temperature, cfg.generate.top_p, cfg.generate.top_k

    assert sampling(tiny_target) == (0.0, 1.0, None)  # names none: greedy, as the demo always generated
    assert sampling(target_with(None)) == (0.0, 1.0, None)
    kimi_like = target_with({"temperature": 1.0, "top_p": 0.95, "top_k": -1, "do_sample": False})
    assert sampling(kimi_like) == (1.0, 0.95, None)
    assert sampling(kimi_like, temperature=0.0) == (0.0, 0.95, None)
    assert sampling(target_with({"temperature": 0.6, "top_k": 20})) == (0.6, 1.0, 20)
    assert sampling(target_with({"top_p": 0.8})) == (0.0, 1.0, None)  # no temperature named: greedy
    with pytest.raises(
        ConfigError,
        match=r"generation_config.json: its sampling does not fit.*temperature.*set "
        "generate.temperature, top_p and top_k explicitly",
    ):
        sampling(target_with({"temperature": 5.0}))


def test_missing_model_dir_is_named():
    cfg = parse_run_config(with_changes(target={"model_path": "/nonexistent/model"}))
    with pytest.raises(ConfigError) as refused:
        resolve_target_facts(cfg)
    assert refused.value.where == "target.model_path" and "/nonexistent/model/config.json" in refused.value.fact


def test_config_is_written_once(tmp_path):
    cfg = parse_run_config(with_changes(workdir=str(tmp_path)))
    path = write_run_config(cfg)
    assert path == tmp_path / "runs" / "kimi-k2.5-eagle3" / "config.json"
    assert load_run_config(path) == cfg
    assert write_run_config(cfg) == path  # a retried task writes the same thing again: fine

    changed = parse_run_config(with_changes(workdir=str(tmp_path), train={"epochs": 3}))
    with pytest.raises(ConfigError) as refused:
        write_run_config(changed)
    assert refused.value.where == str(path) and "run_name" in refused.value.fix
    assert load_run_config(path) == cfg


def test_a_copy_with_other_workdir_and_run_name_is_an_independent_run(tmp_path):
    original = parse_run_config(with_changes(workdir=str(tmp_path / "a")))
    data = json.loads(dump_run_config(original))
    data.update(workdir=str(tmp_path / "b"), run_name="rerun")
    copy = parse_run_config(data)
    assert copy.run_dir == tmp_path / "b" / "runs" / "rerun"
    assert copy.store_dir.is_relative_to(copy.run_dir)


def test_loading_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(with_changes(seed=-1)))
    with pytest.raises(InvalidConfig) as refused:
        load_run_config(bad)
    assert (refused.value.where, refused.value.fields) == (str(bad), ["seed"])
    bad.write_text("{not json")
    with pytest.raises(ConfigError) as refused:
        load_run_config(bad)
    assert refused.value.where == str(bad)


@pytest.mark.slow
def test_importing_the_config_stays_light():
    """The DAG imports eagle3.config at parse time: it must not pull in torch or transformers."""
    code = "import sys, eagle3.config; print([m for m in ('torch', 'transformers', 'airflow') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


KIMI_K25_CONFIG = {  # the shape of Kimi-K2.5's config.json (language model under text_config); no weights
    "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 18432,
        "vocab_size": 163840,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
    },
}


@pytest.mark.slow
def test_init_derives_a_drafter_shape_sglang_serves_for_a_kimi_shaped_target(tmp_path):
    """hidden / heads would give head_dim 112 with 64 full K/V heads: neither what the published drafters use
    nor a head dim flashinfer runs. init records head_dim 128, 56 heads, 8 KV heads, the dense MLP width, and
    the export states exactly that shape in the config SGLang reads."""
    from eagle3.model.drafter import DraftConfig
    from eagle3.stages.export import drafter_config
    from tests.conftest import run_eagle3

    model = tmp_path / "kimi-k2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI_K25_CONFIG))
    draft = with_changes(workdir=str(tmp_path / "work"), target={"model_path": str(model)})
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    written = run_eagle3("init", "--config", str(tmp_path / "draft.json")).stdout.strip()
    cfg = load_run_config(written)
    assert cfg.drafter.model_dump() == {
        "head_dim": 128,
        "num_attention_heads": 56,
        "num_key_value_heads": 8,
        "intermediate_size": 18432,
        "rope_theta": 50000.0,
        "rope_scaling": "target",
        "fc_norm": False,
        "norm_output": False,
    }
    draft = DraftConfig.from_target(model, 32000, cfg.resolved_aux_layers(), cfg.drafter.model_dump())
    exported = drafter_config(draft, KIMI_K25_CONFIG["architectures"][0], "bfloat16")
    assert (
        exported["head_dim"],
        exported["num_attention_heads"],
        exported["num_key_value_heads"],
        exported["hidden_size"],
        exported["intermediate_size"],
    ) == (128, 56, 8, 7168, 18432)
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # inputs of layers 2, 30, 58


@pytest.mark.slow
def test_init_names_what_a_target_config_lacks_for_the_serving_engines(tmp_path):
    """A config.json written by transformers' DeepseekV3Config lacks the router fields SGLang and vLLM read with no
    default (vLLM then fails to load the weights, SGLang does not start): init says so, naming them, before any
    server is started hours later; the real Kimi-K2.5 config carries them and gets no warning."""
    from tests.conftest import run_eagle3

    for name, extra in (
        ("lacking", {}),
        (
            "complete",
            {
                "topk_method": "noaux_tc",
                "scoring_func": "sigmoid",
                "moe_layer_freq": 1,
                "n_group": 1,
                "topk_group": 1,
                "norm_topk_prob": True,
                "routed_scaling_factor": 2.827,
            },
        ),
    ):
        model = tmp_path / name
        model.mkdir()
        config = {**KIMI_K25_CONFIG, "text_config": {**KIMI_K25_CONFIG["text_config"], **extra}}
        (model / "config.json").write_text(json.dumps(config))
        draft = with_changes(run_name=name, workdir=str(tmp_path / "work"), target={"model_path": str(model)})
        (tmp_path / f"{name}.json").write_text(json.dumps(draft))
        init = run_eagle3("init", "--config", str(tmp_path / f"{name}.json"))
        warned = [line for line in init.stderr.splitlines() if "lacks what the serving engines read" in line]
        if name == "lacking":
            assert len(warned) == 1 and all(f in warned[0] for f in ("topk_method", "scoring_func", "moe_layer_freq"))
        else:
            assert not warned


@pytest.mark.slow
def test_init_refuses_layers_an_engine_of_the_run_cannot_be_told(tmp_path):
    from tests.conftest import run_eagle3

    model = tmp_path / "kimi-k2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI_K25_CONFIG))
    draft = with_changes(
        workdir=str(tmp_path / "work"),
        target={"model_path": str(model)},
        extract={"aux_layers": [0, 29, 57]},
        benchmark={"enabled": True},
    )
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    init = run_eagle3("init", "--config", str(tmp_path / "draft.json"), check=False)
    assert init.returncode == 2 and "extract.aux_layers: [0, 29, 57] cannot be told to sglang" in init.stderr
    # vLLM can be told HF layer 0 (the input ids [1, 30, 58]): the same run served by vLLM is fine.
    draft["server"] = {"engine": "vllm"}
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    assert run_eagle3("init", "--config", str(tmp_path / "draft.json"), check=False).returncode == 0


def test_a_head_dim_sglang_cannot_run_is_refused_by_name():
    assert "drafter.head_dim: 112 is not one SGLang's attention backends all run" in error_of(
        with_changes(drafter={"head_dim": 112})
    )
    assert "drafter.num_key_value_heads: 5 does not divide num_attention_heads 56" in error_of(
        with_changes(drafter={"num_attention_heads": 56, "num_key_value_heads": 5})
    )


# -- a trigger configures the pipeline, nothing more (whoever may trigger the DAG must not own the box) -------


@pytest.mark.parametrize(
    "flag, value",
    [
        ("host", "0.0.0.0"),  # would listen on every interface of the box
        ("hos", "0.0.0.0"),  # argparse reads an unambiguous prefix as the flag itself
        ("port", 22),
        ("model-path", "/home/other/model"),  # would serve another model than target.model_path
        ("model", "/home/other/model"),  # SGLang's alias of --model-path
        (
            "trust_remote_code",
            True,
        ),  # underscore spelling of --trust-remote-code, while target.trust_remote_code is off
        ("trust-remote", True),
        ("tensor-parallel-size", 8),
        ("config", "/tmp/any.yaml"),  # a YAML file that sets any flag, host included
        ("dist-init-addr", "10.0.0.9:5000"),  # joins a server on another host
        ("speculative_draft_model_path", "/x"),  # the benchmark's own flags
    ],
)
def test_server_extra_args_cannot_override_the_launch(flag, value):
    message = error_of(with_changes(server={"extra_args": {flag: value}}))
    assert f"server.extra_args: {flag!r}" in message


@pytest.mark.parametrize(
    "flag",
    [
        # Issue 43's: SGLang imports a named factory and calls it (os:system ran a command), deletes the target's
        # weights once up, talks to other hosts (plural words passed the old denylist's 'url'/'endpoint' words).
        "forward-hooks",
        "delete-ckpt-after-loading",
        "encoder-urls",
        "decoupled-spec-connect-endpoints",
        # Issue 35's: unpickle request data, reach other hosts, write or read elsewhere, load code, rewrite the model,
        # or put a secret on the argv where ps shows it.
        "enable-custom-logit-processor",
        "custom-weight-loader",
        "otlp-traces-endpoint",
        "kv-events-config",
        "log-requests-target",
        "crash-dump-folder",
        "download-dir",
        "api-key",
        "admin-api-key",
        "chat-template",
        "json-model-override-args",
        "tool-server",
        "file-storage-path",
        "quantization-param-path",
        "model-loader-extra-config",
        "no-such-flag-yet",  # a flag an engine adds later is refused until someone reviews it
    ],
)
def test_server_extra_args_take_only_reviewed_flags(flag):
    message = error_of(with_changes(server={"extra_args": {flag: "x"}}))
    assert f"server.extra_args: {flag!r} is not one of the engine flags this project reviewed" in message
    assert "server.reviewed_flags" in message  # the fix: the operator allows it by name, in the settings


def test_a_flag_the_operator_reviewed_is_taken_but_never_one_the_launch_owns():
    allowed = with_changes(
        server={
            "extra_args": {"enable-metrics-for-all-schedulers": True},
            "reviewed_flags": ["enable-metrics-for-all-schedulers"],
        }
    )
    assert parse_run_config(allowed).server.extra_args == {"enable-metrics-for-all-schedulers": True}
    message = error_of(with_changes(server={"extra_args": {"hos": "0.0.0.0"}, "reviewed_flags": ["hos"]}))
    assert "server.extra_args: 'hos' is the launcher's" in message


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_reviewed_flag_passes_the_run_configs_own_checks(engine):
    """The allowlist (eagle3/engine_flags.py) and the launch's own flags never overlap: each listed flag is taken."""
    from eagle3.engine_flags import SERVER_FLAGS

    extra = dict.fromkeys(SERVER_FLAGS[engine], True)
    assert parse_run_config(with_changes(server={"engine": engine, "extra_args": extra})).server.extra_args == extra


def test_every_reviewed_capture_argument_passes_the_run_configs_own_checks():
    from eagle3.engine_flags import SGLANG_ENGINE

    extra = dict.fromkeys(SGLANG_ENGINE, 1)
    assert parse_run_config(with_changes(extract={"sglang": {"extra_args": extra}})).extract.sglang.extra_args == extra


@pytest.mark.parametrize(
    "flag",
    [
        "worker-extension-cls",
        "logits-processors",
        "middleware",
        "tool-parser-plugin",
        "hf-overrides",
        "kv-transfer-config",
        "api-key",
        "chat-template",
        "compilation-config",  # vllm 0.32: code, hosts, files, secrets
        "distributed-executor-backend",  # issue 43: a <module.attr> it imports
        "speculative-config",
        "per-request-spec-decode-metrics",
        "spec-model",  # evaluate's and benchmark's own
        "tensor-parallel-size",
        "gpu-memory-utilization",
        "uds",
        "headless",  # the run config's, the launcher's
    ],
)
def test_vllm_server_extra_args_are_checked_against_vllms_flags(flag):
    message = error_of(with_changes(server={"engine": "vllm", "extra_args": {flag: "x"}}))
    assert f"server.extra_args: {flag!r}" in message


@pytest.mark.parametrize("value", ["--host=0.0.0.0", "-h", "line\nbreak", "x" * 2000])
def test_server_extra_args_values_are_plain_values(value):
    # A value starting with '-' could be read as a flag of its own after a flag whose value is optional (SGLang's
    # --model-checksum): refused here, and never a token of its own on the argv (tests/test_engines.py).
    message = error_of(with_changes(server={"extra_args": {"reasoning-parser": value}}))
    assert "server.extra_args: the value of 'reasoning-parser'" in message and "plain value" in message
    assert len(message) < 600  # a 2000-character value is not echoed whole


@pytest.mark.parametrize(
    "name",
    [
        "dist_init_addr",
        "nnodes",
        "node_rank",
        "host",
        "port",
        "api_key",
        "enable_custom_logit_processor",
        "json_model_override_args",
        "download_dir",
    ],
)
def test_capture_engine_extra_args_refuse_what_the_servers_refuse(name):
    message = error_of(with_changes(extract={"sglang": {"extra_args": {name: "x"}}}))
    assert "extract.sglang.extra_args" in message and name in message


def test_vllm_cannot_benchmark_a_tree():
    message = error_of(
        with_changes(server={"engine": "vllm"}, benchmark={"enabled": True, "eagle_topk": 4, "num_draft_tokens": 8})
    )
    assert "benchmark.eagle_topk: vLLM drafts EAGLE-3 chains only" in message


def test_server_extra_args_still_take_real_tuning_flags():
    extra = {
        "attention-backend": "triton",
        "reasoning-parser": "kimi_k2",
        "disable-radix-cache": True,
        "tool-call-parser": "kimi_k2",
        "log-requests": True,
    }
    assert parse_run_config(with_changes(server={"extra_args": extra})).server.extra_args == extra
    vllm = {
        "max-model-len": 8192,
        "kv-cache-memory-bytes": 1 << 30,
        "enable-auto-tool-choice": True,
        "tool-call-parser": "kimi_k2",
        "reasoning-parser": "kimi_k2",
        "max-num-seqs": 64,
    }
    assert parse_run_config(with_changes(server={"engine": "vllm", "extra_args": vllm})).server.extra_args == vllm


def test_engine_extra_args_are_refused_in_every_spelling():
    for name in ("trust_remote_code", "trust-remote-code", "Model_Path"):
        message = error_of(with_changes(extract={"sglang": {"extra_args": {name: True}}}))
        assert "extract.sglang.extra_args: " in message and ("run config" in message or "underscores" in message)


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://evil.example:8080/anything#",  # the fragment would cut off /chat/completions: a GET/POST to any path
        "http://evil.example/admin?x=",
        "http://127.0.0.1:30000/v1/../../admin",
    ],
)
def test_an_endpoint_cannot_redirect_the_stage_to_another_path(endpoint):
    assert "generate.endpoint" in error_of(with_changes(generate={"endpoint": endpoint}))


def test_an_endpoint_with_a_password_is_refused_without_printing_the_password():
    message = error_of(with_changes(generate={"endpoint": "https://user:hunter2@api.example.com/v1"}))
    assert "generate.endpoint" in message and "generate.api_key_env" in message
    assert "hunter2" not in message


def numeric_fields() -> list[tuple[str, str, dict]]:
    """(dotted name, JSON type, schema with the bounds) of every number a run takes (from the trigger form or the
    deployment's settings: its `run`, presets and `box`), read from the models' own JSON schema: for a list of
    numbers, the schema of its items."""
    from eagle3.config import RunConfig
    from eagle3_airflow.params import BOX_PREFIX, BoxSettings, _walk

    fields = []
    for dotted, _, prop, _ in _walk(RunConfig, "", "") + _walk(BoxSettings, BOX_PREFIX, ""):
        for option in prop.get("anyOf", [prop]):
            schema = option.get("items", {}) if option.get("type") == "array" else option
            if schema.get("type") in ("integer", "number"):
                fields.append((dotted, schema["type"], schema))
    return fields


def test_every_number_in_the_form_has_an_upper_bound():
    """A seed of 2**70 or a draft vocabulary of 10**12 would pass a bound-less field and fail hours later in torch."""
    fields = numeric_fields()
    assert len(fields) > 40  # (the walk found the form's numbers)
    assert [dotted for dotted, _, schema in fields if not {"maximum", "exclusiveMaximum"} & set(schema)] == []


def test_infinity_and_nan_are_refused_in_every_number_field():
    """An infinite timeout, learning rate or heartbeat limit means "never" (a job that never counts as dead)."""
    from eagle3_airflow.params import BOX_PREFIX, FORM_FIELDS, ParamsError, params_to_configs

    form, run = {"target.model_path": "/m", "data.path": "/d"}, {"workdir": "/w"}
    for dotted, kind, _ in numeric_fields():
        if kind != "number":
            continue
        for bad in (float("inf"), float("nan")):
            with pytest.raises(ParamsError) as info:  # each where it is set: the form, the settings' run or box
                if dotted in FORM_FIELDS:
                    params_to_configs({**form, dotted: bad}, "manual__1", run)
                elif dotted.startswith(BOX_PREFIX + "."):
                    params_to_configs(form, "manual__1", run, box={dotted.removeprefix(BOX_PREFIX + "."): bad})
                else:
                    params_to_configs(form, "manual__1", {**run, dotted: bad})
            shown = dotted.removeprefix(BOX_PREFIX + ".") if dotted.startswith(BOX_PREFIX) else dotted
            assert f"{shown}: Input should be a finite number" in str(info.value), dotted


@pytest.mark.parametrize(
    "section, values, field",
    [
        ("seed", 2**70, "seed"),
        ("vocab", {"draft_vocab_size": 10**12}, "vocab.draft_vocab_size"),
        ("train", {"gpus": [0, 10**9]}, "train.gpus.1"),
        ("extract", {"aux_layers": [1, 2, 10**9]}, "extract.aux_layers.2"),
    ],
)
def test_absurd_integers_are_refused_with_the_field_named(section, values, field):
    assert f"{field}: Input should be less than or equal to" in error_of(with_changes(**{section: values}))


@pytest.mark.slow
@pytest.mark.parametrize("hidden_size", ["7168", 7168.5, True, 10**12, -1, None])
def test_a_target_config_with_a_bad_size_is_a_clear_error_not_a_traceback(tmp_path, hidden_size):
    """A model directory whose config.json says hidden_size "7168" (a string), 10**12 or null: init exits 2 with
    the file and the field named (the operator then fails without retries), never a traceback."""
    from tests.conftest import run_eagle3

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**KIMI_K25_CONFIG["text_config"], "hidden_size": hidden_size}))
    draft = with_changes(workdir=str(tmp_path / "work"), target={"model_path": str(model), "num_hidden_layers": None})
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    proc = run_eagle3("init", "--config", str(tmp_path / "draft.json"), check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"{model}/config.json: hidden_size is {hidden_size!r}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_target_config_that_is_not_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{'hidden_size': 7168,")
    with pytest.raises(ConfigError) as refused:
        resolve_target_facts(parse_run_config(with_changes(target={"model_path": str(tmp_path)})))
    assert refused.value.where == f"{tmp_path}/config.json"


def test_a_workdir_with_a_colon_is_refused_on_the_box_too():
    """Stages run with PYTHONPATH={workdir}/code/<digest>: '/data/x:/tmp/mine' would put /data/x/code/... and
    /tmp/mine/code/... on the path, and /tmp/mine's eagle3 could be imported. The validate task refuses it first."""
    assert "workdir: '/data/x:/tmp/mine' has a ':'" in error_of(with_changes(workdir="/data/x:/tmp/mine"))


def kimi_init(tmp_path, name: str, text_config: dict | None = None, **sections):
    """`eagle3 init` of a run on a Kimi-shaped target (config.json only) with `text_config` entries and sections."""
    from tests.conftest import run_eagle3

    model = tmp_path / f"model-{name}"
    model.mkdir()
    config = {**KIMI_K25_CONFIG, "text_config": {**KIMI_K25_CONFIG["text_config"], **(text_config or {})}}
    (model / "config.json").write_text(json.dumps(config))
    draft = with_changes(run_name=name, workdir=str(tmp_path / "work"), target={"model_path": str(model)}, **sections)
    (tmp_path / f"{name}.json").write_text(json.dumps(draft))
    return model, run_eagle3("init", "--config", str(tmp_path / f"{name}.json"), check=False)


KIMI_K2_ROPE = {
    "rope_scaling": {
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 131072,
}


@pytest.mark.slow
def test_the_drafter_carries_the_targets_rope_scaling_and_refuses_one_it_cannot(tmp_path):
    from eagle3.model.drafter import DraftConfig

    model, init = kimi_init(tmp_path, "yarn", KIMI_K2_ROPE)
    assert init.returncode == 0, init.stderr
    cfg = load_run_config(init.stdout.strip())
    assert (cfg.drafter.rope_theta, cfg.drafter.rope_scaling) == (50000.0, "target")
    draft = DraftConfig.from_target(model, 32000, cfg.resolved_aux_layers(), cfg.drafter.model_dump())
    assert draft.rope_scaling == {
        "type": "yarn",
        **{k: v for k, v in KIMI_K2_ROPE["rope_scaling"].items() if k != "type"},
    }
    llama3 = {
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    }
    _, refused = kimi_init(tmp_path, "llama3", llama3)
    assert refused.returncode == 2 and "drafter.rope_scaling:" in refused.stderr and "'llama3'" in refused.stderr
    _, knowingly = kimi_init(tmp_path, "plain", llama3, drafter={"rope_scaling": "none"})
    assert knowingly.returncode == 0 and "drafter.rope_scaling is none: the target scales its RoPE" in knowingly.stderr


@pytest.mark.slow
def test_the_drafters_heads_must_split_across_every_serving_tp_size(tmp_path):
    """Kimi-K2.5 is served at tp 8 and 16; the derived 56 heads split across 8 but not 16 (SGLang asserts it when it
    loads the drafter): refused at init with the fix, not when the box loads it."""
    _, tp16 = kimi_init(tmp_path, "tp16", serve={"tp_sizes": [8, 16]})
    assert tp16.returncode == 2
    assert "drafter.num_attention_heads: 56 heads do not split across tp 16" in tp16.stderr and "e.g. 64" in tp16.stderr
    _, fixed = kimi_init(tmp_path, "tp16-64", serve={"tp_sizes": [8, 16]}, drafter={"num_attention_heads": 64})
    assert fixed.returncode == 0, fixed.stderr
    assert "num_key_value_heads" in error_of(
        with_changes(serve={"tp_sizes": [3]}, drafter={"num_attention_heads": 6, "num_key_value_heads": 2})
    )
    # The engine this run starts with the drafter (benchmark, evaluate.backend server) serves at server.tp_size.
    _, served = kimi_init(
        tmp_path, "server-tp16", serve={"tp_sizes": [8]}, server={"tp_size": 16}, benchmark={"enabled": True}
    )
    assert served.returncode == 2 and "56 heads do not split across tp 16 (server.tp_size)" in served.stderr
    _, unserved = kimi_init(tmp_path, "server-tp16-unused", serve={"tp_sizes": [8]}, server={"tp_size": 16})
    assert unserved.returncode == 0, unserved.stderr  # generate's server does not load the drafter


def test_two_batch_overlap_is_refused_for_extraction():
    """SGLang's two-batch overlap runs a DeepSeek model's later layers without capturing their aux states
    (sglang 0.5.23 deepseek_v2.py): the store would lack them. Refused before the GPUs are taken."""
    message = error_of(
        with_changes(extract={"backend": "sglang", "sglang": {"extra_args": {"enable_two_batch_overlap": True}}})
    )
    assert "enable_two_batch_overlap" in message and "two-batch overlap" in message


def test_a_shallow_targets_default_aux_layers_are_three_distinct_layers():
    from eagle3.config import default_aux_layers

    assert default_aux_layers(6) == [1, 2, 4]  # was [1, 2, 2]: one layer captured twice, and fc fed it twice
    assert default_aux_layers(5) == [1, 2, 3]
    assert default_aux_layers(8) == [1, 3, 4] and default_aux_layers(61) == [1, 29, 57]  # unchanged where distinct
    for layers in range(5, 80):
        ids = default_aux_layers(layers)
        assert len(set(ids)) == 3 and ids == sorted(ids) and ids[-1] <= layers - 2


def test_a_config_error_is_where_fact_and_fix_through_pickling():
    """Every refusal reads "where: fact; fix", and keeps its parts when it crosses a process (torchrun's ranks)."""
    import pickle

    refused = ConfigError("train.gpus", "lists GPU 9, the box has 8", "name GPUs 0 to 7")
    assert str(refused) == "train.gpus: lists GPU 9, the box has 8; name GPUs 0 to 7"
    again = pickle.loads(pickle.dumps(refused))
    assert (type(again), again.where, again.fact, again.fix) == (ConfigError, refused.where, refused.fact, refused.fix)
    with pytest.raises(InvalidConfig) as invalid:
        parse_run_config(with_changes(seed=-1, train={"epochs": 0}))
    copied = pickle.loads(pickle.dumps(invalid.value))
    assert sorted(copied.fields) == sorted(invalid.value.fields) == ["seed", "train.epochs"]
    assert str(copied) == str(invalid.value)
