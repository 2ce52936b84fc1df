"""Session statistics and transcripts to JSON, CSV and Markdown. Every write is atomic.

JSON is the source of truth (schema_version 1); CSV has one header row and one row per layer;
the Markdown report follows llama-bench's table style and adds plotext charts as plain text.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moechat.app.atomic import write_atomic
from moechat.app.conversations import Conversation, now_iso
from moechat.engine.cache.stats import (
    RECENT_TOKENS,
    CountersSnapshot,
    Recent,
    RecentWindow,
    StatsSnapshot,
)
from moechat.engine.events import DoneEvent
from moechat.tuner.baselines import MinBound
from moechat.widgets.ticks import whole_ticks

from moechat import __version__

SCHEMA_VERSION = 1
# The settings a reply ran with, recorded with its stats in the session export.
REPLY_SETTINGS = (
    "temp", "top_k", "top_p", "min_p", "repeat_penalty", "n_predict", "system", "moe_cache_mib", "moe_cache_cpu_share",
)  # fmt: skip
SERIES_MAX = 2000  # points kept; older ones are dropped (one point per stats update, ~4/s)


@dataclass(frozen=True)
class Point:
    time: str  # ISO-8601 UTC
    tokens: int  # the reply's tokens so far
    tps: float
    hit_rate: float
    uploaded_mib: float
    cpu_misses: int
    recent_hit_rate: float  # over the last RECENT_TOKENS tokens or so (`recent_tokens`: the span)
    recent_tokens: int
    reply: int = 0  # which reply (1 = the first), 0 outside a reply
    session_tokens: int = 0  # tokens generated in the session up to this point: the charts' axis, never folding back


@dataclass
class SessionStats:
    """What an export holds: the run's identity and settings, the latest counters and a bounded time series."""

    model: dict[str, Any]
    settings: dict[str, Any]
    started: str = field(default_factory=now_iso)
    snapshot: StatsSnapshot | None = None
    series: deque[Point] = field(default_factory=lambda: deque(maxlen=SERIES_MAX))
    replies: list[dict[str, Any]] = field(default_factory=list)  # per reply: tokens, t/s, ttft
    # What caches that the engine has since rebuilt counted (the wizard's and a settings change
    # start the counters again): per layer (small, large), and their tokens and settings.
    earlier: dict[int, tuple[CountersSnapshot, CountersSnapshot]] = field(default_factory=dict)
    earlier_tokens: int = 0
    periods: list[dict[str, Any]] = field(default_factory=list)
    recent: RecentWindow = field(default_factory=RecentWindow, repr=False)
    # MIN's hit rate (with bypass) at the current cache's size and the cache's own, on its recent lookups,
    # after the last reply.
    min_bound: MinBound | None = None

    @property
    def min_hit_rate(self) -> float | None:
        return self.min_bound.rate if self.min_bound is not None else None

    def set_bound(self, bound: MinBound | None) -> None:
        """The bound after a reply: the session's, and the reply's record."""
        self.min_bound = bound
        if self.replies:
            self.replies[-1]["min_hit_rate"] = self.min_hit_rate
            self.replies[-1]["min_bound"] = asdict(bound) if bound is not None else None

    def cache_rebuilt(self) -> None:
        """The engine's cache starts its counters again: keep what the old one counted in the session."""
        snap, self.snapshot = self.snapshot, None
        if snap is None or not snap.tokens:
            return
        for ls in snap.layers:
            small, large = self.earlier.get(ls.layer, (CountersSnapshot(), CountersSnapshot()))
            self.earlier[ls.layer] = (small + ls.small, large + ls.large)
        self.earlier_tokens += snap.tokens
        t = snap.total
        self.periods.append({
            "settings": {k: self.settings.get(k) for k in ("moe_cache_mib", "moe_cache_cpu_share")},
            "tokens": snap.tokens, "hits": t.hits, "lookups": t.lookups, "cpu": t.cpu, "uploads": t.uploads,
        })  # fmt: skip

    def add(self, snap: StatsSnapshot | None, tokens: int, tps: float) -> Recent | None:
        """Record a stats update; returns the counters over the recent tokens (the dashboard shows them)."""
        recent = None
        if snap is not None:
            self.snapshot = snap
            recent = self.recent.add(snap)
        t = self.snapshot.total if self.snapshot is not None else None
        before = sum(int(r.get("n_generated", 0)) for r in self.replies)  # the replies finished so far
        self.series.append(Point(now_iso(), tokens, tps, t.hit_rate if t else 0.0,
                                 t.uploaded_bytes / 2**20 if t else 0.0, t.cpu if t else 0,
                                 recent.total.hit_rate if recent else 0.0, recent.span if recent else 0,
                                 len(self.replies) + 1, before + tokens))  # fmt: skip
        return recent

    def to_dict(self) -> dict[str, Any]:
        """The whole session: each layer's counters add up over every cache the session ran."""
        current = {ls.layer: ls for ls in self.snapshot.layers} if self.snapshot is not None else {}
        layers = []
        for layer in sorted(set(current) | set(self.earlier)):
            small, large = self.earlier.get(layer, (CountersSnapshot(), CountersSnapshot()))
            ls = current.get(layer)
            if ls is not None:
                small, large = small + ls.small, large + ls.large
            t = small + large
            layers.append({
                "layer": layer, "group": ls.group if ls else -1, "lookups": t.lookups, "hits": t.hits,
                "prefetched": t.prefetched, "prefetched_bytes": t.prefetched_bytes, "prefetch_hits": t.prefetch_hits,
                "predicted": t.predicted, "predicted_used": t.predicted_used,
                "recall": t.recall if t.predicted else None, "exposed": t.exposed,
                "misses": t.misses, "cpu": t.cpu, "uploads": t.uploads, "uploaded_bytes": t.uploaded_bytes,
                "bypassed": t.bypassed, "hit_rate": t.hit_rate, "occupancy": ls.occupancy if ls else 0,
                "small": asdict(small), "large": asdict(large),
            })  # fmt: skip
        return {
            "schema_version": SCHEMA_VERSION,
            "moechat_version": __version__,
            "exported": now_iso(),
            "started": self.started,
            "model": self.model,
            "settings": self.settings,
            "tokens": self.earlier_tokens + (self.snapshot.tokens if self.snapshot else 0),
            "cpu_share": self.snapshot.cpu_share if self.snapshot else 0.0,
            # Experts the current cache put in its slots from the saved counts, before its first token.
            "warm_start": {
                "uploads": self.snapshot.warm_uploads if self.snapshot else 0,
                "bytes": self.snapshot.warm_bytes if self.snapshot else 0,
            },
            "groups": [asdict(g) for g in self.snapshot.groups] if self.snapshot else [],
            "policy": self.snapshot.policy if self.snapshot else "classlru",
            # Look-ahead: experts predicted one layer ahead and those the lookup then selected (recall), experts
            # uploaded ahead on a prediction and those used; exposed: misses neither cached nor fetched ahead.
            "prefetch": {
                k: sum(layer[k] for layer in layers)
                for k in ("prefetched", "prefetched_bytes", "prefetch_hits", "predicted", "predicted_used", "exposed")
            },
            # The experts' RAM tier (a model whose experts do not fit in RAM): lookups, reads and waits, whole session.
            "ram_tier": asdict(self.snapshot.ram)
            if self.snapshot is not None and self.snapshot.ram is not None
            else None,
            "min_hit_rate": self.min_hit_rate,
            "min_bound": asdict(self.min_bound) if self.min_bound is not None else None,
            "layers": layers,
            "cache_periods": self.periods,  # caches rebuilt during the session, before the current one
            "replies": self.replies,
            # The recent hit rate's window: at least this many tokens; each point gives its span.
            "recent_window_min_tokens": RECENT_TOKENS,
            "series": [asdict(p) for p in self.series],
        }


