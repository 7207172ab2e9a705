"""Run configuration: one pydantic model for a whole run, the single source of truth.

The Airflow DAG builds its trigger-form Params from this model (so it must stay importable without
torch), writes the validated result once to ``{workdir}/runs/{run_name}/config.json``, and every
box-side stage reads that file back: ``python -m eagle3 <stage> --config <run dir>/config.json``.
The box validates it again, fills in facts about the target from its ``config.json`` (eagle3.target), and
checks them, so a bad value fails in seconds with the field named, not hours into a GPU job.

Every output path of a run is derived from ``workdir`` and ``run_name`` (see ``RunConfig.run_dir``):
a copy of a config.json with other values for those two runs the same stages elsewhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3.disk.fsutil import atomic_write_text
from eagle3.disk.layout import CONFIG, CONVERSATIONS, HIDDEN_STATES, run_dir_of
from eagle3.engine_flags import SERVER_FLAGS, SGLANG_ENGINE, check_extra_args

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# http(s)://host[:port][/path] and nothing else: no user:password@ (it would be printed and stored), no ?query or
# #fragment (either would cut off the /chat/completions the stage appends), no '.' or '..' path segment.
ENDPOINT_PATTERN = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9_~-][A-Za-z0-9._~-]*)*/?$"
# Absolute POSIX path without control characters. Paths travel in this file, never on a command line,
# but a newline in a path is still always a mistake.
ABS_PATH_PATTERN = r"^/[^\x00-\x1f]*$"


def redact_url(url: str) -> str:
    """The URL as it may be printed: scheme, host, port and path, never user:password, query or fragment."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class ConfigError(ValueError):
    """A run configuration a stage cannot use, in one shape: where (the field, file or option), what is wrong there
    (fact), what to do (fix); the message is "where: fact; fix". Tests assert the type and `where`."""

    def __init__(self, where: str | Path, fact: str, fix: str = ""):
        self.where, self.fact, self.fix = str(where), fact, fix
        super().__init__(f"{self.where}: {fact}" + (f"; {fix}" if fix else ""))

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:  # (pickled as its three parts, not as the message)
        return type(self), (self.where, self.fact, self.fix)


class InvalidConfig(ConfigError):
    """Fields the schema refuses: `fields` names each (dotted), the message one line per field with its fix."""

    def __init__(self, where: str | Path, problems: list[tuple[str, str]]):
        self.problems, self.fields = problems, [field for field, _ in problems]
        super().__init__(where, "invalid:\n  " + "\n  ".join(problem_lines(problems)))

    def __reduce__(self) -> tuple[type, tuple[str, list[tuple[str, str]]]]:  # type: ignore[override]
        return type(self), (self.where, self.problems)


class Section(BaseModel):
    # allow_inf_nan=False: JSON from a trigger may carry Infinity or NaN, and an infinite timeout or heartbeat
    # limit means "never", which no field here is meant to allow.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Upper bounds for the numbers a run may ask for: far above any real model or run (DeepSeek-V3: 61 layers, 7168
# hidden, 129280 vocab), low enough that a typo (2**70) is refused here with its field named, not hours later by
# torch or numpy.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # hidden, intermediate and vocabulary sizes; also tokens per batch or per answer
MAX_COUNT = 1_000_000_000  # samples, steps
MAX_GPU_INDEX = 1023
DAY_S = 24 * 3600.0
GpuIndex = Annotated[int, Field(ge=0, le=MAX_GPU_INDEX)]
LayerId = Annotated[int, Field(ge=0, le=MAX_LAYERS - 1)]
DraftLength = Annotated[int, Field(ge=1, le=64)]
PublicSet = Literal["mtbench", "gsm8k", "humaneval", "bfcl"]  # the sets eagle3.data.public_sets knows


class TargetConfig(Section):
    """The model the drafter learns to imitate."""

    model_path: str = Field(
        title="Target model directory",
        description="HF-format directory on the box: config.json, *.safetensors, tokenizer files.",
        pattern=ABS_PATH_PATTERN,
    )
    tokenizer_path: str | None = Field(
        None, title="Tokenizer directory", description="Defaults to the model directory.", pattern=ABS_PATH_PATTERN
    )
    trust_remote_code: bool = Field(
        False, title="Trust remote code", description="Needed by models with custom code, e.g. Kimi-K2.5."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", title="Compute dtype", description="Dtype the target runs in during capture."
    )
    # Facts about the target. Filled on the box from the model's config.json (resolve_target_facts);
    # set them in the trigger form to have layer ids checked before anything starts.
    num_hidden_layers: int | None = Field(
        None, ge=1, le=MAX_LAYERS, title="Decoder layers", description="Filled from config.json."
    )
    hidden_size: int | None = Field(
        None, ge=1, le=MAX_WIDTH, title="Hidden size", description="Filled from config.json."
    )
    vocab_size: int | None = Field(
        None, ge=1, le=16 * MAX_WIDTH, title="Vocabulary size", description="Filled from config.json."
    )


class DataConfig(Section):
    """The conversations the drafter trains on."""

    path: str = Field(
        title="Conversations (JSONL)",
        description='One conversation per line, ShareGPT ({"conversations": [{"from", "value"}]}) or '
        'OpenAI ({"messages": [{"role", "content"}]}).',
        pattern=ABS_PATH_PATTERN,
    )
    max_length: int = Field(
        4096,
        ge=16,
        le=1_048_576,
        title="Max tokens per sample",
        description="A longer conversation keeps its start and the turns that end within it; each later turn gets "
        "a sample of its own, its context cut from the left (a turn longer than this is cut at its end). Counted in "
        "the extract stats.",
    )
    max_samples: int | None = Field(
        None, ge=1, le=MAX_COUNT, title="Max samples", description="Use only the first N lines."
    )
    on_bad_record: Literal["error", "skip"] = Field(
        "error",
        title="Bad records",
        description="error: stop and list the bad line numbers. skip: skip them and count them in the stats.",
    )
    chat_template_kwargs: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        title="Chat template arguments",
        description="Passed to the target's chat template wherever it renders (and to SGLang in generate), e.g. "
        '{"enable_thinking": true} for Qwen3, or a template\'s option to keep reasoning in earlier turns.',
    )
    generation_chat_template: str | None = Field(
        None,
        title="Template for the turns as generated",
        description="A jinja chat template file on the box that renders every assistant turn with its reasoning "
        "(e.g. Kimi-K2.5's own, with its history branch emptied). Without it each turn is derived from the target's "
        "template; set it where that fails (extract refuses the run and says so): each turn is then its own sample, "
        "its prompt by the target's template, the turn by this one.",
        pattern=ABS_PATH_PATTERN,
    )
    loss_mask: Literal["assistant_turn", "content"] = Field(
        "assistant_turn",
        title="Trained tokens",
        description="assistant_turn (SpecForge's): all the target generated in a turn, reasoning, tool calls and "
        "the end-of-turn token included. content: only the content and reasoning text.",
    )
    max_untrained_fraction: float = Field(
        0.01,
        ge=0,
        le=1,
        title="Untrained turns allowed",
        description="Extract refuses the run (exit 2) when more than this fraction of the assistant turns, or of "
        "their tokens, cannot be trained as the target generated them (the chat template renders them otherwise: "
        "set data.generation_chat_template). 0: none may be lost; 1: never refuse. Counted in the extract stats.",
    )


