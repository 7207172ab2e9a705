"""The target's own facts, read from its model directory on the box, and what a run derives from them.

`init` resolves them once (resolve_target_facts) into the run's config.json: the layer count and sizes, the
drafter's shape, the sampling the engines serve the target with; and refuses, before anything runs, a RoPE scaling
the drafter cannot carry or aux layers an engine cannot be told. Stages read the resolved config.json and never
these files again. Torch-free: the DAG's validation imports eagle3.config, which this module builds on.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from eagle3.config import (
    MAX_LAYERS,
    MAX_WIDTH,
    ConfigError,
    DrafterConfig,
    GenerateConfig,
    RunConfig,
    parse_run_config,
)
from eagle3.model.layer_ids import LayerIdError, family, ids_for

SUPPORTED = ("default", "linear", "yarn")  # RoPE scalings the drafter computes as the engines do (eagle3.model.rope)


def target_rope(text_config: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) of a target's (text) config.json, in either spelling transformers writes: `rope_parameters`
    (transformers 5) or `rope_theta` + `rope_scaling`. The scaling as {"type": ..., parameters}; None for none."""
    parameters = text_config.get("rope_parameters") or {}
    theta = float(parameters.get("rope_theta", text_config.get("rope_theta", 10000.0)))
    scaling = dict(text_config.get("rope_scaling") or {})
    if not scaling and parameters:
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if kind == "default":
        return theta, None
    return theta, {"type": kind, **scaling}


def unsupported(scaling: dict | None) -> str | None:
    """Why the drafter cannot carry `scaling` exactly as the engines will compute it, or None."""
    if scaling is None:
        return None
    if scaling.get("type") not in SUPPORTED:
        return f"its RoPE scaling type {scaling.get('type')!r} is not one the drafter computes ({list(SUPPORTED)})"
    if not isinstance(scaling.get("factor"), int | float) or scaling["factor"] < 1:
        return f"its RoPE scaling factor {scaling.get('factor')!r} is not a number >= 1"
    if scaling["type"] == "yarn" and not isinstance(scaling.get("original_max_position_embeddings"), int):
        return "its yarn RoPE scaling has no original_max_position_embeddings"
    return None


def read_text_config(model_path: str | Path) -> dict:
    """The language model's HF config.json; multimodal wrappers such as Kimi-K2.5 keep it under `text_config`."""
    config_file = Path(model_path) / "config.json"
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            "target.model_path", f"{config_file} does not exist", "point it at an HF model directory"
        ) from None
    except (ValueError, UnicodeDecodeError) as err:  # (JSONDecodeError is a ValueError)
        raise ConfigError(config_file, f"not valid JSON ({err})", "restore the model's own config.json") from None
    text_config = hf_config.get("text_config") or hf_config if isinstance(hf_config, dict) else None
    if not isinstance(text_config, dict):
        raise ConfigError(
            config_file, "not a JSON object (or its text_config is not)", "restore the model's own config.json"
        )
    return text_config


TARGET_FACT_LIMITS = {"num_hidden_layers": MAX_LAYERS, "hidden_size": MAX_WIDTH, "vocab_size": 16 * MAX_WIDTH}


def read_target_facts(model_path: str | Path, text_config: dict) -> dict[str, int]:
    """num_hidden_layers, hidden_size, vocab_size from the target's (text) config.json, as read_text_config read it."""
    config_file = Path(model_path) / "config.json"
    facts = {}
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text_config:
            raise ConfigError(
                config_file, f"has no {key!r}", "point target.model_path at a decoder-only language model"
            )
        value = text_config[key]
        bounds = TARGET_FACT_LIMITS[key]  # the same bounds as the TargetConfig field the fact fills in
        if type(value) is not int or not 1 <= value <= bounds:  # (bool is an int subclass: not a size)
            raise ConfigError(
                config_file,
                f"{key} is {value!r}, not a whole number from 1 to {bounds}",
                "fix the file, or point target.model_path at the model's own directory",
            )
        facts[key] = value
    return facts


def resolve_target_facts(cfg: RunConfig) -> RunConfig:
    """Fill the target's layer count, hidden and vocab size from its config.json, and check them."""
    text_config = read_text_config(cfg.target.model_path)  # read once: every fact below comes from it
    facts = read_target_facts(cfg.target.model_path, text_config)
    for key, actual in facts.items():
        given = getattr(cfg.target, key)
        if given is not None and given != actual:
            raise ConfigError(
                f"target.{key}",
                f"the config says {given} but {cfg.target.model_path}/config.json says {actual}",
                "leave it empty or fix it",
            )
    data = cfg.model_dump(mode="json")
    data["target"].update(facts)
    try:
        data["drafter"] = drafter_shape(cfg.drafter, text_config)
    except KeyError as err:
        raise ConfigError(
            f"{cfg.target.model_path}/config.json",
            f"has no {err}",
            f"set drafter.{err.args[0]} to derive the drafter's shape without it",
        ) from None
    except (TypeError, ValueError) as err:  # a size that is not a number
        raise ConfigError(
            f"{cfg.target.model_path}/config.json",
            f"a size the drafter's shape is derived from is not a whole number ({err})",
            "fix the file, or set drafter.* explicitly",
        ) from None
    data["generate"].update(serving_sampling(cfg.generate, cfg.target.model_path))
    resolved = parse_run_config(data, f"{cfg.run_name} (with facts from {cfg.target.model_path})")
    check_layers_served(resolved, read_architecture(cfg.target.model_path))
    check_rope_carried(resolved, text_config)
    return resolved


GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": None}


def serving_sampling(gen: GenerateConfig, model_path: str | Path) -> dict:
    """generate.temperature / top_p / top_k with the empty ones filled from the target's generation_config.json,
    the sampling SGLang (--sampling-defaults model) and vLLM (--generation-config auto) serve it with when a request
    names none (both read these keys whatever do_sample says). A file that names no temperature leaves generation
    greedy: OpenAI's default of 1 is no choice of the model's authors. A top_k of 0 or below means no limit
    (transformers' 0, SGLang's -1)."""
    given = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
    if all(value is not None for value in given.values()):
        return given
    config_file = Path(model_path) / "generation_config.json"
    try:
        served = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(
            config_file,
            f"not valid JSON ({err})",
            "restore the model's own file, or set generate.temperature, top_p and top_k",
        ) from None
    if not isinstance(served, dict):
        raise ConfigError(
            config_file,
            "not a JSON object",
            "restore the model's own file, or set generate.temperature, top_p and top_k",
        )
    defaults = dict(GREEDY)
    if served.get("temperature") is not None:
        defaults.update({key: served[key] for key in ("temperature", "top_p", "top_k") if served.get(key) is not None})
    if isinstance(defaults["top_k"], int) and not isinstance(defaults["top_k"], bool) and defaults["top_k"] <= 0:
        defaults["top_k"] = None
    filled = {key: defaults[key] if value is None else value for key, value in given.items()}
    try:
        GenerateConfig.model_validate({**gen.model_dump(), **filled})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))} {e['input']!r}: {e['msg']}" for e in err.errors())
        raise ConfigError(
            config_file,
            f"its sampling does not fit generate's bounds ({problems})",
            "set generate.temperature, top_p and top_k explicitly",
        ) from None
    return filled


def check_rope_carried(cfg: RunConfig, text_config: dict) -> None:
    """Refuse a target RoPE scaling the drafter cannot carry exactly as the engines apply it
    (eagle3.model.rope), before training a drafter that the serving engine would rotate otherwise."""
    scaling = target_rope(text_config)[1]
    why = unsupported(scaling) if cfg.drafter.rope_scaling == "target" else None
    if why:
        raise ConfigError(
            "drafter.rope_scaling",
            f"{cfg.target.model_path}/config.json: {why}",
            'set it to "none" to train and serve the drafter with plain RoPE (theta only), knowingly',
        )


def read_architecture(model_path: str | Path) -> str:
    """The target's architecture, as config.json names it first (Kimi-K2.5: the multimodal wrapper's)."""
    config_file = Path(model_path) / "config.json"
    architectures = json.loads(config_file.read_text(encoding="utf-8")).get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ConfigError(config_file, 'has no "architectures" list', "restore the model's own config.json")
    return architectures[0]


def check_layers_served(cfg: RunConfig, architecture: str) -> None:
    """Refuse, before anything runs, aux layers that an engine this run drives cannot be told
    (eagle3.model.layer_ids):
    the sglang capture backend, and the serving engine that evaluate or benchmark start with the drafter. The
    export serves every engine that can be told them, and says which."""
    try:
        family(architecture)  # the export must know how engines read this target's ids, whoever serves it
        if cfg.extract.backend == "sglang":
            ids_for(cfg.resolved_aux_layers(), architecture, "sglang")
        if cfg.evaluate.backend == "server" or cfg.benchmark.enabled:
            ids_for(cfg.resolved_aux_layers(), architecture, cfg.server.engine)
    except LayerIdError as err:
        raise ConfigError("extract.aux_layers", str(err), "choose layers the engines can be told") from None


def drafter_shape(drafter: DrafterConfig, text_config: dict) -> dict:
    """Every drafter.* field, the empty ones derived from the target's (text) config.json."""
    hidden = int(text_config["hidden_size"])
    head_dim = drafter.head_dim or (128 if hidden >= 1024 else 64)
    heads = drafter.num_attention_heads or max(1, hidden // head_dim)
    kv = drafter.num_key_value_heads or next(d for d in range(min(8, heads), 0, -1) if heads % d == 0)
    return {
        "head_dim": head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": drafter.intermediate_size or int(text_config["intermediate_size"]),
        "rope_theta": drafter.rope_theta or target_rope(text_config)[0],
        "rope_scaling": drafter.rope_scaling,
        "fc_norm": drafter.fc_norm,
        "norm_output": drafter.norm_output,
    }
