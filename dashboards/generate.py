#!/usr/bin/env python3
"""Writes the Grafana dashboards in this folder (overview.json, realtime.json, autoscaling.json).

The JSON files are the product (the operator and the Helm chart ship them as they are); this
script is how they are kept consistent: one selector, one datasource reference, one way to write
a percentile. Edit here, run `python3 dashboards/generate.py`, commit both. `--check` exits 1 if
the committed files differ from what this script writes (tests/it/dashboards.rs runs it).

Aggregation across replicas follows docs/metrics.md: queue and running are summed, KV-cache
usage is averaged, latencies are histogram_quantile over `sum by (le)` of the bucket rates.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}

# Every server series is filtered by these; `model_name` is the variable the operator presets.
SEL = 'namespace=~"$namespace", model_name=~"$model_name", pod=~"$pod"'
# The operator's per-InferenceService series (labels `namespace`, `inferenceservice`).
ISVC = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice"'
# Variables are looked up through a ferrite/vLLM series, so other exporters' `model_name` or
# `namespace` labels never show up in the lists.
ANCHOR = "vllm:num_requests_running"
# The router's series (ferrite-router, scraped with honorLabels) are filtered by the model alone:
# their `namespace` (and `pod`) target labels are the router pod's own. Some carry labels of the
# model's own: ferrite_router_held_requests and ferrite_router_queued_requests its
# InferenceService's `namespace`, and ferrite_router_in_flight_requests the replica's `pod`.
ROUTER = 'model_name=~"$model_name"'
# Joins a per-pod series without `model_name` (process, DCGM) to the pods serving the model.
MODEL_PODS = f"on (namespace, pod) group_left () (max by (namespace, pod) ({ANCHOR}{{{SEL}}}) * 0 + 1)"


def dcgm(metric):
    """A DCGM exporter series with the GPU's pod in `pod` and `namespace`, in either form it
    is scraped in: the GPU operator's ServiceMonitor honors the exporter's own labels, while
    kube-prometheus-stack's default scrape renames them to `exported_pod` and
    `exported_namespace` (the target's own being the exporter pod's). The join with
    MODEL_PODS then keeps the model's pods."""
    return (
        f'label_replace(label_replace({metric}, "pod", "$1", "exported_pod", "(.+)"), '
        f'"namespace", "$1", "exported_namespace", "(.+)")'
    )

PERCENTILES = [("p99", 0.99), ("p95", 0.95), ("p90", 0.9), ("p50", 0.5)]


def variable(name, label, query, hide=0):
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": query,
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "hide": hide,
    }


def datasource_variable():
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "refresh": 1,
        "current": {"text": "default", "value": "default"},
        "hide": 0,
    }


def server_variables():
    return [
        datasource_variable(),
        variable("namespace", "Namespace", f"label_values({ANCHOR}, namespace)"),
        variable(
            "model_name",
            "Model (InferenceService)",
            f'label_values({ANCHOR}{{namespace=~"$namespace"}}, model_name)',
        ),
        variable(
            "pod",
            "Pod",
            f'label_values({ANCHOR}{{namespace=~"$namespace", model_name=~"$model_name"}}, pod)',
        ),
    ]


def target(expr, legend, ref, fmt=None):
    t = {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "refId": ref,
    }
    if fmt:
        t["format"] = fmt
    return t


def refs():
    return iter("ABCDEFGHIJKLMNOP")


def timeseries(title, description, exprs, unit="short", stack=False, bars=False, minimum=0):
    r = refs()
    custom = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 10 if not bars else 80,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    defaults = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    if minimum is not None:
        defaults["min"] = minimum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [target(e, legend, next(r)) for e, legend in exprs],
    }


def heatmap(title, description, metric, unit):
    expr = f"sum by (le) (increase({metric}_bucket{{{SEL}}}[$__rate_interval]))"
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False}}}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Spectral", "steps": 64, "exponent": 0.5, "fill": "dark-orange", "reverse": False},
            "yAxis": {"axisPlacement": "left", "unit": unit},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": False},
            "legend": {"show": True},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
        },
        "targets": [target(expr, "{{le}}", "A", fmt="heatmap")],
    }


def stat(title, description, expr, unit="short", decimals=None):
    defaults = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        },
        "targets": [target(expr, title, "A")],
    }


def row(title, collapsed=False):
    """A row; a collapsed one holds the panels after it (until the next row) in its `panels`."""
    return {"type": "row", "title": title, "collapsed": collapsed, "panels": []}