class ServerConfig(Section):
    """A serving engine a stage starts on the box and always stops again: SGLang (python -m sglang.launch_server) or
    vLLM (its OpenAI-compatible server). generate (with launch_server), evaluate (backend "server") and benchmark
    use it."""

    engine: Literal["sglang", "vllm"] = Field(
        "sglang",
        title="Serving engine",
        description="sglang: the box's engine for large targets. vllm: vLLM's OpenAI-compatible server (its CPU "
        "build serves small targets without a GPU).",
    )
    python: str | None = Field(
        None,
        title="Engine's interpreter",
        description="The Python that has the engine installed (SGLang and vLLM rarely share one environment). Empty: "
        "box.python.",
        pattern=ABS_PATH_PATTERN,
    )
    port: int = Field(
        30000,
        ge=1024,
        le=65535,
        title="Port",
        description="On 127.0.0.1 of the box. A stage refuses it while a process other than its engine listens there.",
    )
    tp_size: int = Field(1, ge=1, le=64, title="Tensor parallel size", description="GPUs per server (Kimi-K2.5: 8).")
    mem_fraction_static: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        title="Static memory fraction",
        description="Of each GPU (SGLang's --mem-fraction-static, vLLM's --gpu-memory-utilization); empty: the "
        "engine's default.",
    )
    extra_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        title="Extra server arguments",
        description='Other flags of the engine\'s server, e.g. {"attention-backend": "triton", "reasoning-parser": '
        '"kimi_k2"}; true: a bare flag. Each goes as one --name=value argument. Only flags eagle3/engine_flags.py '
        "lists as reviewed, or reviewed_flags names.",
    )
    reviewed_flags: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,99}$")]] = Field(
        default_factory=list,
        title="Flags the operator reviewed",
        description="extra_args flags the deployment allows beyond the project's reviewed list, each by name (a "
        "settings-file decision: what the flag reads, writes or reaches is the operator's to know).",
    )
    startup_timeout_s: float = Field(
        1800,
        gt=0,
        le=DAY_S,
        title="Startup timeout (s)",
        description="Until /health answers; loading a 1T model takes a while.",
    )

    # Flags extra_args must leave alone, per engine, and why, reviewed or not. argparse takes any unambiguous prefix
    # of a flag ('--hos' is '--host'), so a name that begins one of these is refused too. A name ending in '-' stands
    # for a family of flags.
    FROM_CONFIG_WHY: ClassVar[str] = (
        "comes from the run config (target.*, server.tp_size, server.mem_fraction_static): set it there"
    )
    KEPT_LOCAL_WHY: ClassVar[str] = (
        "is the launcher's: the server listens on 127.0.0.1:server.port of one box, with "
        "no config file of its own; remove it"
    )
    SET_BY_STAGES_WHY: ClassVar[str] = "is set by the stages (evaluate.*, benchmark.*): remove it"
    RESERVED: ClassVar[dict[str, dict[str, str]]] = {
        "sglang": {
            **dict.fromkeys(
                (
                    "model-path",
                    "model",
                    "tokenizer-path",
                    "trust-remote-code",
                    "dtype",
                    "tp-size",
                    "tensor-parallel-size",
                    "mem-fraction-static",
                ),
                FROM_CONFIG_WHY,
            ),
            **dict.fromkeys(
                ("host", "port", "config", "dist-init-addr", "nccl-init-addr", "nnodes", "node-rank"), KEPT_LOCAL_WHY
            ),
            "speculative-": SET_BY_STAGES_WHY,
        },
        "vllm": {
            **dict.fromkeys(
                (
                    "model",
                    "tokenizer",
                    "trust-remote-code",
                    "dtype",
                    "tensor-parallel-size",
                    "tp",
                    "gpu-memory-utilization",
                ),
                FROM_CONFIG_WHY,
            ),
            **dict.fromkeys(
                ("host", "port", "uds", "config", "headless", "data-parallel-address", "data-parallel-rpc-port"),
                KEPT_LOCAL_WHY,
            ),
            # vllm 0.32 also spells speculative decoding --spec-method / --spec-model / --spec-tokens
            **dict.fromkeys(("speculative-", "spec-", "per-request-spec-decode-metrics"), SET_BY_STAGES_WHY),
        },
    }

    @model_validator(mode="after")
    def _extra_args_are_reviewed_and_leave_the_launch_alone(self) -> ServerConfig:
        for name in self.extra_args:
            for reserved, why in self.RESERVED[self.engine].items():
                if _names_flag(name, reserved):
                    raise ValueError(f"server.extra_args: {name!r} {why}")
        check_extra_args("server.extra_args", self.extra_args, SERVER_FLAGS[self.engine], self.reviewed_flags, "-")
        return self


def _names_flag(flag: str, reserved: str) -> bool:
    """Whether argparse would read `--flag` as the reserved flag: the same, or an abbreviation of it. A reserved
    name ending in '-' stands for a family of flags ('speculative-')."""
    if reserved.endswith("-") and flag.startswith(reserved):
        return True
    return reserved.startswith(flag)


