"""The built-in server's /metrics: engine statistics as Prometheus text, under vLLM's metric names.

Who talks to it: the /metrics route renders `EngineStats` with `render_metrics`; clients (the rollout
worker's load poller, `harness/generation/server_load.py`) parse it exactly as they parse a vLLM server's.

The KV-usage figure is `rows x longest running sequence / kv_cache_tokens`: the share of the KV budget the
engine's dense rows occupy, which is what makes it preempt when it reaches 1. `vllm:cache_config_info`
reports the budget as `num_gpu_blocks` blocks of `block_size` 16 tokens (a block is only an accounting
unit here), so KV tokens / max_model_len gives the number of full-length requests that fit, as for vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.server.engine import PREFILL_RUNS, EngineStats
from harness.server.histograms import HistogramSnapshot

BLOCK_SIZE_TOKENS = 16


def _labels(labels: dict[str, str]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{key}="{escape(value)}"' for key, value in labels.items()) + "}"


def render_metrics(
    stats: EngineStats,
    *,
    model_name: str,
    max_model_len: int,
    http_durations: Mapping[str, HistogramSnapshot] | None = None,
) -> str:
    """Prometheus text exposition (version 0.0.4) of the engine's state; `http_durations`: the HTTP
    layer's time per generation route ("/v1/completions", ...), as vLLM's server reports it."""
    base = {"engine": "0", "model_name": model_name}
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{_labels(labels)} {float(value)!r}")

    def histogram(name: str, help_text: str, series: list[tuple[dict[str, str], HistogramSnapshot]]) -> None:
        samples: list[tuple[str, dict[str, str], float]] = []
        for labels, snapshot in series:
            for bound, count in zip(snapshot.bounds, snapshot.cumulative, strict=True):
                samples.append((f"{name}_bucket", {**labels, "le": repr(float(bound))}, count))
            samples.append((f"{name}_bucket", {**labels, "le": "+Inf"}, snapshot.count))
            samples.append((f"{name}_sum", labels, snapshot.sum))
            samples.append((f"{name}_count", labels, snapshot.count))
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} histogram")
        lines.extend(f"{sample}{_labels(labels)} {float(value)!r}" for sample, labels, value in samples)

    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        [(base, stats.num_running)],
    )
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        [(base, stats.num_waiting)],
    )
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        [(base, stats.kv_cache_usage)],
    )
    metric(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        [(base, stats.num_preemptions)],
    )
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        [(base, stats.num_prompt_tokens)],
    )
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        [(base, stats.num_generation_tokens)],
    )
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        [(base, stats.num_prefix_cache_queries)],
    )
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        [(base, stats.num_prefix_cache_hits)],
    )
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [
            ({**base, "finished_reason": reason}, count)
            for reason, count in sorted(stats.num_finished.items())
        ],
    )
    cache_labels = {
        "block_size": str(BLOCK_SIZE_TOKENS),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(stats.prefix_cache_enabled),
        "engine": "0",
        "kv_cache_max_concurrency": repr(stats.kv_cache_tokens / max_model_len),
        "kv_cache_size_tokens": str(stats.kv_cache_tokens),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(stats.kv_cache_tokens // BLOCK_SIZE_TOKENS),
    }
    metric(
        "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(cache_labels, 1.0)]
    )
    metric(
        "harness:kv_cache_allocated_bytes",
        "gauge",
        "Bytes the built-in server's KV cache holds now.",
        [(base, stats.kv_cache_allocated_bytes)],
    )
    metric(
        "harness:weight_version",
        "gauge",
        "Number of weight updates applied since start.",
        [(base, stats.weight_version)],
    )
    metric(
        "harness:engine_seconds_total",
        "counter",
        "Seconds the built-in server's engine thread spent per phase: prefill forwards, decode steps, idle.",
        [
            ({**base, "phase": "prefill"}, stats.prefill_s),
            ({**base, "phase": "decode"}, stats.decode_s),
            ({**base, "phase": "idle"}, stats.idle_s),
        ],
    )
    metric(
        "harness:engine_steps_total",
        "counter",
        "Forward passes of the built-in server's engine: prefills (each of one or more requests) and decode "
        "steps (each over every running row).",
        [
            ({**base, "phase": "prefill"}, stats.num_prefill_steps),
            ({**base, "phase": "decode"}, stats.num_decode_steps),
        ],
    )
    metric(
        "harness:engine_prefills_total",
        "counter",
        "Prefill forwards of the built-in server's engine by how they ran: replayed from a CUDA graph, "
        "captured into one, or eager.",
        [({**base, "run": run}, stats.prefills_by_run.get(run, 0)) for run in PREFILL_RUNS],
    )
    metric(
        "harness:engine_prefill_seconds_total",
        "counter",
        "Seconds of the built-in server's prefill forwards (with their sampling) by how they ran.",
        [({**base, "run": run}, stats.prefill_s_by_run.get(run, 0.0)) for run in PREFILL_RUNS],
    )
    metric(
        "harness:engine_prefills_ahead_total",
        "counter",
        "Prefills the built-in server's engine launched behind a decode step still in flight (async "
        "scheduling); their seconds count the launch only.",
        [(base, stats.num_prefills_ahead)],
    )
    metric(
        "harness:engine_prefill_requests_total",
        "counter",
        "Requests prefilled by the built-in server's engine (a group's identical prompts counted once).",
        [(base, stats.num_prefill_requests)],
    )
    histogram(
        "vllm:request_queue_time_seconds",
        "Seconds from a request's submission to the engine until it was first admitted to a batch.",
        [(base, stats.queue_time)],
    )
    histogram(
        "vllm:time_to_first_token_seconds",
        "Seconds from a request's submission to the engine until its first token was sampled.",
        [(base, stats.time_to_first_token)],
    )
    histogram(
        "vllm:e2e_request_latency_seconds",
        "Seconds from a request's submission to the engine until it ended (stop or length).",
        [(base, stats.e2e_latency)],
    )
    if http_durations:
        histogram(
            "http_request_duration_seconds",
            "Seconds the HTTP handler of a generation route took, from the request to its answer.",
            [({"handler": route, "method": "POST"}, snapshot) for route, snapshot in http_durations.items()],
        )
    return "\n".join(lines) + "\n"
