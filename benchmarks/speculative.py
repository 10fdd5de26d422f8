"""Speculative decoding on the default model: decode with n-gram drafts vs without.

Workload (deterministic): agent-style prompts whose output repeats its context, a tool call
to repeat with the same arguments, a list to copy, a JSON object to echo back with one field
changed, and plain tasks whose output repeats nothing (the "misses cost nothing" case). Every
request has ``ignore_eos`` and the same number of output tokens; it is greedy, or with
``--temperature T`` sampled at T with a seed per prompt (``--seed`` + its index), so the drafts
are verified by rejection sampling and the seeded outputs of both engines still compare; each
prompt is prefilled once beforehand (cached), so only decoding is timed.
Batch 1 runs the prompts one at a time; batch 16 runs 16 at once (the prompts cycled).
``--tool-calls``: the agent's case instead: four tools of agents.texts (bounded schemas, the
gateway's own tool prompt and grammar, ``tool_choice`` required, one call) and tasks that call
them; every request is a constrained row, which drafts its grammar's forced tokens (the call's
structure and keys) and otherwise n-gram tokens the grammar accepts; the output ends with the
call, so both engines emit the same (greedy) tokens, counted.

Measured in one run: two engines on the same loaded model, ``--speculative-tokens`` 0 and N,
alternating (off, on) pairs ``--repeats`` times (at batch 1, per prompt); reported: median decode tokens/s of each, the
median of the per-pair ratios (on / off; noisy machines: ratios of adjacent runs), acceptance
(accepted / proposed draft tokens), and whether the outputs were token-identical.

    python -m benchmarks.speculative --json out/speculative.json
    python -m benchmarks.speculative --temperature 0.8 --batches 1 --json out/speculative_t08.json
    python -m benchmarks.speculative --tool-calls --json out/speculative_tools.json
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import base_parser, bounded_schema, print_table, write_json
from prefixgate.agents import texts
from prefixgate.engine.api import Delta, GenerationRequest, GrammarSpec, SamplingParams
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.loader import load_model

REPEATING = [
    'Previous call: {"name": "search_code", "arguments": {"query": "retry policy", "path": '
    '"src/http", "max_results": 5}}. The tool timed out. Call search_code again with exactly '
    "the same arguments, as JSON.",
    "Copy this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, "
    "kappa. Then copy it again.",
    'Echo this JSON back with "status" set to "done": {"task_id": 4821, "owner": "build-agent", '
    '"status": "running", "steps": ["checkout", "compile", "test", "package"]}',
]


PLAIN = [
    "Write two sentences on why teams review code before merging.",
    "Describe a good on-call handover in a short paragraph.",
]


TOOL_TASKS = [
    "Find errors from checkout-api in the last hour about payment timeouts.",
    "Read the file src/http/retry.py on the main branch.",
    "How many orders failed yesterday? Query the warehouse.",
    "Get the http_requests_total metric for the last 24h.",
    "Search the logs of auth-service for 'token expired'.",
]


def tool_requests(tokenizer) -> tuple[list[tuple[int, ...]], GrammarSpec]:
    """The tool-calling prompts (the gateway's tool prompt format) and their call grammar."""
    from prefixgate.gateway.server.tools import FunctionTool, ToolChoice, tool_grammar
    from prefixgate.gateway.server.tools.prompt import prepare_messages

    tools = []
    for name, description, properties, required in texts.TOOLS[:4]:
        schema = {"type": "object", "properties": {k: v for k, v in properties.items() if k in required},
                  "required": required, "additionalProperties": False}
        tools.append(FunctionTool(name, description, bounded_schema(schema)))
    grammar = tool_grammar(tools, ToolChoice("required", parallel=False), None,
                           lambda i: f"tools[{i}].function.parameters")
    assert grammar is not None
    system = "You are an operations agent. Use a tool for every task."
    prompts = [tuple(tokenizer.apply_chat_template(prepare_messages(
        [{"role": "system", "content": system}, {"role": "user", "content": task}], tools)))
        for task in TOOL_TASKS]
    return prompts, grammar


def prompts(tokenizer, system: str) -> list[tuple[int, ...]]:
    """The repeating prompts, then two tasks whose answers repeat nothing."""
    tasks = [*REPEATING, *PLAIN]
    return [tuple(tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": task}]))
        for task in tasks]


def run(engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}

    def sink_for(rid: str):
        def sink(delta: Delta) -> None:
            if isinstance(delta, Delta):
                out[rid].extend(delta.token_ids)
        return sink

    for r in requests:
        engine.add_request(r, sink_for(r.request_id))
    while engine.has_work():
        engine.step()
    return out


def measure(engine, batch_prompts: list[tuple[int, ...]], max_tokens: int, tag: str,
            temperature: float = 0.0, seeds: list[int] | None = None,
            grammar: GrammarSpec | None = None) -> tuple[float, dict[str, list[int]]]:
    """Decode tokens/s of one batch (prompts prefilled first, untimed)."""
    warm = [GenerationRequest(p, SamplingParams(max_tokens=1, temperature=0), request_id=f"{tag}w{i}")
            for i, p in enumerate(batch_prompts)]
    run(engine, warm)
    timed = [GenerationRequest(p, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                 seed=seeds[i] if seeds and temperature else None,
                                                 ignore_eos=True),
                               request_id=f"{i}", grammar=grammar) for i, p in enumerate(batch_prompts)]
    began = time.perf_counter()
    out = run(engine, timed)
    elapsed = time.perf_counter() - began
    return sum(len(v) for v in out.values()) / elapsed, out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampled requests: seed + prompt index")
    parser.add_argument("--tool-calls", action="store_true",
                        help="tool-calling prompts, every row constrained by the call grammar")
    args = parser.parse_args()
    loaded = load_model(None)
    system = "You are a careful software agent. Answer exactly as asked."
    engines = {k: create_llm_engine(EngineConfig(num_pages=1024, device="cpu", num_speculative_tokens=k),
                                    loaded=loaded)[0] for k in (0, args.speculative_tokens)}
    grammar = None
    if args.tool_calls:
        base, grammar = tool_requests(loaded.tokenizer)
    else:
        base = prompts(loaded.tokenizer, system)
    results: dict[str, object] = {"speculative_tokens": args.speculative_tokens,
                                  "max_tokens": args.max_tokens, "repeats": args.repeats,
                                  "temperature": args.temperature, "tool_calls": args.tool_calls}
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        batch_prompts = [base[i % len(base)] for i in range(max(batch, 1))]
        if batch == 1:
            batch_prompts = base  # one at a time, every prompt
        speeds: dict[int, list[float]] = {k: [] for k in engines}
        identical = True
        for rep in range(args.repeats):
            outputs: dict[int, dict[str, list[int]]] = {k: {} for k in engines}
            if batch == 1:
                # off and on alternate per prompt, so each pair is seconds apart on a noisy machine
                totals = {k: [0, 0.0] for k in engines}
                for i, p in enumerate(batch_prompts):
                    for k, engine in engines.items():
                        tps, out = measure(engine, [p], args.max_tokens, f"r{rep}b1p{i}",
                                           args.temperature, [args.seed + i], grammar)
                        n = sum(len(v) for v in out.values())
                        totals[k][0] += n
                        totals[k][1] += n / tps
                        outputs[k][str(i)] = out["0"]
                for k in engines:
                    speeds[k].append(totals[k][0] / totals[k][1])
            for k, engine in engines.items():
                if batch != 1:
                    tps, out = measure(engine, batch_prompts, args.max_tokens, f"r{rep}b{batch}",
                                       args.temperature, [args.seed + i for i in range(len(batch_prompts))],
                                       grammar)
                    speeds[k].append(tps)
                    outputs[k] = out
            identical = identical and len({str(sorted(o.items())) for o in outputs.values()}) == 1
        off, on = speeds[0], speeds[args.speculative_tokens]
        ratio = statistics.median(b / a for a, b in zip(off, on, strict=True))
        results[f"b{batch}"] = {"tokens_per_s_off": statistics.median(off),
                                "tokens_per_s_on": statistics.median(on),
                                "speedup": ratio, "identical": identical,
                                "pairs": [b / a for a, b in zip(off, on, strict=True)]}
        rows += [(f"b{batch} decode tok/s off", statistics.median(off)),
                 (f"b{batch} decode tok/s on", statistics.median(on)),
                 (f"b{batch} speedup (median pair)", ratio), (f"b{batch} identical", identical)]
    drafter = engines[args.speculative_tokens].scheduler.drafter
    results["acceptance"] = drafter.num_accepted / drafter.num_proposed if drafter.num_proposed else 0.0
    results["drafts"] = drafter.num_drafts
    rows.append(("acceptance (accepted / proposed)", results["acceptance"]))
    mode = f"temperature {args.temperature}, seeded" if args.temperature else "greedy"
    mode += ", tool calls (grammar-forced + n-gram drafts)" if args.tool_calls else ""
    print_table(f"speculative decoding (n-gram drafts) vs plain decode ({mode})", rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
