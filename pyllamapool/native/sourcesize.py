"""How long the functions of a C or C++ file are, for check-patches' tables: a reviewer reads a
function in one sitting or not at all.

A scanner, not a parser: preprocessor lines, comments and literals are blanked, then braces are
followed. A brace opens a function body where the text before it holds a parameter list and no `=`
outside parentheses (which would make it an initializer); namespaces and `extern "C"` blocks are transparent; struct, class,
union and enum bodies are searched for the member functions defined in them. Lambdas and other blocks
inside a function count towards that function.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hpp", ".cu", ".cuh", ".m", ".mm")
_LITERAL = re.compile(r'(?m:^[ \t]*#(?:\\\n|[^\n])*)|//[^\n]*|/\*.*?\*/|R"(?P<d>[^(\s]*)\(.*?\)(?P=d)"|"(?:\\.|[^"\\\n])*"|'
                      r"'(?:\\.|[^'\\\n])*'", re.S)
_TRANSPARENT = re.compile(r"^\s*(?:inline\s+)?(?:namespace\b|extern\s*\"\s*\")")
_TYPE = re.compile(r"^\s*(?:template\s*<[^{]*>\s*)?(?:typedef\s+)?(?:struct|class|union|enum)\b")
_NAME = re.compile(r"(~?[A-Za-z_][\w:]*)\s*$")


@dataclass(frozen=True)
class Function:
    name: str
    first_line: int
    lines: int


def is_source(path: str) -> bool:
    return path.endswith(_SOURCE_SUFFIXES)


def _blank(match: re.Match) -> str:
    """A preprocessor line, comment or literal becomes spaces, keeping its newlines so line numbers
    stay right; a string keeps its quotes (so `extern "C"` is still recognisable)."""
    text = match.group(0)
    body = re.sub(r"[^\n]", " ", text)
    return ('"' + body[1:-1] + '"') if text.startswith('"') else body


def _paren_free(header: str) -> str:
    """The header with everything inside parentheses removed (a default argument's `=` is not an
    initializer's)."""
    out, depth = [], 0
    for ch in header:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _function_name(header: str) -> str | None:
    outside = re.sub(r"\boperator\s*[^\s\w]+", "operator", _paren_free(header))
    if "(" not in header or "=" in outside:
        return None
    before = header[:header.index("(")]
    match = _NAME.search(before)
    if match:
        return match.group(1).replace(" ", "")
    words = before.split()  # an operator: `bool operator==`
    return words[-1] if words else None


def functions(text: str) -> list[Function]:
    """Every function defined in `text`, in order, with the lines from its signature's first line to
    its closing brace."""
    clean = _LITERAL.sub(_blank, text)
    found: list[Function] = []
    stack: list[tuple[str, str | None, int]] = []  # (kind, function name, first line)
    header, header_line, line = "", 0, 1
    in_function = False  # functions do not nest: a brace inside one is one of its blocks
    for ch in clean:
        if ch == "\n":
            line += 1
        if ch == "{":
            if in_function:
                stack.append(("block", None, line))
            elif _TRANSPARENT.match(header):
                stack.append(("namespace", None, line))
            elif _TYPE.match(header):
                stack.append(("type", None, line))
            else:
                name = _function_name(header)
                stack.append(("fn", name, header_line) if name else ("block", None, line))
                in_function = name is not None
            header = ""
        elif ch == "}":
            if stack:
                kind, name, first = stack.pop()
                if kind == "fn":
                    found.append(Function(name, first, line - first + 1))
                    in_function = False
            header = ""
        elif ch == ";" and not in_function:
            header = ""
        elif not in_function:
            if not header.strip() and not ch.isspace():
                header_line = line
            header += ch
    return found


def longest_function(text: str) -> Function | None:
    found = functions(text)
    return max(found, key=lambda f: f.lines) if found else None
