"""Markdown tables for what people read: the audit's report and the benchmarks' RESULTS.md."""

from __future__ import annotations


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
