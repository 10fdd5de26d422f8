"""Achieved / ideal prefix hit of a tool loop, per chat template (issue 29's tool-loop column).

Workload: 8 agents, each a 4-turn tool loop. Turn t's prompt is the conversation rendered the
way the gateway renders it for that template (tools/dialect.py: the template's own tool
rendering, or the gateway's Hermes prompt when the template teaches none); the model writes
one call in the template's format (the grammar's canonical JSON; ``<think>`` first for the
thinking rows) and its end-of-turn token; the tool answers; turn t+1 re-renders the history.
The prefix cache can serve turn t+1 only as far as its tokens agree with turn t's prompt and
output: achieved = that common prefix, ideal = turn t's prompt + output, summed over every
turn of every agent. Outputs are tokenized canonically (what a trained model writes, mostly).

Tokenizers: the real ones of the family fixtures (tests/family_fixtures.py). The sdist has no
Mistral or Granite tokenizer: Llama 3's stands in, with their control tokens added as special
tokens (as they are in their own); Qwen's stands in for Hermes 2 Pro (it has ``<|im_end|>``).
gpt-oss runs on its real o200k_harmony (tests/harmony_fixture.py): with the reasoning sent
back, without it (the gateway puts the analysis it wrote back), and with a final answer and
a follow-up question as the last turn (the template drops the chain's analysis). Qwen3.5
(Qwen3-Coder's calls, a ``<think>`` span its generation prompt opens) has the same three rows,
and one with thinking off; Qwen3 one without the reasoning sent back (tools/dialect.py puts
the reasoning it wrote back, as for harmony). Nothing is timed; every row's
ratio is deterministic. Where a row is under 0.98, ``diverges`` shows the text at the first
differing token: what the template re-renders differently from what was generated.

Run::

    python -m benchmarks.tool_loop_hit --json out/tool_loop_hit.json
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from benchmarks.common import base_parser, write_json
from prefixgate.engine.tokenizer import Tokenizer
from prefixgate.gateway.server.tools.dialect import ToolDialect, choose_dialect
from prefixgate.gateway.server.tools.formats.reasoning import thinking_kwargs
from prefixgate.gateway.server.tools.prompt import call_begin, canonical_json
from prefixgate.gateway.server.tools.records import FunctionTool
from tests.family_fixtures import family_fixture, template
from tests.harmony_fixture import HARMONY_TEMPLATE, harmony_tokenizer

AGENTS = 8
TURNS = 4
TARGET = 0.98
HARMONY = "o200k_harmony"
EOS = "eos"  # the end of turn is the tokenizer's eos token (the Mistral templates write it)
SMOLLM3_SPECIALS = ("<|im_start|>", "<|im_end|>")
GRANITE_SPECIALS = ("<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>")
# Mistral's control tokens (single tokens in its own tokenizer, so nothing merges across them)
MISTRAL_SPECIALS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]", "[TOOL_CONTENT]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
READ_FILE = FunctionTool("read_file", "Read a file of the repository", {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})


@dataclass(frozen=True, slots=True)
class Case:
    template: str
    tokenizer: str  # the family fixture whose tokenizer renders it
    end_of_turn: str  # what ends an assistant turn the model writes
    think: bool = False  # the model reasons before its call
    system: bool = True  # the template takes a system turn (Gemma 2's refuses one)
    specials: tuple[str, ...] = ()  # control tokens the real tokenizer has and the stand-in lacks
    sends_reasoning: bool = True  # the client sends the reasoning back (reasoning_content)
    answers: bool = False  # after the calls the model answers and the user asks again
    no_think: bool = False  # the request turns thinking off (SmolLM3's template thinks unasked)


CASES = {
    "qwen3": Case("Qwen-Qwen3-0.6B.jinja", "qwen3", "<|im_end|>"),
    "qwen3-thinking": Case("Qwen-Qwen3-0.6B.jinja", "qwen3", "<|im_end|>", think=True),
    "qwen3-no-reasoning-back": Case("Qwen-Qwen3-0.6B.jinja", "qwen3", "<|im_end|>", think=True,
                                    sends_reasoning=False),
    "qwen2.5": Case("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen3", "<|im_end|>"),
    "qwen3-coder": Case("Qwen3-Coder.jinja", "qwen3_moe", "<|im_end|>"),
    "llama3.1": Case("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3", "<|eot_id|>"),
    "llama3.2": Case("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3", "<|eot_id|>"),
    "llama3.3": Case("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3", "<|eot_id|>"),
    # Qwen's tokenizer stands in: it has the <|im_end|> special token Hermes 2 Pro adds
    "hermes-2-pro": Case("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "qwen3",
                         "<|im_end|>"),
    "mistral-small-3.2": Case("Mistral-Small-3.2-24B-Instruct-2506.jinja", "llama3", EOS,
                              specials=MISTRAL_SPECIALS),
    "devstral": Case("unsloth-mistral-Devstral-Small-2507.jinja", "llama3", EOS,
                     specials=MISTRAL_SPECIALS),
    # Nemo's template writes the system prompt only into a LAST user message: gone from the
    # history once a call follows it; without one the loop extends
    "mistral-nemo": Case("mistralai-Mistral-Nemo-Instruct-2407.jinja", "llama3", EOS,
                         specials=MISTRAL_SPECIALS),
    "mistral-nemo-nosys": Case("mistralai-Mistral-Nemo-Instruct-2407.jinja", "llama3", EOS,
                               system=False, specials=MISTRAL_SPECIALS),
    "deepseek-r1-qwen": Case("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "qwen3",
                             "<｜end▁of▁sentence｜>", think=True),
    "granite-3.3": Case("ibm-granite-granite-3.3-2B-Instruct.jinja", "llama3", "<|end_of_text|>",
                        specials=GRANITE_SPECIALS),
    "phi-3.5": Case("microsoft-Phi-3.5-mini-instruct.jinja", "phi3", "<|end|>"),
    # SmolLM3's template renders no tools (the gateway's Hermes prompt); Llama 3's vocabulary
    # with SmolLM3's <|im_start|> / <|im_end|> added as the special tokens they are in its own
    "smollm3-no-think": Case("HuggingFaceTB-SmolLM3-3B.jinja", "smollm3", "<|im_end|>",
                             specials=SMOLLM3_SPECIALS, no_think=True),
    "smollm3-thinking": Case("HuggingFaceTB-SmolLM3-3B.jinja", "smollm3", "<|im_end|>",
                             think=True, specials=SMOLLM3_SPECIALS),
    "gemma-2": Case("google-gemma-2-2b-it.jinja", "gemma3", "<end_of_turn>", system=False),
    # gpt-oss: o200k_harmony (tests/harmony_fixture.py); the call ends with <|call|>, analysis
    # first. Its template keeps a call turn's analysis until a final answer follows.
    "gpt-oss": Case(HARMONY_TEMPLATE, HARMONY, "", think=True),
    "gpt-oss-no-reasoning-back": Case(HARMONY_TEMPLATE, HARMONY, "", think=True,
                                      sends_reasoning=False),
    "gpt-oss-answer-then-ask": Case(HARMONY_TEMPLATE, HARMONY, "", think=True, answers=True),
    # Qwen3.5: Qwen3-Coder's XML calls; the generation prompt opens <think> (or closes an empty
    # span with thinking off); the template renders the reasoning of every assistant turn after
    # the last user query, and drops it from the turns before
    "qwen3.5-thinking": Case("Qwen3.5-4B.jinja", "qwen3_5", "<|im_end|>", think=True),
    "qwen3.5-no-think": Case("Qwen3.5-4B.jinja", "qwen3_5", "<|im_end|>", no_think=True),
    "qwen3.5-no-reasoning-back": Case("Qwen3.5-4B.jinja", "qwen3_5", "<|im_end|>", think=True,
                                      sends_reasoning=False),
    "qwen3.5-answer-then-ask": Case("Qwen3.5-4B.jinja", "qwen3_5", "<|im_end|>", think=True,
                                    answers=True),
}  # fmt: skip


def case_tokenizer(case: Case) -> Tokenizer:
    if case.tokenizer == HARMONY:
        return harmony_tokenizer()
    hf_dir = family_fixture(case.tokenizer).hf_dir
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_hf_files(str(hf_dir / "tokenizer.json"), tokenizer_config=config,
                                        chat_template=template(case.template))
    if not case.specials:
        return tokenizer
    tokenizer.backend.add_special_tokens(list(case.specials))
    return Tokenizer(tokenizer.backend, eos_token_ids=tokenizer.eos_token_ids,
                     bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                     chat_template=tokenizer.chat_template)


def call_text(dialect: ToolDialect, arguments: dict[str, Any], call_id: str) -> str:
    """One call as the grammar writes it in the dialect's format (``call_id``: where the
    model writes one, Mistral Small 3.2 and Nemo)."""
    fmt = dialect.format
    if fmt.block is not None:  # Mistral Nemo: the call in its list, its id last
        return (f'{fmt.block[0]}{fmt.begin(READ_FILE.name)}{canonical_json(arguments)}, "id": '
                f'"{call_id}{fmt.end}{fmt.block[1]}')
    if getattr(fmt, "call_ids", False):
        return f"{fmt.begin(READ_FILE.name)}{call_id}[ARGS]{canonical_json(arguments)}"
    if fmt.name == "qwen3_coder":
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
        return fmt.begin(READ_FILE.name) + body + fmt.end
    if fmt.name == "hermes":
        return call_begin(READ_FILE.name) + canonical_json(arguments) + "}\n</tool_call>"
    return fmt.begin(READ_FILE.name) + canonical_json(arguments) + fmt.end


def client_turn(dialect: ToolDialect, output: str, result: str, sends_reasoning: bool = True,
                prompt_text: str = "") -> list[dict[str, Any]]:
    """What an OpenAI client sends back: the call the gateway parsed (its id, its arguments
    text), the reasoning as ``reasoning_content`` (unless the client drops it), then the
    tool's result. ``prompt_text``: the prompt (a template may open the span there)."""
    parser = dialect.parser([READ_FILE], None, prompt_text[-64:])
    assert parser is not None
    parser.feed(output, True)
    (call,) = parser.calls
    message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]}
    if parser.reasoning and sends_reasoning:
        message["reasoning_content"] = "".join(parser.reasoning).strip("\n")
    return [message, {"role": "tool", "tool_call_id": call.id, "content": result}]


