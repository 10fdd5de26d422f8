"""The grammar-compile worker process: compiles specs under an address-space limit.

Started by worker_pool.py as ``python -m prefixgate.engine.grammar.worker``. It reads
length-prefixed JSON messages on stdin and answers on stdout (``frames.py``):

1. the first message carries the tokenizer (``TokenizerInfo.serialize_json``), the memory
   budget and the compiler's thread count; the worker answers ``{"ready": true}`` once
   xgrammar is loaded and its address space is capped at what it uses then plus the budget;
2. each later message is ``{"kind", "source", "strict"}``; the answer is
   ``{"ok": true, "grammar": CompiledGrammar.serialize_json(), "seconds", "peak_rss"}``, or
   ``{"ok": false, "error", "memory"}`` when xgrammar refuses the spec or runs out of room.

Why a process: compiling a grammar is xgrammar's C++ over the whole vocabulary, which a
hostile spec can make run for minutes and allocate without end; a thread cannot be stopped
and shares the server's memory. A process is killed at its deadline and its memory is capped
by the kernel; the server only ever deserializes a finished result.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

from prefixgate.engine.grammar.frames import read_frame, write_frame


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cap_address_space(budget_bytes: int) -> None:
    """Cap virtual memory at what the process maps now plus ``budget_bytes``: an allocation
    past it fails (std::bad_alloc / MemoryError) instead of growing into the server's RAM."""
    if budget_bytes <= 0:
        return
    limit = _status_kib("VmSize") * 1024 + budget_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _compile(compiler: Any, request: dict[str, Any]) -> dict[str, Any]:
    from prefixgate.engine.grammar.compiler import compile_spec

    start = time.perf_counter()
    try:
        compiled = compile_spec(compiler, request["kind"], request["source"],
                                bool(request.get("strict", True)))
        text = compiled.serialize_json()
    except MemoryError:
        return {"ok": False, "error": "out of memory", "memory": True}
    except (RuntimeError, ValueError, TypeError, RecursionError) as exc:
        message = str(exc)
        return {"ok": False, "error": message, "memory": "bad_alloc" in message}
    reply = {"ok": True, "grammar": text, "seconds": time.perf_counter() - start,
             "peak_rss": _status_kib("VmHWM") * 1024}
    if request.get("probe_steps"):
        try:
            reply["forced_chars"] = _probe(compiled, int(request["probe_steps"]))
        except MemoryError:
            return {"ok": False, "error": "out of memory while probing", "memory": True}
        except RuntimeError as exc:
            return {"ok": False, "error": f"probing: {exc}", "memory": "bad_alloc" in str(exc)}
    return reply


def _probe(compiled: Any, steps: int) -> int:
    """Walk the grammar as drafting would (tests and benchmarks/grammar_fuzz.py): at each step
    take the text it forces (``find_jump_forward_string``), then the lowest token it allows;
    the most forced characters seen. Runs under this process's limits, so a grammar that forces
    text without end is a memory failure here instead of in the server."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    stops = set(compiled.tokenizer_info.stop_token_ids)
    most = 0
    for _ in range(steps):
        if matcher.is_terminated():
            break
        forced = matcher.find_jump_forward_string()
        most = max(most, len(forced))
        if forced and not matcher.accept_string(forced):
            break
        matcher.fill_next_token_bitmask(bitmask)
        token = _first_allowed(bitmask, stops)
        if token is None or not matcher.accept_token(token):
            break
    return most


def _first_allowed(bitmask: Any, stops: set[int]) -> int | None:
    """The lowest token id the bitmask allows that does not end the output."""
    for index, word in enumerate(bitmask[0].tolist()):
        word &= 0xFFFFFFFF
        while word:
            low = word & -word
            token = index * 32 + low.bit_length() - 1
            if token not in stops:
                return token
            word ^= low
    return None


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    hello = read_frame(stdin)
    if hello is None:
        return 0
    # a compile competes for the cores with the engine's steps and the event loop: at a lower
    # priority, a compile held to its time limit slows only other compiles
    os.nice(int(hello.get("nice", 10)))
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(hello["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=int(hello.get("threads", 1)),
                                   cache_enabled=False)
    _cap_address_space(int(hello.get("memory_bytes", 0)))
    write_frame(stdout, {"ready": True})
    while (request := read_frame(stdin)) is not None:
        write_frame(stdout, _compile(compiler, request))
    return 0


if __name__ == "__main__":
    sys.exit(main())

