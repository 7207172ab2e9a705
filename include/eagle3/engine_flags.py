"""The serving engines' flags a run config may pass through extra_args: an allowlist, reviewed flag by flag.

`server.extra_args` goes onto the command line of the engine a stage starts (SGLang's launch_server, vLLM's OpenAI
server); `extract.sglang.extra_args` into `sglang.Engine(**kwargs)`. A flag is taken only if it is listed here, with
the reason it is safe: it tunes the one local server (kernels, memory, batching, scheduling, output parsing) and
does not read or write files, reach other hosts, import code, carry a secret or replace the model the run names.
Reviewed against sglang 0.5.23 (srt/server_args.py) and vllm 0.32 (engine/arg_utils.py, entrypoints/openai).

A deployment that needs another flag names it in its settings (`server.reviewed_flags`,
`extract.sglang.reviewed_args`): an operator's explicit decision, never a trigger's. The flags a stage sets itself
(model, host, port, parallelism, speculative decoding) stay refused either way, in eagle3.config.
"""

from __future__ import annotations

import re

# `python -m sglang.launch_server` flags, without '--'.
SGLANG_SERVER: dict[str, str] = {
    # kernels / backends (argparse choices, checked before launch)
    "attention-backend": "attention kernel choice (enum): compute only",
    "decode-attention-backend": "decode-phase attention kernel (enum), overrides attention-backend: compute only",
    "prefill-attention-backend": "prefill-phase attention kernel (enum), overrides attention-backend: compute only",
    "sampling-backend": "sampling kernel choice (enum: flashinfer/pytorch/...): compute only",
    "fp8-gemm-backend": "blockwise FP8 GEMM kernel choice (enum): compute only",
    "moe-runner-backend": "MoE expert GEMM kernel choice (enum): compute only",
    "kv-cache-dtype": "KV cache storage dtype (enum, e.g. fp8_e4m3): memory/numerics of the local cache",
    "enable-torch-compile": "torch.compile the model (bool): compute only; JIT caches as any kernel build",
    "torch-compile-max-bs": "largest batch compiled with torch.compile (int): compute only",
    "enable-deterministic-inference": "batch-invariant kernels (bool): numerics/reproducibility only",
    "triton-attention-num-kv-splits": "KV splits of the Triton decode kernel (int): compute only",
    "disable-custom-all-reduce": "use NCCL instead of the custom all-reduce (bool): intra-server comms only",
    "enable-symm-mem": "NCCL symmetric memory for collectives (bool): intra-server comms only",
    "enable-nccl-nvls": "NCCL NVLS for prefill collectives (bool): intra-server comms only",
    # CUDA graphs
    "cuda-graph-max-bs-decode": "largest decode batch captured in a CUDA graph (int): memory/speed only",
    "cuda-graph-backend-decode": "decode CUDA graph mode (enum: full/breakable/disabled): compute only",
    "disable-decode-cuda-graph": "run decode eagerly (bool): compute only",
    "disable-prefill-cuda-graph": "run prefill eagerly (bool): compute only",
    "disable-cuda-graph": "deprecated alias: both phases' CUDA graphs disabled (bool): compute only",
    "disable-cuda-graph-padding": "no CUDA graph when padding is needed (bool): compute only",
    # memory / batching / scheduling
    "context-length": "cap on context length (int; above config.json refused without env): memory only",
    "max-running-requests": "cap on concurrent running requests (int): scheduling only",
    "max-queued-requests": "cap on queued requests (int): admission/scheduling only",
    "max-total-tokens": "KV pool size in tokens (int): memory only",
    "max-prefill-tokens": "token budget of one prefill batch (int): scheduling only",
    "prefill-max-requests": "cap on requests in one prefill batch (int): scheduling only",
    "chunked-prefill-size": "prefill chunk size, -1 off (int): scheduling/memory only",
    "enable-mixed-chunk": "mix prefill chunks with decode in a batch (bool): scheduling only",
    "page-size": "tokens per KV page (int): memory layout only",
    "schedule-policy": "request scheduling order (enum: fcfs/lpm/...): scheduling only",
    "schedule-conservativeness": "how conservatively new requests are admitted (float): scheduling only",
    "num-continuous-decode-steps": "decode steps per scheduler round (int): scheduling only",
    "disable-radix-cache": "turn off prefix (radix) caching (bool): memory/scheduling only",
    "radix-eviction-policy": "prefix cache eviction order (enum: lru/lfu/...): memory only",
    "disable-chunked-prefix-cache": "turn off DeepSeek chunked prefix cache (bool): compute only",
    "disable-overlap-schedule": "turn off CPU/GPU overlap scheduler (bool): scheduling only",
    "enable-two-batch-overlap": "two micro-batch compute/comm overlap (bool): compute only",
    "enable-single-batch-overlap": "compute/comm overlap within one batch (bool): compute only",
    # parallelism inside the server's own tp-size GPUs
    "attn-dp-size": "attention-DP groups inside the TP group (int, divides tp-size): no extra GPUs",
    "dcp-size": "decode context parallel inside the TP group (int, divides tp-size): no extra GPUs",
    "ep-size": "expert parallelism inside the TP group (int): no extra GPUs",
    "moe-a2a-backend": "MoE all-to-all among the server's own ranks (enum: none/deepep/...): comms only",
    "deepep-mode": "DeepEP dispatch mode (enum: auto/normal/low_latency): comms only",
    "moe-dense-tp-size": "TP width of MoE models' dense MLPs (int, within TP): compute layout only",
    "disable-shared-experts-fusion": "keep DeepSeek shared experts unfused (bool): compute only",
    "enable-dp-lm-head": "vocab-parallel LM head under attention DP (bool): compute only",
    "ep-num-redundant-experts": "redundant expert replicas for EP (int): memory/load balance only",
    "enable-eplb": "rebalance experts across EP ranks in memory (bool): load balance only",
    "eplb-algorithm": "EPLB algorithm, looked up in an Enum by name (string): load balance only",
    # output parsing
    "reasoning-parser": "split reasoning from content (enum of built-in parsers): output parsing only",
    "tool-call-parser": "parse tool calls from output (enum of built-in parsers): output parsing only",
    "tokenizer-mode": "fast or slow HF tokenizer of the same files (enum: auto/slow): same tokens",
    # logs / metrics / seeds
    "random-seed": "sampling RNG seed (int): reproducibility only",
    "log-level": "log verbosity (string, a logging level name): local logs only",
    "log-level-http": "HTTP server log verbosity (string, a logging level name): local logs only",
    "log-requests": "log requests to the server's own stdout (bool; target flag not allowed): logs only",
    "log-requests-level": "how much of each request is logged (enum 0-3): local logs only",
    "decode-log-interval": "decode iterations between stats logs (int): local logs only",
    "enable-metrics": "Prometheus /metrics on the same port (bool; private temp dir): observability only",
    "enable-cache-report": "report cached prompt tokens in usage (bool): response field only",
    "watchdog-timeout": "seconds before a hung forward batch crashes the server (float): liveness only",
    "dist-timeout": "torch.distributed init timeout in seconds (int): startup only",
}