def written(tokenizer: Tokenizer, prompt: list[int], prompt_text: str, output: str
            ) -> list[int]:
    """The output's tokens as a trained model writes them: the tokenizer's own split of the
    text in context (the prompt's end may merge with it), not of the output alone."""
    joint = tokenizer.encode(prompt_text + output, add_special_tokens=False)
    if joint[:len(prompt)] == prompt:
        return joint[len(prompt):]
    return tokenizer.encode(output, add_special_tokens=False)


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def agent_loop(tokenizer: Tokenizer, dialect: ToolDialect, case: Case, agent: int
               ) -> tuple[int, int, str]:
    """``(achieved, ideal, diverges)`` of one agent's loop."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": f"Agent {agent}: fix the failing test in cache.py"}
    ][0 if case.system else 1:]
    achieved = ideal = 0
    diverges = ""

    # the thinking rows ask for it (DeepSeek R1's template closes the span unless asked)
    controls = thinking_kwargs(True) if case.think else {}
    if case.no_think:
        controls = thinking_kwargs(False)

    def render(messages: list[dict[str, Any]]) -> tuple[list[int], str]:
        prepared, tools = dialect.template_inputs(messages, [READ_FILE])
        return (tokenizer.apply_chat_template(prepared, tools, **controls),
                tokenizer.render_chat(prepared, tools, True, **controls))

    for turn in range(TURNS):
        prompt, prompt_text = render(history)
        arguments = {"path": f"src/agent{agent}/file_{turn}.py"}
        reasoning = f"I need to read file {turn}."
        text = call_text(dialect, arguments, f"{agent:04d}x{turn:04d}")
        if case.think and dialect.format.channels:  # harmony: an analysis message first
            text = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant{text}"
        elif case.think:  # DeepSeek R1's prompt opens the span itself
            opened = prompt_text.rstrip().endswith("<think>")
            text = ("" if opened else "<think>\n") + f"{reasoning}\n</think>\n\n" + text
        end = tokenizer.eos_token if case.end_of_turn == EOS else case.end_of_turn
        generated = prompt + written(tokenizer, prompt, prompt_text, text + (end or ""))
        history = [*history, *client_turn(dialect, text, f"contents {turn}",
                                          case.sends_reasoning, prompt_text)]
        if case.answers and turn == TURNS - 1:  # the answer, then the user's next question
            prompt, prompt_text = render(history)
            answer = ("<|channel|>analysis<|message|>I have read them all.<|end|><|start|>"
                      "assistant<|channel|>final<|message|>Fixed.<|return|>")
            if not dialect.format.channels:  # a think span (opened by the prompt or not)
                opened = prompt_text.rstrip().endswith("<think>")
                answer = (("" if opened else "<think>\n") + "I have read them all.\n</think>"
                          "\n\nFixed." + (tokenizer.eos_token if case.end_of_turn == EOS
                                           else case.end_of_turn))
            generated = prompt + written(tokenizer, prompt, prompt_text, answer)
            history = [*history, {"role": "assistant", "content": "Fixed.",
                                  "reasoning_content": "I have read them all."},
                       {"role": "user", "content": "Now run the tests."}]
        following, _ = render(history)
        common = _common(generated, following)
        if common < len(generated) and not diverges:
            diverges = (f"generated {tokenizer.decode(generated[common:common + 6], False)!r} "
                        f"/ re-rendered {tokenizer.decode(following[common:common + 6], False)!r}")
        achieved, ideal = achieved + common, ideal + len(generated)
    return achieved, ideal, diverges


def measure(name: str) -> dict[str, Any]:
    case = CASES[name]
    tokenizer = case_tokenizer(case)
    dialect = choose_dialect(tokenizer.chat_template)
    achieved = ideal = 0
    diverges = ""
    for agent in range(AGENTS):
        a, i, d = agent_loop(tokenizer, dialect, case, agent)
        achieved, ideal, diverges = achieved + a, ideal + i, diverges or d
    return {"template": case.template, "format": dialect.format.name,
            "prompt": "template" if dialect.native else "gateway (hermes)",
            "tokenizer": case.tokenizer, "think": case.think, "achieved": achieved,
            "ideal": ideal, "hit_over_ideal": round(achieved / ideal, 4), "diverges": diverges}


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="only these rows (repeatable; default all)")
    args = parser.parse_args(argv)
    rows = {name: measure(name) for name in args.case or CASES}
    print(f"\ntool loop: {AGENTS} agents x {TURNS} turns, achieved / ideal prefix hit")
    print(f"{'case':<26} {'format':<12} {'prompt':<17} {'hit/ideal':>9}  first divergence")
    for name, row in rows.items():
        flag = "" if row["hit_over_ideal"] >= TARGET else row["diverges"]
        print(f"{name:<26} {row['format']:<12} {row['prompt']:<17} "
              f"{row['hit_over_ideal']:>9.4f}  {flag}")
    write_json(args.json, {"benchmark": "tool_loop_hit", "agents": AGENTS, "turns": TURNS,
                           "target": TARGET, "rows": rows})


if __name__ == "__main__":
    main()
