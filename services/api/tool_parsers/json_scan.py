"""Find top-level JSON objects in text that may still be growing (streaming)."""
from __future__ import annotations


def object_spans(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int | None]]:
    """(start, end) of each top-level `{...}` in text[start:end], in order; the last one's end
    is None while it is unterminated. Characters between objects (",", ";", "[", spaces) are
    skipped; braces inside strings do not count."""
    end = len(text) if end is None else end
    spans: list[tuple[int, int | None]] = []
    depth = 0
    in_string = escaped = False
    obj_start = -1
    for i in range(start, end):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"' and depth > 0:
            in_string = True
        elif ch == "{":
            if depth == 0:
                obj_start = i
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append((obj_start, i + 1))
    if depth > 0:
        spans.append((obj_start, None))
    return spans
