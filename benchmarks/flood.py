"""A flood of maximal request bodies against a live `prefixgate serve`: does /health and a small
chat still answer quickly, does every flood request get a 4xx in its surface's envelope (never
a 5xx), and does the server's memory stay bounded? (issue #27.1; target: /health and a small
chat p99 <= 0.5 s under the flood). Issue #37.1 adds the hostile-schema mix.

Workload (deterministic; defaults in brackets, --quick in braces):
  * the server: `prefixgate serve --kv-memory [1] GiB` on the default model, in its own
    process (benchmarks.server_process), plus --prefixgate-args.
  * the flood: --flood-processes [2] {1} client processes with --senders [3] {3} connections
    each (client processes apart from the probes, so the client's own GIL does not show as
    server latency), sending bodies back to back for --duration [60] {20} s, every sender
    rotating over the kinds:
      - ``chat``, ``responses``, ``messages``: a MAXIMAL body of each surface within the
        server's limits: as many messages of ``MAX_TEXT_CHARS`` (1 Mi) characters as fit
        --body-bytes [32 MiB, the default --max-body-size], or just under a one-prompt
        route's own cap when the server names one in a 413 (what a prompt that fits the
        context can take, JSON-escaped: ~8.2 MB on the default model), the largest body the
        server still reads and parses. It cannot fit the context: the answer must be a 400
        before tokenizing.
      - ``chat_tokenized``: a chat body just under the server's byte bound (context x the
        longest token's bytes, read from the first flood answer's message), so it IS
        tokenized (~the context in tokens, or more) before it is refused.
    and with --mix schemas or all [all], the hostile-schema mix (#37.1):
      - ``schema_tools``: the issue's tool schema, ``{"properties": {"a": {"$ref": "#"}},
        "required": ["a"]}`` with tool_choice required (once grew the server to 23 GB);
      - ``schema_messages`` / ``schema_responses``: the same as an Anthropic ``input_schema``
        and as a Responses ``text.format``;
      - ``schema_slow``: an EBNF response_format of 500 nested starred groups, whose compile
        runs to --grammar-compile-timeout in its worker;
      - ``schema_enum``: an enum of 5,000 values (over the enum cap);
      - ``schema_fresh``: a valid, never-seen schema every time (the compile cache flood),
        answered (200, max_tokens 4) or, while every compile worker is busy, 429.
  * the probes, in this process: /health polled back to back on one connection, and small
    chats ("Say hi.", max_tokens 4) back to back on another, from the moment the flood starts
    to its end.
  * memory: the server's VmRSS sampled every 0.2 s (peak), its VmHWM, before (idle, after a
    warm-up), and after (the flood over, 2 s later).

Reported: /health and small-chat latency p50/p99/max and counts, under the flood and in
--baseline [10] {5} s of the same probes without it, first (the loaded machine's floor); the flood's requests per
kind and the status codes they got; ``server_errors`` (5xx), ``bad_envelopes`` (a 4xx not in
its surface's error format) and ``transport_errors`` (must all be 0); RSS before/peak/after.
The comparison is against the target (0.5 s p99), printed as ``target_met``.

    python -m benchmarks.flood --json out/flood.json
    python -m benchmarks.flood --quick
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from typing import Any

import httpx

from benchmarks.common import base_parser, write_json
from benchmarks.server_process import memory_mb
from benchmarks.serving import prefixgate_process
from prefixgate.agents.report import percentile
from prefixgate.gateway.http.limits import MIB
from prefixgate.gateway.server.fields import MAX_TEXT_CHARS

TARGET_P99_S = 0.5  # issue #27.1
BODY_KINDS = ("chat", "responses", "messages", "chat_tokenized")
SCHEMA_KINDS = ("schema_tools", "schema_messages", "schema_responses", "schema_slow",
                "schema_enum", "schema_fresh")
KINDS = BODY_KINDS + SCHEMA_KINDS
MIXES = {"bodies": BODY_KINDS, "schemas": SCHEMA_KINDS, "all": KINDS}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
         "messages": "/v1/messages", "chat_tokenized": "/v1/chat/completions",
         "schema_tools": "/v1/chat/completions", "schema_messages": "/v1/messages",
         "schema_responses": "/v1/responses", "schema_slow": "/v1/chat/completions",
         "schema_enum": "/v1/chat/completions", "schema_fresh": "/v1/chat/completions"}
RECURSIVE_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
SLOW_EBNF = "root ::= " + "(" * 500 + '"a"' + ' | "b")*' * 500
SMALL_CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
              "temperature": 0}
# the server's 400 for a text that cannot fit names the byte bound (PromptTooLongError)
BYTE_BOUND_RE = re.compile(r"spell at most (\d+) bytes")
# a one-prompt route's 413 names its cap (gateway/http/slow_clients.py prompt_body_caps)
ROUTE_CAP_RE = re.compile(r"limit of (\d+) bytes of this route")
MEMORY_SAMPLE_S = 0.2


@dataclass(frozen=True, slots=True)
class FloodWorkload:
    duration_s: float = 60.0
    baseline_s: float = 10.0  # the probes alone first, for the unflooded latencies
    flood_processes: int = 2
    senders: int = 3
    body_bytes: int = 32 * MIB
    message_chars: int = MAX_TEXT_CHARS
    mix: str = "all"  # a key of MIXES

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.baseline_s < 0 or self.flood_processes < 1 or self.senders < 1:
            raise ValueError("duration_s > 0, flood_processes >= 1 and senders >= 1")
        if not 1 <= self.message_chars <= self.body_bytes - 4096:
            raise ValueError("message_chars must be in [1, body_bytes - 4096]")
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {', '.join(MIXES)}")

    @property
    def num_messages(self) -> int:
        """Messages of ``message_chars`` ASCII characters that fit the body with its JSON."""
        per_message = self.message_chars + 64  # {"role": "user", "content": "..."}, and room
        return max(1, (self.body_bytes - 1024) // per_message)


QUICK = {"duration_s": 20.0, "baseline_s": 5.0, "flood_processes": 1}


def flood_body(kind: str, model: str | None, messages: int, chars: int) -> bytes:
    """One request body of ``kind``: ``messages`` user messages of ``chars`` characters."""
    # NOTE: distinct words, not one repeated character: a realistic text for the tokenizer
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    turns = [{"role": "user", "content": text}] * messages
    if kind == "responses":
        body: dict[str, Any] = {"input": [{"type": "message", **t} for t in turns],
                                "max_output_tokens": 16, "store": False}
    elif kind == "messages":
        body = {"messages": turns, "max_tokens": 16}
    else:
        body = {"messages": turns, "max_tokens": 16}
    if model is not None:
        body["model"] = model
    return json.dumps(body).encode()


def schema_body(kind: str, model: str | None, turn: int) -> bytes:
    """One body of the hostile-schema mix (``turn`` makes ``schema_fresh`` distinct)."""
    ask = [{"role": "user", "content": "Call the tool."}]
    body: dict[str, Any]
    if kind == "schema_tools":
        body = {"messages": ask, "max_tokens": 16, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": RECURSIVE_SCHEMA}}]}
    elif kind == "schema_messages":
        body = {"messages": ask, "max_tokens": 16, "tool_choice": {"type": "any"},
                "tools": [{"name": "f", "input_schema": RECURSIVE_SCHEMA}]}
    elif kind == "schema_responses":
        body = {"input": "Answer.", "max_output_tokens": 16, "store": False, "text": {
            "format": {"type": "json_schema", "name": "r", "schema": RECURSIVE_SCHEMA}}}
    elif kind == "schema_slow":
        body = {"messages": ask, "max_tokens": 4,
                "response_format": {"type": "grammar", "grammar": SLOW_EBNF}}
    elif kind == "schema_enum":
        body = {"messages": ask, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "e", "schema": {
                "enum": [f"value-{i}" for i in range(5000)]}}}}
    else:
        field = f"field_{os.getpid()}_{turn}"
        body = {"messages": ask, "max_tokens": 4, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "fresh", "schema": {
                "type": "object", "properties": {field: {"type": "integer"}},
                "required": [field]}}}}
    if model is not None:
        body["model"] = model
    return json.dumps(body).encode()


def envelope_ok(kind: str, status: int, raw: bytes) -> bool:
    """A 4xx in its surface's error format: OpenAI's ``{"error": {"message", "type"}}``,
    Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""
    try:
        data = json.loads(raw)
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    if not (400 <= status < 500 and isinstance(error, dict) and error.get("message")):
        return False
    if kind == "messages":
        return data.get("type") == "error" and bool(error.get("type"))
    return bool(error.get("type") or error.get("code"))


