"""Boxes drawn on the pages they point into, as PNGs a person can look at: a PDF's pages
rendered at 144 dpi, an image's pages (frames) as they are."""

from __future__ import annotations

from pathlib import Path

from structspec.ingest.document import Document
from structspec.ingest.image import page_image
from structspec.ingest.limits import Limits
from structspec.ingest.pdf import MEDIA_TYPE as PDF
from structspec.ingest.pdf import render_scale

SCALE = 2.0  # pixels per PDF point in the rendered page (144 dpi)
A4_HEIGHT_PT = 842  # an image's lines and labels are as thick, for its height, as on a rendered A4 page
COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def draw_boxes(doc: Document, boxes: dict[str, list[dict]], out_dir: Path, stem: str) -> list[Path]:
    """Each page of `doc` that holds a box, rendered with every box of `boxes` ({pointer:
    [{"page", "box"}]}) outlined and labelled with its pointer; the PNG paths written
    (`{stem}-page{N}.png`)."""
    from PIL import ImageDraw, ImageFont

    pages = sorted({place["page"] for places in boxes.values() for place in places})
    if not pages:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for number, image, scale in _page_images(doc, pages):
        k = 1.0 if doc.media_type == PDF else max(image.height / (A4_HEIGHT_PT * SCALE), 1.0)
        font = None if k == 1.0 else ImageFont.load_default(size=round(11 * k))
        draw = ImageDraw.Draw(image)
        for i, (pointer, places) in enumerate(boxes.items()):
            colour = COLOURS[i % len(COLOURS)]
            for place in places:
                if place["page"] != number:
                    continue
                x0, y0, x1, y1 = (v * scale for v in place["box"])
                draw.rectangle([x0 - k, y0 - k, x1 + k, y1 + k], outline=colour, width=round(2 * k))
                draw.text((x0, max(y0 - 11 * k, 0)), pointer, fill=colour, font=font)
        path = out_dir / f"{stem}-page{number}.png"
        image.save(path)
        written.append(path)
    return written


def _page_images(doc: Document, pages: list[int]):
    """(page number, its image in RGB, pixels per unit of its boxes) for each of `pages`."""
    if doc.media_type != PDF:
        for number in pages:
            yield number, page_image(doc.source, doc.media_type, number), 1.0
        return
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(doc.source)
    try:
        for number in pages:
            page = pdf[number - 1]
            scale = min(SCALE, render_scale(*page.get_size(), Limits().max_page_pixels))  # a huge page: smaller
            yield number, page.render(scale=scale).to_pil().convert("RGB"), scale
    finally:
        pdf.close()