class GenerateConfig(Section):
    """Regenerating the assistant turns with the target itself (the generate stage)."""

    enabled: bool = Field(False, title="Regenerate responses", description="Off: train on the data as given.")
    backend: Literal["server", "hf"] = Field(
        "server",
        title="Generation backend",
        description="server: an OpenAI-compatible endpoint (SGLang). hf: the target in transformers inside the "
        "stage, batched; for small targets (the CPU demo), no reasoning or tool-call parsing.",
    )
    launch_server: bool = Field(
        False,
        title="Start SGLang for this stage",
        description="On: start the target on the box with the server settings below, stop it afterwards. "
        "Off: use the endpoint as it runs.",
    )
    endpoint: str = Field(
        "http://127.0.0.1:30000/v1",
        title="OpenAI-compatible endpoint",
        description="Base URL of the target's server, seen from the box (ignored when the stage starts the server); "
        "the stage calls its /chat/completions and /models. No user:password, query or fragment: put a key in "
        "generate.api_key_env.",
        pattern=ENDPOINT_PATTERN,
    )
    api_key_env: str | None = Field(
        None,
        title="API key variable",
        description="Name of the environment variable on the box that holds the endpoint's API key (sent as "
        "'Authorization: Bearer'). The key itself never goes into the form, the run config or a log.",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
    )
    model: str | None = Field(
        None, title="Model name in requests", description="Empty: target.model_path, SGLang's default served name."
    )
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        title="Temperature",
        description="Empty: the target's own sampling, as its generation_config.json names it (temperature, top_p, "
        "top_k: what SGLang and vLLM serve it with by default, so the drafter learns the answers it will be asked "
        "to predict), filled in at init; greedy when the file names no temperature. 0: greedy.",
    )
    top_p: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        title="Top-p",
        description="Nucleus sampling. Empty: the target's generation_config.json, else 1 (keeps all).",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        le=16 * MAX_WIDTH,
        title="Top-k",
        description="Sample among the k likeliest tokens. Empty: the target's generation_config.json, else no limit.",
    )
    max_tokens: int = Field(
        32768,
        ge=1,
        le=MAX_WIDTH,
        title="Max new tokens per turn",
        description="A longer answer is cut here (SGLang finish_reason length), kept as cut and trained without an "
        "end of turn. Room for a thinking target's reasoning (Kimi-K2.5 thinks for thousands of tokens, and a cut "
        "tool-call turn changes the call); other targets end long before it.",
    )
    reasoning: Literal["keep", "drop"] = Field(
        "keep",
        title="Reasoning content",
        description="Thinking models (SGLang --reasoning-parser): keep it as the assistant's reasoning_content, "
        "which the chat template renders and the drafter learns; or drop it.",
    )
    num_samples: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        title="Conversations to regenerate",
        description="The first N; empty: data.max_samples, or all.",
    )
    concurrency: int = Field(
        64,
        ge=1,
        le=4096,
        title="Concurrent requests",
        description="Conversations in flight; SGLang batches them. Higher keeps the GPUs busier.",
    )
    request_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=DAY_S,
        title="Request timeout (s)",
        description="The whole of one turn's request, from connecting to the last byte of the answer; a timeout is "
        "retried. An answer of max_tokens at 10-20 tokens/s per request in a full batch takes most of an hour.",
    )
    max_retries: int = Field(
        5, ge=0, le=100, title="Retries per request", description="On connection errors, timeouts, 429 and 5xx."
    )
    max_failure_rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        title="Failure rate that stops the stage",
        description="Of the conversations tried (checked after the first 20): a dead server stops the stage early.",
    )
    progress_interval_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        title="Progress log interval (s)",
        description="Seconds between progress lines in the task log.",
    )

    @field_validator("endpoint", mode="before")
    @classmethod
    def _endpoint_without_credentials(cls, url: object) -> object:
        # Before the pattern, whose message would repeat the URL, password and all, into the task log.
        if isinstance(url, str):
            parts = urlsplit(url)
            if "@" in parts.netloc:
                raise ValueError(
                    "generate.endpoint: has user:password in it, which would be printed and stored "
                    f"with the URL ({redact_url(url)}); put the key in a variable on the box and name "
                    "it in generate.api_key_env"
                )
            if parts.query or parts.fragment or "?" in url or "#" in url:
                raise ValueError(
                    f"generate.endpoint: {redact_url(url)} has a ?query or #fragment, which would cut "
                    "off the /chat/completions the stage appends; give the base URL only, e.g. "
                    "http://127.0.0.1:30000/v1"
                )
        return url

    @model_validator(mode="after")
    def _hf_starts_no_server(self) -> GenerateConfig:
        if self.backend == "hf" and self.launch_server:
            raise ValueError(
                "generate.launch_server: the hf backend runs the target inside the stage and starts no "
                "server; turn launch_server off (or use backend 'server')"
            )
        return self


