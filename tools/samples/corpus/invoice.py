"""Invoices and order confirmations: line items that multiply out and add up to the total."""

import datetime

from tools.samples.corpus.locales import random_day
from tools.samples.corpus.pools import PRODUCTS


def invoice(rng, loc):
    seller, buyer = loc.company(), loc.company()
    day = random_day(rng)
    items = []
    for product in rng.sample(PRODUCTS, rng.randint(2, 6)):
        quantity = rng.randint(1, 12) if product[5] > 400 else rng.randint(2, 250)
        unit_cents = rng.randint(product[4] * 100, product[5] * 100)
        items.append((product, quantity, unit_cents, quantity * unit_cents))
    subtotal = sum(item[3] for item in items)
    discount_rate = rng.choice([0, 0, 3, 5]) if subtotal > 100_000 else 0
    discount = subtotal * discount_rate // 100
    tax_rate = rng.choice([0, 5, 8, 10, 20]) if loc.lang == "en" else rng.choice([6, 9, 13])
    tax = ((subtotal - discount) * tax_rate + 50) // 100
    total = subtotal - discount + tax
    terms = rng.choice([15, 30, 45, 60])
    due = day + datetime.timedelta(days=terms)
    number = f"{rng.choice(['INV', 'SO', 'PO'])}-{day:%y%m}-{rng.randint(1, 9999):04d}"
    m = loc.money
    if loc.lang == "en":
        kind = rng.choice(["Invoice", "Order confirmation"])
        lines = [
            f"{kind} {number}",
            f"Date: {loc.date(day)}",
            f"Seller: {seller}",
            f"Bill to: {buyer}, {loc.city()}",
            "",
            "Items",
        ]
        lines += [f"{i}. {p[0]} - {q} x {m(u)} = {m(a)}" for i, (p, q, u, a) in enumerate(items, 1)]
        lines += ["", f"Subtotal: {m(subtotal)}"]
        if discount_rate:
            lines.append(f"Volume discount ({discount_rate}%): -{m(discount)}")
        lines += [
            f"Tax ({tax_rate}%): {m(tax)}",
            f"Total due: {m(total)}",
            "",
            f"Payment terms: net {terms} days, due by {loc.date(due)}. "
            + rng.choice(
                [
                    "Please quote the document number with your payment.",
                    "Late payments may incur interest of 1% per month.",
                    "Thank you for your business.",
                ]
            ),
        ]
    else:
        kind = rng.choice(["销售发票", "订单确认书"])
        lines = [
            f"{kind} 编号：{number}",
            f"日期：{loc.date(day)}",
            f"销售方：{seller}",
            f"购买方：{buyer}（{loc.city()}）",
            "",
            "货物明细",
        ]
        lines += [f"{i}. {p[1]} {q}{p[3]} × {m(u)} = {m(a)}" for i, (p, q, u, a) in enumerate(items, 1)]
        lines += ["", f"小计：{m(subtotal)}"]
        if discount_rate:
            lines.append(f"批量折扣（{discount_rate}%）：-{m(discount)}")
        lines += [
            f"增值税（{tax_rate}%）：{m(tax)}",
            f"应付总额：{m(total)}",
            "",
            f"付款条件：开票后{terms}天内付款，最迟于{loc.date(due)}前到账。"
            + rng.choice(["付款时请注明单据编号。", "逾期付款将按每月1%计收滞纳金。", "感谢您的惠顾。"]),
        ]
    return "\n".join(lines)
