"""A jinja2 sandbox that bounds what a chat template may cost: time, loop iterations, the size
of every value it builds and of its output.

jinja2's immutable sandbox stops code execution, not denial of service: ``range(10**9)``
raised OverflowError (a 500), nested loops ran for ever, ``'A' * 10**8`` grew the server by
GBs. A template comes with the model file (a GGUF downloaded from anywhere, a
``tokenizer_config.json``), so every render runs under a :class:`RenderBudget`:

- a deadline and an iteration budget, checked on every loop iteration (each ``for`` is
  rewritten to iterate through a counter), every call and every output piece;
- a size bound on every value built by ``*``, ``+``, ``~``, ``%``, a filter or a method call,
  checked *before* the operations that multiply (``*``, ``**``, ``replace``, ``join``,
  ``indent``, format widths), after the ones that at most add;
- a bound on the output.

Exceeding one raises :class:`TemplateLimitError` (a ValueError: the request gets a 400).
"""

from __future__ import annotations

import contextvars
import functools
import operator
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2.nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_SECONDS = 5.0
# a real template loops a few times over at most a few thousand messages
MAX_LOOP_ITERATIONS = 1_000_000
# one value or the whole output, in characters (or items): the largest request body
MAX_VALUE_CHARS = 1 << 25
MAX_INT_ARGUMENT = 1 << 16  # widths, counts, repeats and range() handed to filters and methods
MAX_EXPONENT = 256
MAX_SIZE_VISITS = 1 << 21  # nested values walked to size one value
_WIDE_FORMAT = re.compile(r"(?:%[-#0 +]*(?:\*|\d{6,})|\{[^{}]*\d{6,}[^{}]*\})")
_NOT_ALLOWED_FILTERS = ("center", "wordwrap", "urlize", "xmlattr", "pprint", "random",
                        "filesizeformat")


class TemplateLimitError(ValueError):
    """The chat template went over a bound (time, iterations, value or output size)."""


class OutputTooLongError(TemplateLimitError):
    """The rendered prompt passed the caller's bound (e.g. what can still fit the context)."""

    def __init__(self, limit: int):
        super().__init__(f"the rendered prompt is over {limit} characters")
        self.limit = limit


@dataclass(slots=True)
class RenderBudget:
    deadline: float
    iterations_left: int = MAX_LOOP_ITERATIONS
    output_chars: int = field(default=0)

    def tick(self, iterations: int = 1) -> None:
        self.iterations_left -= iterations
        if self.iterations_left < 0:
            raise TemplateLimitError(
                f"the chat template ran more than {MAX_LOOP_ITERATIONS} loop iterations")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"the chat template took longer than {MAX_RENDER_SECONDS:g} s to render")


_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "prefixgate_render_budget", default=None)


def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()


def _size(value: Any) -> int:
    """Characters (and items) ``value`` spells when printed, nested values and repeated
    references included; anything past the visit cap counts as too big."""
    total, visits, stack = 0, 0, [value]
    while stack and total <= MAX_VALUE_CHARS:
        item = stack.pop()
        visits += 1
        if visits > MAX_SIZE_VISITS:
            return MAX_VALUE_CHARS + 1
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple)):
            total += len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
    return total


def _check_size(value: Any, what: str) -> Any:
    if _size(value) > MAX_VALUE_CHARS:
        raise TemplateLimitError(f"the chat template built a value over {MAX_VALUE_CHARS} "
                                 f"characters ({what})")
    return value


def _check_ints(args: Iterable[Any]) -> None:
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_INT_ARGUMENT:
            raise TemplateLimitError(
                f"the chat template passed {arg} where at most {MAX_INT_ARGUMENT} is allowed")


def _check_format(template: Any) -> None:
    if isinstance(template, str) and _WIDE_FORMAT.search(template):
        raise TemplateLimitError("the chat template formats with a width over the limit")