class SglangEngineConfig(Section):
    """Arguments for sglang.Engine, passed through as given (no hard-coded kernels or backends)."""

    tp_size: int = Field(
        1, ge=1, le=64, title="Tensor parallel size", description="GPUs per capture engine (Kimi-K2.5: 8)."
    )
    mem_fraction_static: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        title="Static memory fraction",
        description="Of each GPU, for the capture engine (one at a time on either capture path).",
    )
    attention_backend: str | None = Field(
        None,
        title="Attention backend",
        description="Blackwell workstation cards (sm_120) need one that supports them.",
        pattern=r"^[A-Za-z0-9_-]+$",
    )
    capture: Literal["auto", "plugin", "lists"] = Field(
        "auto",
        title="Capture path",
        description="plugin: one engine, one prefill per sample; its scheduler writes the states to files "
        "(eagle3/capture/sglang_plugin.py). lists: SGLang's public return path, two engines in turn, the prefill "
        "twice. auto: plugin where the sglang version and a start-up probe allow, else lists (logged).",
    )
    extra_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        title="Extra engine arguments",
        description="Other sglang ServerArgs fields, by name: those eagle3/engine_flags.py lists as reviewed, or "
        "reviewed_args names.",
    )
    reviewed_args: list[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,99}$")]] = Field(
        default_factory=list,
        title="Arguments the operator reviewed",
        description="extra_args names the deployment allows beyond the project's reviewed list (a settings-file "
        "decision).",
    )

    # Engine arguments extra_args must leave alone, and why (the capture backend sets the first two kinds).
    FROM_CONFIG: ClassVar[tuple[str, ...]] = (
        "model_path",
        "tokenizer_path",
        "trust_remote_code",
        "dtype",
        "tp_size",
        "mem_fraction_static",
        "attention_backend",
    )
    FOR_CAPTURE: ClassVar[tuple[str, ...]] = (
        "skip_tokenizer_init",
        "disable_radix_cache",
        "chunked_prefill_size",
        "enable_return_aux_hidden_states",
        "speculative_algorithm",
        "return_aux_hidden_state_layer_ids",
        "enable_return_hidden_states",
        "base_gpu_id",
        "disable_overlap_schedule",
    )
    SPREAD_OVER_GPUS: ClassVar[tuple[str, ...]] = ("dp_size", "pp_size", "gpu_id_step")
    # Two-batch overlap runs a DeepSeek model's layers after its dense ones through model_forward_stages, which
    # captures no aux state (sglang 0.5.23 srt/models/deepseek_v2.py): the later aux layers would come back empty.
    LOSES_AUX_STATES: ClassVar[tuple[str, ...]] = ("enable_two_batch_overlap",)
    KEPT_LOCAL: ClassVar[tuple[str, ...]] = ("host", "port", "dist_init_addr", "nccl_init_addr", "nnodes", "node_rank")

    @model_validator(mode="after")
    def _extra_args_are_reviewed_and_leave_the_capture_alone(self) -> SglangEngineConfig:
        cls, extra = type(self), self.extra_args
        for name in extra:  # sglang.Engine takes ServerArgs field names as keyword arguments
            if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                raise ValueError(
                    f"extract.sglang.extra_args: {name!r} is not a ServerArgs field name; write it with "
                    f"underscores, e.g. {name.replace('-', '_').lower()!r}"
                )
        for names, why in (
            (cls.FROM_CONFIG, "come from the run config (target.*, extract.sglang.*): set them there"),
            (cls.FOR_CAPTURE, "are set by the capture backend for capture to work: remove them"),
            (
                cls.SPREAD_OVER_GPUS,
                "would spread a shard over more GPUs than its group (and pp_size > 1 cannot "
                "capture aux states): use extract.num_shards for data parallelism",
            ),
            (
                cls.LOSES_AUX_STATES,
                "would run the layers after the dense ones without capturing their aux states "
                "(SGLang's two-batch overlap): remove them for extraction (serving may still use them)",
            ),
            (
                cls.KEPT_LOCAL,
                "are the engine's own: one capture engine runs on one box, reached by no one else; remove them",
            ),
        ):
            clash = sorted(set(extra) & set(names))
            if clash:
                raise ValueError(f"extract.sglang.extra_args: {clash} {why}")
        check_extra_args("extract.sglang.extra_args", extra, SGLANG_ENGINE, self.reviewed_args, "_")
        return self


class ExtractConfig(Section):
    """Capturing the target's hidden states into the store (the extract stage)."""

    backend: Literal["hf", "sglang"] = Field(
        "hf", title="Capture backend", description="hf: transformers (reference, small targets). sglang: TP giants."
    )
    aux_layers: list[LayerId] | None = Field(
        None,
        min_length=3,
        max_length=3,
        title="Aux layer ids",
        description="HF convention (output of decoder layer i). Default [1, L//2-1, L-4]: [1, 29, 57] for 61 layers.",
    )
    device: str = Field(
        "auto",
        title="Device (hf backend)",
        description="auto: a GPU of the shard's own on its box (see Shards), or the CPU without CUDA.",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
    )
    batch_tokens: int = Field(
        16384,
        ge=16,
        le=16 * MAX_WIDTH,
        title="Tokens per forward batch",
        description="Padded tokens per forward pass (hf); tokens per request batch (sglang).",
    )
    state_dtype: Literal["bf16", "fp8_e4m3"] = Field(
        "bf16",
        title="Stored state dtype",
        description="bf16: as the target computes them. fp8_e4m3: half the disk, one scale per token and layer.",
    )
    chunk_mib: int = Field(
        256, ge=1, le=16384, title="Chunk size (MiB)", description="Target size of one store chunk file."
    )
    num_shards: int = Field(
        1,
        ge=1,
        le=4096,
        title="Shards",
        description="Data-parallel extraction jobs, dealt round-robin to the boxes; the shards on one box take "
        "GPUs of their own there: one each (hf), or extract.sglang.tp_size each (sglang).",
    )
    writer_queue_depth: int = Field(
        2, ge=1, le=64, title="Writer queue depth", description="Batches buffered between compute and disk."
    )
    progress_interval_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        title="Progress log interval (s)",
        description="Seconds between progress lines in the task log.",
    )
    sglang: SglangEngineConfig = Field(default_factory=SglangEngineConfig)

    @field_validator("aux_layers")
    @classmethod
    def _aux_layers_increasing(cls, layers: list[int] | None) -> list[int] | None:
        if layers is None:
            return None
        if any(i < 0 for i in layers):
            raise ValueError(f"layer ids must be >= 0, got {layers}")
        if sorted(set(layers)) != layers:
            raise ValueError(f"layer ids must be strictly increasing (low, mid, high), got {layers}")
        return layers


class VocabConfig(Section):
    """Draft/target vocabulary mapping (the vocab stage)."""

    draft_vocab_size: int = Field(
        32000,
        ge=1,
        le=16 * MAX_WIDTH,
        title="Draft vocabulary size",
        description="The most frequent target tokens in the answers; the drafter predicts only these (d2t, t2d).",
    )
    reuse_from: str | None = Field(
        None,
        title="Reuse mapping from",
        description="A vocab_mapping/ dir of an earlier run; reused only if its coverage of this data is enough.",
        pattern=ABS_PATH_PATTERN,
    )
    min_coverage: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        title="Minimum coverage for reuse",
        description="Share of this data's answer tokens a reused mapping must cover; below it the stage stops.",
    )