# vLLM OpenAI server flags (`python -m vllm.entrypoints.openai.api_server` / `vllm serve`), without '--'.
# BooleanOptionalAction flags also have a 'no-' form; flag_tokens drops False, so the 'no-' form is listed where
# turning a default-on feature off is useful.
VLLM_SERVER: dict[str, str] = {
    # memory / context
    "max-model-len": "cap on context length (int or 'auto'; above config refused without env): memory",
    "kv-cache-memory-bytes": "KV cache size in bytes (int, k/M/G suffixes): memory only, no file",
    "kv-cache-dtype": "KV cache storage dtype (enum, e.g. fp8): memory/numerics of the local cache",
    "block-size": "tokens per KV block (int): memory layout only",
    "enable-prefix-caching": "prefix caching on (bool): memory/scheduling only",
    "no-enable-prefix-caching": "prefix caching off (bool): memory/scheduling only",
    "prefix-caching-hash-algo": "prefix-cache block hash (enum: sha256/xxhash/...): compute only",
    # batching / scheduling
    "max-num-seqs": "cap on concurrent sequences (int): scheduling only",
    "max-num-batched-tokens": "token budget per scheduler step (int): scheduling only",
    "enable-chunked-prefill": "chunked prefill on (bool): scheduling only",
    "no-enable-chunked-prefill": "chunked prefill off (bool): scheduling only",
    "long-prefill-token-threshold": "prefill length treated as long by the scheduler (int): scheduling only",
    "scheduling-policy": "request order (enum: fcfs/priority): scheduling only",
    "async-scheduling": "overlap scheduling with execution (bool): scheduling only",
    "no-async-scheduling": "no async scheduling (bool): scheduling only",
    "stream-interval": "tokens per streamed chunk (int): response batching only",
    # kernels / compilation
    "attention-backend": "attention kernel, an AttentionBackendEnum member name (e.g. CPU_MLA): compute",
    "moe-backend": "MoE expert kernel choice (enum): compute only",
    "linear-backend": "linear-layer GEMM kernel choice (enum): compute only",
    "enforce-eager": "no CUDA graphs / compile (bool): compute only",
    "optimization-level": "compile/CUDA-graph level O0-O3 (int enum): compute only",
    "performance-mode": "tuning preset (enum: balanced/interactivity/throughput): compute only",
    "max-cudagraph-capture-size": "largest batch captured in a CUDA graph (int): memory/speed only",
    "disable-custom-all-reduce": "use NCCL instead of the custom all-reduce (bool): intra-server comms only",
    # parallelism inside the server's own tensor-parallel-size GPUs
    "enable-expert-parallel": "experts sharded over the TP ranks instead of split (bool): no extra GPUs",
    "decode-context-parallel-size": "decode context parallel reusing the TP ranks (int, divides TP)",
    "all2all-backend": "MoE all-to-all among the server's own ranks (enum): comms only",
    "enable-eplb": "rebalance experts across EP ranks in memory (bool): load balance only",
    "eplb-config": "EPLB JSON of ints/bools/enums (extra keys forbidden, no paths): load balance only",
    "expert-placement-strategy": "initial expert placement (enum: linear/round_robin): load balance only",
    "enable-dbo": "dual-batch overlap of compute and comms (bool): compute only",
    "dbo-decode-token-threshold": "decode tokens before dual-batch overlap kicks in (int): compute only",
    "dbo-prefill-token-threshold": "prefill tokens before dual-batch overlap kicks in (int): compute only",
    # output parsing / response format
    "reasoning-parser": "split reasoning from content (built-in registry name; no plugin): parsing only",
    "tool-call-parser": "parse tool calls (built-in registry name; no plugin): output parsing only",
    "enable-auto-tool-choice": "let the model choose tool calls (bool, needs tool-call-parser): parsing",
    "max-logprobs": "cap on logprobs per token a request may ask (int): response size only",
    "logprobs-mode": "which logprobs are returned (enum): response content only",
    "enable-prompt-tokens-details": "cached-token details in usage (bool): response field only",
    # logs / seeds
    "seed": "sampling RNG seed (int): reproducibility only",
    "disable-log-stats": "no periodic stats logging (bool): local logs only",
    "log-level": "log verbosity (enum: CRITICAL..NOTSET): local logs only",
    "uvicorn-log-level": "HTTP server log verbosity (enum): local logs only",
    "disable-uvicorn-access-log": "no per-request access log lines (bool): local logs only",
    "enable-log-requests": "log request info to the server's own stdout (bool): local logs only",
    "max-log-len": "max prompt chars/ids printed in logs (int): local logs only",
}

