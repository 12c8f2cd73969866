"""Synthetic shop receipts for schemas/receipt.json, generated deterministically from a seed.

There is no receipt dataset: these imitate examples/receipt-*.txt (a header with the shop's
name and address, a date in one of several printed formats, item lines with prices, a total,
how it was paid) with enough variety that prompt lookup and the model see different text in
every document: shop, city, currency, layout, item count, tax lines, payment wording. Each
receipt comes with its gold value (what a perfect extraction returns), so benchmarks can grade.
Outputs are short: 2-5 items make ~45-80 output tokens with the default model's tokenizer.

`python -m bench.receipts --n 32 --out receipts.jsonl` writes them as a dataset for
`python -m bench.harness --dataset` ({id, schema, text, gold} per line; one schema for all).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

RECEIPT_SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "receipt.json"

SHOPS = [
    ("The Corner Cafe", "88 High Street, Bristol BS1 2AW", "GBP", "cafe"),
    ("SUNRISE MART SDN BHD", "12 Jalan Ampang, 50450 Kuala Lumpur", "RM", "grocery"),
    ("Bakkerij de Molen", "Molenstraat 14, 2513 BK Den Haag", "EUR", "bakery"),
    ("Green Leaf Grocers", "301 Elm Avenue, Portland OR 97204", "$", "grocery"),
    ("Kaffeehaus Lindner", "Lindengasse 7, 1070 Wien", "EUR", "cafe"),
    ("HARBOUR HARDWARE", "2 Quay Road, Hobart TAS 7000", "AUD", "hardware"),
    ("Papeterie Martin", "23 rue des Carmes, 31000 Toulouse", "EUR", "stationery"),
    ("Maple Street Pharmacy", "415 Maple Street, Toronto ON M5V 2T6", "CAD", "pharmacy"),
    ("Taqueria El Sol", "1920 Mission St, San Francisco CA 94103", "$", "food"),
    ("NORDIC BOOKS AB", "Drottninggatan 55, 111 21 Stockholm", "SEK", "books"),
    ("Sakura Ramen House", "3-14-2 Shibuya, Tokyo 150-0002", "JPY", "food"),
    ("Fresh & Co. Market", "77 Orchard Road, Singapore 238839", "SGD", "grocery"),
]
ITEMS = {
    "cafe": [("Flat white", 3.4), ("Almond croissant", 2.95), ("Orange juice", 2.5), ("Espresso", 2.2),
             ("Blueberry muffin", 2.75), ("Cappuccino", 3.1), ("Cheese toastie", 5.5), ("Chai latte", 3.6)],
    "grocery": [("Milo 1kg", 21.5), ("Gardenia Bread", 4.2), ("Eggs (10)", 6.8), ("Mineral Water 1.5L", 2.1),
                ("Bananas 1kg", 1.89), ("Basmati rice 5kg", 12.99), ("Olive oil 1L", 8.49), ("Greek yogurt", 3.25),
                ("Cheddar 400g", 5.79), ("Tomatoes", 2.35)],
    "bakery": [("Volkorenbrood", 3.25), ("Appeltaart punt", 3.75), ("Croissant", 1.6), ("Stroopwafels", 2.95),
               ("Krentenbol", 0.85), ("Roggebrood", 2.6)],
    "hardware": [("Claw hammer", 24.95), ("Wood screws 100pk", 8.5), ("Masking tape", 4.2), ("Sandpaper P120", 3.9),
                 ("LED bulb E27", 6.75), ("Paint brush 50mm", 7.3), ("Cable ties", 5.15)],
    "stationery": [("Carnet A5", 6.9), ("Stylo plume", 18.5), ("Cartouches encre", 3.2), ("Agenda 2024", 14.9),
                   ("Crayons de couleur", 7.45), ("Enveloppes x25", 4.1)],
    "pharmacy": [("Ibuprofen 200mg", 9.99), ("Vitamin D3", 12.49), ("Hand cream", 7.25), ("Bandages", 4.79),
                 ("Cough syrup", 11.3), ("Sunscreen SPF50", 15.99)],
    "food": [("Carne asada burrito", 11.5), ("Chips & salsa", 4.25), ("Horchata", 3.75), ("Fish taco", 5.25),
             ("Tonkotsu ramen", 12.0), ("Gyoza (6)", 6.5), ("Green tea", 2.0), ("Quesadilla", 8.95)],
    "books": [("Pippi Langstrump", 129.0), ("Notebook", 45.0), ("Bokmarke", 19.0), ("Kartbok Sverige", 249.0),
              ("Deckare pocket", 99.0)],
}
CASHIERS = ["Aina", "Tom", "Lena", "Marco", "Yuki", "Priya", "Sam", "Ines"]
CARDS = ["VISA", "Mastercard", "AMEX", "Maestro"]
OTHER_PAYMENTS = ["Store voucher", "Gift card", "Mobile wallet (QR)", "Bank transfer", "Loyalty points"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
THANKS = ["Thank you, please come again!", "Thanks for shopping with us", "Merci de votre visite",
          "Bedankt en tot ziens", "Tack for ditt kop", "Keep this receipt for returns within 30 days", ""]


def receipts(n: int, seed: int = 0) -> list[dict]:
    """n receipts {id, text, gold}; the same (n, seed) always gives the same receipts, and the
    first m of receipts(n, seed) are receipts(m, seed)."""
    return [receipt(random.Random(f"{seed}:{i}"), f"receipt-{seed}-{i}") for i in range(n)]


def receipt_rows(n: int, seed: int = 0) -> list[dict]:
    """receipts(n, seed), each with schemas/receipt.json as its schema (a benchmark dataset)."""
    schema = json.loads(RECEIPT_SCHEMA.read_text())
    return [{**r, "schema": schema} for r in receipts(n, seed)]


def receipt(rng: random.Random, rid: str) -> dict:
    merchant, address, currency, kind = rng.choice(SHOPS)
    date = _date(rng)
    items = _items(rng, kind, currency)
    subtotal = round(sum(price for _, price in items), 2)
    tax = round(subtotal * rng.choice([0.05, 0.08, 0.1, 0.2]), 2) if rng.random() < 0.35 else 0.0
    total = round(subtotal + tax, 2)
    payment, paid_lines = _payment(rng, total, currency)
    width = rng.choice([30, 34, 40])
    lines = [merchant, address]
    if rng.random() < 0.5:
        lines.append(f"Tel: {rng.randint(10, 99)}-{rng.randint(1000, 9999)} {rng.randint(1000, 9999)}")
    lines.append("")
    if rng.random() < 0.5:
        lines.append(f"Date: {date}   Cashier: {rng.choice(CASHIERS)}")
    else:
        lines.append(date)
    lines.append("")
    lines += [_line(name, price, currency, width) for name, price in items]
    lines.append("")
    if tax:
        lines.append(_line("Subtotal", subtotal, currency, width))
        lines.append(_line("Tax", tax, currency, width))
    lines.append(_line(rng.choice(["Total", "TOTAL", "Amount due"]), total, currency, width))
    lines += paid_lines
    thanks = rng.choice(THANKS)
    if thanks:
        lines += ["", thanks]
    gold = {"merchant": merchant, "date": date, "items": [{"name": n, "price": p} for n, p in items],
            "total": total, "payment": payment}
    return {"id": rid, "text": "\n".join(lines) + "\n", "gold": gold}


def _date(rng: random.Random) -> str:
    y, m, d = rng.randint(2021, 2025), rng.randint(1, 12), rng.randint(1, 28)
    hh, mm = rng.randint(7, 21), rng.randint(0, 59)
    fmt = rng.randrange(5)
    if fmt == 0:
        return f"{y}-{m:02d}-{d:02d} {hh:02d}:{mm:02d}"
    if fmt == 1:
        return f"{d:02d}/{m:02d}/{y}"
    if fmt == 2:
        return f"{d:02d}.{m:02d}.{y} {hh:02d}:{mm:02d}"
    if fmt == 3:
        return f"{MONTHS[m - 1]} {d}, {y} {(hh - 1) % 12 + 1}:{mm:02d} {'AM' if hh < 12 else 'PM'}"
    return f"{d:02d}-{MONTHS[m - 1]}-{y}"


def _items(rng: random.Random, kind: str, currency: str) -> list[tuple[str, float]]:
    picked = rng.sample(ITEMS[kind], rng.randint(2, min(5, len(ITEMS[kind]))))
    out = []
    for name, price in picked:
        price = round(price * rng.choice([1.0, 1.0, 1.1, 0.9]), 2)
        if currency == "JPY":
            price = float(round(price * 100))  # yen have no cents
        out.append((name, price))
    return out


def _money(value: float, currency: str) -> str:
    return f"{value:.0f}" if currency == "JPY" else f"{value:.2f}"


def _line(label: str, value: float, currency: str, width: int) -> str:
    amount = f"{currency} {_money(value, currency)}" if currency in ("RM", "$") else _money(value, currency)
    return f"{label:<{width - len(amount) - 1}} {amount}"


def _payment(rng: random.Random, total: float, currency: str) -> tuple[str, list[str]]:
    """(the schema's payment value, the lines printed for it)."""
    r = rng.random()
    if r < 0.4:
        tendered = float(int(total) + rng.choice([1, 5, 10])) if currency != "JPY" else total + 1000
        return "cash", [f"Cash tendered {_money(tendered, currency)} {currency}",
                        f"Change {_money(tendered - total, currency)}"]
    if r < 0.8:
        card = rng.choice(CARDS)
        return "card", [rng.choice([f"Paid by: {card} card ****{rng.randint(1000, 9999)}",
                                    f"{card} contactless ****{rng.randint(1000, 9999)}",
                                    f"Card payment ({card})"])]
    return "other", [f"Paid with: {rng.choice(OTHER_PAYMENTS)}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.receipts",
                                description="Write synthetic receipts as a JSONL dataset (one schema for all).")
    p.add_argument("--n", type=int, default=32, help="receipts (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same receipts")
    p.add_argument("--out", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in receipt_rows(args.n, args.seed)),
                   encoding="utf-8")
    print(f"{args.n} receipts written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
