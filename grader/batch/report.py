"""The batch grading report: one readable HTML page, a summary row per student, then details."""
from __future__ import annotations

import os
from html import escape
from pathlib import Path

from grader.results import Graded

STYLE = """body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1.5em}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}
.passed{background:#e6f4ea}.failed,.delegated,.timeout,.crashed,.tampered,.missing,.refused{background:#fce8e6}
.skipped,.unverifiable,.manual{background:#f1f3f4}pre{white-space:pre-wrap;margin:0;font-size:90%}"""


def _manual(g: Graded) -> str:
    return f" (+ {g.manual_points:g} points graded by the instructor)" if g.manual else ""


def render_html(graded: list[Graded], lab: str) -> str:
    rows = "".join(
        f"<tr><td><a href='#{escape(g.student)}'>{escape(g.student)}</a></td>"
        f"<td>{g.points:g} / {g.max_points:g}{escape(_manual(g))}</td><td>{escape(g.reason)}</td></tr>"
        for g in graded
    )
    details = []
    for g in graded:
        notes = "".join(f"<li>{escape(n)}</li>" for n in g.notes)
        tests = "".join(
            f"<tr class='{escape(r.status)}'><td>{escape(r.name)}</td><td>{escape(r.task)}</td>"
            f"<td>{r.points:g} / {r.max_points:g}</td><td>{escape(r.status)}</td>"
            f"<td><pre>{escape(r.message)}</pre></td></tr>"
            for r in g.results
        )
        tests += "".join(
            f"<tr class='manual'><td>{escape(grade_id)}</td><td></td><td>? / {points:g}</td><td>manual</td>"
            f"<td>{points:g} points graded by the instructor</td></tr>"
            for grade_id, points in g.manual
        )
        details.append(
            f"<h2 id='{escape(g.student)}'>{escape(g.student)}: {g.points:g} / {g.max_points:g}{escape(_manual(g))}</h2>"
            + (f"<p><b>{escape(g.reason)}</b></p>" if g.reason else "")
            + (f"<ul>{notes}</ul>" if notes else "")
            + "<table><tr><th>test</th><th>task</th><th>points</th><th>status</th><th>message</th></tr>"
            + tests + "</table>"
        )
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(lab)} grades</title>"
            f"<style>{STYLE}</style></head><body><h1>{escape(lab)}: {len(graded)} submissions</h1>"
            "<table><tr><th>student</th><th>points</th><th>reason</th></tr>"
            f"{rows}</table>{''.join(details)}</body></html>")


def write_html(graded: list[Graded], lab: str, path: Path) -> None:
    """Writes the report atomically (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(render_html(graded, lab))
    os.replace(tmp, path)
