"""Expert-load heatmap: MoE layers x experts, each cell the expert's share of its layer's routing.

A balanced layer is a uniform row at 1/E; an idle expert is a dark cell, an overloaded one a
bright cell. Drawn with Pillow so no plotting stack is needed; the same RGB array goes to
TensorBoard and to ``expert_load.png`` in the run dir.
"""

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

CELL = 28
MARGIN_LEFT = 64
MARGIN_TOP = 34
MARGIN_BOTTOM = 46
# Dark blue (idle) -> teal -> yellow (overloaded), anchored at 0, the balanced share and 2x it.
ANCHORS = np.array([[20, 24, 82], [33, 145, 140], [253, 231, 37]], np.float64)


def _colour(ratio: float) -> tuple:
    """Colour of a cell whose load is ``ratio`` times the balanced share (clipped at 2)."""
    position = min(max(ratio, 0.0), 2.0)
    low = int(min(position, 1.0))
    frac = position - low
    rgb = ANCHORS[low] * (1 - frac) + ANCHORS[min(low + 1, 2)] * frac
    return tuple(int(round(c)) for c in rgb)


def render_expert_load(counts_LE: np.ndarray, layer_ids, title: str) -> np.ndarray:
    """RGB image ``[H, W, 3]`` uint8 of the load shares in ``counts_LE`` (rows = MoE layers)."""
    num_layers, num_experts = counts_LE.shape
    totals = np.maximum(counts_LE.sum(-1, keepdims=True), 1e-12)
    shares = counts_LE / totals
    width = max(MARGIN_LEFT + num_experts * CELL + 10, 330)
    height = MARGIN_TOP + num_layers * CELL + MARGIN_BOTTOM
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    try:
        font = ImageFont.load_default(size=12)
    except (TypeError, OSError):  # Pillow without FreeType: the small bitmap font
        font = ImageFont.load_default()
    draw.text((4, 4), title, fill=(0, 0, 0), font=font)
    for row, layer_id in enumerate(layer_ids):
        top = MARGIN_TOP + row * CELL
        draw.text((4, top + CELL // 3), f"layer {layer_id}", fill=(0, 0, 0), font=font)
        for expert in range(num_experts):
            left = MARGIN_LEFT + expert * CELL
            draw.rectangle(
                [left, top, left + CELL - 2, top + CELL - 2], fill=_colour(shares[row, expert] * num_experts)
            )
    for expert in range(num_experts):
        draw.text(
            (MARGIN_LEFT + expert * CELL + 6, MARGIN_TOP + num_layers * CELL + 4),
            str(expert),
            fill=(0, 0, 0),
            font=font,
        )
    legend_top = MARGIN_TOP + num_layers * CELL + 24
    for step in range(5):
        draw.rectangle([4 + step * 14, legend_top, 16 + step * 14, legend_top + 12], fill=_colour(step / 2))
    draw.text((80, legend_top), "idle - balanced (1/E) - 2x or more", fill=(0, 0, 0), font=font)
    return np.asarray(image)


def save_png(rgb: np.ndarray, path: Path) -> None:
    """Write atomically so a reader never sees a half-written image."""
    tmp = Path(path).with_suffix(".tmp.png")
    Image.fromarray(rgb).save(tmp)
    tmp.replace(path)
