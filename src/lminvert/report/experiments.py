"""results.md and figures of an experiment (or lab) run, from its results.json document alone."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..paths import atomic_file
from .figures import plot_spec
from .text import fmt


def _cell(value: Any) -> str:
    return fmt(value).replace("|", "\\|")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def command_line(doc: Mapping[str, Any]) -> str:
    config = doc["config"]
    name = doc.get("experiment", "")
    verb = {"lab": "lminvert lab", "audit": "lminvert audit"}.get(doc.get("kind", ""), "lminvert experiment")
    parts = [verb] if doc.get("kind") == "audit" else [verb, name]
    if config.get("quick"):
        parts.append("--quick")
    models = config.get("models", [])
    if len(models) == 1:
        parts.append(f"--model {models[0]}")
    if doc.get("kind") != "lab" and doc.get("dtype") not in (None, "float32"):  # labs build their own models
        parts.append(f"--dtype {doc['dtype']}")
    if config.get("seed"):
        parts.append(f"--seed {config['seed']}")
    for key, value in doc.get("overrides", {}).items():
        text = json.dumps(value, separators=(",", ":"))
        parts.append(
            f"--size {key}={text}" if text.replace(".", "").replace("-", "").isalnum() else f"--size '{key}={text}'"
        )
    parts.append("--out DIR")
    return " ".join(parts)


def run_line(doc: Mapping[str, Any]) -> str:
    machine = doc.get("machine", {})
    versions = doc.get("versions", {})
    device = machine.get("cuda") or f"{machine.get('cpu', 'CPU')} ({doc.get('threads', '?')} threads)"
    size = "quick" if doc["config"].get("quick") else "full"
    dtype = f", dtype {doc['dtype']}" if doc.get("dtype") else ""
    return (
        f"{size} size, models {', '.join(doc['config'].get('models', []))}, seed {doc['config'].get('seed', 0)}; "
        f"{len(doc.get('units_seconds', {}))} units in {doc.get('compute_seconds', 0):.0f} s of compute "
        f"({doc.get('units_resumed', 0)} resumed); {device}; torch {versions.get('torch', '?')}{dtype}"
    )


def experiment_markdown(doc: Mapping[str, Any], figure_paths: Mapping[str, str]) -> str:
    summary = doc.get("summary", {})
    lines = [f"# {doc.get('title') or doc.get('experiment')}", ""]
    if doc.get("paper"):
        lines += [f"**The paper.** {doc['paper']}", ""]
    lines += [f"**This run.** {run_line(doc)}. Reproduce: `{command_line(doc)}`.", ""]
    if doc.get("full_duration"):
        lines += [f"Full size on the reference 2-core CPU: {doc['full_duration']}.", ""]
    for table in summary.get("tables", []):
        lines += [f"## {table['title']}", ""]
        lines += markdown_table(table["columns"], table["rows"])
        if table.get("note"):
            lines += ["", table["note"]]
        lines.append("")
    for spec in summary.get("figures", []):
        path = figure_paths.get(spec["name"])
        if path:
            lines += [f"![{spec['caption']}]({path})", "", f"*{spec['caption']}*", ""]
    if summary.get("notes"):
        lines += ["## Notes", ""] + [f"- {note}" for note in summary["notes"]] + [""]
    return "\n".join(lines)


def render_experiment(doc: Mapping[str, Any], directory: str | Path, figures: bool = True) -> dict[str, str]:
    """Write results.md and figures/<name>.png (and .svg) into ``directory`` from a results document."""
    directory = Path(directory)
    figure_paths: dict[str, str] = {}
    out: dict[str, str] = {}
    for spec in doc.get("summary", {}).get("figures", []):
        if spec.get("kind") == "file":
            if spec.get("path") and (directory / spec["path"]).exists():
                figure_paths[spec["name"]] = spec["path"]
            continue
        if not figures:
            continue
        relative = f"figures/{spec['name']}.png"
        plot_spec(spec, directory / relative)
        plot_spec(spec, directory / f"figures/{spec['name']}.svg")
        figure_paths[spec["name"]] = relative
    with atomic_file(directory / "results.md") as tmp:
        tmp.write_text(experiment_markdown(doc, figure_paths), encoding="utf-8")
    out["markdown"] = str(directory / "results.md")
    out.update({f"figure:{k}": str(directory / v) for k, v in figure_paths.items()})
    return out
