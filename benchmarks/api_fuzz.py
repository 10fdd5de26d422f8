"""A schemathesis pass over the gateway's OpenAPI schema (the three API surfaces and the rest)
against a live `prefixgate serve`: does any input the schema describes, or any it forbids, get
a 5xx? (issue #37.3; target: none, and every 4xx in its surface's error envelope)

Workload (deterministic for a given --seed; defaults in brackets, --quick in braces):
  * the server: `prefixgate serve --kv-memory [1] GiB` on the default model, in its own
    process (benchmarks.server_process), plus --prefixgate-args.
  * the operations: every operation of the served /openapi.json (chat/completions,
    completions, Responses, Messages, count_tokens, tokenize, detokenize, GET / DELETE
    /v1/responses/{id}, models, health, metrics, cache stats) except the cache
    administration (pin, unpin, reset: they change what every later request sees).
  * the cases: --max-examples [200] {40} per operation and generation mode, drawn by
    schemathesis (hypothesis, seeded) from the schema, in --modes [positive,negative]:
    ``positive`` (what the schema admits) and ``negative`` (what it forbids: wrong types,
    numbers out of range, missing fields, ...).
  * kept cheap, by a ``map_body`` hook (:func:`bounded_body`): at most --max-new-tokens [2]
    output tokens (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens`` set when
    absent or larger), ``n`` <= 2 and <= 4 prompts (``n`` x prompts sequences), <= 4 tools
    (their random schemas are rendered into the prompt), and the served ``model`` (a random
    name is a 404 before anything else is read), so a case costs its input's validation and
    a short prefill, not decoding.

Reported, per operation and mode: cases, the statuses seen, ``5xx`` (server errors),
``bad_envelopes`` (a 4xx not in its surface's error format), ``stream_errors`` (an SSE stream
ending in an internal error), ``transport_errors`` (no answer), seconds, and the first failing
case as a curl command. Exit status 1 when any of those four counts is not 0.

    python -m benchmarks.api_fuzz --json out/api_fuzz.json
    python -m benchmarks.api_fuzz --quick
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import requests
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.errors import Unsatisfiable

from benchmarks.common import base_parser, write_json
from benchmarks.serving import prefixgate_process

GENERATES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
SKIPPED = ("/v1/cache/pin", "/v1/cache/unpin", "/v1/cache/reset")
ANTHROPIC_PATH = "/v1/messages"  # routes under it answer in Anthropic's envelope
MODES = ("positive", "negative")
OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_CHOICES = 2
MAX_PROMPTS = 4
MAX_TOOLS = 4  # each one's random schema is rendered into the prompt: ~70 took 26 s to prefill
QUICK = {"max_examples": 40}


@dataclass(frozen=True, slots=True)
class FuzzSettings:
    """One fuzz run's knobs (each a flag of :func:`main`)."""

    max_examples: int = 200  # per operation and mode
    seed: int = 0
    modes: tuple[str, ...] = MODES
    max_new_tokens: int = 2
    timeout_s: float = 120.0  # one request; past it the case is a transport error

    def __post_init__(self) -> None:
        if self.max_examples < 1:
            raise ValueError(f"max_examples must be >= 1, got {self.max_examples}")
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"modes must be some of {', '.join(MODES)}, got {self.modes}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(slots=True)
class OperationFigures:
    """What one operation answered to one generation mode's cases."""

    operation: str  # "POST /v1/messages"
    mode: str
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)  # status code (or "timeout") -> count
    server_errors: int = 0
    bad_envelopes: int = 0
    stream_errors: int = 0
    transport_errors: int = 0
    seconds: float = 0.0
    slowest_s: float = 0.0  # the slowest case's answer
    first_failure: str | None = None  # a curl command and the answer's head

    @property
    def failures(self) -> int:
        return self.server_errors + self.bad_envelopes + self.stream_errors + self.transport_errors


