"""The long-context report as tables: markdown for people, JSON for programs.

Rows are scaling types, columns context lengths; a cell is ``loss (ppl)`` in nats per scored token.
"""

import json
import math
from pathlib import Path

JSON_FILE = "long_context.json"
MARKDOWN_FILE = "long_context.md"


def _ratio(length: int, trained_length: int) -> str:
    return f"{length / trained_length:g}×"


def _cell(loss) -> str:
    return "–" if loss is None else f"{loss:.3f} ({math.exp(loss):.1f})"


def best_versus_none(report: dict, key: str = "loss") -> list:
    """Per length beyond the trained one: ``(length, best type, its loss, none's loss)`` by ``key``
    (``loss`` or ``loss_beyond``), when none and another type were run."""
    found = []
    for column in report["columns"]:
        length = column["length"]
        cells = {row["scaling"]: row[key] for row in report["rows"] if row["length"] == length}
        if length <= report["trained_length"] or cells.get("none") is None or len(cells) < 2:
            continue
        best = min((name for name in cells if name != "none"), key=cells.get)
        found.append((length, best, cells[best], cells["none"]))
    return found


def _comparison(best: str, best_loss: float, none_loss: float) -> str:
    delta = best_loss - none_loss
    return (
        f"{best}, loss {best_loss:.3f} vs none {none_loss:.3f}: {delta:+.3f} nats, perplexity "
        f"×{math.exp(delta):.3f} ({'better' if delta < 0 else 'worse'} than none)"
    )


def _table(report: dict, key: str, lengths: list) -> list:
    types = list(dict.fromkeys(row["scaling"] for row in report["rows"]))
    cells = {(row["scaling"], row["length"]): row[key] for row in report["rows"]}
    lines = [
        "| scaling | "
        + " | ".join(f"L={length} ({_ratio(length, report['trained_length'])})" for length in lengths)
        + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name in types:
        lines.append(f"| {name} | " + " | ".join(_cell(cells.get((name, length))) for length in lengths) + " |")
    return lines


def markdown(report: dict) -> str:
    trained = report["trained_length"]
    columns = report["columns"]
    lengths = [column["length"] for column in columns]
    attention = (
        "attention within each document, as in training"
        if report["attention"] == "document"
        else "attention across documents (each window is one document), so context reaches L"
    )
    factor = (
        f"factor = L / {trained} per column"
        if not report["factor"]
        else f"factor = {report['factor']:g} for every column"
    )
    scored = {
        column["length"]: next(row for row in report["rows"] if row["length"] == column["length"]) for column in columns
    }
    lines = [
        f"Checkpoint `{report['checkpoint']}` (step {report['step']}), trained at {trained} tokens; "
        f"{attention}; {factor} (none: no scaling); MoE dispatch {report['dispatch']}.",
        "",
        "Validation loss, nats per scored token (perplexity):",
        "",
    ]
    lines += _table(report, "loss", lengths)
    lines.append("| *unigram baseline* | " + " | ".join(_cell(column["unigram_loss"]) for column in columns) + " |")
    lines.append("| *scaling factor* | " + " | ".join(f"{column['factor']:g}" for column in columns) + " |")
    lines.append(
        "| *windows / scored tokens* | "
        + " | ".join(f"{column['windows']} / {scored[column['length']]['scored_tokens']:,}" for column in columns)
        + " |"
    )
    lines += [
        "",
        f"Only the scored tokens whose context reaches beyond {trained} positions "
        f"(input offset >= {trained} in its attention span):",
        "",
    ]
    lines += _table(report, "loss_beyond", lengths)
    lines.append("| *tokens* | " + " | ".join(f"{scored[length]['beyond_tokens']:,}" for length in lengths) + " |")
    lines.append("")
    beyond = {
        length: (best, best_loss, none_loss)
        for length, best, best_loss, none_loss in best_versus_none(report, "loss_beyond")
    }
    for length, best, best_loss, none_loss in best_versus_none(report):
        line = (
            f"At L={length} ({_ratio(length, trained)}) the best scaling type over all scored tokens is "
            f"{_comparison(best, best_loss, none_loss)}"
        )
        if length in beyond:
            line += f"; over the tokens beyond {trained} it is {_comparison(*beyond[length])}"
        lines.append(line + ".")
    return "\n".join(lines).rstrip() + "\n"


def write_report(report: dict, out_dir: Path) -> tuple:
    """Write ``long_context.json`` and ``long_context.md`` into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = out_dir / JSON_FILE, out_dir / MARKDOWN_FILE
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    markdown_path.write_text(markdown(report), encoding="utf-8")
    return json_path, markdown_path
