"""Step overheads: the Python time of one engine step at batch 16 decode against its forward.

Workload (defaults; every size is a flag): the default model (SmolLM2-135M-Instruct GGUF, CPU),
``--batch`` 16 concurrent requests, each a ``--prompt-tokens`` 512-token prompt (an agent
swarm's: a ``--shared-tokens`` 448-token system prefix all of them share, then a task of its
own), decoding ``--max-tokens`` 64 tokens with ``ignore_eos`` and two stop strings that never
match (so the stop-string path runs on every token and every request decodes every token).
The prompts are prefilled once beforehand (cached), so a timed run is all decode steps; only
the steady ones are counted: every row of the batch decoding (not its first step, which
computes the last prompt token and admits the requests).

Runs, in one process on one engine (prompts cached once):
  * ``greedy_lean``: greedy, only the step and the model forward timed (two wrappers): the
    headline ``overhead_pct`` = (step - forward) / step, per step, median.
  * ``greedy``, ``sampled`` (temperature ``--temperature`` 0.8, unseeded): every phase of the
    step timed (exclusive times, so a step's phases sum to it; ``other`` is the rest of
    ``LLMEngine.step`` itself): schedule (the scheduler's chunks are the runner's records
    too), inputs (the runner's tensors), attention_plan (the kernel backend's per-step metadata), forward (the model
    call, attention included), commit, sample,
    output (``_on_token``'s own logic), append (token into the sequence), detokenize,
    stop_strings, emit (deltas, finishing), sink (the consumer's callback).
  * ``async``: greedy through the async engine (engine.py) with ``--batch`` concurrent
    ``generate()`` consumers on an event loop: the same phases plus the stream fan-out to the
    consumers (``sink``: handing a delta to the loop inside the step; ``between_steps_ms``:
    what the engine thread charges between two steps, the per-step hand-over ``fanout``);
    ``period_ms`` = start to start of consecutive steps on the engine thread (the engine loop
    and the fan-out between steps included), ``loop_cpu_ms_per_step`` = CPU time the event-loop
    thread spent per step (it competes with the engine thread for the cores and the GIL).
  * ``speculative``: a second engine with ``--speculative-tokens`` 4 at
    ``--speculative-batch`` 4 (within the scheduler's ``speculative_max_rows`` cap of 8 decode
    rows, so drafts run; at batch 16 the cap turns them off): the same phases plus drafts
    (verification and emitting accepted drafts).

Reported per run: per-step medians of step, forward and every phase (ms), overhead (ms and % of
the step; and the engine thread's CPU time outside the forward, which a loaded machine's waits
for a core do not inflate, though torch's worker threads are not in it), the phases' means (they sum to the mean step), decode tokens/s, and whether the
greedy outputs of greedy_lean / greedy / async (and their digest, to compare across code
versions) are token-identical. The load average before and after (shared machine: noisy).
The wrappers cost ~1 us a call: compare ``greedy`` with ``greedy_lean`` for their total.

    python -m benchmarks.step_overhead --json out/step_overhead.json
    py-spy record --native -o out/step.svg -- .venv/bin/python -m benchmarks.step_overhead
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.common import base_parser, print_table, write_json
from prefixgate.engine import async_engine as async_engine_module
from prefixgate.engine import step_sampling
from prefixgate.engine.api import Delta, EngineError, GenerationRequest, SamplingParams
from prefixgate.engine.async_engine import AsyncEngine
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.engine_core import LLMEngine
from prefixgate.engine.loader import LoadedModel, load_model
from prefixgate.engine.stop_strings import StopStringMatcher

NEVER_MATCHING_STOPS = ("<END_OF_ANSWER>", "[[stop here]]")
WORDS = ["agent", "tool", "cache", "page", "prefix", "token", "retry", "request", "schema", "build", "test", "deploy", "log", "metric", "queue", "worker", "session", "result", "error", "timeout", "search", "file", "patch", "review", "merge", "branch", "commit", "plan", "step", "budget", "memory", "report", "status", "owner", "task", "input", "output", "value"]
# in the order they happen in a step; "other" is what LLMEngine.step spends itself
PHASES = ("schedule", "inputs", "attention_plan", "forward", "commit", "sample",
          "drafts", "output", "append", "detokenize", "stop_strings", "logprobs", "emit", "sink",
          "fanout", "other")


@dataclass(frozen=True, slots=True)
class Settings:
    batch: int = 16
    prompt_tokens: int = 512
    shared_tokens: int = 448
    max_tokens: int = 64
    temperature: float = 0.8
    repeats: int = 1
    speculative_tokens: int = 4
    speculative_batch: int = 4
    seed: int = 0


# ---------------------------------------------------------------------------- the workload


def build_prompts(tokenizer: Any, settings: Settings) -> list[tuple[int, ...]]:
    """``batch`` prompts of exactly ``prompt_tokens`` ids: a shared prefix, then a task each."""
    rng = random.Random(settings.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def ids(text: str, count: int) -> list[int]:
        out = tokenizer.encode(text)
        while len(out) < count:  # a prose prompt long enough for any count
            out += tokenizer.encode(" " + words(count))
        return out[:count]

    shared = min(settings.shared_tokens, settings.prompt_tokens - 1)
    prefix = ids("You are a careful software agent in a swarm. Context: " + words(shared), shared)
    tail = settings.prompt_tokens - shared
    return [tuple(prefix + ids(f" Task {i}: " + words(tail), tail)) for i in range(settings.batch)]


def make_requests(prompts: list[tuple[int, ...]], settings: Settings, tag: str,
                  temperature: float = 0.0) -> list[GenerationRequest]:
    sampling = SamplingParams(max_tokens=settings.max_tokens, temperature=temperature,
                              ignore_eos=True, stop=NEVER_MATCHING_STOPS)
    return [GenerationRequest(p, sampling, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]


def _collector(out: dict[str, list], request_id: str) -> Callable[[Delta | EngineError], None]:
    def sink(item: Delta | EngineError) -> None:
        if isinstance(item, EngineError):
            raise item
        out[request_id].append((item.token_ids, item.text))
    return sink


def prefill(engine: LLMEngine, prompts: list[tuple[int, ...]], tag: str) -> None:
    """Compute (and cache) every prompt once: the timed runs then only decode."""
    requests = [GenerationRequest(p, SamplingParams(max_tokens=1, temperature=0),
                                  request_id=f"{tag}-warm-{i}") for i, p in enumerate(prompts)]
    out: dict[str, list] = defaultdict(list)
    for request in requests:
        engine.add_request(request, _collector(out, request.request_id))
    while engine.has_work():
        engine.step()


def digest(outputs: dict[str, list]) -> str:
    """One hash of every request's token ids and text, in request order (tag stripped)."""
    h = hashlib.sha256()
    for key in sorted(outputs, key=lambda k: int(k.rsplit("-", 1)[1])):
        for token_ids, text in outputs[key]:
            h.update(repr((token_ids, text)).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- instrumentation


class StepProbe:
    """Exclusive per-phase times of each steady decode step of one LLMEngine.

    Phase functions are wrapped from outside (instance attributes, or class attributes for
    per-sequence objects) while the probe is entered, and restored on exit. A wrapper charges
    its elapsed time minus that of the wrapped calls inside it, so the phases of a step add up
    to the step. ``lean``: only the step and the forward.
    """

    def __init__(self, engine: LLMEngine, batch: int, *, lean: bool = False) -> None:
        self.engine = engine
        self.batch = batch
        self.lean = lean
        self.steps: list[dict[str, float]] = []  # per steady step: phase -> seconds, + "step"
        self.starts: list[float] = []  # perf_counter at each steady step's start
        self.num_steps = 0  # every non-empty step
        self.step_tokens: list[int] = []
        self._current: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []
        self._undo: list[Callable[[], None]] = []
        self._last_steady = False

    # a wrapper for ``fn`` charging ``phase``
    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        stack, current = self._stack, self._current

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(0.0)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - began
                inner = stack.pop()
                current[phase] += elapsed - inner
                if stack:
                    stack[-1] += elapsed

        return timed

    def patch(self, owner: Any, name: str, phase: str) -> None:
        """Wrap ``owner.name`` (an instance's or a class's attribute) until exit."""
        if isinstance(owner, type):
            original = owner.__dict__[name]
            function = original.__func__ if isinstance(original, staticmethod) else original
            wrapped = self.wrap(function, phase)
            setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
            self._undo.append(lambda: setattr(owner, name, original))
            return
        had = name in getattr(owner, "__dict__", {})
        original = getattr(owner, name)
        setattr(owner, name, self.wrap(original, phase))
        self._undo.append(lambda: setattr(owner, name, original) if had else delattr(owner, name))

    def __enter__(self) -> StepProbe:
        engine = self.engine
        runner = engine.runner
        self.patch(runner.model, "forward", "forward")
        timed_forward, current = runner.model.forward, self._current

        def forward(*args: Any, **kwargs: Any) -> Any:  # its engine-thread CPU time too
            began = time.thread_time()
            try:
                return timed_forward(*args, **kwargs)
            finally:
                current["cpu:forward"] += time.thread_time() - began

        runner.model.forward = forward
        if not self.lean:
            scheduler = engine.scheduler
            self.patch(scheduler, "schedule", "schedule")
            self.patch(runner, "_build_batch", "inputs")
            self.patch(runner.attention, "prepare_metadata", "attention_plan")
            self.patch(scheduler, "commit", "commit")
            self.patch(step_sampling, "_sample", "sample")
            self.patch(engine.sampler, "verify_drafts", "drafts")
            output = engine.output  # the output processor: tokens into deltas
            self.patch(output, "_on_drafts", "drafts")
            self.patch(output, "_on_token", "output")
            self.patch(scheduler, "append_token", "append")
            decoder_class = type(engine.tokenizer.incremental_decoder())
            for name in ("feed", "flush"):
                self.patch(decoder_class, name, "detokenize")
                self.patch(StopStringMatcher, name, "stop_strings")
            self.patch(output, "_logprob", "logprobs")
            self.patch(output, "emit", "emit")
            if hasattr(async_engine_module, "_deliver"):  # the async engine's call_soon_threadsafe
                self.patch(async_engine_module, "_deliver", "sink")
        step = engine.step

        def probed_step() -> Any:
            if self._current:  # charged since the last step: the engine loop between steps
                if self._last_steady:
                    self.steps[-1].update({f"between:{k}": v for k, v in self._current.items()})
                self._current.clear()
            began, began_cpu = time.perf_counter(), time.thread_time()
            out = step()
            elapsed, cpu = time.perf_counter() - began, time.thread_time() - began_cpu
            if out.chunks:
                self.num_steps += 1
            self._last_steady = len(out.chunks) == self.batch and all(
                c.start_pos >= c.seq.num_prompt_tokens for c in out.chunks)
            if self._last_steady:
                phases = dict(self._current)
                forward_cpu = phases.pop("cpu:forward", 0.0)
                if not self.lean:
                    phases["other"] = elapsed - sum(phases.values())
                phases["step"] = elapsed
                phases["cpu:overhead"] = cpu - forward_cpu
                self.steps.append(phases)
                self.starts.append(began)
                self.step_tokens.append(out.num_tokens)
            self._current.clear()
            return out

        engine.step = probed_step  # type: ignore[method-assign]
        self._undo.append(lambda: delattr(engine, "step"))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def summary(self) -> dict[str, Any]:
        """Medians (and means) in ms over the steady steps."""
        steps = self.steps
        if not steps:
            return {"steps": 0}

        def med(key: str) -> float:
            return statistics.median(s.get(key, 0.0) for s in steps) * 1e3

        def mean(key: str) -> float:
            return statistics.fmean(s.get(key, 0.0) for s in steps) * 1e3

        phases = [p for p in PHASES if any(p in s for s in steps)]
        overhead = [(s["step"] - s.get("forward", 0.0)) for s in steps]
        result: dict[str, Any] = {
            "steps": len(steps),
            "step_ms": med("step"),
            "forward_ms": med("forward"),
            "overhead_ms": statistics.median(overhead) * 1e3,
            "overhead_pct": statistics.median(
                100 * o / s["step"] for o, s in zip(overhead, steps, strict=True)),
            # the engine thread's CPU outside the forward: what the overhead costs without the
            # waits of a loaded machine (torch's worker threads not counted)
            "overhead_cpu_ms": med("cpu:overhead"),
            "step_mean_ms": mean("step"),
            "tokens_per_step": statistics.median(self.step_tokens),
        }
        if not self.lean:
            result["phases_ms"] = {p: med(p) for p in phases}
            result["phases_mean_ms"] = {p: mean(p) for p in phases}
            between = sorted({k for s in steps for k in s if k.startswith("between:")})
            if between:
                result["between_steps_ms"] = {k.removeprefix("between:"): med(k) for k in between}
        return result


# ---------------------------------------------------------------------------- runs


def run_sync(engine: LLMEngine, requests: list[GenerationRequest], *, lean: bool = False
             ) -> tuple[dict[str, Any], dict[str, list]]:
    out: dict[str, list] = {r.request_id: [] for r in requests}
    with StepProbe(engine, len(requests), lean=lean) as probe:
        for request in requests:
            engine.add_request(request, _collector(out, request.request_id))
        began = time.perf_counter()
        while engine.has_work():
            engine.step()
        elapsed = time.perf_counter() - began
    result = probe.summary()
    result["tokens_per_s"] = sum(len(v) for v in out.values()) / elapsed
    return result, out


def run_async(engine: LLMEngine, requests: list[GenerationRequest]) -> tuple[dict[str, Any], dict[str, list]]:
    """The requests as concurrent ``generate()`` streams of an AsyncEngine over ``engine``."""
    front = AsyncEngine(engine, model_name="bench")
    out: dict[str, list] = {r.request_id: [] for r in requests}

    async def consume(request: GenerationRequest) -> None:
        async for delta in front.generate(request):
            out[request.request_id].append((delta.token_ids, delta.text))

    async def main() -> tuple[float, float]:
        cpu = time.thread_time()
        began = time.perf_counter()
        await asyncio.gather(*(consume(r) for r in requests))
        return time.perf_counter() - began, time.thread_time() - cpu

    with StepProbe(engine, len(requests)) as probe:
        # the async front's own fan-out: per delta in the step, then per step between steps
        for name, phase in (("_send", "sink"), ("_flush_outbox", "fanout")):
            if hasattr(front, name):
                probe.patch(front, name, phase)
        front.start_sync()
        try:
            elapsed, loop_cpu = asyncio.run(main())
        finally:
            front.shutdown_sync()
    result = probe.summary()
    periods = [b - a for a, b in zip(probe.starts, probe.starts[1:], strict=False)]
    if periods:
        result["period_ms"] = statistics.median(periods) * 1e3
        forward = [s.get("forward", 0.0) for s in probe.steps[:-1]]
        result["period_overhead_pct"] = statistics.median(
            100 * (p - f) / p for p, f in zip(periods, forward, strict=True))
    result["loop_cpu_ms_per_step"] = loop_cpu / max(1, probe.num_steps) * 1e3
    result["tokens_per_s"] = sum(len(v) for v in out.values()) / elapsed
    return result, out


def new_engine(loaded: LoadedModel, settings: Settings, batch: int, speculative_tokens: int) -> LLMEngine:
    page_size = 16
    per_seq = -(-(settings.prompt_tokens + settings.max_tokens) // page_size) + 1
    num_pages = int(batch * per_seq / 0.85) + 16  # above the admission watermark
    config = EngineConfig(num_pages=num_pages, page_size=page_size, device="cpu",
                          num_speculative_tokens=speculative_tokens, max_num_seqs=max(64, batch))
    return create_llm_engine(config, loaded=loaded)[0]


def run_benchmark(settings: Settings, loaded: LoadedModel | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    loaded = loaded or load_model(None)
    load_before = os.getloadavg()
    prompts = build_prompts(loaded.tokenizer, settings)
    engine = new_engine(loaded, settings, settings.batch, 0)
    log(f"prefilling {len(prompts)} prompts of {settings.prompt_tokens} tokens")
    prefill(engine, prompts, "main")
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    digests: dict[str, set[str]] = defaultdict(set)
    # a short untimed pass of each run first: first calls (sampler paths, the event loop's
    # thread, allocator growth) cost more than steady ones
    warmup = replace(settings, max_tokens=min(4, settings.max_tokens))
    for rep in range(-1, settings.repeats):
        for name in ("greedy_lean", "greedy", "sampled", "async"):
            log(f"repeat {rep + 1}/{settings.repeats}: {name}" if rep >= 0 else f"warm-up: {name}")
            temperature = settings.temperature if name == "sampled" else 0.0
            requests = make_requests(prompts, settings if rep >= 0 else warmup, f"{name}{rep}",
                                     temperature)
            if name == "async":
                result, out = run_async(engine, requests)
            else:
                result, out = run_sync(engine, requests, lean=name == "greedy_lean")
            if rep < 0:
                continue
            runs[name].append(result)
            if name != "sampled":
                digests["greedy"].add(digest(out))
    if settings.speculative_tokens:
        spec = new_engine(loaded, settings, settings.speculative_batch, settings.speculative_tokens)
        spec_prompts = prompts[: settings.speculative_batch]
        prefill(spec, spec_prompts, "spec")
        run_sync(spec, make_requests(spec_prompts, warmup, "specwarm"))
        for rep in range(settings.repeats):
            log(f"repeat {rep + 1}/{settings.repeats}: speculative")
            drafts, accepted = spec.spec_stats()["spec_drafts"], spec.spec_tokens_accepted
            result, out = run_sync(spec, make_requests(spec_prompts, settings, f"spec{rep}"))
            result["drafts"] = spec.spec_stats()["spec_drafts"] - drafts
            result["accepted_tokens"] = spec.spec_tokens_accepted - accepted
            runs["speculative"].append(result)
    results: dict[str, Any] = {
        "settings": asdict(settings),
        "load_avg_before": list(load_before),
        "load_avg_after": list(os.getloadavg()),
        "cpu_threads": _torch_threads(),
        "greedy_identical": len(digests["greedy"]) == 1,
        "greedy_digest": sorted(digests["greedy"])[0],
    }
    for name, samples in runs.items():
        results[name] = _merge(samples)
    return results


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _merge(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one run: the median of each figure (per phase too); counts summed."""
    if len(samples) == 1:
        return samples[0]
    merged: dict[str, Any] = {}
    for key, value in samples[0].items():
        if not all(key in s for s in samples):
            continue  # e.g. a repeat without steady steps
        if isinstance(value, dict):
            merged[key] = {k: statistics.median(s[key].get(k, 0.0) for s in samples) for k in value}
        elif key in ("steps", "drafts", "accepted_tokens"):
            merged[key] = sum(s[key] for s in samples)
        else:
            merged[key] = statistics.median(s[key] for s in samples)
    return merged


def table_rows(results: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for name in ("greedy_lean", "greedy", "sampled", "async", "speculative"):
        run = results.get(name)
        if not run or not run.get("steps"):
            continue
        rows += [(f"{name}: step ms (median, {run['steps']} steps)", run["step_ms"]),
                 (f"{name}: forward ms", run["forward_ms"]),
                 (f"{name}: overhead ms", run["overhead_ms"]),
                 (f"{name}: overhead % of step", run["overhead_pct"]),
                 (f"{name}: overhead engine-thread CPU ms", run["overhead_cpu_ms"])]
        for phase, ms in run.get("phases_ms", {}).items():
            if phase != "forward":
                rows.append((f"{name}:   {phase} ms", ms))
        for phase, ms in run.get("between_steps_ms", {}).items():
            rows.append((f"{name}:   {phase} ms (between steps)", ms))
        for key in ("period_ms", "period_overhead_pct", "loop_cpu_ms_per_step", "tokens_per_step",
                    "drafts", "accepted_tokens", "tokens_per_s"):
            if key in run:
                rows.append((f"{name}: {key}", run[key]))
    rows += [("greedy outputs identical", results["greedy_identical"]),
             ("greedy digest", results["greedy_digest"]),
             ("load avg before / after", f"{results['load_avg_before'][0]:.2f} / "
                                         f"{results['load_avg_after'][0]:.2f}")]
    return rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    defaults = Settings()
    for field, value in asdict(defaults).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args()
    settings = Settings(**{f: getattr(args, f) for f in asdict(defaults)})
    results = run_benchmark(settings)
    print_table(f"step overheads at batch {settings.batch} decode (ms per step, medians)",
                table_rows(results))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
