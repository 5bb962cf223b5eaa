"""Summary table and figure for bench/gateway_overhead.py, from its result dict (bench/out/gateway.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench._common import median, percentile
from bench._gateway_clients import ClientKind, Round

ARMS = ("inprocess", "sdk", "websockets")
LABELS = {"inprocess": "in-process", "sdk": "openai SDK", "websockets": "raw websockets"}
COLORS = {"inprocess": "tab:gray", "sdk": "tab:blue", "websockets": "tab:orange"}


def _gaps(rounds: list[Round], arm: str) -> list[float]:
    return [g for r in rounds if r.arm == arm for g in r.intervals()]


def _itl_ms(gaps: list[float]) -> dict[str, float]:
    return {"p50": percentile(gaps, 50) * 1e3, "p90": percentile(gaps, 90) * 1e3,
            "p99": percentile(gaps, 99) * 1e3, "n": len(gaps)}


def summarize_throughput(rounds: list[Round], headline: ClientKind) -> dict[str, Any]:
    """Per arm: median tokens/s over its rounds, and the median over its rounds of each
    round's ITL p50/p99 (one disturbed round would otherwise own the pooled p99)."""
    by_arm = {arm: [r for r in rounds if r.arm == arm] for arm in ARMS}
    medians = {arm: median([r.tok_s for r in rs]) for arm, rs in by_arm.items()}
    gaps = {arm: _gaps(rounds, arm) for arm in by_arm}
    per_round = {id(r): _itl_ms(r.intervals()) for r in rounds}
    itl = {arm: {"p50": median([per_round[id(r)]["p50"] for r in rs]),
                 "p99": median([per_round[id(r)]["p99"] for r in rs])} for arm, rs in by_arm.items()}
    # Arms of the same round ran back to back: their ratio is less exposed to slow drift.
    paired = {arm: median([r.tok_s / by_arm["inprocess"][n].tok_s for n, r in enumerate(by_arm[arm])])
              for arm in ("sdk", "websockets")}
    reference = {i: t for i, t in enumerate(by_arm["inprocess"][0].turns)}
    same_text = {arm: sum(t.text == reference[i].text for i, t in enumerate(rs[0].turns)) for arm, rs in by_arm.items()}
    same_prompt = {arm: sum(t.input_tokens == reference[i].input_tokens for i, t in enumerate(rs[0].turns))
                   for arm, rs in by_arm.items()}
    return {
        "headline_client": headline,
        "tok_s_median": medians,
        "ratio_vs_inprocess": {arm: medians[arm] / medians["inprocess"] for arm in ("sdk", "websockets")},
        "median_of_round_ratios": paired,
        "itl_ms": itl,
        "itl_ms_pooled": {arm: _itl_ms(g) for arm, g in gaps.items()},
        "itl_quantiles_ms": {arm: [round(percentile(g, q) * 1e3, 4) for q in range(101)] for arm, g in gaps.items()},
        "added_itl_ms": {arm: {"p50": itl[arm]["p50"] - itl["inprocess"]["p50"],
                               "p99": itl[arm]["p99"] - itl["inprocess"]["p99"]} for arm in ("sdk", "websockets")},
        "ttft_ms_median": {arm: median([(t.arrivals[0] - t.sent_at) * 1e3 for r in rs for t in r.turns
                                        if t.arrivals]) for arm, rs in by_arm.items()},
        "outputs_identical_to_inprocess": same_text,
        "prompt_tokens_identical": same_prompt,
        "rounds": [{"arm": r.arm, "round": r.index, "seconds": r.seconds, "tokens": r.tokens, "tok_s": r.tok_s,
                    "itl_p50_ms": per_round[id(r)]["p50"], "itl_p99_ms": per_round[id(r)]["p99"],
                    "bench_cpu_s": r.client_cpu_s, "gateway_cpu_s": r.server_cpu_s, "other_cpu_s": r.other_cpu_s}
                   for r in rounds],
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    tp, cancel, idle, setup = result["throughput"], result["cancel"], result["idle"], result["setup"]
    lines = [
        f"gateway benchmark: {setup['clients']} streams x {setup['max_output_tokens']} tokens, "
        f"{setup['rounds']} interleaved rounds per arm, edge {setup['edge']['backend']} "
        f"n_seq_max={setup['edge']['n_seq_max']}; load {setup['load_before'][0]:.2f} -> {setup['load_after'][0]:.2f}",
        "",
        f"{'arm':<16}{'tok/s (median)':>16}{'vs in-process':>15}{'(paired)':>10}{'ITL p50 ms':>12}"
        f"{'ITL p99 ms':>12}{'TTFT p50 ms':>13}{'same text':>11}",
    ]
    for arm in ARMS:
        ratio = tp["ratio_vs_inprocess"].get(arm, 1.0)
        paired = tp["median_of_round_ratios"].get(arm, 1.0)
        itl = tp["itl_ms"][arm]
        lines.append(f"{LABELS[arm]:<16}{tp['tok_s_median'][arm]:>16.1f}{ratio:>15.3f}{paired:>10.3f}"
                     f"{itl['p50']:>12.2f}{itl['p99']:>12.2f}{tp['ttft_ms_median'][arm]:>13.1f}"
                     f"{tp['outputs_identical_to_inprocess'][arm]:>8}/{setup['clients']}")
    lines.append("(ITL: median over the arm's rounds of each round's percentile; paired: median of the ratios "
                 "of arms run back to back)")
    lines += [
        "",
        f"cancel ({cancel['client']}, {cancel['count']} responses on {cancel['sessions']} sessions): "
        f"p50 {cancel['p50_ms']:.1f} ms, p99 {cancel['p99_ms']:.1f} ms, max {cancel['max_ms']:.1f} ms",
        f"idle ({idle['sessions']} sessions, extensions negotiated: {idle['negotiated_extensions']}): "
        f"{idle['bytes_per_session'] / 1024:.1f} KiB per session = {idle['sessions_per_gib']:,.0f} sessions/GiB",
        f"headline client: {tp['headline_client']}",
    ]
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tp, cancel = result["throughput"], result["cancel"]
    fig, (ax_tp, ax_itl, ax_cancel) = plt.subplots(1, 3, figsize=(15, 4.2))

    for arm in ARMS:
        rounds = [r for r in tp["rounds"] if r["arm"] == arm]
        ax_tp.plot([r["round"] + 1 for r in rounds], [r["tok_s"] for r in rounds], "o-", color=COLORS[arm],
                   label=f"{LABELS[arm]} (median {tp['tok_s_median'][arm]:.0f})")
    ax_tp.set(title=f"Throughput, {result['setup']['clients']} concurrent streams", xlabel="round",
              ylabel="output tokens/s")
    ax_tp.set_ylim(bottom=0)
    ax_tp.set_xticks(range(1, result["setup"]["rounds"] + 1))
    ax_tp.legend(fontsize=8, loc="lower right")

    for arm in ARMS:
        quantiles = tp["itl_quantiles_ms"][arm]
        ax_itl.plot(quantiles, [q / (len(quantiles) - 1) for q in range(len(quantiles))], color=COLORS[arm],
                    label=LABELS[arm])
    ax_itl.set(title="Inter-token latency (per stream)", xlabel="ms", ylabel="fraction of gaps", xscale="log")
    ax_itl.legend(fontsize=8)

    latencies = sorted(cancel["latencies_ms"])
    ax_cancel.plot([latencies[0], *latencies], [0.0] + [(i + 1) / len(latencies) for i in range(len(latencies))],
                   drawstyle="steps-post", color=COLORS[cancel["client"]])
    ax_cancel.axvline(cancel["p99_ms"], linestyle=":", color="black", label=f"p99 {cancel['p99_ms']:.1f} ms")
    ax_cancel.set(title=f"response.cancel -> response.done ({cancel['count']} cancels)", xlabel="ms",
                  ylabel="fraction of cancels")
    ax_cancel.legend(fontsize=8)

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
