"""Structured outputs (issue 29) on this machine's CPU, every figure measured side by side in one run.

The shipped schemas (configs/structured_schemas.json: 20 function tools a voice assistant offers,
10 response formats apps ask for, each with a user prompt that should use it) and the embedded
SmolLM2-135M on both tiers:

1. **Compile**: each shipped schema alone (a tool under ``tool_choice: required``, a response
   format as ``json_schema``), the compiler's cache cleared before each: parsing the wire fields,
   building the grammar and compiling it with llguidance (its first mask included). p50 / p99 over
   every compile of every round; the grammar of all 20 tools together is timed too.
2. **Validity** on each tier and through the cascade: every case (a tool prompt offers its tool
   and the next three, ``tool_choice: required``; a response-format prompt asks for its schema)
   ``--samples`` times at temperature 0.7, a seed each. An output is valid when it parses and
   validates with ``jsonschema`` (formats checked): a tool call parsed by the family's parser, its
   name one of the offered tools, its arguments valid against that tool's parameters; a response
   format's JSON against its schema. An answer cut by ``max_tokens`` counts as invalid (the share
   valid among the answers that ended by themselves is reported beside it). Each tier's matcher
   knows the answer's ``max_tokens`` and, near it, forces a short way to close the document, so an
   answer the small model would loop in ends valid; ``ended_near_budget`` counts the answers that
   ended within the budget's last ``NEAR_BUDGET`` (25) tokens (closed by it, or rarely ending there).
   - torch tier: the in-process ``LLMEngine`` (the greedy answers of step 4, speculative, are
     judged too, apart: at ``--spec-tokens`` many are cut short);
   - edge tier: the llama.cpp backend (``engine_edge.create_backend``);
   - cascade: a gateway started in this process, the official ``openai`` SDK as the client
     (tools / response_format as an app sends them) against the cascade's model id, four turns at
     a time; validated: the ``tool_calls`` and ``content`` the gateway returns. Twice: the default
     configuration as shipped, then always escalating (threshold 1), so that every turn's held
     edge tokens are verified by the torch tier under the grammar.
3. **Per-token cost** of a grammar, tokens/s with it over tokens/s without, the same prompts and
   batch: the grammar is a product catalogue of at least 200 items (names, prices, flags), so a
   constrained answer runs to ``max_tokens`` as the free one does (``ignore_eos``). tok/s counts the
   tokens emitted while the whole batch decodes (from the last sequence's first token to the
   first sequence's end: no prefill in it). Arms in A-B-B-A quads (a drift of the machine's speed
   cancels), the ratio of each quad, their median. Torch tier at batch 1 and 32; edge at 1 and 4.
4. **Speculative acceptance** on the torch tier with the edge drafter (k = 4, fixed): every case
   greedily, without and with its grammar, eight at a time; acceptance = accepted / verified
   draft tokens, as the engine counts it. Under a grammar a draft is first cut to its valid
   prefix; the share of drafted tokens cut (also by the room a sequence has left) is reported,
   and accepted / drafted with it.

Each compute pool runs with its share of the host's CPU budget, as the gateway gives it (on 2 cores
one thread each for torch, its drafter and the edge; ``--threads`` sets them all).

Last stdout line: one JSON object (``valid_rate_gpu``, ``valid_rate_edge``, ``valid_rate_cascade``,
``constrained_over_free_tok_s_b1``, ``constrained_over_free_tok_s_b32``,
``edge_constrained_over_free_tok_s`` (batch 1), ``compile_ms_p50``, ``compile_ms_p99``,
``spec_acceptance_free``, ``spec_acceptance_constrained``, ``cpu``); details in
bench/out/structured.json.

    .venv/bin/python bench/structured.py [--samples 1] [--quads 3] [--spec-tokens 192] [--smoke]

About 15 minutes on 2 cores (14 min 43 s on 2026-11-26); --smoke runs one tool and one response
format at tiny sizes in about a minute, results in bench/out/smoke/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from bench._common import (
    REPO_ROOT,
    SMOKE_HELP,
    cpu_dtype,
    cpu_facts,
    median,
    percentile,
    progress,
    result_path,
    write_json,
)
from bench._structured_cases import (
    FAMILY,
    TOOLS_OFFERED,
    Case,
    Verdict,
    check_calls,
    load_cases,
    report_validity,
    schema_error,
    summary,
    verdicts,
)
from bench._structured_tiers import Edge, Out, Torch, steady_tok_s
from bench.engine import OtherLoad
from gateway.config import DEFAULT_CONFIG, Config, load_config
from gateway.process.server import create_app, start_server
from gateway.tiers.build import close_engines, host_plan, load_engines
from llm_shared.contract import SamplingParams
from llm_shared.structured import (
    GrammarCompiler,
    Message,
    build_grammar,
    parse_chat_constraints,
    render_messages,
)
from llm_shared.tokenizer import Tokenizer

SCHEMAS = REPO_ROOT / "configs" / "structured_schemas.json"
# The per-token-cost grammar: an answer that cannot end before max_tokens, mixing strings, numbers
# and structure as a real list does.
CATALOGUE = {"type": "object", "additionalProperties": False, "required": ["products"], "properties": {"products": {
    "type": "array", "minItems": 200, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "price", "in_stock"],
        "properties": {"name": {"type": "string"}, "price": {"type": "number", "minimum": 0},
                       "in_stock": {"type": "boolean"}}}}}}
SHOPS = ("a bakery", "a hardware store", "a bookshop", "a pharmacy", "a garden centre", "a toy shop", "a grocer",
         "a music shop", "a pet shop", "a sports shop", "a florist", "a stationer", "a fishmonger", "a cheese shop",
         "a bike shop", "a tea shop")


# --- the workload ---------------------------------------------------------------------------------


def prompt_of(tokenizer: Tokenizer, body: dict[str, Any], prompt: str) -> list[int]:
    """The prompt ids the gateway would build: tools in the system prompt, a schema asked for."""
    return tokenizer.encode_chat(render_messages([Message("user", prompt)], parse_chat_constraints(body), FAMILY))


def grammar_of(body: dict[str, Any]) -> str:
    source = build_grammar(parse_chat_constraints(body), FAMILY)
    assert source is not None
    return source.text


def catalogue_body() -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "catalogue", "schema": CATALOGUE,
                                                                       "strict": True}}}


# --- 1. compile times -----------------------------------------------------------------------------


def compile_times(tokenizer: Tokenizer, alone: list[tuple[str, dict[str, Any]]], rounds: int,
                  all_tools: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, family=FAMILY)
    build_s = time.perf_counter() - started

    def cold(body: dict[str, Any]) -> tuple[float, float]:
        compiler.clear_cache()
        t0 = time.perf_counter()
        compiled = compiler.compile(parse_chat_constraints(body))
        assert compiled is not None
        return (time.perf_counter() - t0) * 1e3, compiled.compile_ms

    first = cold(alone[0][1])[0]  # the process's very first compile (llguidance's own state cold too)
    per_schema: dict[str, list[float]] = {name: [] for name, _ in alone}
    llguidance_ms: list[float] = []
    for _ in range(rounds):
        for name, body in alone:
            total, inner = cold(body)
            per_schema[name].append(total)
            llguidance_ms.append(inner)
    every = [ms for values in per_schema.values() for ms in values]
    together = [cold(all_tools)[0] for _ in range(rounds)]
    out = {
        "p50_ms": median(every), "p99_ms": percentile(every, 99), "max_ms": max(every),
        "llguidance_p50_ms": median(llguidance_ms), "llguidance_p99_ms": percentile(llguidance_ms, 99),
        "first_compile_in_process_ms": first, "compiler_build_s": build_s, "rounds": rounds,
        "per_schema_median_ms": {name: median(v) for name, v in per_schema.items()},
        "all_20_tools_required_median_ms": median(together),
    }
    progress(f"compile (cold cache, {len(every)} compiles): p50 {out['p50_ms']:.2f} ms, p99 {out['p99_ms']:.2f} ms "
             f"(llguidance alone p50 {out['llguidance_p50_ms']:.2f}); all 20 tools in one grammar "
             f"{out['all_20_tools_required_median_ms']:.2f} ms; first in the process {first:.2f} ms")
    return out


# --- driving the tiers ----------------------------------------------------------------------------


# --- 2. validity, 3. per-token cost, 4. acceptance ------------------------------------------------


def sampled(cases: Sequence[Case], samples: int, max_tokens: int) -> list[tuple[Case, SamplingParams]]:
    return [(case, SamplingParams(temperature=0.7, seed=1000 * s + i, max_tokens=max_tokens,
                                  grammar=grammar_of(case.body)))
            for s in range(samples) for i, case in enumerate(cases)]


def abba(run_arm: Any, quads: int, label: str) -> dict[str, Any]:
    """A-B-B-A quads of the free (A) and constrained (B) arms; each quad's ratio of mean tok/s."""
    rows = []
    for q in range(quads):
        order = ("free", "constrained", "constrained", "free") if q % 2 == 0 else \
            ("constrained", "free", "free", "constrained")
        runs: dict[str, list[float]] = {"free": [], "constrained": []}
        for arm in order:
            runs[arm].append(run_arm(arm))
        ratio = statistics.fmean(runs["constrained"]) / statistics.fmean(runs["free"])
        rows.append({"tok_s": runs, "ratio": ratio})
        progress(f"  {label} quad {q + 1}: free {statistics.fmean(runs['free']):.1f} tok/s, constrained "
                 f"{statistics.fmean(runs['constrained']):.1f} -> {ratio:.3f}")
    return {"ratio": median([r["ratio"] for r in rows]), "quads": rows}