def bounded_body(path: str, body: Any, model: str | None, max_new_tokens: int) -> Any:
    """``body`` with generation kept short and the served model, for a generating ``path``.

    Only values that would cost decoding are changed: an output limit absent, null or over
    ``max_new_tokens`` (absent means "the rest of the context"; ``3080.0`` counts, as the
    server reads a whole float as an int), ``n`` / ``best_of`` over 2, prompts past 4, tools
    past 4 (a Responses namespace's functions too: each is prompt to prefill); wrong types and
    negative numbers stay, for the server to refuse."""
    if path not in GENERATES or not isinstance(body, dict):
        return body
    body = dict(body)
    limits = OUTPUT_LIMITS if path != "/v1/responses" else ("max_output_tokens",)
    for key in limits:
        value = body.get(key)
        if (key in body or key == limits[0]) and (value is None or _over(value, max_new_tokens)):
            body[key] = max_new_tokens
    for key in ("n", "best_of"):
        if _over(body.get(key), MAX_CHOICES):
            body[key] = MAX_CHOICES
    if isinstance(body.get("prompt"), list) and body["prompt"] and not all(
            type(item) is int for item in body["prompt"]):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]
    if isinstance(body.get("tools"), list):
        body["tools"] = [_few_tools(tool) for tool in body["tools"][:MAX_TOOLS]]
    if model is not None and isinstance(body.get("model"), str):
        body["model"] = model
    return body


def _few_tools(tool: Any) -> Any:
    if isinstance(tool, dict) and isinstance(tool.get("tools"), list):  # a namespace
        return {**tool, "tools": tool["tools"][:MAX_TOOLS]}
    return tool


def _over(value: Any, bound: int) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound


def envelope_ok(path: str, status: int, raw: bytes) -> bool:
    """A 4xx in its surface's error format: OpenAI's ``{"error": {"message", "type"}}``,
    Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under /v1/messages."""
    try:
        data = json.loads(raw)
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    if not (400 <= status < 500 and isinstance(error, dict) and error.get("message")):
        return False
    if path.startswith(ANTHROPIC_PATH):
        return data.get("type") == "error" and bool(error.get("type"))
    return bool(error.get("type"))


def stream_failed(content_type: str, text: str) -> bool:
    """An SSE stream that reported an internal error (its status was already 200)."""
    return "text/event-stream" in content_type and (
        '"internal_error"' in text or '"api_error"' in text)


def load_schema(base_url: str, model: str | None, max_new_tokens: int) -> Any:
    """The served OpenAPI schema as schemathesis reads it, with :func:`bounded_body` as its
    ``map_body`` hook (applied to every generated body, both modes)."""
    import schemathesis

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")

    @schema.hook
    def map_body(context: Any, body: Any) -> Any:
        return bounded_body(context.operation.path, body, model, max_new_tokens)

    return schema


def operations(schema: Any) -> list[Any]:
    """Every operation of ``schema`` but the cache administration, in the schema's order."""
    found = []
    for result in schema.get_all_operations():
        operation = result.ok()  # raises on an operation schemathesis cannot read: a finding
        if operation.path not in SKIPPED:
            found.append(operation)
    return found


def fuzz_operation(operation: Any, mode: str, base_url: str, session: requests.Session,
                   fuzz: FuzzSettings) -> OperationFigures:
    """Send ``fuzz.max_examples`` cases of ``mode`` to ``operation``; what came back."""
    from schemathesis import GenerationMode

    figures = OperationFigures(f"{operation.method.upper()} {operation.path}", mode)

    @seed(fuzz.seed)
    @settings(max_examples=fuzz.max_examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              verbosity=Verbosity.quiet)
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def send(case: Any) -> None:
        figures.cases += 1
        sent = time.perf_counter()
        try:
            response = case.call(base_url=base_url, session=session, timeout=fuzz.timeout_s)
        except requests.RequestException as exc:
            figures.statuses["no answer"] += 1
            figures.transport_errors += 1
            _first_failure(figures, case, f"{type(exc).__name__}: {exc}")
            return
        figures.slowest_s = max(figures.slowest_s, time.perf_counter() - sent)
        status = response.status_code
        figures.statuses[status] += 1
        answer = f"{status} {response.text[:400]}"
        if status >= 500:
            figures.server_errors += 1
            _first_failure(figures, case, answer)
        elif status >= 400 and not envelope_ok(operation.path, status, response.content):
            figures.bad_envelopes += 1
            _first_failure(figures, case, answer)
        elif stream_failed(" ".join(response.headers.get("content-type", ())), response.text):
            figures.stream_errors += 1
            _first_failure(figures, case, answer)

    started = time.perf_counter()
    try:
        send()
    except Unsatisfiable:
        # nothing of the operation's can be negated (GET /health takes no input): no case
        if mode != "negative" or figures.cases:
            raise
    figures.seconds = time.perf_counter() - started
    return figures