def _send_until(base_url: str, bodies: dict[str, bytes | None], deadline: float,
                offset: int, model: str | None = None) -> list[dict[str, Any]]:
    """One sender: the kinds in turn, back to back, until ``deadline`` (time.time()). A kind
    whose body is None is built for each send (``schema_body``)."""
    outcomes = []
    kinds = list(bodies)
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(300)) as client:
        turn = offset
        while turn == offset or time.time() < deadline:  # at least one, however late it starts
            kind = kinds[turn % len(kinds)]
            turn += 1
            started = time.perf_counter()
            try:
                content = bodies[kind] or schema_body(kind, model, turn)
                response = client.post(PATHS[kind], content=content, headers=headers)
                # a fresh valid schema may be answered: only errors have an envelope to check
                ok = (kind == "schema_fresh" and response.status_code == 200) or envelope_ok(
                    kind, response.status_code, response.content)
                outcomes.append({"kind": kind, "status": response.status_code,
                                 "envelope_ok": ok,
                                 "seconds": time.perf_counter() - started,
                                 "message": response.text[:300]})
            except httpx.HTTPError as exc:
                outcomes.append({"kind": kind, "status": None, "envelope_ok": False,
                                 "seconds": time.perf_counter() - started,
                                 "message": f"{type(exc).__name__}: {exc}"[:300]})
    return outcomes