def _expected_size(name: str, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What a growing operation would build, computed before building it."""
    if name == "replace" and isinstance(obj, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = obj.count(old) if old else len(obj) + 1
        return len(obj) + count * max(0, len(new) - len(old))
    if name == "join":
        # "glue".join(items) (a method) or items|join(glue) (the filter)
        items, glue = (args[0] if args else (), obj) if isinstance(obj, str) else (
            obj, args[0] if args else "")
        if not isinstance(items, (list, tuple)):
            return 0  # an iterator: sized after (its items are bounded values)
        return _size(items) + _size(str(glue)) * len(items)
    if name == "indent" and isinstance(obj, str):
        width = args[0] if args else kwargs.get("width", 4)
        return len(obj) * (1 + (width if isinstance(width, int) else len(str(width))))
    return 0


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _check_ints([*args, *kwargs.values()])
        values = [a for a in args
                  if not isinstance(a, (Context, jinja2.Environment, jinja2.nodes.EvalContext))]
        if values and _expected_size(name, values[0], tuple(values[1:]), kwargs) > MAX_VALUE_CHARS:
            raise TemplateLimitError(f"the chat template's |{name} would build over "
                                     f"{MAX_VALUE_CHARS} characters")
        if name == "format" and values:
            _check_format(values[0])
        return _check_size(func(*args, **kwargs), f"|{name}")

    return bounded


class _Counted:
    """A loop's iterable, counting each iteration against the render's budget."""

    __slots__ = ("_items",)

    def __init__(self, items: Any):
        self._items = items

    def __len__(self) -> int:
        return len(self._items)  # TypeError for iterators: jinja then counts by consuming

    def __iter__(self) -> Iterator[Any]:
        for item in self._items:
            _tick()
            yield item


def _bounded_range(*args: int) -> range:
    _check_ints(args)  # a clear 400, where jinja's sandbox raised OverflowError (a 500)
    values = range(*args)
    if len(values) > MAX_INT_ARGUMENT:
        raise TemplateLimitError(f"range() of more than {MAX_INT_ARGUMENT} items in the chat template")
    return values


class _CountLoops:
    """Rewrites the parsed template: every ``for`` iterates through the budget's counter and
    every ``~`` concatenation is size-checked (jinja offers no hook for either)."""

    def visit(self, node: jinja2.nodes.Node) -> jinja2.nodes.Node:
        for name, value in node.iter_fields():
            if isinstance(value, jinja2.nodes.Node):
                setattr(node, name, self.visit(value))
            elif isinstance(value, list):
                setattr(node, name, [self.visit(v) if isinstance(v, jinja2.nodes.Node) else v
                                     for v in value])
        if isinstance(node, jinja2.nodes.For):
            node.iter = _filter(node.iter, "_prefixgate_loop", node.lineno)
        if isinstance(node, jinja2.nodes.Concat):  # each operand, then the sum
            node.nodes = [_filter(n, "_prefixgate_sized", node.lineno) for n in node.nodes]
            return _filter(node, "_prefixgate_sized", node.lineno)
        if isinstance(node, jinja2.nodes.Output):  # printing a value spells it out
            node.nodes = [n if isinstance(n, jinja2.nodes.TemplateData)
                          else _filter(n, "_prefixgate_sized", node.lineno) for n in node.nodes]
        return node


def _filter(node: jinja2.nodes.Expr, name: str, lineno: int) -> jinja2.nodes.Filter:
    return jinja2.nodes.Filter(node, name, [], [], None, None, lineno=lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the bounds of this module's docstring."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any):
        super().__init__(**options)
        for name in _NOT_ALLOWED_FILTERS:
            self.filters.pop(name, None)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["_prefixgate_loop"] = _Counted
        self.filters["_prefixgate_sized"] = lambda value: _check_size(value, "~")
        self.globals["range"] = _bounded_range

    def add_filter(self, name: str, func: Callable[..., Any]) -> None:
        self.filters[name] = _bounded_filter(name, func)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        _CountLoops().visit(tree)
        return tree

    def call_binop(self, context: Context, operator_name: str, left: Any, right: Any) -> Any:
        _tick()
        if operator_name == "*":
            count, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and _size(seq) * min(max(count, 0), 1 << 40) > MAX_VALUE_CHARS:
                raise TemplateLimitError(f"the chat template repeats a value past {MAX_VALUE_CHARS}")
            return _check_size(operator.mul(left, right), "*")
        if operator_name == "**":
            if isinstance(right, int) and (abs(right) > MAX_EXPONENT or (
                    isinstance(left, int) and abs(left) > 2 and right > 64)):
                raise TemplateLimitError("the chat template raises to a power over the limit")
            return operator.pow(left, right)
        if operator_name == "%":
            _check_format(left)
            return _check_size(operator.mod(left, right), "%")
        return _check_size(super().call_binop(context, operator_name, left, right), operator_name)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        _check_ints([*args, *kwargs.values()])
        name = getattr(__obj, "__name__", "")
        # (the sandbox hands str.format out wrapped; the wrapper keeps the method in __wrapped__)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if name in ("format", "format_map"):
            _check_format(owner)
        if _expected_size(name, owner, args, kwargs) > MAX_VALUE_CHARS:
            raise TemplateLimitError(f"the chat template's .{name}() would build over "
                                     f"{MAX_VALUE_CHARS} characters")
        return _check_size(super().call(__context, __obj, *args, **kwargs), f"{name}()")


def render_bounded(template: jinja2.Template, variables: dict[str, Any],
                   max_output_chars: int = MAX_VALUE_CHARS) -> str:
    """Render ``template`` under a fresh :class:`RenderBudget`; TemplateLimitError past it, or
    :class:`OutputTooLongError` once the output passes ``max_output_chars``."""
    budget = RenderBudget(deadline=time.monotonic() + MAX_RENDER_SECONDS)
    token = _BUDGET.set(budget)
    try:
        pieces = []
        for piece in template.generate(**variables):
            budget.output_chars += len(piece)
            if budget.output_chars > min(max_output_chars, MAX_VALUE_CHARS):
                raise OutputTooLongError(min(max_output_chars, MAX_VALUE_CHARS))
            budget.tick(0)
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _BUDGET.reset(token)