# Head dims every SGLang attention backend a drafter may run on supports: flashinfer dispatches 64, 128, 256
# (and 512) and rejects the rest; fa3 takes multiples of 8 up to 256; triton pads to a power of two. Read in
# sglang 0.5.23 and flashinfer 0.7.2 (2026-12).
SGLANG_HEAD_DIMS = (64, 128, 256)


class DrafterConfig(Section):
    """The draft model's attention and MLP shape. Empty: derived from the target as the published drafters
    for DeepSeek-V3 and Kimi do (head_dim 128, hidden/128 heads, 8 KV heads, the target's dense MLP width);
    init fills them in, so the run config records them."""

    head_dim: int | None = Field(
        None,
        ge=1,
        le=max(SGLANG_HEAD_DIMS),
        title="Attention head dim",
        description=f"One of {list(SGLANG_HEAD_DIMS)}, what SGLang's attention backends (flashinfer, fa3, triton) "
        "all run. Default 128 (64 for targets narrower than 1024).",
    )
    num_attention_heads: int | None = Field(
        None,
        ge=1,
        le=4096,
        title="Attention heads",
        description="Default hidden_size // head_dim (DeepSeek-V3/Kimi: 56).",
    )
    num_key_value_heads: int | None = Field(
        None,
        ge=1,
        le=4096,
        title="KV heads",
        description="Grouped-query attention; divides the heads. Default 8 (or the heads, if fewer): the draft KV "
        "cache SGLang keeps per token.",
    )
    intermediate_size: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        title="MLP width",
        description="Default the target's dense intermediate_size (DeepSeek-V3: 18432).",
    )
    rope_theta: float | None = Field(
        None,
        gt=0,
        le=1e12,
        title="RoPE theta",
        description="Default the target's rope_theta (Kimi-K2.5: 50000).",
    )
    rope_scaling: Literal["target", "none"] = Field(
        "target",
        title="RoPE scaling",
        description="target: train and export the drafter with the target's RoPE scaling (Kimi-K2.5's YaRN), as the "
        "engines will apply it from the drafter's config.json. none: plain theta, knowingly (init warns when the "
        "target scales its RoPE).",
    )

    fc_norm: bool = Field(
        False,
        title="EAGLE-3.1: norm each aux state",
        description="An RMSNorm on each of the target's aux states before the drafter's fc (EAGLE-3.1; SGLang and "
        "vLLM read fc_norm from the drafter's config.json).",
    )
    norm_output: bool = Field(
        False,
        title="EAGLE-3.1: pass the normed state on",
        description="Each draft step hands the next one its hidden state after the final norm, not before "
        "(EAGLE-3.1; SGLang and vLLM read norm_output).",
    )

    @field_validator("head_dim")
    @classmethod
    def _served_head_dim(cls, head_dim: int | None) -> int | None:
        if head_dim is not None and head_dim not in SGLANG_HEAD_DIMS:
            raise ValueError(
                f"drafter.head_dim: {head_dim} is not one SGLang's attention backends all run; "
                f"use one of {list(SGLANG_HEAD_DIMS)} (or leave it empty for the default)"
            )
        return head_dim

    @model_validator(mode="after")
    def _kv_heads_divide(self) -> DrafterConfig:
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ValueError(
                f"drafter.num_key_value_heads: {kv} does not divide num_attention_heads {heads}; pick a divisor"
            )
        return self


class TrainConfig(Section):
    """Training the draft model (the train stage)."""

    nproc_per_node: int = Field(
        1, ge=1, le=64, title="Processes per node", description="DDP ranks; with gpus set, len(gpus) wins."
    )
    gpus: list[GpuIndex] | None = Field(
        None,
        title="GPUs",
        description="GPU indices to train on, e.g. [0, 1, 2, 3] for 4 of 8; one rank each. Empty: all visible.",
    )
    first_draft_position: bool = Field(
        True,
        title="Train the drafts decoding makes",
        description="Train the drafts speculative decoding makes, and only those: from the prompt's last token "
        "(the first draft after prefill) to the answer's end of turn, each chain only while it stays in the answer. "
        "Off: SpecForge's mask exactly (targets after the end of turn included).",
    )
    ttt_length: int = Field(
        7,
        ge=1,
        le=16,
        title="Training-time-test steps",
        description="Draft positions unrolled per step, each fed the previous one's output (SpecForge: 7).",
    )
    objective: Literal["kl", "lk_lambda", "lk_alpha"] = Field(
        "kl",
        title="Training objective",
        description="kl: SpecForge's (cross-entropy to the target's distribution over the draft vocab). lk_lambda / "
        "lk_alpha: LK losses (arXiv 2602.23881, SpecForge's lk_loss_type), which target the expected acceptance "
        "directly: lk_lambda blends KL (while the drafter is poor) into 1 - acceptance (once it is good), lk_alpha "
        "is -log acceptance. docs/results.md has the paired-seed comparison.",
    )
    lk_kl_decay: float = Field(
        3.0,
        ge=0,
        le=100,
        title="LK: KL weight decay",
        description="lk_lambda's KL weight is exp(-decay * acceptance): higher hands over to acceptance sooner.",
    )
    epochs: int = Field(1, ge=1, le=10_000, title="Epochs", description="Passes over the training split of the store.")
    init_from: Literal["scratch", "current"] = Field(
        "scratch",
        title="Start from",
        description="scratch: fresh seeded weights. current: the lineage's promoted drafter "
        "({workdir}/drafters/<lineage>/current; scratch while there is none), its draft-vocab rows matched by token. "
        "Chosen by the first try and kept: retries start from the same weights.",
    )
    learning_rate: float = Field(
        1e-4, gt=0, le=10, title="Learning rate", description="AdamW peak, reached after warmup; cosine decay after."
    )
    warmup_ratio: float = Field(
        0.015, ge=0, lt=1, title="Warmup fraction", description="Of all steps, with the learning rate rising linearly."
    )
    max_grad_norm: float = Field(0.5, gt=0, le=1e6, title="Gradient clip norm", description="Global L2 norm, per step.")
    batch_tokens: int | None = Field(
        None,
        ge=16,
        le=16 * MAX_WIDTH,
        title="Tokens per rank per step",
        description="Padded tokens per rank per step (samples packed up to it). Empty: one sample per rank per "
        "step, SpecForge's default, which trained the better drafter on the same tokens (bench/train_recipe.py).",
    )
    val_fraction: float = Field(
        0.02,
        ge=0,
        lt=1,
        title="Held-out fraction",
        description="Held out of training, by user turn: the lower half gives evaluate's and benchmark's "
        "prompts, the upper half validates and picks the best checkpoint.",
    )
    save_every_steps: int = Field(
        1000,
        ge=1,
        le=MAX_COUNT,
        title="Checkpoint every N steps",
        description="Also validates. A crash loses at most this many steps; the last step is always saved.",
    )
    keep_last: int = Field(
        2,
        ge=1,
        le=1000,
        title="Checkpoints kept (plus best)",
        description="Older ones are deleted; the best by offline acceptance length (decoding replayed on the "
        "validation split) is kept too.",
    )
    progress_interval_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        title="Progress log interval (s)",
        description="Seconds between progress lines in the task log.",
    )

    @field_validator("gpus")
    @classmethod
    def _gpus_distinct(cls, gpus: list[int] | None) -> list[int] | None:
        if gpus is not None and (not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0):
            raise ValueError(f"GPU indices must be distinct and >= 0, got {gpus}; leave empty for all visible GPUs")
        return gpus

    @property
    def ranks(self) -> int:
        return len(self.gpus) if self.gpus else self.nproc_per_node