# sglang.Engine(**kwargs) for the capture engine (ServerArgs field names). No argparse here: ServerArgs(**kwargs)
# takes the value as given, so enum choices are only checked where the engine looks the value up.
# Left out on purpose: what capture sets (attention_backend, skip_tokenizer_init, disable_radix_cache,
# chunked_prefill_size, enable_return_aux_hidden_states, speculative_*, return_aux_hidden_state_layer_ids,
# enable_return_hidden_states, base_gpu_id, disable_overlap_schedule), GPU spreading (dp_size, pp_size,
# gpu_id_step, attn_dp_size, enable_dp_attention, attn_cp_size, moe_dp_size), and enable_two_batch_overlap.
SGLANG_ENGINE: dict[str, str] = {
    "cuda_graph_max_bs_decode": "largest decode batch captured in a CUDA graph (int): memory/startup only",
    "disable_cuda_graph": "no CUDA graphs in either phase (bool): compute only, capture unaffected",
    "disable_decode_cuda_graph": "run decode eagerly (bool): compute only",
    "disable_prefill_cuda_graph": "run prefill eagerly (bool): compute only",
    "disable_cuda_graph_padding": "no CUDA graph when padding is needed (bool): compute only",
    "kv_cache_dtype": "KV cache storage dtype (str, e.g. fp8_e4m3): memory; fp8 nudges captured states",
    "context_length": "cap on context length (int; above config.json refused without env): memory only",
    "max_running_requests": "cap on concurrent requests (int): scheduling only",
    "max_total_tokens": "KV pool size in tokens (int): memory only",
    "max_prefill_tokens": "token budget of one prefill batch (int): scheduling only",
    "prefill_max_requests": "cap on requests in one prefill batch (int): scheduling only",
    "page_size": "tokens per KV page (int): memory layout only",
    "schedule_conservativeness": "how conservatively new requests are admitted (float): scheduling only",
    "disable_chunked_prefix_cache": "turn off DeepSeek chunked prefix cache (bool): compute only",
    "ep_size": "expert parallelism inside the TP group (int): no extra GPUs",
    "moe_a2a_backend": "MoE all-to-all among the engine's own ranks (str enum): comms only",
    "deepep_mode": "DeepEP dispatch mode (str: auto/normal/low_latency): comms only",
    "moe_runner_backend": "MoE expert GEMM kernel choice (str enum): compute only",
    "moe_dense_tp_size": "TP width of MoE models' dense MLPs (int, within TP): compute layout only",
    "disable_shared_experts_fusion": "keep DeepSeek shared experts unfused (bool): compute only",
    "ep_num_redundant_experts": "redundant expert replicas for EP (int): memory/load balance only",
    "fp8_gemm_runner_backend": "blockwise FP8 GEMM kernel choice (str enum): compute only",
    "disable_custom_all_reduce": "use NCCL instead of the custom all-reduce (bool): intra-engine comms",
    "enable_symm_mem": "NCCL symmetric memory for collectives (bool): intra-engine comms only",
    "random_seed": "RNG seed (int): reproducibility only",
    "log_level": "log verbosity (str, a logging level name; Engine default 'error'): local logs only",
    "watchdog_timeout": "seconds before a hung forward batch crashes the engine (float): long prefills",
    "dist_timeout": "torch.distributed init timeout in seconds (int): startup only",
}

