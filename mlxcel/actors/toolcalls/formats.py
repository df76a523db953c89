"""One parser per tool-call family. Each only says where its regions start and how to decide one;
streaming, holding back and falling back to content live in ``_stream``."""

from __future__ import annotations

import ast
import re
import string

from mlxcel.actors.toolcalls._stream import (
    WS,
    Bail,
    Balancer,
    Cut,
    Done,
    More,
    Scan,
    StreamParser,
    call_from_json,
    cut_call,
    dumps_args,
    loads,
)


def _skip(buf: str, i: int, chars: str = WS) -> int:
    while i < len(buf) and buf[i] in chars:
        i += 1
    return i


def _json_calls(values: list[str], *, need_args: bool = False) -> list[tuple[str, str]] | None:
    """Decode call objects (or lists of them); None if any is not a call."""
    calls: list[tuple[str, str]] = []
    for v in values:
        try:
            obj = loads(v)
        except (ValueError, RecursionError):
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            if need_args and not (
                isinstance(item, dict) and ("parameters" in item or "arguments" in item)
            ):
                return None
            call = call_from_json(item)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def _cut_json(buf: str, bal: Balancer | None, vstart: int, whole: list[str]) -> Cut | None:
    """A region cut inside its JSON call object (``bal`` still open at ``vstart``), after the
    ``whole`` objects before it."""
    if bal is None:
        return None
    part = cut_call(buf[vstart:])
    calls = _json_calls(whole) if whole else []
    if calls is None or not (part or calls):
        return None
    return Cut(calls, part)