class ExportConfig(Section):
    """Writing the SGLang-loadable drafter (the export stage)."""

    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", title="Weights dtype", description="Of the exported drafter's weights (trained in fp32)."
    )


class EvaluateConfig(Section):
    """Measuring acceptance length (the evaluate stage)."""

    backend: Literal["hf", "server"] = Field(
        "hf",
        title="Measured on",
        description="hf: speculative decoding on the target in transformers inside the stage (the reference; targets "
        "that fit one device). server: the serving engine (server.engine) with the drafter loaded, what users get; "
        "for targets transformers cannot hold (Kimi-K2.5). Either way the figure that gates promotion.",
    )

    num_prompts: int = Field(
        64,
        ge=1,
        le=MAX_WIDTH,
        title="Held-out prompts",
        description="From the evaluation part of the split (by user turn), never trained on: first user "
        "turns, up to half later turns.",
    )
    draft_lengths: list[DraftLength] = Field(
        default_factory=lambda: [3, 7],
        min_length=1,
        title="Draft lengths k",
        description="Draft tokens proposed per verify step; acceptance length is measured for each.",
    )
    max_new_tokens: int = Field(
        256,
        ge=1,
        le=MAX_WIDTH,
        title="Max new tokens per prompt",
        description="Answered by the target with and without the drafter; raise it for reasoning answers.",
    )
    sampling: Literal["greedy", "serving"] = Field(
        "greedy",
        title="Answers drawn",
        description="greedy: temperature 0; every answer with the drafter must equal the plain one token for token. "
        "serving: the target's serving sampling (generate.temperature, top_p, top_k as init resolved them from its "
        "generation_config.json), as users are served: a draft is accepted with the target's probability of it and "
        "a rejected one resampled from the rest (the speculative sampling rule SGLang and vLLM apply), and the "
        "answers are checked to follow plain sampling's distribution (a permutation test). Greedy when the target "
        "samples at temperature 0.",
    )
    promote: bool = Field(
        True,
        title="Promote a better drafter",
        description="Measure the lineage's current drafter on the same pinned prompts and make this run's the "
        "current one ({workdir}/drafters/<lineage>/current) if it is better.",
    )
    promote_margin: float = Field(
        0.0,
        ge=0,
        le=100,
        title="Promotion margin",
        description="How much longer the acceptance length at the first draft length must be than the current "
        "drafter's.",
    )
    keep_versions: int = Field(
        3, ge=1, le=1000, title="Promoted versions kept", description="Older promoted drafters are removed."
    )
    progress_interval_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        title="Progress log interval (s)",
        description="Seconds between progress lines in the task log.",
    )
    # Public sets (eagle3.data.public_sets): the names there, SETS, are these.
    benchmarks: list[PublicSet] = Field(
        default_factory=list,
        max_length=4,
        title="Public benchmark sets",
        description="Also measure this run's drafter on public sets, at the configurations published Kimi drafters "
        "report (3 steps / topk 1 / 4 draft tokens, and 7 / 1 / 8: k=3 and k=7), beside the held-out prompts: "
        "mtbench (MT-Bench, both turns), gsm8k, humaneval, bfcl (BFCL v3 simple, with its tools). Read from the "
        "Hugging Face hub on the box (the datasets library), or from benchmark_files; rendered with the target's "
        "chat template and data.chat_template_kwargs. Empty: none, and nothing is downloaded.",
    )
    benchmark_prompts: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        title="Records per public set",
        description="The first N records of each set (an MT-Bench record asks two prompts). Empty: SpecForge's "
        "bench sizes, MT-Bench 80, GSM8K 200, HumanEval 200 (all 164), BFCL 200.",
    )
    benchmark_files: dict[PublicSet, Annotated[str, Field(pattern=ABS_PATH_PATTERN)]] = Field(
        default_factory=dict,
        title="Public sets from local files",
        description="A local copy per set, read instead of the hub (offline boxes): the set's own records as a JSON "
        'array, JSON lines or parquet, e.g. {"gsm8k": "/data/gsm8k-test.jsonl"} of {"question": ...} records.',
    )
    benchmark_max_new_tokens: int = Field(
        2048,
        ge=1,
        le=MAX_WIDTH,
        title="Max new tokens per public-set prompt",
        description="Greedy; 2048 as SpecForge's MT-Bench bench asks. A thinking target reasons longer: the answers "
        "cut here are counted in report.json (public_sets.<set>.answers_cut_at_max_new_tokens).",
    )

    @model_validator(mode="after")
    def _benchmark_files_name_measured_sets(self) -> EvaluateConfig:
        if len(set(self.benchmarks)) < len(self.benchmarks):
            raise ValueError(f"evaluate.benchmarks: {self.benchmarks} names a set twice; name each once")
        unused = sorted(set(self.benchmark_files) - set(self.benchmarks))
        if unused:
            raise ValueError(
                f"evaluate.benchmark_files: {', '.join(unused)} is not in evaluate.benchmarks "
                f"{self.benchmarks}; add it there to measure it, or remove its file"
            )
        return self