def cost_arms(tokenizer: Tokenizer, batch: int, tokens: int) -> dict[str, tuple[list[list[int]], list[SamplingParams]]]:
    body, grammar = catalogue_body(), grammar_of(catalogue_body())
    prompts = [prompt_of(tokenizer, body, f"List the products of {SHOPS[i % len(SHOPS)]} with their prices.")
               for i in range(batch)]
    free = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return {"free": (prompts, [free] * batch), "constrained": (prompts, [replace(free, ignore_eos=False,
                                                                                  grammar=grammar)] * batch)}


def checked_tok_s(outs: list[Out], tokens: int, arm: str) -> float:
    if any(len(o.times) != tokens for o in outs):
        raise RuntimeError(f"{arm}: outputs of {[len(o.times) for o in outs]} tokens, not {tokens} each "
                           f"(finish {[o.finish for o in outs]})")
    return steady_tok_s(outs)


def torch_phase(t: Torch, cases: list[Case], args: argparse.Namespace, load: OtherLoad) -> dict[str, Any]:
    tok = t.tokenizer
    jobs = sampled(cases, args.samples, args.max_tokens)
    prompts = {c.name: prompt_of(tok, c.body, c.prompt) for c in cases}
    progress(f"torch tier validity: {len(jobs)} constrained outputs (temperature 0.7), batched")
    plain = verdicts(jobs, t.run([prompts[c.name] for c, _ in jobs], [p for _, p in jobs], tag="valid"))
    out: dict[str, Any] = {"validity_plain": report_validity("torch", plain, cases)}
    load.lap("torch validity")

    progress(f"speculative acceptance: {len(cases)} cases greedily, without and with their grammar, edge drafter k=4")
    spec: dict[str, Any] = {}
    spec_verdicts: list[Verdict] = []
    for arm in ("free", "constrained"):
        engine = t.engine(speculative=True)
        greedy = [SamplingParams(temperature=0.0, max_tokens=args.spec_tokens,
                                 grammar=grammar_of(c.body) if arm == "constrained" else "") for c in cases]
        outs: list[Out] = []
        for start in range(0, len(cases), 8):  # speculation runs at up to 8 decoding sequences (max_batch)
            chunk = cases[start:start + 8]
            outs += t.run([prompts[c.name] for c in chunk], greedy[start:start + 8], engine, tag=f"spec-{arm}-{start}")
        stats, drafter = engine.stats(), engine.speculator.drafter  # type: ignore[union-attr]
        drafted = sum(call.drafted for call in drafter.calls)  # type: ignore[attr-defined]
        verified, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
        spec[arm] = {"acceptance": accepted / verified if verified else 0.0, "verified_drafts": verified,
                     "accepted": accepted, "drafted": drafted, "cut": 1 - verified / drafted if drafted else 0.0,
                     "accepted_of_drafted": accepted / drafted if drafted else 0.0,
                     "mean_accepted_len": stats["spec_mean_accepted_len"], "tokens": sum(len(o.times) for o in outs)}
        if arm == "constrained":
            spec_verdicts = verdicts([(c, p) for c, p in zip(cases, greedy, strict=True)], outs)
        engine.close()
        progress(f"  {arm}: acceptance {spec[arm]['acceptance']:.3f} ({accepted:.0f} of {verified:.0f} verified drafts; "
                 f"{spec[arm]['cut']:.1%} of {drafted} drafted tokens cut first; accepted of drafted "
                 f"{spec[arm]['accepted_of_drafted']:.3f}), "
                 f"{spec[arm]['tokens']} tokens")
    out["speculative"] = spec
    out["validity_speculative"] = report_validity("torch + edge drafter", spec_verdicts, cases)
    out["valid_rate"] = out["validity_plain"]["valid_rate"]
    load.lap("torch acceptance")

    for batch, tokens in ((1, args.tokens_b1), (args.batch, args.tokens_b32)):
        arms = cost_arms(tok, batch, tokens)
        t.run(arms["constrained"][0][:1], [replace(arms["constrained"][1][0], max_tokens=4)], tag="warm")
        progress(f"torch tier per-token cost, batch {batch}: {tokens} tokens a sequence, A-B-B-A x {args.quads}")
        out[f"cost_b{batch}"] = abba(lambda arm, a=arms, n=tokens: checked_tok_s(t.run(*a[arm], tag=arm), n, arm),
                                     args.quads, f"torch b{batch}")
        load.lap(f"torch b{batch}")
    return out


