"""Plain-text, Markdown and JSON renderings of a tune report and of a simulation table (no rich here)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from moechat.tuner.recommend import TuneReport
from moechat.tuner.time_model import TimeModel


def table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def _cell(tps: float, best: bool, markdown: bool) -> str:
    text = f"{tps:.1f}"
    if not best:
        return text
    return f"**{text}**" if markdown else f"{text}*"


def upload_speed(m: TimeModel) -> str:
    """How fast uploads go, in words: where they cost nothing measurable there is no link to speak of."""
    if not math.isfinite(m.upload_gibps):
        return "uploads cost nothing measurable (no link: the device is the CPU)"
    return f"uploads {m.upload_gibps:.2f} GiB/s"


def duration(seconds: float) -> str:
    """A wait as a person reads it: "42 s", "3 min 5 s"."""
    secs = round(seconds)
    return f"{secs // 60} min {secs % 60} s" if secs >= 60 else f"{secs} s"


def work_left(arm_tokens: Mapping[int, int], n_arms: int, tokens_total: int) -> tuple[int, int]:
    """(tokens, runs) a sweep has still to measure: the runs started and not through (`arm_tokens`: the
    tokens each has done, by index; on the CPU device they run together), and those after the last
    one started."""
    to_start = n_arms - 1 - max(arm_tokens)
    tokens = sum(tokens_total - d for d in arm_tokens.values()) + tokens_total * to_start
    return tokens, sum(d < tokens_total for d in arm_tokens.values()) + to_start


def cpu_speed(m: TimeModel) -> str:
    """How fast the CPU takes misses, in words a person reads."""
    if m.cpu_free:
        return "CPU misses cost no more than hits (the device is the CPU)"
    return f"CPU {m.cpu_gibps:.2f} GiB/s"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no infinity


def error_bar(tps: float, model: TimeModel, measured: bool) -> str:
    """ " +- x" for a predicted speed: its leave-one-out relative spread; nothing for a measured one."""
    if measured or not math.isfinite(model.spread):
        return ""
    return f" +- {tps * model.spread:.1f}"


def render(report: TuneReport, markdown: bool = False) -> str:
    m = report.time_model
    code = (lambda t: f"`{t}`") if markdown else (lambda t: t)
    out = [
        f"{code(report.model)}: {report.expert_mib:.1f} MiB of experts, device {report.device}, "
        f"cache up to {report.room_mib:.0f} MiB",
        "",
        "measured runs:",
        table(["cache MiB", "share", "t/s", "hits", "upload MiB/t", "CPU MiB/t", "fit error"],
              [[f"{a.mib:g}", f"{a.share:g}", f"{a.tps:.1f}", f"{100 * a.hit_rate:.0f}%", f"{1024 * a.upload_gib:.2f}",
                f"{1024 * a.cpu_gib:.2f}", f"{100 * e:+.1f}%" if math.isfinite(e) else "-"]
               for a, e in zip(report.arms, m.errors, strict=True)]
              + ([["off", "-", f"{report.off.tps:.1f}", "-", "-", "-", "-"]] if report.off is not None else []),
              markdown),
        "",
    ]  # fmt: skip
    if all(math.isfinite(e) for e in m.errors):
        out += [
            f"machine: {upload_speed(m)}, {cpu_speed(m)}, CPU part {m.split:.2f} ms, "
            f"overlap {m.overlap:.1f} ms/GiB, rest {m.base:.2f} ms per token; fit within {100 * m.max_error:.1f}%"
            + ("" if m.physical else " (not physical)"),
            f"closed form: share ~ 1 - B_upload/B_cpu = {report.closed_form_share:.2f}",
            f"prediction error: +-{100 * m.spread:.1f}% (each run predicted by the model fitted without it, RMS)"
            if math.isfinite(m.spread)
            else "prediction error: unknown (no run can be left out of the fit)",
        ]
    else:
        out.append("machine: no time model (see the warnings)")
    out.append("")
    if report.rows:
        cells = [[f"{r.mib:g}"] + [_cell(t, i == r.best, markdown) for i, t in enumerate(r.tps)] for r in report.rows]
        out += [
            "predicted t/s, warm cache (* = lowest share within 5% of the fastest):",
            table(["cache MiB"] + [f"{s:g}" for s in report.shares], cells, markdown),
            "",
        ]
    elif report.recommendation.reason:  # nothing to predict: the reason says why
        out += ["no predicted table: no size or share changes the speed here", ""]
    else:
        out += ["no predicted table: the time model does not describe the runs (see the warnings)", ""]
    rec = report.recommendation
    if rec.cache_off:
        out.append(f"recommended: {code(rec.command())}: {rec.describe()}")
    elif rec.all_fit:
        out.append(f"all experts fit on the device ({rec.mib:g} MiB): run with {code(f'--moe-cache-mib {rec.mib:g}')}, "
                   "every expert stays resident and the host copy is only read once")  # fmt: skip
    else:
        tail = f", {rec.tps_share0:.1f} with share 0" if rec.share > 0 and math.isfinite(rec.tps_share0) else ""
        out.append(f"recommended: {code(rec.command())} ({rec.tps:.1f}{error_bar(rec.tps, m, rec.measured)} t/s "
                   f"{'measured' if rec.measured else 'predicted'}{tail})")  # fmt: skip
    out += [f"warning: {w}" for w in report.warnings]
    return "\n".join(out)


def to_json(report: TuneReport) -> str:
    d: dict[str, Any] = asdict(report)
    m = report.time_model
    d["time_model"].update(upload_gibps=_finite(m.upload_gibps), cpu_gibps=_finite(m.cpu_gibps), cpu_free=m.cpu_free,
                           spread=_finite(m.spread))  # fmt: skip
    d["recommendation"]["command"] = report.recommendation.command()
    return json.dumps(d, indent=1, default=str)