class BenchmarkConfig(Section):
    """Serving the drafter with the serving engine (server.engine) against the plain target (the benchmark stage)."""

    enabled: bool = Field(
        False,
        title="Benchmark in the serving engine",
        description="Needs the engine on the box (server.engine); off in the CPU demo.",
    )
    num_prompts: int = Field(
        64,
        ge=1,
        le=MAX_WIDTH,
        title="Held-out prompts",
        description="The same for both servers, from the evaluation part of the split.",
    )
    max_new_tokens: int = Field(
        512, ge=1, le=MAX_WIDTH, title="Max new tokens per prompt", description="Greedy (temperature 0)."
    )
    concurrency: int = Field(
        1, ge=1, le=1024, title="Concurrent requests", description="Speculation pays most at small batch sizes."
    )
    num_steps: int = Field(
        3, ge=1, le=16, title="--speculative-num-steps", description="Draft forward passes per verify step."
    )
    eagle_topk: int = Field(
        1, ge=1, le=16, title="--speculative-eagle-topk", description="Branches per draft step; 1 is a chain."
    )
    num_draft_tokens: int = Field(
        4,
        ge=2,
        le=64,
        title="--speculative-num-draft-tokens",
        description="Tokens verified per step; with topk 1 it must be num_steps + 1.",
    )

    @model_validator(mode="after")
    def _draft_tokens_fit(self) -> BenchmarkConfig:
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"benchmark.num_draft_tokens: with eagle_topk 1 SGLang drafts a chain of num_steps + 1 = "
                f"{self.num_steps + 1} tokens; set it to that (got {self.num_draft_tokens})"
            )
        return self


class ServeConfig(Section):
    """Where the drafter will be served: nothing runs with these; init checks the drafter's shape against them."""

    tp_sizes: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=lambda: [1],
        min_length=1,
        title="Serving tensor-parallel sizes",
        description="The TP sizes the target and drafter will be served at (Kimi-K2.5: [8, 16]). The drafter's "
        "attention heads must split evenly across each, and its KV heads split or replicate evenly.",
    )