def edge_phase(e: Edge, cases: list[Case], args: argparse.Namespace, load: OtherLoad) -> dict[str, Any]:
    jobs = sampled(cases, args.samples, args.max_tokens)
    prompts = {c.name: prompt_of(e.tokenizer, c.body, c.prompt) for c in cases}
    progress(f"edge tier validity: {len(jobs)} constrained outputs (temperature 0.7), 8 at a time")
    out: dict[str, Any] = {"validity": report_validity(
        "edge", verdicts(jobs, e.run([prompts[c.name] for c, _ in jobs], [p for _, p in jobs], tag="valid")), cases)}
    load.lap("edge validity")
    for batch in (1, 4):
        arms = cost_arms(e.tokenizer, batch, args.tokens_b1)
        progress(f"edge tier per-token cost, batch {batch}: {args.tokens_b1} tokens a sequence, A-B-B-A x {args.quads}")
        out[f"cost_b{batch}"] = abba(
            lambda arm, a=arms: checked_tok_s(e.run(*a[arm], tag=arm), args.tokens_b1, arm), args.quads,
            f"edge b{batch}")
        load.lap(f"edge b{batch}")
    return out


async def cascade_arm(config: Config, cases: list[Case], args: argparse.Namespace, label: str) -> dict[str, Any]:
    """A gateway on ``config`` in this process, the official SDK against its cascade id."""
    progress(f"cascade ({label}): starting a gateway (both tiers, the edge drafter)")
    engines = await load_engines(config)
    server = await start_server(create_app(config, engines))
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(4)

    async def one(case: Case, seed: int) -> Verdict:
        async with gate:
            done = await client.chat.completions.create(
                model=config.routing.cascade_model, messages=[{"role": "user", "content": case.prompt}],
                max_tokens=args.max_tokens, temperature=0.7, seed=seed, **case.body)
        choice, extra = done.choices[0], done.model_extra or {}
        route = f"{extra.get('x_tier', '?')}:{(extra.get('x_route') or {}).get('route', '?')}"
        called = None
        if case.calls:
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            why = check_calls(case, calls) or ("text besides the call" if (choice.message.content or "").strip()
                                               else "")
            called = calls[0][0] if calls else None
        else:
            try:
                why = schema_error(case.schemas[""], json.loads(choice.message.content or ""))
            except ValueError as e:
                why = f"not JSON ({e})"
        if choice.finish_reason != ("tool_calls" if case.calls else "stop"):
            why = f"finished {choice.finish_reason!r}" + (f": {why}" if why else "")
        tokens = done.usage.completion_tokens if done.usage else 0
        return Verdict(case.name, choice.finish_reason, why, called, tokens, route, args.max_tokens)

    try:
        await one(cases[-1], 0)  # warm both tiers' paths
        started = time.perf_counter()
        results = list(await asyncio.gather(*(one(c, 1000 * s + i) for s in range(args.samples)
                                              for i, c in enumerate(cases))))
        seconds = time.perf_counter() - started
        async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as response:
            metrics = await response.text()
    finally:
        await server.stop()
        await close_engines(engines)
    out = report_validity(f"cascade ({label})", results, cases)
    out["routes"] = {r: sum(v.route == r for v in results) for r in sorted({v.route for v in results})}
    held = {"accepted": 0.0, "rejected": 0.0}  # the edge's held tokens the torch tier verified on escalation
    for line in metrics.splitlines():
        if line.startswith("gateway_cascade_held_tokens_total{"):
            held[line.split('"')[1]] = float(line.split()[-1])
    out["held_tokens"], out["seconds"], out["verdicts"] = held, seconds, [vars(v) for v in results]
    progress(f"  routes {out['routes']}; held tokens verified on escalation: {held}")
    return out


