"""Three-way merges and names from titles."""

from __future__ import annotations

import difflib
import re
import unicodedata

from notesvc.notes.paths import FRONT_MATTER_RE, PREVIEW_CHARS

# -- three-way merges and names from titles (docs/api.md: phone) ------------------------------


MERGE_MAX_EDITS = 500  # lines added or removed between two versions that a merge follows


class _LineDiff:
    """What two lists of lines share, as difflib's get_matching_blocks/get_opcodes say it,
    found by Myers' O(ND) algorithm after the common start and end are set aside (an edit
    is mostly one place in a long note). Beyond MERGE_MAX_EDITS changed lines the middle
    counts as replaced whole: a merge there becomes a conflict copy, never a long stall."""

    def __init__(self, a: list, b: list):
        n, m = len(a), len(b)
        pre = 0
        while pre < n and pre < m and a[pre] == b[pre]:
            pre += 1
        suf = 0
        while suf < n - pre and suf < m - pre and a[n - 1 - suf] == b[m - 1 - suf]:
            suf += 1
        middle = _myers(a[pre : n - suf], b[pre : m - suf], MERGE_MAX_EDITS) or []
        blocks = [(0, 0, pre)] + [(i + pre, j + pre, k) for i, j, k in middle]
        blocks.append((n - suf, m - suf, suf))
        joined: list = []
        for i, j, k in blocks:
            if (
                k
                and joined
                and joined[-1][0] + joined[-1][2] == i
                and joined[-1][1] + joined[-1][2] == j
            ):
                joined[-1] = (joined[-1][0], joined[-1][1], joined[-1][2] + k)
            elif k:
                joined.append((i, j, k))
        self.blocks = [*joined, (n, m, 0)]

    def get_matching_blocks(self) -> list:
        return self.blocks

    def get_opcodes(self) -> list:
        ops, i, j = [], 0, 0
        for ai, bj, size in self.blocks:
            if i < ai or j < bj:
                tag = "replace" if i < ai and j < bj else "delete" if i < ai else "insert"
                ops.append((tag, i, ai, j, bj))
            if size:
                ops.append(("equal", ai, ai + size, bj, bj + size))
            i, j = ai + size, bj + size
        return ops


def _myers(a: list, b: list, limit: int) -> list | None:
    """Return the matching blocks (i, j, size) of a shortest edit script from a to b, or
    None when it takes more than `limit` lines added and removed."""
    n, m = len(a), len(b)
    if not n or not m:
        return []
    v, trace = {1: 0}, []
    for d in range(min(n + m, limit) + 1):
        trace.append(v.copy())
        for k in range(-d, d + 1, 2):
            x = v[k + 1] if k == -d or (k != d and v[k - 1] < v[k + 1]) else v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return _snakes(trace, n, m)
    return None


def _snakes(trace: list, x: int, y: int) -> list:
    """Walk Myers' trace back from (x, y): the diagonal runs, first to last."""
    blocks = []
    for d in range(len(trace) - 1, 0, -1):
        v, k = trace[d], x - y
        prev = k + 1 if k == -d or (k != d and v[k - 1] < v[k + 1]) else k - 1
        px = v[prev]
        py = px - prev
        sx = px if prev == k + 1 else px + 1  # where this step's run begins
        if x > sx:
            blocks.append((sx, sx - k, x - sx))
        x, y = px, py
    if x > 0:
        blocks.append((0, 0, x))
    return blocks[::-1]