class HermesParser(StreamParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call
    (Qwen 2.5/3, Hermes 2/3, SmolLM3). A block holding several objects is accepted too."""

    markers = ("<tool_call>",)
    CLOSE = "</tool_call>"

    def _begin(self, marker: str) -> None:
        self._pos = len(marker)
        self._bal: Balancer | None = None
        self._vstart = 0
        self._values: list[str] = []

    def _scan(self, buf: str, final: bool) -> Scan:
        while True:
            if self._bal is not None:
                end = self._bal.advance(buf)
                if end is None:
                    return Bail(len(buf)) if final else More()
                if end < 0:
                    return Bail(self._bal.pos)
                self._values.append(buf[self._vstart : end])
                self._bal, self._pos = None, end
            j = _skip(buf, self._pos)
            rest = buf[j:]
            if rest.startswith("{"):
                self._vstart, self._bal = j, Balancer(j)
                continue
            if not self._values:
                return More() if not rest and not final else Bail(len(self.markers[0]))
            if rest.startswith(self.CLOSE):
                return self._decide(j + len(self.CLOSE))
            if self.CLOSE.startswith(rest):
                # A block cut off before (or inside) its close tag: accept it at the end, since
                # the JSON is whole; the model was stopped, not wrong.
                return self._decide(len(buf)) if final else More()
            return Bail(j)  # a foreign close tag or trailing prose: not our format after all

    def _decide(self, end: int) -> Scan:
        calls = _json_calls(self._values)
        return Bail(end) if calls is None else Done(end, calls)

    def _partial(self, buf: str) -> Cut | None:
        return _cut_json(buf, self._bal, self._vstart, self._values)


class Llama3JsonParser(StreamParser):
    """``<|python_tag|>{"name": ..., "parameters": {...}}``, or the same JSON bare at the start
    of the turn (Llama 3.1-3.3); several calls may follow separated by ``;``."""

    markers = ("<|python_tag|>",)
    bare_starts = "{"
    separators = WS + ";"

    def _begin(self, marker: str) -> None:
        self._pos = len(marker)
        self._bare = not marker
        self._bal: Balancer | None = None
        self._vstart = 0

    def _scan(self, buf: str, final: bool) -> Scan:
        if self._bal is None:
            j = _skip(buf, self._pos)
            if j == len(buf):
                return Bail(len(buf)) if final else More()
            if buf[j] != "{":
                return Bail(j)  # python_tag before code (a built-in tool): content
            k = _skip(buf, j + 1)
            if k == len(buf):
                return Bail(len(buf)) if final else More()
            if buf[k] != '"':
                return Bail(j + 1)  # "{ like this" in prose
            self._vstart, self._bal = j, Balancer(j)
        end = self._bal.advance(buf)
        if end is None:
            return Bail(len(buf)) if final else More()
        if end < 0:
            return Bail(self._bal.pos)
        # Bare JSON must carry the arguments key: a plain JSON answer that happens to have a
        # "name" field is content, not a call.
        calls = _json_calls([buf[self._vstart : end]], need_args=self._bare)
        return Bail(end) if calls is None else Done(end, calls)

    def _partial(self, buf: str) -> Cut | None:
        return _cut_json(buf, self._bal, self._vstart, [])


_MISTRAL_NAME = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")


def _mistral_head_possible(rest: str) -> bool:
    """Could ``rest`` still grow into ``name[CALL_ID]id[ARGS]`` / ``name[ARGS]``?"""
    rest = rest[_NAME_CHARS.match(rest).end() :]  # type: ignore[union-attr]  # * always matches
    if "[CALL_ID]".startswith(rest) or "[ARGS]".startswith(rest):
        return True
    if rest.startswith("[CALL_ID]"):
        tail = rest[len("[CALL_ID]") :].lstrip(string.ascii_letters + string.digits)
        return "[ARGS]".startswith(tail)
    return False


class MistralParser(StreamParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3, Nemo, Small
    2501) and ``[TOOL_CALLS]name[ARGS]{...}`` (tokenizer v11+: Small 3.2, Magistral, Devstral),
    with the optional ``[CALL_ID]id`` of later tokenizers."""

    markers = ("[TOOL_CALLS]",)

    def _begin(self, marker: str) -> None:
        self._pos = len(marker)
        self._bal: Balancer | None = None
        self._vstart = 0
        self._name: str | None = None

    def _scan(self, buf: str, final: bool) -> Scan:
        if self._bal is None:
            j = _skip(buf, self._pos)
            rest = buf[j:]
            if not rest:
                return Bail(len(buf)) if final else More()
            if rest[0] not in "[{":
                m = _MISTRAL_NAME.match(buf, j)
                if m is None:
                    if final or not _mistral_head_possible(rest):
                        return Bail(self._pos)
                    return More()
                self._name = m.group(1)
                j = _skip(buf, m.end())
                if j == len(buf):
                    return Bail(len(buf)) if final else More()
                if buf[j] != "{":
                    return Bail(self._pos)
            self._vstart, self._bal = j, Balancer(j)
        end = self._bal.advance(buf)
        if end is None:
            return Bail(len(buf)) if final else More()
        if end < 0:
            return Bail(self._bal.pos)
        value = buf[self._vstart : end]
        if self._name is None:
            calls = _json_calls([value])
            return Bail(end) if calls is None else Done(end, calls)
        try:
            args = dumps_args(loads(value))
        except (ValueError, RecursionError):
            args = None
        return Bail(end) if args is None else Done(end, [(self._name, args)])


class _NotLiteral(Exception):
    pass


_PY_NAMES: dict[str, object] = {
    "True": True, "False": False, "None": None,
    # Small models mix JSON spellings into Python syntax; they mean the same thing.
    "true": True, "false": False, "null": None,
}  # fmt: skip


def _py_value(node: ast.expr) -> object:
    """A literal argument value as JSON-able data; anything executable is refused."""
    match node:
        case ast.Constant(value=v) if v is None or isinstance(v, (str, int, float, bool)):
            return v
        case ast.List(elts=elts) | ast.Tuple(elts=elts):
            return [_py_value(e) for e in elts]
        case ast.Dict(keys=keys, values=values):
            if any(k is None for k in keys):  # {**spread}
                raise _NotLiteral
            pairs = zip(keys, values, strict=True)
            return {_py_key(k): _py_value(v) for k, v in pairs if k is not None}
        case ast.Name(id=name) if name in _PY_NAMES:
            return _PY_NAMES[name]
        case ast.UnaryOp(op=ast.USub(), operand=ast.Constant(value=v)) if isinstance(
            v, (int, float)
        ) and not isinstance(v, bool):
            return -v
    raise _NotLiteral


def _py_key(node: ast.expr) -> str:
    key = _py_value(node)
    if not isinstance(key, str):
        raise _NotLiteral
    return key


def _py_name(node: ast.expr) -> str | None:
    match node:
        case ast.Name(id=name):
            return name
        case ast.Attribute(value=inner, attr=attr):
            base = _py_name(inner)
            return None if base is None else f"{base}.{attr}"
    return None


def python_literal(src: str) -> object:
    """One Python (or JSON-spelled) literal as JSON-able data, parsed with ``ast`` and never
    evaluated; ValueError when ``src`` is anything else."""
    try:
        return _py_value(ast.parse(src.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _NotLiteral):
        raise ValueError("not a literal") from None


def pythonic_calls(src: str) -> list[tuple[str, str]] | None:
    """Parse ``[f(a=1), g()]`` with ``ast`` (never evaluated); None if it is not such a list."""
    try:
        body = ast.parse(src.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(body, ast.List) or not body.elts:
        return None
    calls: list[tuple[str, str]] = []
    for el in body.elts:
        if not isinstance(el, ast.Call) or el.args:  # positional arguments have no names
            return None
        name = _py_name(el.func)
        if name is None or any(kw.arg is None for kw in el.keywords):
            return None
        try:
            args = dumps_args({kw.arg: _py_value(kw.value) for kw in el.keywords})
        except (_NotLiteral, RecursionError):
            return None
        if args is None:
            return None
        calls.append((name, args))
    return calls


_PY_HEAD = re.compile(r"\[\s*([A-Za-z_][\w.]*)?\s*")


class PythonicParser(StreamParser):
    """``[get_weather(city="Paris"), get_time(tz="UTC")]`` at the start of the turn (Llama 4,
    Llama 3.2 pythonic templates, several small tool models)."""

    bare_starts = "["

    def _begin(self, marker: str) -> None:
        self._bal: Balancer | None = None

    def _scan(self, buf: str, final: bool) -> Scan:
        if self._bal is None:
            # Decide early on prose like "[1] see above": a call list opens with "name(".
            m = _PY_HEAD.match(buf)
            assert m is not None  # the region starts with "["
            if m.end() == len(buf):
                return Bail(len(buf)) if final else More()
            if m.group(1) is None or buf[m.end()] != "(":
                return Bail(1)
            self._bal = Balancer(0, quotes="\"'", brackets="[{(")
        end = self._bal.advance(buf)
        if end is None:
            return Bail(len(buf)) if final else More()
        if end < 0:
            return Bail(self._bal.pos)
        calls = pythonic_calls(buf[:end])
        return Bail(end) if calls is None else Done(end, calls)
