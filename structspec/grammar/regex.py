"""User regexes (`pattern`, `patternProperties`, `format: regex`) on a linear-time engine.

A schema's patterns are the tenant's input, and a backtracking engine (Python's `re`, which
jsonschema uses) can take time exponential in the string's length: `^(a+)+b$` against sixty
`a`s never ends, and a worker validating such a result would stall its whole batch. Every
pattern the service runs therefore runs on RE2 (google-re2), whose matching time is linear in
the input, after a translation from JSON Schema's dialect (ECMA-262) to RE2's:

- `\\uXXXX`, `\\u{X…}` become `\\x{…}`; `\\cX` the control character; `\\/` a slash;
- `.` excludes every ECMA line terminator (\\n, \\r, U+2028, U+2029), and `\\s` / `\\S` take
  ECMA's white space set (RE2's is ASCII only); `\\d`, `\\w`, `\\b` are ASCII in both;
- `(?<name>…)` becomes `(?P<name>…)`; `[\\b]` a backspace, `\\0` NUL; `\\p{Script=Greek}`,
  `\\p{gc=Lu}` and the like `\\p{Greek}`, `\\p{Lu}` (RE2 takes the value alone).

What RE2 cannot run in linear time is refused with the reason (`PatternError`): look-ahead and
look-behind, back-references (`\\1`, `\\k<name>`). So is a pattern RE2 cannot parse, or one
whose program is over RE2's memory limit (a pattern of huge counted repetitions).

`grammar/validation.py` points jsonschema's keyword implementations at `search` below, so
result validation never touches `re` with a user pattern; registration (`check_patterns`)
refuses what `search` could not run, naming the pattern's JSON pointer.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import re2

# ECMA-262 WhiteSpace and LineTerminator, as the inside of a character class
_ECMA_SPACE = r"\t\n\x{b}\f\r \x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}\x{feff}"
_DOT = r"[^\n\r\x{2028}\x{2029}]"
_HEX = set("0123456789abcdefABCDEF")
# keywords whose values are data, not subschemas: a "pattern" key inside them is no pattern
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# ECMA's \p{Key=Value} keys whose value RE2 takes as \p{Value}
_PROPERTY_KEYS = frozenset({"Script", "sc", "Script_Extensions", "scx", "General_Category", "gc"})


_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is the caller's error to report, not a log line


class PatternError(ValueError):
    """A pattern the service cannot run on its linear-time engine; the message says why."""


def translate(pattern: str) -> str:
    """The RE2 form of an ECMA-262 `pattern`; PatternError for what RE2 cannot do."""
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise PatternError("the pattern ends with a lone backslash")
            e = pattern[i + 1]
            i += 2
            if e == "u":
                if i < n and pattern[i] == "{":
                    end = pattern.find("}", i)
                    digits = pattern[i + 1:end] if end > 0 else ""
                    if not digits or not set(digits) <= _HEX:
                        raise PatternError(f"invalid escape \\u{pattern[i:i + 8]}")
                    out.append(f"\\x{{{digits}}}")
                    i = end + 1
                else:
                    digits = pattern[i:i + 4]
                    if len(digits) != 4 or not set(digits) <= _HEX:
                        raise PatternError(f"invalid escape \\u{digits} (\\u takes four hex digits)")
                    out.append(f"\\x{{{digits}}}")
                    i += 4
            elif e == "c":
                if i >= n or not pattern[i].isascii() or not pattern[i].isalpha():
                    raise PatternError("invalid escape \\c (it takes a letter)")
                out.append(f"\\x{{{ord(pattern[i]) % 32:x}}}")
                i += 1
            elif e in "123456789":
                raise PatternError(f"back-reference \\{e} is not supported: patterns run on a linear-time "
                                   "engine (RE2)")
            elif e == "k" and i < n and pattern[i] == "<":
                raise PatternError("named back-reference \\k<…> is not supported: patterns run on a "
                                   "linear-time engine (RE2)")
            elif e == "s":
                out.append(_ECMA_SPACE if in_class else f"[{_ECMA_SPACE}]")
            elif e == "S" and not in_class:
                out.append(f"[^{_ECMA_SPACE}]")
            elif e == "/":
                out.append("/")
            elif e == "b" and in_class:  # ECMA: [\b] is a backspace, not a word boundary
                out.append("\\x{8}")
            elif e == "0" and not (i < n and pattern[i].isdigit()):  # ECMA's \0: NUL
                out.append("\\x{0}")
            elif e in "pP" and i < n and pattern[i] == "{":
                end = pattern.find("}", i)
                if end < 0:
                    raise PatternError(f"unterminated property escape \\{e}{pattern[i:i + 12]}")
                name, value = pattern[i + 1:end].partition("=")[::2]
                if value and name not in _PROPERTY_KEYS:
                    raise PatternError(f"unsupported property \\{e}{{{pattern[i + 1:end]}}}: "
                                       "a script or general category is supported")
                out.append(f"\\{e}{{{value or name}}}")  # RE2 takes the value alone
                i = end + 1
            else:
                out.append("\\" + e)
            continue
        if in_class:
            if c == "]":
                in_class = False
            elif c == "[" and pattern.startswith("[:", i):
                out.append("\\[")  # ECMA has no POSIX classes: a literal bracket
                i += 1
                continue
            out.append(c)
            i += 1
            continue
        if c == "[":
            negated = pattern.startswith("^", i + 1)
            i += 2 if negated else 1
            if pattern.startswith("]", i):  # ECMA: `[^]` matches any character, `[]` none
                if not negated:
                    raise PatternError("an empty class [] matches nothing")
                out.append("[\\x{0}-\\x{10ffff}]")
                i += 1
                continue
            in_class = True
            out.append("[^" if negated else "[")
            continue
        if c == "(" and pattern.startswith("(?", i):
            rest = pattern[i + 2:i + 4]
            if rest[:1] in ("=", "!") or rest in ("<=", "<!"):
                raise PatternError("look-ahead and look-behind ((?=…), (?!…), (?<=…), (?<!…)) are not supported: "
                                   "patterns run on a linear-time engine (RE2)")
            if rest[:1] == "<":
                out.append("(?P<")
                i += 3
                continue
        if c == ".":
            out.append(_DOT)
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def compiled(pattern: str):
    """The compiled RE2 program of an ECMA-262 pattern (cached); PatternError if it cannot be."""
    translated = translate(pattern)
    try:
        return re2.compile(translated, options=_OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise PatternError(f"invalid pattern: {reason}") from None


def search(pattern: str, string: str, flags: int = 0) -> bool:
    """Whether `pattern` matches somewhere in `string` (JSON Schema's unanchored match), in time
    linear in `string`. The signature of `re.search`, for jsonschema's keyword code."""
    return compiled(pattern).search(string) is not None


def is_regex(value: object) -> bool:
    """The `regex` format: an ECMA-262 pattern the service can run (PatternError otherwise)."""
    if isinstance(value, str):
        compiled(value)
    return True


def schema_patterns(schema: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """(path, pattern) of every `pattern` and every `patternProperties` key in `schema`."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in _DATA_KEYWORDS:
                continue
            if key == "pattern" and isinstance(value, str):
                yield path + (key,), value
            elif key == "patternProperties" and isinstance(value, dict):
                for name in value:
                    yield path + (key, name), name
            yield from schema_patterns(value, path + (key,))
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from schema_patterns(item, path + (i,))