SERVER_FLAGS: dict[str, dict[str, str]] = {"sglang": SGLANG_SERVER, "vllm": VLLM_SERVER}

# What may follow a flag as its value: no leading '-' (an engine's parser could take it for a flag of its own where
# the flag's value is optional), no control characters, bounded.
FLAG_VALUE_PATTERN = r"^[^-\x00-\x1f][^\x00-\x1f]{0,1023}$"


def check_extra_args(field: str, extra: dict, allowed: dict[str, str], reviewed: list[str], separator: str) -> None:
    """Refuse any name in `extra` that is neither on the `allowed` list nor one the deployment `reviewed`, and any
    value that is not a plain value. `separator`: '-' for command-line flags, '_' for keyword arguments."""
    for name, value in extra.items():
        if separator == "-" and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            raise ValueError(
                f"{field}: {name[:80]!r} is not a flag name; write it as the engine spells it, without "
                "'--', e.g. 'disable-radix-cache'"
            )
        if separator == "_" and not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise ValueError(
                f"{field}: {name[:80]!r} is not an argument name; write it with underscores, e.g. "
                f"{name.replace('-', '_').lower()[:80]!r}"
            )
        if name not in allowed and name not in reviewed:
            setting = "reviewed_flags" if separator == "-" else "reviewed_args"
            raise ValueError(
                f"{field}: {name!r} is not one of the engine flags this project reviewed (eagle3/engine_flags.py "
                f"lists them, each with why it is safe); remove it, or have the deployment's operator allow it by "
                f"name in the settings' run ({field.rsplit('.', 1)[0]}.{setting})"
            )
        if isinstance(value, str) and not re.fullmatch(FLAG_VALUE_PATTERN, value, flags=re.DOTALL):
            raise ValueError(
                f"{field}: the value of {name!r} ({value[:40]!r}{'...' if len(value) > 40 else ''}) starts with '-', "
                "holds a control character or is over 1024 characters; give a plain value"
            )