CSV_FIELDS = ["layer", "group", "lookups", "hits", "misses", "cpu", "uploads", "uploaded_bytes", "bypassed",
              "hit_rate", "occupancy"]  # fmt: skip


def reply_stats(d: DoneEvent) -> dict[str, Any]:
    """A reply's figures, as the conversation keeps them with the reply (the app adds its time to the first token)."""
    return {"n_prompt": d.n_prompt, "n_kept": d.n_kept, "n_generated": d.n_generated, "prompt_tps": d.prompt_tps,
            "gen_tps": d.gen_tps}  # fmt: skip


def reply_record(stats: dict[str, Any], stop_reason: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A reply as the session keeps it: its figures, how it stopped and the settings it ran with."""
    return stats | {"stop": stop_reason, "settings": {k: v for k, v in settings.items() if k in REPLY_SETTINGS}}


def session_file(data: Path) -> Path:
    """Where this start's session stats go: a file of its own in the data folder, named by the time."""
    return data / "sessions" / f"{now_iso().replace(':', '')}.json"


def to_csv(d: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in d["layers"]:
        w.writerow(row)
    return buf.getvalue()


def _chart(title: str, lines: list[tuple[str, list[float], list[float]]], ylabel: str) -> str:
    """A plain-text chart of `lines` (label, xs, ys), each drawn apart: a line never joins two replies."""
    import plotext as plt

    plt.clear_figure()
    plt.plotsize(70, 15)
    plt.theme("clear")  # no colours: the chart is plain text in a Markdown code block
    markers = ("braille", "dot", "x", "+")
    named = set()
    for label, xs, ys in lines:
        marker = markers[sorted({lab for lab, _, _ in lines}).index(label) % len(markers)]
        plt.plot(xs, ys, marker=marker, label=label if label not in named else "")
        named.add(label)
    ticks = whole_ticks([x for _, xs, _ in lines for x in xs])
    plt.xticks(ticks, [str(t) for t in ticks])  # tokens are whole: no fractions on the axis
    plt.title(title)
    plt.xlabel("tokens generated in the session")
    plt.ylabel(ylabel)
    out = plt.build()
    plt.clear_figure()
    return str(plt.uncolorize(out))


def charts(d: dict[str, Any]) -> list[tuple[str, str, str, list[tuple[str, list[float], list[float]]]]]:
    """The report's charts: (key, title, y label, lines), each line one reply's points on the session's tokens."""
    series = d["series"]
    if len(series) < 2:
        return []
    replies_of = _by_reply(series)
    tps = [("t/s", xs, [p["tps"] for p in ps]) for xs, ps in replies_of]
    hits = [("since the cache's start", xs, [100 * p["hit_rate"] for p in ps]) for xs, ps in replies_of]
    hits += [(f"last ~{RECENT_TOKENS} tokens", xs, [100 * p["recent_hit_rate"] for p in ps])
             for xs, ps in replies_of if any(p.get("recent_tokens") for p in ps)]  # fmt: skip
    return [("tps", "tokens/s of each reply, on the session's token axis", "t/s", tps),
            ("hit-rate", "expert cache hit rate", "%", hits)]  # fmt: skip


def _recent_line(d: dict[str, Any]) -> list[str]:
    """The latest recent hit rate, as a sentence (none before the window has two snapshots)."""
    last = next((p for p in reversed(d["series"]) if p.get("recent_tokens")), None)
    if last is None:
        return []
    return ["", f"Recent hit rate: {100 * last['recent_hit_rate']:.1f}% over the last {last['recent_tokens']} tokens."]


def _prefetch_line(d: dict[str, Any]) -> list[str]:
    p = d.get("prefetch") or {}
    out = []
    if p.get("predicted"):
        out.append(f"Look-ahead: {p['predicted']} experts predicted one layer ahead, {p['predicted_used']} of them "
                   f"selected (recall {100 * p['predicted_used'] / p['predicted']:.1f}%).")  # fmt: skip
    if p.get("prefetched"):
        out.append(f"Prefetch: {p['prefetched']} experts uploaded ahead ({p['prefetched_bytes'] / 2**20:.1f} MiB), "
                   f"{p['prefetch_hits']} of them used ({100 * p['prefetch_hits'] / p['prefetched']:.1f}%); "
                   f"{p.get('exposed', 0)} misses exposed (neither in a slot nor fetched ahead).")  # fmt: skip
    return ["", *out] if out else []


def _bound_line(d: dict[str, Any]) -> list[str]:
    """How far the cache's policy is from MIN at its size (none before a reply), both on the current cache's
    lookups (the session's total also counts the caches it ran before)."""
    bound = d.get("min_bound")
    if bound is None:
        return []
    policy = d.get("policy", "classlru")
    if bound["from_start"]:
        return ["", f"MIN (offline optimum, with bypass) at this size, on the same lookups as the current cache's "
                    f"hit rate and from its start (warm-started slots included): hit rate {100 * bound['rate']:.1f}%, "
                    f"against {100 * bound['hit_rate']:.1f}% for {policy}."]  # fmt: skip
    return ["", f"MIN (offline optimum, with bypass) at this size, on the same lookups as the current cache's, its "
                f"last {bound['tokens']} tokens (from the slots as they were then): hit rate "
                f"{100 * bound['rate']:.1f}%, against {100 * bound['hit_rate']:.1f}% for {policy}."]  # fmt: skip


def to_markdown(d: dict[str, Any], pictures: dict[str, str] | None = None) -> str:
    """The session as a Markdown report; `pictures`: each chart's key and the file its picture is in (linked
    above the plain-text chart)."""
    m, s = d["model"], d["settings"]
    replies = d["replies"]
    total = {k: sum(layer[k] for layer in d["layers"]) for k in ("lookups", "hits", "cpu", "uploaded_bytes")}
    out = [
        f"# moechat session report ({d['started']})",
        "",
        f"moechat {d['moechat_version']}, exported {d['exported']}",
        "",
        "| model | arch | device | cache MiB | cpu share | test | t/s | median reply t/s |",
        "| ----- | ---- | ------ | --------: | --------: | ---: | --: | ---------------: |",
    ]
    base = f"| {m.get('name', '?')} | {m.get('arch', '?')} | {m.get('device', '?')} | {s.get('moe_cache_mib', 0):g} " \
           f"| {s.get('moe_cache_cpu_share', 0):g} "  # fmt: skip
    # Rates over the whole session, weighted by tokens: all tokens over all the time they took; beside them the
    # median reply's, which one slow reply (a first start, a busy machine) does not drag down.
    for test, n_key, tps_key in (("pp", "n_prompt", "prompt_tps"), ("tg", "n_generated", "gen_tps")):
        timed = [(r[n_key], r[n_key] / r[tps_key]) for r in replies if r.get(tps_key) and r.get(n_key)]
        if timed:
            n, seconds = sum(t[0] for t in timed), sum(t[1] for t in timed)
            median = statistics.median(count / took for count, took in timed)
            out.append(base + f"| {test}{round(n / len(timed))} | {n / seconds:.2f} | {median:.2f} |")
    hit = total["hits"] / total["lookups"] if total["lookups"] else 0.0
    out += [
        "",
        f"Expert cache over the whole session ({1 + len(d.get('periods') or [])} cache(s): a cache change "
        f"starts a new one): {d['tokens']} tokens, hit rate {100 * hit:.1f}%, {total['cpu']} misses on the CPU, "
        f"{total['uploaded_bytes'] / 2**20:.1f} MiB uploaded.",
        *_recent_line(d),
        *_bound_line(d),
        *_prefetch_line(d),
        "",
        "| layer | lookups | hits | hit rate | cpu | uploads | uploaded MiB | slots held |",
        "| ----: | ------: | ---: | -------: | --: | ------: | -----------: | ---------: |",
    ]
    for r in d["layers"]:
        out.append(f"| {r['layer']} | {r['lookups']} | {r['hits']} | {100 * r['hit_rate']:.1f}% | {r['cpu']} | "
                   f"{r['uploads']} | {r['uploaded_bytes'] / 2**20:.2f} | {r['occupancy']} |")  # fmt: skip
    if replies:
        out += [
            "",
            "| reply | prompt tok read | reply tok | t/s | temp | top-k | top-p | cache MiB | cpu share | system |",
            "| ----: | ---------: | --------: | --: | ---: | ----: | ----: | --------: | --------: | ------ |",
        ]
        for i, r in enumerate(replies, 1):
            rs = r.get("settings") or {}
            system = " ".join(str(rs.get("system", "")).split())[:30].replace("|", "/") or "none"
            cells = [i, r["n_prompt"], r["n_generated"], f"{r.get('gen_tps', 0):.2f}"]
            cells += [rs.get(k, "?") for k in ("temp", "top_k", "top_p", "moe_cache_mib", "moe_cache_cpu_share")]
            out.append("| " + " | ".join(str(c) for c in [*cells, system]) + " |")
    for key, title, ylabel, lines in charts(d):
        if pictures and key in pictures:
            out += ["", f"![{title}]({pictures[key]})"]
        out += ["", "```", _chart(title, lines, ylabel), "```"]
    return "\n".join(out) + "\n"


def _by_reply(series: list[dict[str, Any]]) -> list[tuple[list[float], list[dict[str, Any]]]]:
    """The series cut into replies, each with its x: the session's tokens. An export written before the
    points carried them: a reply begins where the tokens fall, and goes on after the ones before."""
    out: list[tuple[list[float], list[dict[str, Any]]]] = []
    offset = last_tokens = 0
    last_reply = None
    for p in series:
        if "session_tokens" in p:
            new, x = p["reply"] != last_reply, p["session_tokens"]
        else:
            new = p["tokens"] < last_tokens
            offset += last_tokens if new else 0
            x = offset + p["tokens"]
        if new or not out:
            out.append(([], []))
        out[-1][0].append(float(x))
        out[-1][1].append(p)
        last_reply, last_tokens = p.get("reply"), p["tokens"]
    return out


def write_stats(d: dict[str, Any], path: Path, fmt: str) -> list[Path]:
    """The session in `fmt` at `path`; Markdown also writes its charts as SVG pictures beside it. The files
    written, the report first."""
    if fmt == "json":
        return [write_atomic(path, json.dumps(d, indent=1))]
    if fmt == "csv":
        return [write_atomic(path, to_csv(d))]
    if fmt not in ("md", "markdown"):
        raise ValueError(f"unknown export format '{fmt}' (json, csv or md)")
    from moechat.app.export_charts import picture_names, svg_chart

    found = charts(d)
    files = picture_names(path, [key for key, *_ in found])
    pictures = [write_atomic(files[key], svg_chart(title, lines, ylabel)) for key, title, ylabel, lines in found]
    return [write_atomic(path, to_markdown(d, {k: f.name for k, f in files.items()})), *pictures]


def transcript_markdown(conv: Conversation) -> str:
    out = [f"# {conv.title}", "", f"{conv.model}, {conv.created}", ""]
    if conv.system:
        out += ["**system**", "", conv.system, ""]
    for msg in conv.messages:
        mark = " (stopped)" if msg.get("stopped") else ""
        out += [f"**{msg['role']}**{mark}", "", msg["content"], ""]
    return "\n".join(out)


def read_stats(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a moechat stats file ({e})") from None
    if not isinstance(d, dict) or d.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: not a moechat stats file of schema version {SCHEMA_VERSION}")
    return d
