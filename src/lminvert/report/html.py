"""One self-contained HTML page from any lminvert outputs: experiment, lab, collision and exhaustive run
directories, and inversion results (``lminvert invert --out result.json``).

Figures are embedded as data URIs, the style sheet is inline, there is no script and no network reference: the page
opens the same from a laptop, a mail attachment or an air-gapped machine. Each run's section is its results.md
(the same text a terminal reader sees) converted with markdown-it; an inversion result is shown as its recovered
text, each token coloured by its margin, uncertain positions marked.
"""

from __future__ import annotations

import base64
import html
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LminvertError
from ..paths import atomic_file, read_json

STYLE = """
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#1b1f23}
h1{border-bottom:2px solid #d0d7de;padding-bottom:.3em}
h2{margin-top:2em;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;margin:1em 0;font-size:13px;display:block;overflow-x:auto}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:right;white-space:nowrap}
th{background:#f6f8fa}td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eaecef}
code{background:#f6f8fa;padding:1px 4px;border-radius:3px}
section.run{margin-top:3em}
.tok{border-radius:3px;padding:0 1px;margin:0 1px;font-family:ui-monospace,monospace;white-space:pre-wrap}
.unc{outline:2px solid #d73a49;background:#ffdce0}
.conf{text-decoration:underline dotted #6a737d}
.legend span{padding:2px 6px;margin-right:6px}
"""


