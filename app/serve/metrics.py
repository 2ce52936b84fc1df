"""/metrics in Prometheus' text format: requests, tokens, the queue, and the expert cache per layer group.

The cache's figures are the engine's snapshot, summed over each group's layers (a group: the layers
that share one bank of slots), so they equal what the chat app's dashboard and exports show.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from moechat.app.serve.jobs import Jobs
from moechat.engine.cache.stats import CountersSnapshot, StatsSnapshot, TierSnapshot
from moechat.engine.events import BatchStatus
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def group_totals(snap: StatsSnapshot) -> dict[int, CountersSnapshot]:
    """Each group's counters, its layers' summed."""
    out: dict[int, CountersSnapshot] = {g.index: CountersSnapshot() for g in snap.groups}
    for layer in snap.layers:
        out[layer.group] = out.get(layer.group, CountersSnapshot()) + layer.total
    return out


class ServerCollector(Collector):
    def __init__(self, jobs: Jobs, requests: Counter[tuple[str, int]], snapshot: Callable[[], StatsSnapshot | None],
                 batch: Callable[[], BatchStatus | None] = lambda: None) -> None:  # fmt: skip
        self.jobs, self.requests, self.snapshot, self.batch = jobs, requests, snapshot, batch

    def collect(self) -> Iterator[Metric]:
        req = CounterMetricFamily("moechat_requests", "HTTP requests answered", labels=["endpoint", "code"])
        for (endpoint, code), n in sorted(self.requests.items()):
            req.add_metric([endpoint, str(code)], n)
        yield req
        yield CounterMetricFamily("moechat_prompt_tokens", "prompt tokens of answered requests",
                                  value=self.jobs.prompt_tokens)  # fmt: skip
        yield CounterMetricFamily("moechat_completion_tokens", "tokens generated", value=self.jobs.completion_tokens)
        yield CounterMetricFamily("moechat_requests_cancelled", "generations a client ended before their end",
                                  value=self.jobs.cancelled)  # fmt: skip
        yield GaugeMetricFamily("moechat_queue_depth", "requests waiting for the engine", value=self.jobs.waiting)
        yield GaugeMetricFamily("moechat_requests_running", "requests on the engine now", value=self.jobs.running)
        batch = self.batch()
        if batch is not None:
            yield from batch_metrics(batch)
        snap = self.snapshot()
        if snap is None:
            return
        if snap.ram is not None:
            yield from ram_tier_metrics(snap.ram)
        families = {
            "hits": CounterMetricFamily("moechat_cache_hits", "expert lookups found in a slot", labels=["group"]),
            "misses": CounterMetricFamily(
                "moechat_cache_misses",
                "expert lookups not in a slot (exposed: neither cached nor fetched ahead)",
                labels=["group"],
            ),
            "prefetch_hits": CounterMetricFamily(
                "moechat_cache_prefetch_hits",
                "expert lookups a prefetch put in their slot: misses the look-ahead hid",
                labels=["group"],
            ),
            "prefetched": CounterMetricFamily(
                "moechat_cache_prefetched", "experts uploaded ahead on a prediction", labels=["group"]
            ),
            "predicted": CounterMetricFamily(
                "moechat_cache_predicted", "experts predicted one layer ahead", labels=["group"]
            ),
            "predicted_used": CounterMetricFamily(
                "moechat_cache_predicted_used",
                "predicted experts the layer then selected (recall: over predicted)",
                labels=["group"],
            ),
            "cpu": CounterMetricFamily("moechat_cache_cpu_misses", "misses computed on the CPU", labels=["group"]),
            "uploaded_bytes": CounterMetricFamily(
                "moechat_cache_uploaded_bytes", "bytes uploaded into slots", labels=["group"]
            ),
        }
        rate = GaugeMetricFamily("moechat_cache_hit_rate", "hits over lookups since the cache's start",
                                 labels=["group"])  # fmt: skip
        slots = GaugeMetricFamily("moechat_cache_slots", "slots of the group", labels=["group"])
        totals = group_totals(snap)
        for g in snap.groups:
            t = totals.get(g.index, CountersSnapshot())
            for name, family in families.items():
                family.add_metric([str(g.index)], getattr(t, name))
            rate.add_metric([str(g.index)], t.hit_rate)
            slots.add_metric([str(g.index)], g.n_slots)
        yield from families.values()
        yield rate
        yield slots
        yield GaugeMetricFamily("moechat_cache_tokens", "tokens through the MoE layers since the cache's start",
                                value=snap.tokens)  # fmt: skip


def batch_metrics(b: BatchStatus) -> Iterator[Metric]:
    """The engine's KV slots and decode steps (`--parallel`): busy slots, requests waiting for one, the last step."""
    yield GaugeMetricFamily("moechat_slots", "KV slots: requests decoded together at most", value=b.slots)
    yield GaugeMetricFamily("moechat_slots_active", "slots holding a request (reading its prompt or decoding)",
                            value=b.active)  # fmt: skip
    yield GaugeMetricFamily("moechat_slots_queued", "requests the engine holds until a slot is free", value=b.queued)
    yield GaugeMetricFamily("moechat_batch_size", "tokens in the last decode step", value=b.last_batch)
    yield CounterMetricFamily("moechat_decode_steps", "decode steps run", value=b.steps)
    tps = GaugeMetricFamily("moechat_slot_tokens_per_second", "each busy slot's decode speed now", labels=["slot"])
    for i, v in enumerate(b.slot_tps):
        tps.add_metric([str(i)], v)
    yield tps


def ram_tier_metrics(r: TierSnapshot) -> Iterator[Metric]:
    """The experts' RAM tier (a model whose experts do not fit in RAM): its lookups, reads and waits."""
    yield GaugeMetricFamily("moechat_ram_tier_slots", "experts the RAM tier holds", value=r.n_slots)
    yield CounterMetricFamily("moechat_ram_tier_lookups", "expert lookups in the RAM tier", value=r.lookups)
    yield CounterMetricFamily("moechat_ram_tier_hits", "expert lookups found in RAM", value=r.hits)
    yield CounterMetricFamily("moechat_ram_tier_reads", "experts read from the file on demand", value=r.reads)
    yield CounterMetricFamily("moechat_ram_tier_read_ahead", "experts read ahead on a prediction", value=r.prefetched)
    yield CounterMetricFamily("moechat_ram_tier_read_bytes", "bytes read from the model file", value=r.bytes_read)
    yield CounterMetricFamily("moechat_ram_tier_wait_seconds", "seconds lookups waited for reads", value=r.wait_s)
    yield GaugeMetricFamily("moechat_ram_tier_prediction_recall", "selected experts that were predicted",
                            value=r.recall)  # fmt: skip


def metrics_text(collector: ServerCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