def _first_failure(figures: OperationFigures, case: Any, answer: str) -> None:
    if figures.first_failure is None:
        figures.first_failure = f"{case.as_curl_command()[:1500]}\n-> {answer}"


def fuzz(base_url: str, model: str | None, fuzz_settings: FuzzSettings,
         paths: tuple[str, ...] | None = None) -> list[OperationFigures]:
    """The whole pass: every operation (or those of ``paths``) in every mode, in order."""
    schema = load_schema(base_url, model, fuzz_settings.max_new_tokens)
    chosen = [op for op in operations(schema) if paths is None or op.path in paths]
    with requests.Session() as session:
        return [fuzz_operation(op, mode, base_url, session, fuzz_settings)
                for op in chosen for mode in fuzz_settings.modes]


def totals(figures: list[OperationFigures]) -> dict[str, Any]:
    return {"cases": sum(f.cases for f in figures),
            "server_errors": sum(f.server_errors for f in figures),
            "bad_envelopes": sum(f.bad_envelopes for f in figures),
            "stream_errors": sum(f.stream_errors for f in figures),
            "transport_errors": sum(f.transport_errors for f in figures),
            "seconds": sum(f.seconds for f in figures)}


def print_report(figures: list[OperationFigures]) -> None:
    rows = [("operation", "mode", "cases", "statuses seen", "5xx", "other", "seconds",
             "slowest case s")]
    for f in figures:
        seen = " ".join(f"{status}:{count}" for status, count in sorted(
            f.statuses.items(), key=lambda item: str(item[0])))
        rows.append((f.operation, f.mode, str(f.cases), seen, str(f.server_errors),
                     str(f.bad_envelopes + f.stream_errors + f.transport_errors),
                     f"{f.seconds:.1f}", f"{f.slowest_s:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("\nschemathesis over /openapi.json (benchmarks.api_fuzz)\n" + "-" * (sum(widths) + 12))
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    total = totals(figures)
    print(f"total        {total['cases']} cases in {total['seconds']:.1f} s: "
          f"5xx {total['server_errors']}, bad envelopes {total['bad_envelopes']}, "
          f"stream errors {total['stream_errors']}, transport errors {total['transport_errors']}")
    for f in figures:
        if f.first_failure:
            print(f"\nfirst failure of {f.operation} ({f.mode}):\n{f.first_failure}")


def as_json(figures: list[OperationFigures]) -> list[dict[str, Any]]:
    return [{**asdict(f), "statuses": {str(k): v for k, v in f.statuses.items()}} for f in figures]


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    defaults = FuzzSettings()
    parser.add_argument("--max-examples", type=int, default=defaults.max_examples,
                        help="cases per operation and mode")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--modes", default=",".join(defaults.modes),
                        help="comma-separated: positive, negative")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--kv-memory", type=float, default=1.0, metavar="GB")
    parser.add_argument("--prefixgate-args", default="", help="extra `prefixgate serve` flags")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['max_examples']} cases per operation and mode")
    args = parser.parse_args(argv)
    max_examples = args.max_examples
    if args.quick and max_examples == defaults.max_examples:
        max_examples = QUICK["max_examples"]
    try:
        fuzz_settings = FuzzSettings(max_examples=max_examples, seed=args.seed,
                                     modes=tuple(m.strip() for m in args.modes.split(",")),
                                     max_new_tokens=args.max_new_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    server = prefixgate_process(args.kv_memory, args.prefixgate_args)
    command = server.command
    try:
        startup_s, ids = server.wait_ready(600)
        print(f"[prefixgate] ready in {startup_s:.1f} s; fuzzing ({fuzz_settings.max_examples} "
              f"cases per operation and mode) ...", flush=True)
        figures = fuzz(server.base_url, ids[0] if ids else None, fuzz_settings)
    finally:
        server.stop()
    print_report(figures)
    write_json(args.json, {"operations": as_json(figures), "totals": totals(figures),
                           "settings": asdict(fuzz_settings), "command": " ".join(command),
                           "startup_s": startup_s})
    return 1 if any(f.failures for f in figures) else 0


if __name__ == "__main__":
    sys.exit(main())
