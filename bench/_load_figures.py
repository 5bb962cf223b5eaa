"""The figures of bench/load.py: what a window or a run of streams measured (throughput, ITL, TTFT, goodput against the SLOs), and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench._common import percentile
from bench._load_setup import CASCADE_THRESHOLDS, ITL_GOAL_S, SLO_KEYS, TOKENS_PER_S
from bench._ws_lean import Stream


def gc_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def window_figures(streams: list[Stream], start: float, end: float) -> dict[str, Any]:
    """ITL of the deltas that arrived in [start, end) (each gap to the delta before it in the same
    response) and TTFT of the responses asked for in it."""
    gaps = [b - a for s in streams for a, b in zip(s.deltas, s.deltas[1:], strict=False) if start <= b < end]
    ttfts = [s.first - s.sent for s in streams if s.first is not None and start <= s.sent < end]
    # Deltas of one engine step arrive together (the cascade's released held tokens, verified
    # drafts); the gaps that span a step say whether the steps kept their pace.
    stepped = [g for g in gaps if g > 0.5 / TOKENS_PER_S]
    return {"itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "itl_mean_ms": sum(gaps) / max(1, len(gaps)) * 1e3,
            "step_gap_mean_ms": sum(stepped) / max(1, len(stepped)) * 1e3,
            "ttft_p99_ms": percentile(ttfts, 99) * 1e3, "deltas": len(gaps)}


def request_figures(streams: list[Stream], seconds: float, slo: dict[str, float]) -> dict[str, Any]:
    """TPOT, E2EL, request throughput and goodput (``vllm bench serve``'s definitions) of the
    requests in ``streams``, over the ``seconds`` they were sent in; ``slo`` in ms by metric."""
    tpot: list[float] = []
    e2el: list[float] = []
    done = good = 0
    for s in streams:
        if s.status not in ("completed", "incomplete") or s.first is None or s.done is None:
            continue
        measured = {"ttft": (s.first - s.sent) * 1e3, "e2el": (s.done - s.sent) * 1e3}
        if s.output_tokens > 1:
            measured["tpot"] = (s.deltas[-1] - s.first) * 1e3 / (s.output_tokens - 1)
            tpot.append(measured["tpot"])
        e2el.append(measured["e2el"])
        done += 1
        good += all(measured.get(key, 0.0) <= limit for key, limit in slo.items())
    return {"requests_done": done, "request_throughput": done / seconds, "goodput": good / seconds,
            "tpot_mean_ms": sum(tpot) / max(1, len(tpot)), "tpot_p99_ms": percentile(tpot, 99),
            "e2el_p50_ms": percentile(e2el, 50), "e2el_p99_ms": percentile(e2el, 99)}


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """``--goodput ttft:1000 tpot:55``: an SLO in ms per metric (``vllm bench serve``'s flag)."""
    slo: dict[str, float] = {}
    for pair in pairs:
        key, _, value = pair.partition(":")
        if key not in SLO_KEYS:
            raise SystemExit(f"--goodput: {key!r} is not one of {SLO_KEYS} (KEY:MS pairs, e.g. ttft:1000 tpot:55)")
        try:
            slo[key] = float(value)
        except ValueError:
            raise SystemExit(f"--goodput: {pair!r} needs a number of milliseconds after the colon") from None
    return slo


def sustained(level: dict[str, Any]) -> bool:
    """The streams got their 20 tokens/s (the mean gap between steps within 5% of 50 ms: a gateway
    that falls behind stretches the engine's steps) with ITL p99 under the goal, and every
    response completed."""
    return (level["itl_p99_ms"] < ITL_GOAL_S * 1e3 and level["step_gap_mean_ms"] <= 1.05e3 / TOKENS_PER_S
            and level["completed"] == level["responses"])


def overload_figures(streams: list[Stream], base_ttft: list[float]) -> dict[str, Any]:
    accepted = [s for s in streams if s.status in ("completed", "incomplete")]
    refused = [s for s in streams if s.status == "failed"]
    reject_ms = [(s.done - s.sent) * 1e3 for s in refused if s.done is not None]
    accepted_ttft = [s.first - s.sent for s in accepted if s.first is not None]
    return {"requests": len(streams), "accepted": len(accepted), "refused": len(refused),
            "refused_codes": sorted({str(s.code) for s in refused}),
            "reject_p50_ms": percentile(reject_ms, 50), "reject_p99_ms": percentile(reject_ms, 99),
            "accepted_ttft_p99_ms": percentile(accepted_ttft, 99) * 1e3,
            "accepted_ttft_p99_ratio": percentile(accepted_ttft, 99) / percentile(base_ttft, 99)}


def plot(result: dict[str, Any], path: Path) -> None:
    """ITL (the edge route's, and the cascade's p99) and both processes' CPU against the number of
    streams (the floor's cores at 2,000 beside)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["streams"]["levels"]
    n = [lv["streams"] for lv in levels]
    fig, (ax_itl, ax_cpu) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax_itl.plot(n, [lv["itl_p99_ms"] for lv in levels], "o-", color="C1", label="ITL p99, edge route")
    ax_itl.plot(n, [lv["step_gap_mean_ms"] for lv in levels], "o-", color="C0", label="mean gap between steps, edge")
    for (name, arm), color in zip(((k, v) for k, v in result.get("cascade", {}).items() if k in CASCADE_THRESHOLDS),
                                  ("C2", "C3"), strict=False):
        cn = [lv["streams"] for lv in arm["levels"]]
        ax_itl.plot(cn, [lv["itl_p99_ms"] for lv in arm["levels"]], "^--", color=color, label=f"ITL p99, cascade {name}")
        ax_itl.plot(cn, [lv["step_gap_mean_ms"] for lv in arm["levels"]], "^:", color=color, alpha=0.6,
                    label=f"mean gap between steps, {name}")
    gc_levels = [lv for lv in levels if lv["gc"]["full_collections"] > 0]
    ax_itl.plot([lv["streams"] for lv in gc_levels], [lv["itl_p99_ms"] for lv in gc_levels], "x", color="black",
                markersize=10, label="a full GC in the window")
    ax_itl.axhline(ITL_GOAL_S * 1e3, linestyle=":", color="black", label="goals: p99 under 100 ms,")
    ax_itl.axhline(1.05e3 / TOKENS_PER_S, linestyle="--", color="grey", label="mean gap within 5% of 50 ms")
    ax_itl.set(title="One gateway process, 20 tokens/s per stream", xlabel="concurrent streams", ylabel="ms")
    ax_itl.legend(fontsize=7)
    ax_cpu.plot(n, [lv["server_cores"] for lv in levels], "o-", label="gateway (one event loop)")
    ax_cpu.plot(n, [lv["clients_cores"] for lv in levels], "o-", label="clients (lean, same machine)")
    if floor := result.get("floor"):
        ax_cpu.plot([floor["streams"]], [floor["writer_cores"]], "s", color="C2",
                    label="a bare writer, no gateway code")
        ax_cpu.plot([floor["streams"]], [floor["reader_cores"]], "s", color="C3", label="a bare reader")
    ax_cpu.set(xlabel="concurrent streams", ylabel="cores")
    ax_cpu.set_title(f"CPU, {result['cpu']['cores']} cores\n{result['cpu']['model']}", fontsize=9)
    ax_cpu.set_ylim(0, 1.1)
    ax_cpu.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