def cascade_phase(cases: list[Case], args: argparse.Namespace) -> dict[str, Any]:
    """The default configuration as shipped, then the same always escalating (threshold 1: the
    torch tier verifies every turn's held edge tokens under the grammar)."""
    config = load_config(DEFAULT_CONFIG).with_server(host="127.0.0.1", port=0, api_keys_env="")
    always = replace(config, cascade=replace(config.cascade, threshold=1.0, min_threshold=1.0, load_aware=False,
                                             spill=False))
    arms = {"default": asyncio.run(cascade_arm(config, cases, args, "default threshold")),
            "always_escalate": asyncio.run(cascade_arm(always, cases, args, "always escalating"))}
    every = [Verdict(**v) for arm in arms.values() for v in arm["verdicts"]]
    return {"valid_rate": summary(every, cases)["valid_rate"], **arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1, help="constrained outputs per case on each tier and arm")
    parser.add_argument("--max-tokens", type=int, default=384, help="the most tokens of a validity answer")
    parser.add_argument("--quads", type=int, default=3, help="A-B-B-A quads per per-token-cost figure")
    parser.add_argument("--tokens-b1", type=int, default=192, help="tokens a sequence at batch 1 (both tiers; edge b4)")
    parser.add_argument("--tokens-b32", type=int, default=64, help="tokens a sequence at batch 32")
    parser.add_argument("--spec-tokens", type=int, default=192, help="the most tokens of an acceptance run's answer")
    parser.add_argument("--batch", type=int, default=32, help="the torch tier's large batch")
    parser.add_argument("--compile-rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0,
                        help="threads of every pool (0: each pool its share of the host's CPU budget, as served)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    cases, alone = load_cases(SCHEMAS)
    if args.smoke:  # one tool and one response format; a few tokens everywhere
        cases = [cases[0], cases[-7]]
        args.samples, args.max_tokens, args.spec_tokens, args.quads, args.compile_rounds = 1, 160, 64, 1, 1
        args.tokens_b1, args.tokens_b32, args.batch = 8, 6, 4
    started = time.perf_counter()
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}; load average {os.getloadavg()[0]:.2f}")
    dtype = cpu_dtype("auto")

    # Each pool its share of the CPU budget, as the gateway gives it (on 2 cores: 1 torch, 1 drafter,
    # 1 edge): pools sized to every core crawl as soon as another process takes one of them.
    plan = host_plan(load_config(DEFAULT_CONFIG))
    threads = {"torch": args.threads or plan.engine, "drafter": args.threads or plan.drafter,
               "edge": args.threads or plan.edge}
    torch_tier = Torch(threads["torch"], threads["drafter"], dtype)
    all_tools = {"tools": [b["tools"][0] for _, b in alone if "tools" in b], "tool_choice": "required",
                 "parallel_tool_calls": False}
    compiled = compile_times(torch_tier.tokenizer, alone, args.compile_rounds, all_tools)
    load = OtherLoad()  # other processes' share of the CPUs during each figure: its noise
    gpu = torch_phase(torch_tier, cases, args, load)
    torch_tier.close()
    edge_tier = Edge(threads["edge"])
    edge = edge_phase(edge_tier, cases, args, load)
    edge_tier.close()
    cascade = cascade_phase(cases, args)
    load.lap("cascade (its engine core counts as another process)")

    summary_line = {
        "valid_rate_gpu": round(gpu["valid_rate"], 4),
        "valid_rate_edge": round(edge["validity"]["valid_rate"], 4),
        "valid_rate_cascade": round(cascade["valid_rate"], 4),
        "constrained_over_free_tok_s_b1": round(gpu["cost_b1"]["ratio"], 3),
        "constrained_over_free_tok_s_b32": round(gpu[f"cost_b{args.batch}"]["ratio"], 3),
        "edge_constrained_over_free_tok_s": round(edge["cost_b1"]["ratio"], 3),
        "compile_ms_p50": round(compiled["p50_ms"], 3),
        "compile_ms_p99": round(compiled["p99_ms"], 3),
        "spec_acceptance_free": round(gpu["speculative"]["free"]["acceptance"], 3),
        "spec_acceptance_constrained": round(gpu["speculative"]["constrained"]["acceptance"], 3),
        "cpu": cpu["model"],
    }
    results = {
        "summary": summary_line,
        "edge_constrained_over_free_tok_s_b4": edge["cost_b4"]["ratio"],
        "settings": {**vars(args), "threads": threads, "dtype": dtype, "cases": len(cases),
                     "tools_offered": TOOLS_OFFERED},
        "cpu": cpu, "compile": compiled, "torch": gpu, "edge": edge, "cascade": cascade,
        "other_processes_cpu_share": load.shares, "hypervisor_steal_share": load.steal,
        "seconds": time.perf_counter() - started,
    }
    out_path = result_path("structured.json", args.smoke)
    write_json(out_path, results)
    progress(f"done in {results['seconds']:.0f} s; results in {out_path.relative_to(REPO_ROOT)}")
    print(json.dumps(summary_line))


if __name__ == "__main__":
    main()
