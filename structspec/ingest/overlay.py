"""Boxes drawn on the pages they point into, as PNGs a person can look at."""

from __future__ import annotations

from pathlib import Path

from structspec.ingest.document import Document

SCALE = 2.0  # pixels per PDF point in the rendered page (144 dpi)
COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def draw_boxes(doc: Document, boxes: dict[str, list[dict]], out_dir: Path, stem: str) -> list[Path]:
    """Each page of `doc` that holds a box, rendered with every box of `boxes` ({pointer:
    [{"page", "box"}]}) outlined and labelled with its pointer; the PNG paths written
    (`{stem}-page{N}.png`)."""
    import pypdfium2 as pdfium
    from PIL import ImageDraw

    pages = sorted({place["page"] for places in boxes.values() for place in places})
    if not pages:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    pdf = pdfium.PdfDocument(doc.source)
    try:
        for number in pages:
            image = pdf[number - 1].render(scale=SCALE).to_pil().convert("RGB")
            draw = ImageDraw.Draw(image)
            for i, (pointer, places) in enumerate(boxes.items()):
                colour = COLOURS[i % len(COLOURS)]
                for place in places:
                    if place["page"] != number:
                        continue
                    x0, y0, x1, y1 = (v * SCALE for v in place["box"])
                    draw.rectangle([x0 - 1, y0 - 1, x1 + 1, y1 + 1], outline=colour, width=2)
                    draw.text((x0, max(y0 - 11, 0)), pointer, fill=colour)
            path = out_dir / f"{stem}-page{number}.png"
            image.save(path)
            written.append(path)
    finally:
        pdf.close()
    return written