def _data_uri(path: Path) -> str:
    kind = {"png": "image/png", "svg": "image/svg+xml", "jpg": "image/jpeg", "jpeg": "image/jpeg"}
    mime = kind.get(path.suffix.lower().lstrip("."), "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def markdown_to_html(text: str, base: Path) -> str:
    """results.md as HTML, headings one level down (the page has its own title), images embedded."""
    from markdown_it import MarkdownIt

    shifted = re.sub(r"^(#{1,5}) ", r"#\1 ", text, flags=re.MULTILINE)
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(shifted)

    def embed(match: re.Match[str]) -> str:
        source = html.unescape(match.group(1))
        path = base / source
        if "://" in source or not path.is_file():
            return 'src=""'
        return f'src="{_data_uri(path)}"'

    return re.sub(r'src="([^"]*)"', embed, body)


def _margin_colour(margin: float | None, tolerance: float) -> str:
    """Green when the nearest wrong candidate is far outside the acceptance ball, yellow when close."""
    if margin is None or not math.isfinite(margin):
        return "#c7e9c0"
    ratio = max(margin / max(tolerance, 1e-30), 1.0)
    strength = min(math.log10(ratio) / 4, 1.0)  # 1x -> yellow, >= 10^4 x -> green
    red = int(255 - 56 * strength)
    green = int(235 - 2 * strength)
    blue = int(160 + 32 * strength)
    return f"#{red:02x}{green:02x}{blue:02x}"


def verdict_summary(doc: Mapping[str, Any]) -> str:
    """``"12 certified, 8 confident (float source)"``: a result's verdict counts, for the report pages."""
    counts = doc.get("verdict_counts")
    if counts is None:  # a result written before verdicts: uncertain or not
        flagged = len(doc.get("uncertain_positions", []))
        counts = {"certified": len(doc["token_ids"]) - flagged, "uncertain": flagged}
    text = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    return f"{text} ({doc['source']} source)" if doc.get("source") else text


def inversion_html(docs: Sequence[Mapping[str, Any]], name: str) -> str:
    parts = [f"<h2>Inversion: {html.escape(name)}</h2>"]
    for i, doc in enumerate(docs):
        ids = doc["token_ids"]
        tokens = doc.get("tokens") or [f"[{t}]" for t in ids]
        margins = doc.get("margins") or [None] * len(ids)
        distances = doc.get("distances") or [0.0] * len(ids)
        plain = doc.get("plain_distances") or [None] * len(ids)
        uncertain = set(doc.get("uncertain_positions", []))
        verdicts = doc.get("verdicts") or ["uncertain" if t in uncertain else "certified" for t in range(len(ids))]
        tolerance = doc.get("tolerances") or [max(d, 1e-12) for d in distances]
        spans = []
        for t, (tid, tok) in enumerate(zip(ids, tokens, strict=False)):
            margin = margins[t] if t < len(margins) else None
            again = f" (plain forward {plain[t]:.3g})" if t < len(plain) and plain[t] is not None else ""
            title = (
                f"position {t}: id {tid}, {verdicts[t]}, distance {distances[t]:.3g}{again}, margin "
                f"{margin if margin is not None else 'inf'}"
            )
            if t in uncertain:
                spans.append(
                    f'<span class="tok unc" title="{html.escape(title)} (uncertain)">{html.escape(tok)}</span>'
                )
            else:
                colour = _margin_colour(margin, tolerance[t])
                kind = "tok conf" if verdicts[t] == "confident" else "tok"
                spans.append(
                    f'<span class="{kind}" style="background:{colour}" title="{html.escape(title)}">'
                    f"{html.escape(tok)}</span>"
                )
        flagged = ", " + html.escape(verdict_summary(doc))
        parts.append(
            f"<h3>Prompt {i}</h3><p>{len(ids)} tokens at layer {html.escape(str(doc.get('layer')))} of "
            f"{html.escape(str(doc.get('model')))}, {float(doc.get('seconds', 0)):.2f} s, "
            f"{100 * float(doc.get('explored_fraction', 0)):.3f}% of the vocabulary per position{flagged}.</p>"
            f"<p>{''.join(spans)}</p>"
        )
    parts.insert(
        1,
        '<p class="legend">Each token is coloured by its margin (the distance of the nearest rejected candidate over '
        'the acceptance tolerance): <span style="background:#ffebA0">close call</span>'
        '<span style="background:#c7e9c0">far from any other token</span>; verdicts: certified (plain), '
        '<span class="tok conf">confident</span> (dotted), <span class="tok unc">uncertain</span> (outlined red). '
        "Hover a token for its numbers.</p>",
    )
    return "\n".join(parts)


@dataclass(frozen=True)
class RunSection:
    """One output as the report pages see it: its summary line and its markdown (or inversion results)."""

    path: Path
    kind: str
    what: str
    model: str
    seconds: str
    markdown: str = ""  # results.md of a run directory (figure paths relative to ``path``)
    inversions: tuple[Mapping[str, Any], ...] = ()


def collect(path: str | Path) -> RunSection:
    """Read one output: a run directory (experiment, lab, collisions, exhaustive) or an inversion .json."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        docs = read_json(path)
        docs = docs if isinstance(docs, list) else [docs]
        if not docs or not isinstance(docs[0], dict) or "token_ids" not in docs[0]:
            raise LminvertError(f"{path} is not an inversion result (lminvert invert --out result.json writes one)")
        total = sum(float(d.get("seconds", 0.0)) for d in docs)
        return RunSection(path, "inversion", f"{len(docs)} prompts inverted", str(docs[0].get("model", "?")),
                          f"{total:.1f}", inversions=tuple(docs))  # fmt: skip
    if not path.is_dir():
        raise LminvertError(f"{path} is neither an output directory nor an inversion result .json")
    results = path / "results.json"
    if not results.exists():
        raise LminvertError(f"{path} holds no results.json: finish (or resume) its run first")
    doc = read_json(results)
    kind = str(doc.get("kind") or read_json(path / "manifest.json").get("kind", "?"))
    markdown = path / "results.md"
    if kind in ("experiment", "lab", "audit"):
        from .experiments import render_experiment

        render_experiment(doc, path)  # always current with this version's renderer
    if not markdown.exists():
        raise LminvertError(f"{path} has no results.md: render it with lminvert.render(results), then rerun")
    config = doc.get("config", {})
    model = ", ".join(config.get("models", [])) or str(config.get("model", doc.get("model_info", {}).get("model", "?")))
    seconds = doc.get("compute_seconds", doc.get("seconds", doc.get("timings", {}).get("total_seconds")))
    return RunSection(path, kind, str(doc.get("experiment") or kind), model, _seconds(seconds),
                      markdown=markdown.read_text(encoding="utf-8"))  # fmt: skip


def _seconds(value: Any) -> str:
    try:
        return f"{float(value):.1f}"
    except (TypeError, ValueError):
        return "-"


def build_report(paths: Sequence[str | Path], title: str = "lminvert report") -> str:
    if not paths:
        raise LminvertError("give at least one output directory or inversion .json to report on")
    sections, rows = [], []
    for i, raw in enumerate(paths):
        run = collect(raw)
        body = (
            inversion_html(run.inversions, run.path.name)
            if run.inversions
            else markdown_to_html(run.markdown, run.path)
        )
        anchor = f"run{i}"
        sections.append(f'<section class="run" id="{anchor}">{body}</section>')
        rows.append(
            f'<tr><td><a href="#{anchor}">{html.escape(run.path.name or str(run.path))}</a></td>'
            f"<td>{html.escape(run.kind)}</td><td>{html.escape(run.what)}</td>"
            f"<td>{html.escape(run.model)}</td><td>{run.seconds}</td></tr>"
        )
    head = (
        f"<h1>{html.escape(title)}</h1><p>Generated {time.strftime('%Y-%m-%d %H:%M')} from {len(paths)} outputs.</p>"
        "<table><tr><th>output</th><th>kind</th><th>what was run</th><th>models</th><th>compute s</th></tr>"
        + "".join(rows)
        + "</table>"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        + head
        + "\n".join(sections)
        + "</body></html>\n"
    )


def write_report(paths: Sequence[str | Path], out: str | Path, title: str = "lminvert report") -> Path:
    """Write the page to ``out`` (atomically) and return its path."""
    text = build_report(paths, title)
    out = Path(out)
    with atomic_file(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return out