def quantiles(metric, sel=SEL, with_mean=True):
    sel = f"{{{sel}}}" if sel else ""
    out = [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{sel}[$__rate_interval])))", name)
        for name, q in PERCENTILES
    ]
    if with_mean:
        out.append(
            (
                f"sum(rate({metric}_sum{sel}[$__rate_interval])) / sum(rate({metric}_count{sel}[$__rate_interval]))",
                "mean",
            )
        )
    return out


def layout(items):
    """Places panels left to right, 24 columns wide; `items` are (panel, width, height) or rows.

    A collapsed row's panels go into the row, placed below it as Grafana places them when the
    row opens; while closed they take no room, so the next row follows right under it."""
    x = y = line_h = 0
    panels = []
    collapsed = None  # the collapsed row taking the panels
    for n, item in enumerate(items, start=1):
        if isinstance(item, dict):  # a row
            if collapsed is not None:
                y = collapsed["gridPos"]["y"] + 1
            elif x:
                y += line_h
            x, line_h = 0, 0
            item["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            item["id"] = n
            panels.append(item)
            collapsed = item if item["collapsed"] else None
            y += 1
            continue
        panel, w, h = item
        if x + w > 24:
            y, x, line_h = y + line_h, 0, 0
        panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        panel["id"] = n
        (collapsed["panels"] if collapsed is not None else panels).append(panel)
        x, line_h = x + w, max(line_h, h)
    return panels


def dashboard(title, description, tags, time_from, refresh, variables, items):
    return {
        "title": title,
        "description": description,
        "tags": ["ferrite", "vllm", *tags],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 41,
        "version": 1,
        "refresh": refresh,
        "time": {"from": time_from, "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": []},
        "templating": {"list": variables},
        "panels": layout(items),
    }


def gpu_util(title):
    return timeseries(
        title,
        "GPU utilization per GPU of the model's pods, from NVIDIA's DCGM exporter "
        "(DCGM_FI_DEV_GPU_UTIL, percent), whether Prometheus keeps the exporter's pod labels or "
        "renames them exported_pod. Empty on CPU-only pods.",
        [(f"avg by (pod, gpu) ({dcgm('DCGM_FI_DEV_GPU_UTIL')} * {MODEL_PODS})", "{{pod}} GPU {{gpu}}")],
        unit="percent",
    )


def router_row():
    """The ferrite-router's view of the model: a collapsed row, empty where no router runs."""
    decisions = f"ferrite_router_routing_decisions_total{{{ROUTER}}}"
    return [
        row("Router", collapsed=True),
        (timeseries(
            "Router requests by outcome",
            "Requests the router answered per second, by outcome: success; client_error and "
            "upstream_error (the replica's 4xx or 5xx, or no replica answered); "
            "cold_start_timeout (held past spec.routing.coldStartTimeoutSeconds, answered 503). "
            "Summed over router replicas.",
            [(f"sum by (outcome) (rate(ferrite_router_requests_total{{{ROUTER}}}[$__rate_interval]))", "{{outcome}}")],
            unit="reqps",
            stack=True,
        ), 8, 8),
        (timeseries(
            "Routing decisions by affinity",
            "Share of the router's replica choices that kept the prompt prefix's replica (kept), "
            "went on to the next replica on the ring because that one was over the load bound "
            "(overflowed), or had no affinity (policy least-load or round-robin: none). A retry "
            "is a second choice.",
            [(
                f"sum by (affinity) (rate({decisions}[$__rate_interval])) / ignoring (affinity) "
                f"group_left () sum(rate({decisions}[$__rate_interval]))",
                "{{affinity}}",
            )],
            unit="percentunit",
            stack=True,
        ), 8, 8),
        (timeseries(
            "Upstream latency (router)",
            "From the router sending a request to a replica until the response headers, and "
            "until the end of the response (p50, p99). Headers come at the first token when "
            "streaming, at the end otherwise.",
            [
                (f"histogram_quantile({q}, sum by (le) (rate(ferrite_router_upstream_{m}_seconds_bucket{{{ROUTER}}}[$__rate_interval])))", f"{label} {name}")
                for m, label in [("headers", "headers"), ("duration", "end")]
                for name, q in [("p50", 0.5), ("p99", 0.99)]
            ],
            unit="s",
        ), 8, 8),
        (timeseries(
            "Held requests",
            "Requests the router holds while the model's InferenceService has no ready replica "
            "(scaling from zero, or starting), summed over router replicas.",
            [(f'sum(ferrite_router_held_requests{{namespace=~"$namespace", {ROUTER}}})', "held")],
        ), 6, 8),
        (timeseries(
            "Cold-start wait",
            "How long held requests waited for a ready replica (p50, p95), timed-out ones "
            "included. Shown while cold starts end.",
            [
                (f"histogram_quantile({q}, sum by (le) (rate(ferrite_router_cold_start_seconds_bucket{{{ROUTER}}}[$__rate_interval])))", name)
                for name, q in [("p95", 0.95), ("p50", 0.5)]
            ],
            unit="s",
        ), 6, 8),
        (timeseries(
            "Router retries by reason",
            "Requests retried on another replica before any byte reached the client, per "
            "second: connect (the replica refused or timed out) or unavailable (it answered 503).",
            [(f"sum by (reason) (rate(ferrite_router_retries_total{{{ROUTER}}}[$__rate_interval]))", "{{reason}}")],
            unit="reqps",
        ), 6, 8),
        (timeseries(
            "Router in-flight per replica",
            "Requests the router has open to each replica pod, summed over router replicas: "
            "an uneven spread shows affinity at work, or a hot prefix.",
            [(f'sum by (pod) (ferrite_router_in_flight_requests{{{ROUTER}, pod=~"$pod"}})', "{{pod}}")],
        ), 6, 8),
        (timeseries(
            "Router queue",
            "Requests the router holds because every replica of the model's InferenceService is "
            "saturated (flow control: a replica's own queue or KV cache past the router's "
            "thresholds), summed over router replicas. The operator's autoscaler counts them as "
            "waiting on the pods.",
            [(f'sum(ferrite_router_queued_requests{{namespace=~"$namespace", {ROUTER}}})', "queued")],
        ), 12, 8),
        (timeseries(
            "Router queue wait by tenant (p95)",
            "How long requests waited in the router's queue before going to a replica, p95 per "
            "tenant (\"\" without tenants); 0 for those sent at once. A light tenant's wait "
            "stays short while a heavy one's grows: the queue is fair by tokens.",
            [(
                f"histogram_quantile(0.95, sum by (le, tenant) (rate(ferrite_router_queue_duration_seconds_bucket{{{ROUTER}}}[$__rate_interval])))",
                "{{tenant}}",
            )],
            unit="s",
        ), 12, 8),
        (timeseries(
            "Tenants' requests by outcome",
            "With tenants (--tenants): each tenant's requests for this model per second, by "
            "outcome: admitted, forbidden (a model outside its list), throttled_requests, "
            "throttled_tokens, throttled_concurrent (429 at a limit), shed (429: the router's "
            "queue was full), queue_timeout (503: waited too long). Summed over router replicas.",
            [(f"sum by (tenant, outcome) (rate(ferrite_router_tenant_requests_total{{{ROUTER}}}[$__rate_interval]))", "{{tenant}} {{outcome}}")],
            unit="reqps",
        ), 12, 8),
        (timeseries(
            "Tenants' tokens",
            "Tokens each tenant's requests for this model used per second (prompt and "
            "completion, settled to the replicas' reported usage): what InferenceTenant "
            "tokensPerMinute limits. Summed over router replicas.",
            [(f"sum by (tenant) (rate(ferrite_router_tenant_tokens_total{{{ROUTER}}}[$__rate_interval]))", "{{tenant}}")],
            unit="short",
        ), 12, 8),
    ]


def overview():
    items = [
        (stat("Requests running", "Requests in the running batches, summed over replicas.", f"sum({ANCHOR}{{{SEL}}})"), 6, 4),
        (stat("Requests waiting", "Requests queued, summed over replicas.", f"sum(vllm:num_requests_waiting{{{SEL}}})"), 6, 4),
        (stat("KV cache usage", "Device KV-cache usage, averaged over replicas.", f"avg(vllm:kv_cache_usage_perc{{{SEL}}})", unit="percentunit", decimals=1), 6, 4),
        (stat("Replicas reporting", "Server pods Prometheus scrapes for this model.", f"count({ANCHOR}{{{SEL}}})"), 6, 4),
        (timeseries("E2E request latency", "Arrival to last token: p99, p95, p90, p50 over all replicas, and the mean.", quantiles("vllm:e2e_request_latency_seconds"), unit="s"), 12, 8),
        (timeseries(
            "Token throughput",
            "Prompt (prefill) and generated tokens per second, from the counters, summed over replicas.",
            [
                (f"sum(rate(vllm:prompt_tokens_total{{{SEL}}}[$__rate_interval]))", "prompt tokens/s"),
                (f"sum(rate(vllm:generation_tokens_total{{{SEL}}}[$__rate_interval]))", "generation tokens/s"),
            ],
            unit="short",
        ), 12, 8),
        (timeseries("Inter-token latency (TPOT)", "Gap between consecutive tokens of a request: percentiles and mean.", quantiles("vllm:inter_token_latency_seconds"), unit="s"), 12, 8),
        (timeseries(
            "Scheduler state",
            "Requests running, waiting (queued) and swapped to host memory, summed over replicas.",
            [
                (f"sum({ANCHOR}{{{SEL}}})", "running"),
                (f"sum(vllm:num_requests_waiting{{{SEL}}})", "waiting"),
                (f"sum(vllm:num_requests_swapped{{{SEL}}})", "swapped"),
            ],
        ), 12, 8),
        (timeseries("Time to first token", "Arrival to first generated token: percentiles and mean.", quantiles("vllm:time_to_first_token_seconds"), unit="s"), 12, 8),
        (timeseries(
            "Cache utilization",
            "Device (GPU) KV-cache and host swap-pool usage, averaged over replicas (never summed).",
            [
                (f"avg(vllm:kv_cache_usage_perc{{{SEL}}})", "device KV cache"),
                (f"avg(vllm:cpu_cache_usage_perc{{{SEL}}})", "host swap pool"),
            ],
            unit="percentunit",
        ), 12, 8),
        (timeseries(
            "Prefix cache hit rate",
            "Share of prompt tokens found in the prefix cache (vllm:prefix_cache_hits_total over "
            "vllm:prefix_cache_queries_total, in tokens), over all replicas. Empty while no "
            "prompt arrives, or with --no-enable-prefix-caching.",
            [(
                f"sum(rate(vllm:prefix_cache_hits_total{{{SEL}}}[$__rate_interval])) / "
                f"sum(rate(vllm:prefix_cache_queries_total{{{SEL}}}[$__rate_interval]))",
                "hit rate",
            )],
            unit="percentunit",
        ), 12, 8),
        (timeseries(
            "Requests by finish reason",
            "Finished requests per second by reason: stop, length, abort.",
            [(f"sum by (finished_reason) (rate(vllm:request_success_total{{{SEL}}}[$__rate_interval]))", "{{finished_reason}}")],
            unit="reqps",
            stack=True,
        ), 12, 8),
        (gpu_util("GPU utilization"), 12, 8),
        *router_row(),
    ]
    return dashboard(
        "Ferrite / vLLM overview",
        "Latency, throughput, scheduler and cache of ferrite-server (or vLLM) replicas of one model.",
        ["overview"],
        "now-24h",
        "1m",
        server_variables(),
        items,
    )


def realtime():
    items = [
        row("Inference request metrics"),
        (timeseries(
            "Average prompt throughput",
            "The servers' own average over their last stats interval (vllm:avg_prompt_throughput_toks_per_s), summed over replicas.",
            [(f"sum(vllm:avg_prompt_throughput_toks_per_s{{{SEL}}})", "prompt tokens/s")],
        ), 6, 7),
        (timeseries(
            "Average generation throughput",
            "The servers' own average over their last stats interval, summed over replicas.",
            [(f"sum(vllm:avg_generation_throughput_toks_per_s{{{SEL}}})", "generation tokens/s")],
        ), 6, 7),
        (timeseries(
            "Prompt tokens",
            "Prompt tokens per second per pod, from the counter.",
            [(f"sum by (pod) (rate(vllm:prompt_tokens_total{{{SEL}}}[$__rate_interval]))", "{{pod}}")],
            stack=True,
        ), 6, 7),
        (timeseries(
            "Generation tokens",
            "Generated tokens per second per pod, from the counter.",
            [(f"sum by (pod) (rate(vllm:generation_tokens_total{{{SEL}}}[$__rate_interval]))", "{{pod}}")],
            stack=True,
        ), 6, 7),
        (timeseries(
            "Scheduler running / swapped / waiting",
            "Summed over replicas.",
            [
                (f"sum({ANCHOR}{{{SEL}}})", "running"),
                (f"sum(vllm:num_requests_swapped{{{SEL}}})", "swapped"),
                (f"sum(vllm:num_requests_waiting{{{SEL}}})", "waiting"),
            ],
        ), 6, 8),
        (timeseries(
            "KV cache usage per pod",
            "Device KV-cache usage of each pod, and the average the autoscaler uses.",
            [
                (f"max by (pod) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{pod}}"),
                (f"avg(vllm:kv_cache_usage_perc{{{SEL}}})", "average"),
            ],
            unit="percentunit",
        ), 6, 8),
        (timeseries(
            "Prefix cache hit rate per pod",
            "Share of each pod's prompt tokens found in its prefix cache, from the token "
            "counters (vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total).",
            [(
                f"sum by (pod) (rate(vllm:prefix_cache_hits_total{{{SEL}}}[$__rate_interval])) / "
                f"sum by (pod) (rate(vllm:prefix_cache_queries_total{{{SEL}}}[$__rate_interval]))",
                "{{pod}}",
            )],
            unit="percentunit",
        ), 6, 8),
        (timeseries(
            "Preemptions",
            "Sequences preempted per second (swapped or recomputed) for lack of KV blocks.",
            [(f"sum(rate(vllm:num_preemptions_total{{{SEL}}}[$__rate_interval]))", "preemptions/s")],
        ), 6, 8),
        (heatmap("Inference compute duration", "Time from first scheduled to finish (vllm:request_inference_time_seconds).", "vllm:request_inference_time_seconds", "s"), 12, 8),
        (heatmap("Inference queue duration", "Time from arrival to first scheduled (vllm:request_queue_time_seconds).", "vllm:request_queue_time_seconds", "s"), 12, 8),
        (heatmap("Prompt length", "Prompt tokens per request (vllm:request_prompt_tokens).", "vllm:request_prompt_tokens", "short"), 8, 8),
        (heatmap("Generation length", "Generated tokens per request (vllm:request_generation_tokens).", "vllm:request_generation_tokens", "short"), 8, 8),
        (heatmap("Iteration tokens", "Tokens per engine step, prefill chunks and decodes (vllm:iteration_tokens_total).", "vllm:iteration_tokens_total", "short"), 8, 8),
        row("Hardware infrastructure metrics"),
        (timeseries(
            "CPU usage per pod",
            "CPU cores used by each server process (process_cpu_seconds_total).",
            [(f"sum by (pod) (rate(process_cpu_seconds_total{{namespace=~\"$namespace\", pod=~\"$pod\"}}[$__rate_interval]) * {MODEL_PODS})", "{{pod}}")],
        ), 6, 8),
        (timeseries(
            "Resident memory per pod",
            "Resident set size of each server process.",
            [(f"sum by (pod) (process_resident_memory_bytes{{namespace=~\"$namespace\", pod=~\"$pod\"}} * {MODEL_PODS})", "{{pod}}")],
            unit="bytes",
        ), 6, 8),
        (gpu_util("GPU utilization"), 6, 8),
        (timeseries(
            "GPU memory used",
            "Frame-buffer memory in use per GPU of the model's pods (DCGM_FI_DEV_FB_USED, MiB), "
            "whether Prometheus keeps the exporter's pod labels or renames them exported_pod. "
            "Empty on CPU-only pods.",
            [(f"avg by (pod, gpu) ({dcgm('DCGM_FI_DEV_FB_USED')} * {MODEL_PODS})", "{{pod}} GPU {{gpu}}")],
            unit="decmbytes",
        ), 6, 8),
    ]
    return dashboard(
        "Ferrite / vLLM real-time",
        "The last minutes of ferrite-server (or vLLM) replicas of one model: throughput, scheduler, request-time and size distributions, hardware.",
        ["realtime"],
        "now-5m",
        "5s",
        server_variables(),
        items,
    )


def autoscaling():
    signal = lambda s: f'{{{ISVC}, signal="{s}"}}'  # noqa: E731
    server = 'namespace=~"$namespace", model_name=~"$model_name"'
    variables = [
        datasource_variable(),
        variable("namespace", "Namespace", f"label_values({ANCHOR}, namespace)"),
        variable("model_name", "Model", f'label_values({ANCHOR}{{namespace=~"$namespace"}}, model_name)'),
        # The server pods' `service` target label is the InferenceService's Service, named after it.
        variable(
            "inferenceservice",
            "InferenceService",
            f'label_values({ANCHOR}{{namespace=~"$namespace", model_name=~"$model_name"}}, service)',
        ),
        variable("pod", "Pod", f'label_values({ANCHOR}{{namespace=~"$namespace", model_name=~"$model_name"}}, pod)'),
    ]
    items = [
        row("Decisions"),
        (timeseries(
            "Desired vs actual replicas",
            "Replicas the autoscaler decided on and the signals' raw recommendation (operator), against the server pods Prometheus scrapes.",
            [
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_desired_replicas{{{ISVC}}})", "desired {{inferenceservice}}"),
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_recommended_replicas{{{ISVC}}})", "recommended {{inferenceservice}}"),
                (f'count by (service) ({ANCHOR}{{{server}, service=~"$inferenceservice"}})', "actual (scraped) {{service}}"),
            ],
        ), 12, 8),
        (timeseries(
            "Scale events",
            "Writes of spec.replicas by the autoscaler, by direction, and panic mode (1 while on).",
            [
                (f"sum by (inferenceservice, direction) (increase(ferrite_operator_autoscaler_scale_actions_total{{{ISVC}}}[$__rate_interval]))", "{{direction}} {{inferenceservice}}"),
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_panic_mode{{{ISVC}}})", "panic mode {{inferenceservice}}"),
            ],
            bars=True,
        ), 12, 8),
        row("Signals against targets"),
        (timeseries(
            "Queue per replica vs target",
            "Waiting requests per ready replica as the operator scraped them, its target, and the same signal from Prometheus (sum of the queue over the scraped replicas).",
            [
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_signal{signal('queue_per_replica')})", "scraped {{inferenceservice}}"),
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_target{signal('queue_per_replica')})", "target {{inferenceservice}}"),
                (f"sum(vllm:num_requests_waiting{{{server}}}) / count(vllm:num_requests_waiting{{{server}}})", "Prometheus"),
            ],
        ), 12, 8),
        (timeseries(
            "KV cache usage vs target",
            "Average KV-cache usage over ready replicas as the operator scraped it, its target, and the average from Prometheus.",
            [
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_signal{signal('kv_cache_usage')})", "scraped {{inferenceservice}}"),
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_target{signal('kv_cache_usage')})", "target {{inferenceservice}}"),
                (f"avg(vllm:kv_cache_usage_perc{{{server}}})", "Prometheus"),
            ],
            unit="percentunit",
        ), 12, 8),
        (timeseries(
            "Requests waiting and running (scraped)",
            "Totals over the ready pods, as the autoscaler read them.",
            [
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_signal{signal('requests_waiting')})", "waiting {{inferenceservice}}"),
                (f"max by (inferenceservice) (ferrite_operator_autoscaler_signal{signal('requests_running')})", "running {{inferenceservice}}"),
            ],
        ), 8, 8),
        (timeseries(
            "Queue per pod",
            "Each server pod's queue, from Prometheus: an uneven spread points at the load balancing.",
            [(f'sum by (pod) (vllm:num_requests_waiting{{{server}, pod=~"$pod"}})', "{{pod}}")],
        ), 8, 8),
        (timeseries(
            "Pod scrape errors",
            "Failed scrapes of ready pods by the autoscaler, per second, by kind (connect, status, timeout, parse, too_large, missing_metric).",
            [(f"sum by (inferenceservice, error) (rate(ferrite_operator_autoscaler_scrape_errors_total{{{ISVC}}}[$__rate_interval]))", "{{error}} {{inferenceservice}}")],
        ), 8, 8),
        row("Operator"),
        (timeseries(
            "Reconcile rate",
            "Reconciles per second over all InferenceServices, and the replicas holding the leader Lease (should be 1).",
            [
                ("sum(rate(ferrite_operator_reconciliations_total[$__rate_interval]))", "reconciles/s"),
                ("sum(ferrite_operator_leader)", "leaders"),
            ],
        ), 8, 8),
        (timeseries(
            "Reconcile errors",
            "Failed reconciles per second, by kind of error.",
            [("sum by (error) (rate(ferrite_operator_reconcile_errors_total[$__rate_interval]))", "{{error}}")],
        ), 8, 8),
        (timeseries(
            "Reconcile latency",
            "Wall time of one reconcile, API calls included.",
            quantiles("ferrite_operator_reconcile_duration_seconds", sel="", with_mean=False)[::3],
            unit="s",
        ), 8, 8),
    ]
    return dashboard(
        "Ferrite autoscaling",
        "The ferrite-operator's built-in autoscaler per InferenceService, and the operator's reconcile loop.",
        ["autoscaling", "operator"],
        "now-3h",
        "30s",
        variables,
        items,
    )


def render(d):
    return json.dumps(d, indent=2, ensure_ascii=False) + "\n"


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for name, build in [("overview", overview), ("realtime", realtime), ("autoscaling", autoscaling)]:
        path = HERE / f"{name}.json"
        text = render(build())
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run python3 dashboards/generate.py): {', '.join(stale)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
