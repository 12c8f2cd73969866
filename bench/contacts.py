"""Synthetic e-mails for schemas/contact.json, generated deterministically from a seed, each
with its gold value. They imitate examples/contact-*.txt (a From header, a subject, a short
body, a signature with name | title, company, city and a phone line) with varied people,
companies, cities and wording. Flat and short: the default model reads many of them, unlike
receipts, so they give the calibration benchmark graded values across the confidence range.
"""

from __future__ import annotations

import random

PEOPLE = ["Marta Kowalczyk", "Julien Moreau", "Aisha Bello", "Kenji Watanabe", "Sarah O'Neill", "Diego Herrera",
          "Nora Lindgren", "Rahul Mehta", "Emma Schulz", "Tariq Haddad", "Grace Mwangi", "Paolo Ricci",
          "Lena Novak", "Samuel Adeyemi", "Yuki Tanaka", "Isabel Costa"]
TITLES = ["Operations Manager", "Sales Director", "Project Lead", "Account Manager", "Head of Finance",
          "Office Manager", "Logistics Coordinator", "Senior Engineer", "Purchasing Manager", "Events Manager"]
COMPANIES = [("Harbourline Shipping Ltd", "Southampton", "harbourline.co.uk", "+44 23 5550 {}"),
             ("Verde Valle Foods SA", "Valencia", "verdevalle.es", "+34 96 555 {}"),
             ("Kestrel Robotics GmbH", "Dresden", "kestrel-robotics.de", "+49 351 555 {}"),
             ("Blue Fern Studio", "Wellington", "bluefern.co.nz", "+64 4 555 {}"),
             ("Northgate Pharma Inc.", "Boston", "northgatepharma.com", "(617) 555-{}"),
             ("Sakura Textiles KK", "Osaka", "sakura-textiles.jp", "+81 6 5555 {}"),
             ("Atlas Mining Pty Ltd", "Perth", "atlasmining.com.au", "+61 8 5555 {}"),
             ("Lakeshore Furniture Co.", "Toronto", "lakeshorefurniture.ca", "(416) 555-{}")]
SUBJECTS = [("Delivery schedule", "The pallets for your order leave our warehouse on Monday; tracking follows."),
            ("Invoice query", "Thanks for flagging the duplicate line; a corrected invoice is attached."),
            ("Meeting next week", "Could we move our call to Wednesday afternoon? Tuesday is fully booked."),
            ("Samples", "The samples you asked for were sent by courier this morning."),
            ("Contract renewal", "Our agreement ends this quarter; I have attached the renewal terms.")]
PHONE_LABELS = ["Phone", "Mobile", "Tel.", "Direct"]


def contacts(n: int, seed: int = 0) -> list[dict]:
    """`n` e-mails as {"text", "gold"}."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, title = rng.choice(PEOPLE), rng.choice(TITLES)
        company, city, domain, phone_fmt = rng.choice(COMPANIES)
        subject, body = rng.choice(SUBJECTS)
        first, last = name.lower().replace("'", "").split()
        email = rng.choice([f"{first}.{last}@{domain}", f"{first[0]}.{last}@{domain}", f"{first}@{domain}"])
        phone = phone_fmt.format(f"{rng.randrange(10000):04d}")
        text = (f"From: {name} <{email}>\nSubject: {subject}\n\n{body}\n\n"
                f"{name} | {title}\n{company}, {city}\n{rng.choice(PHONE_LABELS)}: {phone}\n")
        out.append({"text": text, "gold": {"name": name, "job_title": title, "company": company, "email": email,
                                           "phone": phone, "city": city}})
    return out