def _diff(base: list, other: list) -> _LineDiff:
    """Return the line matcher of base to other, lines compared without their endings (a
    note saved with CRLF changes nothing)."""
    return _LineDiff([x.rstrip("\r\n") for x in base], [x.rstrip("\r\n") for x in other])


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two changes touch the same base lines (two insertions at one place do)."""
    if a[0] == a[1] and b[0] == b[1]:
        return a[0] == b[0]
    if a[0] == a[1]:
        return b[0] < a[0] < b[1]
    if b[0] == b[1]:
        return a[0] < b[0] < a[1]
    return a[0] < b[1] and b[0] < a[1]


def _already_made(h: tuple, changes: list) -> bool:
    """Whether an insertion is part of a change the other side made right there (an edit
    sent again after it was merged): its lines end that change where it inserts after
    it, or begin it where it inserts before it."""
    if h[0] != h[1] or not h[2]:
        return False
    wanted, n = [x.rstrip("\r\n") for x in h[2]], len(h[2])
    for g in changes:
        if g[3] == h[3] or g[0] == g[1] or len(g[2]) < n:
            continue
        lines = [x.rstrip("\r\n") for x in g[2]]
        if (g[1] == h[0] and lines[-n:] == wanted) or (g[0] == h[0] and lines[:n] == wanted):
            return True
    return False


def _apply(base: list, lo: int, hi: int, hunks: list) -> list:
    """Return base[lo:hi] with hunks (start, end, lines; inside that range, in order)."""
    out, at = [], lo
    for i1, i2, lines, _ in hunks:
        out += base[at:i1] + lines
        at = i2
    return out + base[at:hi]


def merge3(base: str, current: str, edit: str) -> tuple:
    """Return (the merged text, whether any change of the edit overlapped one of current's)
    of a three-way line merge: changes on one side are kept, identical changes on both sides
    once, overlapping different ones are a conflict (the current text wins there). Lines
    neither side changed keep current's endings.

    >>> merge3("a\\nb\\nc\\n", "A\\nb\\nc\\n", "a\\nb\\nC\\n")
    ('A\\nb\\nC\\n', False)
    >>> merge3("a\\n", "b\\n", "c\\n")[1]
    True
    """
    b, c, e = (t.splitlines(keepends=True) for t in (base, current, edit))
    for side in (b, c, e):  # a last line without its newline, followed by more: add it
        if side and not side[-1].endswith(("\n", "\r")):
            side[-1] += "\n"
    to_current = _diff(b, c)
    kept = b[:]  # base lines as current has them, where it kept them
    for i, j, n in to_current.get_matching_blocks():
        kept[i : i + n] = c[j : j + n]
    changes = [
        (i1, i2, other[j1:j2], side)
        for side, other, matcher in ((0, c, to_current), (1, e, _diff(b, e)))
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
    ]
    changes = [h for h in changes if not _already_made(h, changes)]
    changes.sort(key=lambda h: (h[0], h[1], h[3]))
    groups: list = []
    for h in changes:
        if groups and any(_overlap(h, g) for g in groups[-1]):
            groups[-1].append(h)
        else:
            groups.append([h])
    out, at, conflict = [], 0, False
    for group in groups:
        lo, hi = min(g[0] for g in group), max(g[1] for g in group)
        out += kept[at:lo]
        ours = [g for g in group if g[3] == 0]
        edited = [g for g in group if g[3] == 1]
        if ours and edited:
            mine, theirs = _apply(b, lo, hi, ours), _apply(b, lo, hi, edited)
            conflict = conflict or [x.rstrip("\r\n") for x in mine] != [
                x.rstrip("\r\n") for x in theirs
            ]
            out += mine
        else:
            out += _apply(b, lo, hi, ours or edited)
        at = hi
    out += kept[at:]
    return _last_ending("".join(out), base, current, edit), conflict


def _ends_line(text: str) -> bool:
    return not text or text.endswith(("\n", "\r"))


def _last_ending(merged: str, base: str, current: str, edit: str) -> str:
    """Return merged with the note's last-line ending: current's, unless only the edit
    changed whether the note ends with a newline (merge3 gave every last line one).

    >>> merge3("a\\nb\\nc", "A\\nb\\nc", "a\\nb\\nC")
    ('A\\nb\\nC', False)
    """
    ends = _ends_line(current)
    if _ends_line(edit) != _ends_line(base) and ends == _ends_line(base):
        ends = _ends_line(edit)
    if ends or not merged:
        return merged
    return merged[:-2] if merged.endswith("\r\n") else merged[:-1]


SUMMARY_DIFF_CELLS = 250_000  # past this many (old lines x new lines) changed, lines are counted


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def change_summary(old: bytes, new: bytes) -> str:
    """Return what a change of a note's text did, in a few words ("+2 lines, 1 changed").
    Cheap: the lines both keep at the start and the end are set aside, and the rest is
    compared line-wise (counted only, past SUMMARY_DIFF_CELLS).

    >>> change_summary(b"a\\nb\\n", b"a\\nB\\nc\\nd\\n"), change_summary(b"a\\nb\\n", b"b\\n")
    ('+2 lines, 1 changed', '-1 line')
    """
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)  # UTF-8: line-safe
    both = min(len(a), len(b))
    start = next((i for i in range(both) if a[i] != b[i]), both)
    end = next((i for i in range(both - start) if a[-1 - i] != b[-1 - i]), both - start)
    a, b = a[start : len(a) - end], b[start : len(b) - end]
    # counted: past SUMMARY_DIFF_CELLS, and one line typed (the common case: difflib 10 µs)
    if len(a) * len(b) > SUMMARY_DIFF_CELLS or (len(a) <= 1 and len(b) <= 1):
        blocks = [("replace", 0, len(a), 0, len(b))]
    else:
        blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    added = removed = changed = 0
    for tag, i1, i2, j1, j2 in blocks:
        if tag != "equal":
            both = min(i2 - i1, j2 - j1)
            changed += both
            added += j2 - j1 - both
            removed += i2 - i1 - both
    parts = [f"+{_plural(added, 'line')}"] if added else []
    parts += [f"-{_plural(removed, 'line')}"] if removed else []
    if changed:
        parts.append(f"{changed} changed" if parts else f"{_plural(changed, 'line')} changed")
    return ", ".join(parts) or "no change in its lines"


MAX_DIFF_LINES = 5000  # difflib is quadratic on some inputs: past this, one plain hunk


def _diff_range(start: int, length: int) -> str:
    """Return a unified diff's range (as difflib writes it) of `length` lines from `start`."""
    if length == 1:
        return str(start + 1)
    return f"{start + 1 if length else start},{length}"


def unified_diff(a: str, b: str, from_name: str, to_name: str) -> str:
    """Return the unified diff from text a to text b, in time linear in their size past
    MAX_DIFF_LINES changed lines (the changed middle is then one hunk, not minimal)."""
    x, y = a.splitlines(keepends=True), b.splitlines(keepends=True)
    head = 0
    while head < min(len(x), len(y)) and x[head] == y[head]:
        head += 1
    tail = 0
    while tail < min(len(x), len(y)) - head and x[-1 - tail] == y[-1 - tail]:
        tail += 1
    if max(len(x), len(y)) - head - tail > MAX_DIFF_LINES:
        old, new = x[head : len(x) - tail], y[head : len(y) - tail]
        lines = [
            f"--- {from_name}\n",
            f"+++ {to_name}\n",
            f"@@ -{_diff_range(head, len(old))} +{_diff_range(head, len(new))} @@\n",
            *("-" + line for line in old),
            *("+" + line for line in new),
        ]
    else:  # only the changed middle, with its context, goes through difflib
        lo = max(0, head - 3)
        x_end, y_end = len(x) - max(0, tail - 3), len(y) - max(0, tail - 3)
        lines = []
        for line in difflib.unified_diff(x[lo:x_end], y[lo:y_end], from_name, to_name):
            if line.startswith("@@"):
                line = re.sub(
                    r"([-+])(\d+)", lambda m: f"{m.group(1)}{int(m.group(2)) + lo}", line, count=2
                )
            lines.append(line)
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


_NAME_DROP_RE = re.compile(
    r'[\x00-\x1f\x7f-\x9f/\\:*?"<>|\u200b-\u200d\u2060\ufeff\u202a-\u202e\u2066-\u2069]'
)
_ANY_HEADING_RE = re.compile(r"^ {0,3}#{1,6}[ \t]+(\S[^\n]*?)[ \t#]*$", re.M)


def title_filename(text: str) -> str:
    """Return the file name (without .md) a note without a path gets from its text: its
    first heading, else its first line, made a safe name of at most 80 characters and 200
    bytes ("untitled" when nothing is left).

    >>> title_filename("\\n  Buy milk: 2 l / 3 eggs?  \\n"), title_filename("## ...\\n")
    ('Buy milk 2 l 3 eggs', 'untitled')
    """
    fm = FRONT_MATTER_RE.match(text)
    body = text[fm.end() :] if fm else text
    heading = _ANY_HEADING_RE.search(body[: PREVIEW_CHARS * 64])
    first = next((line for line in body.splitlines() if line.strip()), "")
    name = unicodedata.normalize("NFC", heading.group(1) if heading else first)
    name = " ".join(_NAME_DROP_RE.sub(" ", name).split())
    name = name.lstrip(".").rstrip(". ")[:80]
    while len(name.encode("utf-8")) > 200:
        name = name[:-1]
    return name.rstrip(". ") or "untitled"


def sort_key(name: str) -> tuple:
    return (name.casefold(), name)