def flood_worker(base_url: str, model: str | None, workload: dict[str, Any],
                 byte_bound: int | None, start_at: float, index: int) -> list[dict[str, Any]]:
    """One flood process: ``senders`` threads sending from ``start_at`` (time.time()) for
    ``duration_s``; their outcomes."""
    load = FloodWorkload(**workload)
    kinds = MIXES[load.mix]
    bodies: dict[str, bytes | None] = {
        kind: flood_body(kind, model, load.num_messages, load.message_chars)
        for kind in BODY_KINDS[:3] if kind in kinds}
    if byte_bound is not None and "chat_tokenized" in kinds:  # tokenized, then refused
        bodies["chat_tokenized"] = flood_body("chat_tokenized", model, 1, max(1, byte_bound - 512))
    bodies.update({kind: None for kind in kinds if kind in SCHEMA_KINDS})
    results: list[list[dict[str, Any]]] = [[] for _ in range(load.senders)]
    time.sleep(max(0.0, start_at - time.time()))
    deadline = start_at + load.duration_s

    def run(slot: int) -> None:
        results[slot] = _send_until(base_url, bodies, deadline, index * load.senders + slot,
                                    model)

    threads = [threading.Thread(target=run, args=(slot,)) for slot in range(load.senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [outcome for sender in results for outcome in sender]


class Probes:
    """/health back to back, small chats back to back, and the server's memory, in threads
    until ``stop()``."""

    def __init__(self, base_url: str, model: str | None, pid: int | None) -> None:
        self.base_url, self.pid = base_url, pid
        self.small = {**SMALL_CHAT, **({"model": model} if model else {})}
        self.health: list[float] = []
        self.chat: list[float] = []
        self.errors: list[str] = []
        self.rss_peak_mb = 0.0
        self.tree_peak_mb = 0.0  # the server with its children (grammar-compile workers)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f) for f in (self._poll, self._chat, self._memory)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def _timed(self, client: httpx.Client, out: list[float], method: str, path: str,
               **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            response = client.request(method, path, **kwargs)
            if response.status_code != 200:
                self.errors.append(f"{path}: HTTP {response.status_code}: {response.text[:200]}")
        except httpx.HTTPError as exc:
            self.errors.append(f"{path}: {type(exc).__name__}: {exc}")
        out.append(time.perf_counter() - started)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=120) as client:
            while not self._stop.is_set():
                self._timed(client, self.health, "GET", "/health")

    def _chat(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=120) as client:
            while not self._stop.is_set():
                self._timed(client, self.chat, "POST", "/v1/chat/completions", json=self.small)

    def _memory(self) -> None:
        while self.pid is not None and not self._stop.wait(MEMORY_SAMPLE_S):
            memory = memory_mb(self.pid)
            self.rss_peak_mb = max(self.rss_peak_mb, memory["rss_mb"] or 0.0)
            self.tree_peak_mb = max(self.tree_peak_mb, memory["rss_tree_mb"] or 0.0)


def latency_figures(samples: list[float]) -> dict[str, Any]:
    return {"count": len(samples), "p50_s": percentile(samples, 50),
            "p99_s": percentile(samples, 99), "max_s": max(samples, default=None)}


def flood_figures(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per kind and status; 5xx, envelopes that are not the surface's, transport errors."""
    by_kind: dict[str, Counter[str]] = {}
    for outcome in outcomes:
        by_kind.setdefault(outcome["kind"], Counter())[str(outcome["status"])] += 1
    server_errors = [o for o in outcomes if o["status"] is not None and o["status"] >= 500]
    bad = [o for o in outcomes if o["status"] is not None and o["status"] < 500
           and not o["envelope_ok"]]
    transport = [o for o in outcomes if o["status"] is None]
    problems = server_errors + bad + transport
    return {"requests": len(outcomes),
            "statuses_by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
            "server_errors": len(server_errors), "bad_envelopes": len(bad),
            "transport_errors": len(transport),
            "seconds_p50_by_kind": {kind: percentile([o["seconds"] for o in outcomes
                                                       if o["kind"] == kind], 50)
                                    for kind in sorted(by_kind)},
            "first_problem": ({k: problems[0][k] for k in ("kind", "status", "message")}
                              if problems else None)}


def calibrate(base_url: str, model: str | None, workload: FloodWorkload
              ) -> tuple[FloodWorkload, int | None, str]:
    """The maximal body the server reads, and its byte bound. A one-prompt route may cap its
    bodies below --max-body-size by what the context can hold (its 413 names the cap): the
    flood's bodies then shrink to just under it, the largest the server still parses. The byte
    bound (None if not named) comes from the 400 to one such body."""
    statuses = []
    for _ in range(2):
        body = flood_body("chat", model, workload.num_messages, workload.message_chars)
        response = httpx.post(base_url + PATHS["chat"], content=body, timeout=300,
                              headers={"Content-Type": "application/json"})
        statuses.append(f"HTTP {response.status_code}")
        capped = ROUTE_CAP_RE.search(response.text) if response.status_code == 413 else None
        if capped is None:
            break
        workload = replace(workload, body_bytes=int(capped.group(1)),
                           message_chars=min(workload.message_chars, int(capped.group(1)) - 4096))
    found = BYTE_BOUND_RE.search(response.text)
    return workload, (int(found.group(1)) if found else None), ", ".join(statuses)


def run_flood(base_url: str, model: str | None, workload: FloodWorkload,
              pid: int | None, ready_s: float = 5.0, settle_s: float = 2.0) -> dict[str, Any]:
    """Warm up, measure idle memory, flood for ``duration_s`` with the probes on; figures.
    The flood processes get ``ready_s`` to start and build their bodies: the probes and the
    flood then start together."""
    httpx.post(base_url + PATHS["chat"], json={**SMALL_CHAT, **({"model": model} if model else {})},
               timeout=300)
    before = memory_mb(pid) if pid is not None else {}
    workload, byte_bound, calibration = calibrate(base_url, model, workload)
    loadavg = os.getloadavg()[0]
    baseline = Probes(base_url, model, pid)  # the same probes, no flood: the machine's floor
    baseline.start()
    time.sleep(workload.baseline_s)
    baseline.stop()
    probes = Probes(base_url, model, pid)
    start_at = time.time() + ready_s
    context = get_context("spawn")  # a fresh interpreter: nothing of this process's threads
    with ProcessPoolExecutor(workload.flood_processes, mp_context=context) as pool:
        futures = [pool.submit(flood_worker, base_url, model, asdict(workload), byte_bound,
                               start_at, index) for index in range(workload.flood_processes)]
        time.sleep(max(0.0, start_at - time.time()))
        probes.start()
        outcomes = [outcome for future in futures for outcome in future.result()]
    probes.stop()
    time.sleep(settle_s)  # let the server free what the flood held
    after = memory_mb(pid) if pid is not None else {}
    return {"health": latency_figures(probes.health), "small_chat": latency_figures(probes.chat),
            "baseline": {"health": latency_figures(baseline.health),
                         "small_chat": latency_figures(baseline.chat)},
            "probe_errors": len(probes.errors) + len(baseline.errors),
            "first_probe_error": probes.errors[0] if probes.errors else None,
            "flood": flood_figures(outcomes), "byte_bound": byte_bound, "calibration": calibration,
            "body_bytes": workload.body_bytes,
            "rss_mb": {"before": before.get("rss_mb"), "peak": probes.rss_peak_mb or None,
                       "after": after.get("rss_mb"), "high_water": after.get("rss_hwm_mb"),
                       "with_workers_peak": probes.tree_peak_mb or None},
            "loadavg_1min_start": loadavg, "loadavg_1min_end": os.getloadavg()[0]}


def target_met(figures: dict[str, Any]) -> bool:
    p99s = [figures["health"]["p99_s"], figures["small_chat"]["p99_s"]]
    return all(p is not None and p <= TARGET_P99_S for p in p99s)


def failed(figures: dict[str, Any]) -> bool:
    """Anything the flood must never cause: a 5xx, a foreign envelope, a dropped connection,
    a probe that failed."""
    flood = figures["flood"]
    return bool(flood["server_errors"] or flood["bad_envelopes"] or flood["transport_errors"]
                or figures["probe_errors"] or figures.get("restarts"))


def print_report(figures: dict[str, Any]) -> None:
    def s(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    print("\nflood of maximal bodies (benchmarks.flood)\n" + "-" * 72)
    for name in ("health", "small_chat"):
        for label, f in ((name, figures[name]), ("  no flood", figures["baseline"][name])):
            print(f"{label:<12} n={f['count']:<6} p50 {s(f['p50_s'])} s  p99 {s(f['p99_s'])} s  "
                  f"max {s(f['max_s'])} s")
    flood = figures["flood"]
    print(f"flood        {flood['requests']} requests: {flood['statuses_by_kind']}")
    print(f"             median answer (s): {flood['seconds_p50_by_kind']}")
    print(f"             5xx {flood['server_errors']}, bad envelopes {flood['bad_envelopes']}, "
          f"transport errors {flood['transport_errors']}, probe errors {figures['probe_errors']}")
    rss = figures["rss_mb"]
    print(f"server RSS   before {s(rss['before'])} MB, peak {s(rss['peak'])} MB, after "
          f"{s(rss['after'])} MB, high-water {s(rss['high_water'])} MB; with its "
          f"grammar workers, peak {s(rss.get('with_workers_peak'))} MB")
    print(f"load avg     {figures['loadavg_1min_start']:.2f} -> {figures['loadavg_1min_end']:.2f}; "
          f"target p99 <= {TARGET_P99_S} s met: {figures['target_met']}")


def workload_from_args(args: Any) -> FloodWorkload:
    values = {"duration_s": args.duration, "baseline_s": args.baseline, "flood_processes": args.flood_processes,
              "senders": args.senders, "body_bytes": args.body_bytes, "mix": args.mix}
    if args.quick:
        defaults = asdict(FloodWorkload())
        values.update({k: v for k, v in QUICK.items() if values[k] == defaults[k]})
    return FloodWorkload(**values)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    defaults = FloodWorkload()
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="seconds")
    parser.add_argument("--baseline", type=float, default=defaults.baseline_s,
                        help="seconds of probes without the flood, first")
    parser.add_argument("--flood-processes", type=int, default=defaults.flood_processes)
    parser.add_argument("--senders", type=int, default=defaults.senders, help="per process")
    parser.add_argument("--body-bytes", type=int, default=defaults.body_bytes)
    parser.add_argument("--mix", choices=sorted(MIXES), default=defaults.mix,
                        help="maximal bodies, hostile schemas, or both in turn")
    parser.add_argument("--kv-memory", type=float, default=1.0, metavar="GB")
    parser.add_argument("--prefixgate-args", default="", help="extra `prefixgate serve` flags")
    parser.add_argument("--quick", action="store_true", help="a shorter run (20 s, 1 process)")
    args = parser.parse_args(argv)
    try:
        workload = workload_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    server = prefixgate_process(args.kv_memory, args.prefixgate_args)
    command = server.command
    try:
        startup_s, ids = server.wait_ready(600)
        print(f"[prefixgate] ready in {startup_s:.1f} s; flooding for {workload.duration_s:g} s "
              f"with {workload.flood_processes * workload.senders} senders ...", flush=True)
        figures = run_flood(server.base_url, ids[0] if ids else None, workload, server.pid)
        # the same process answered to the end: nothing killed or restarted it
        figures["restarts"] = int(server.process.poll() is not None)
    finally:
        server.stop()
    figures.update(workload={**asdict(workload), "num_messages": workload.num_messages},
                   command=" ".join(command), startup_s=startup_s)
    figures["target_met"] = target_met(figures)
    print_report(figures)
    write_json(args.json, figures)
    return 1 if failed(figures) else 0


if __name__ == "__main__":
    sys.exit(main())