class RunConfig(Section):
    """Everything one run needs; one DAG run = one run directory."""

    run_name: str = Field(
        title="Run name",
        description="Names the run directory {workdir}/runs/{run_name}. Letters, digits, '.', '_', '-'.",
        pattern=RUN_NAME_PATTERN,
    )
    workdir: str = Field(
        title="Work directory",
        description="Persistent directory on the box (never /tmp): code, runs and jobs live under it.",
        pattern=ABS_PATH_PATTERN,
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, title="Seed", description="Drafter initial weights and data order.")
    target: TargetConfig
    data: DataConfig
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _check_against_target_facts(self) -> RunConfig:
        layers = self.target.num_hidden_layers
        if layers is not None and self.extract.aux_layers is not None:
            for i in self.extract.aux_layers:
                if i >= layers:
                    raise ValueError(
                        f"extract.aux_layers: layer {i} out of range for a {layers}-layer target "
                        f"(valid 0..{layers - 1}); leave aux_layers empty for the default {default_aux_layers(layers)}"
                    )
            if self.extract.backend == "sglang" and self.extract.aux_layers[-1] == layers - 1:
                raise ValueError(
                    f"extract.aux_layers: layer {layers - 1} is the target's last layer, which the sglang backend "
                    "cannot capture (SGLang captures a layer's input, and no layer follows the last); use layers "
                    f"up to {layers - 2}, or the default {default_aux_layers(layers)}"
                )
        if self.benchmark.enabled and self.server.engine == "vllm" and self.benchmark.eagle_topk != 1:
            raise ValueError(
                f"benchmark.eagle_topk: vLLM drafts EAGLE-3 chains only; set it to 1 (and num_steps to the draft "
                f"length), or serve with server.engine sglang (got {self.benchmark.eagle_topk})"
            )
        self._check_served_tp()
        vocab = self.target.vocab_size
        if vocab is not None and self.vocab.draft_vocab_size > vocab:
            raise ValueError(
                f"vocab.draft_vocab_size: {self.vocab.draft_vocab_size} is larger than the target's vocabulary "
                f"({vocab}); set it to at most {vocab}"
            )
        return self

    @field_validator("workdir")
    @classmethod
    def _workdir_is_one_path_entry(cls, workdir: str) -> str:
        if ":" in workdir:  # stages run with PYTHONPATH={workdir}/code/<digest>: a ':' would add other entries
            raise ValueError(
                f"workdir: {workdir[:120]!r} has a ':', which would split the stages' PYTHONPATH "
                "({workdir}/code/...) into entries that are not the synced code; name a directory "
                "without one"
            )
        return workdir

    def _check_served_tp(self) -> None:
        """Every TP size the drafter is served at splits its attention heads evenly, and its KV heads evenly or
        replicates them evenly (tp a multiple of them): what SGLang's and vLLM's tensor-parallel attention need.
        Those are serve.tp_sizes, and server.tp_size where this run serves the drafter itself."""
        heads, kv = self.drafter.num_attention_heads, self.drafter.num_key_value_heads
        for tp in sorted(set(self.serve.tp_sizes) | ({self.server.tp_size} if self.serves_drafter else set())):
            where = f"serve.tp_sizes {self.serve.tp_sizes}" if tp in self.serve.tp_sizes else "server.tp_size"
            if heads is not None and heads % tp:
                fits = next((h for h in range(heads, 4097) if h % tp == 0 and (kv is None or h % kv == 0)), None)
                raise ValueError(
                    f"drafter.num_attention_heads: {heads} heads do not split across tp {tp} ({where}); set "
                    f"drafter.num_attention_heads to a multiple of {tp}"
                    + (
                        f", e.g. {fits} (with head_dim {self.drafter.head_dim}: the attention is then "
                        f"{fits * self.drafter.head_dim} wide, the hidden size stays)"
                        if fits and self.drafter.head_dim
                        else ""
                    )
                )
            if kv is not None and kv % tp and tp % kv:
                raise ValueError(
                    f"drafter.num_key_value_heads: {kv} KV heads neither split across nor replicate "
                    f"evenly over tp {tp} ({where}); pick a divisor or a multiple of {tp}"
                )

    # -- derived facts, defined here alone: the control plane (the GPU sensor, the pools, code sync) and the box read
    #    these, never the fields they come from.
    @property
    def serves_drafter(self) -> bool:
        """A stage serves the drafter itself with server.engine: evaluate (backend server) or benchmark."""
        return self.evaluate.backend == "server" or self.benchmark.enabled

    @property
    def starts_server(self) -> bool:
        """A stage starts server.engine on the run's first box: generate (launch_server), evaluate or benchmark."""
        return (self.generate.enabled and self.generate.launch_server) or self.serves_drafter

    @property
    def server_gpus(self) -> int:
        """GPUs the serving engine takes on the first box: server.tp_size, when a stage starts one."""
        return self.server.tp_size if self.starts_server else 0

    @property
    def needs_sglang(self) -> bool:
        """box.python must have sglang: the sglang capture backend, or an SGLang server started from box.python
        (without a server.python of its own)."""
        return self.extract.backend == "sglang" or (
            self.starts_server and self.server.engine == "sglang" and not self.server.python
        )

    @property
    def gpus_per_shard(self) -> int:
        """GPUs each extraction shard takes: extract.sglang.tp_size (sglang), 1 (hf on device auto), 0 (hf on the
        device extract.device names)."""
        if self.extract.backend == "sglang":
            return self.extract.sglang.tp_size
        return 1 if self.extract.device == "auto" else 0

    @property
    def train_gpus(self) -> int:
        """GPUs the first box must have for training: the highest train.gpus index + 1, or its ranks."""
        return max(self.train.gpus) + 1 if self.train.gpus else self.train.ranks

    # -- derived paths: all outputs live under run_dir, so a copy of the config with another
    #    workdir/run_name is a new, independent run.
    @property
    def run_dir(self) -> Path:
        return run_dir_of(self.workdir, self.run_name)

    @property
    def config_path(self) -> Path:
        return self.run_dir / CONFIG

    @property
    def store_dir(self) -> Path:
        return self.run_dir / HIDDEN_STATES

    @property
    def conversations_path(self) -> Path:
        """What extract trains on: the target's regenerated conversations, or data.path as given."""
        return self.run_dir / CONVERSATIONS if self.generate.enabled else Path(self.data.path)

    @property
    def conversations_missing_hint(self) -> str:
        if self.generate.enabled:
            return "{path} does not exist: run the generate stage first (generate.enabled is on)"
        return "data.path: {path} does not exist"

    @property
    def tokenizer_dir(self) -> str:
        return self.target.tokenizer_path or self.target.model_path

    def resolved_aux_layers(self) -> list[int]:
        if self.extract.aux_layers is not None:
            return list(self.extract.aux_layers)
        if self.target.num_hidden_layers is None:
            raise ConfigError("target.num_hidden_layers", "unknown", "resolve the target facts first (init)")
        return default_aux_layers(self.target.num_hidden_layers)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high capture layers in HF ids: [1, L//2-1, L-4] (61 layers -> [1, 29, 57]), which SGLang
    and vLLM default to as well. Below 8 layers those collide ([1, 2, 2] at 6): then three distinct layers spread the
    same way, from layer 1 to layer L-2 (the last one is no aux layer: SGLang captures a layer's input)."""
    if num_layers < 5:
        raise ConfigError(
            "extract.aux_layers", f"a {num_layers}-layer target is too shallow for the defaults", "set them"
        )
    layers = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(layers)) < 3:
        layers = [1, (num_layers - 1) // 2, num_layers - 2]
    return layers


# -- errors a person can act on --------------------------------------------------------------


def validation_problems(err: ValidationError) -> list[tuple[str, str]]:
    """(section.field, what is wrong and the fix) per problem pydantic found."""
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; check its spelling against `python -m eagle3 config schema`"
        elif e["type"] == "missing":
            msg = "required, but not given"
        elif e["type"] == "string_pattern_mismatch" and "pattern" in e.get("ctx", {}):
            msg = f"{e['input']!r} does not match {e['ctx']['pattern']}" + (
                " (an absolute path is required)" if e["ctx"]["pattern"] == ABS_PATH_PATTERN else ""
            )
        named = re.match(r"([a-z_][a-z0-9_.]*): ", msg)  # a validator that names the field it refuses
        if named and named.group(1).startswith(loc):
            loc, msg = named.group(1), msg[named.end() :]
        problems.append((loc, msg))
    return problems


def problem_lines(problems: list[tuple[str, str]]) -> list[str]:
    return [f"{loc}: {msg}" if loc and not msg.startswith(loc + ":") else msg for loc, msg in problems]


def format_validation_error(err: ValidationError, source: str | None = None) -> str:
    """One line per problem: `section.field: what is wrong (fix)`."""
    where = f" in {source}" if source else ""
    return f"invalid run configuration{where}:\n  " + "\n  ".join(problem_lines(validation_problems(err)))


def parse_run_config(data: dict[str, Any], source: str | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise InvalidConfig(source or "the run configuration", validation_problems(err)) from None


def load_run_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(path, "no such run config", "write one with `python -m eagle3 init`") from None
    except json.JSONDecodeError as err:
        raise ConfigError(path, f"not valid JSON ({err})", "write it with `python -m eagle3 init`") from None
    return parse_run_config(data, str(path))


def dump_run_config(cfg: RunConfig) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def write_run_config(cfg: RunConfig) -> Path:
    """Write config.json into the run directory, once.

    The same content again is a no-op (a retried task); different content is refused, because the
    outputs already in that directory were made with the old values.
    """
    path = cfg.config_path
    if path.exists():
        if load_run_config(path) == cfg:  # compared as validated models: key order and spelling do not matter
            return path
        raise ConfigError(
            path,
            "already exists with different values; its outputs were made with those",
            "pick a new run_name, or delete that run directory to start over",
        )
    atomic_write_text(path, dump_run_config(cfg))
    return path
