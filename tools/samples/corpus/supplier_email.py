"""Supplier e-mails: quotations and delay notices whose dates follow from the order."""

import datetime

from tools.samples.corpus.locales import random_day
from tools.samples.corpus.pools import PRODUCTS

DELAY_REASONS = [
    ("a shortage of raw material at our plant", "工厂原材料短缺"),
    ("port congestion in Rotterdam", "鹿特丹港口拥堵"),
    ("a failed quality inspection of the first batch", "首批货物质检未通过"),
    ("a power outage at our main factory", "主工厂停电"),
    ("severe weather on the shipping route", "运输途中遭遇恶劣天气"),
]


def supplier_email(rng, loc):
    supplier, client = loc.company(), loc.company()
    sender, recipient = loc.person(), loc.person()
    day = random_day(rng)
    product = rng.choice(PRODUCTS)
    base = rng.randint(product[4] * 100, product[5] * 100)
    m = loc.money
    en = loc.lang == "en"
    if rng.random() < 0.5:
        tiers = [
            (q, d, base * (100 - d) // 100)
            for q, d in [
                (rng.choice([10, 20, 50]), 0),
                (rng.choice([100, 200]), rng.randint(3, 6)),
                (rng.choice([500, 1000]), rng.randint(8, 14)),
            ]
        ]
        lead = rng.randint(7, 45)
        valid = day + datetime.timedelta(days=30)
        if en:
            subject = f"Quotation for {product[0]}"
            body = [f"Thank you for your enquiry. Our prices for the {product[0]} are:"]
            body += [f"- from {q} {product[2]}s: {m(p)} each" + (f" ({d}% off list)" if d else "") for q, d, p in tiers]
            body += [
                f"Delivery is {lead} days after order confirmation; an order placed today would arrive by "
                f"{loc.date(day + datetime.timedelta(days=lead))}. "
                f"This quotation is valid until {loc.date(valid)}."
            ]
        else:
            subject = f"关于{product[1]}的报价"
            body = [f"感谢贵司询价。{product[1]}报价如下："]
            body += [
                f"- {q}{product[3]}起：每{product[3]}{m(p)}" + (f"（比标准价优惠{d}%）" if d else "")
                for q, d, p in tiers
            ]
            body += [
                f"交货期为订单确认后{lead}天，今日下单预计{loc.date(day + datetime.timedelta(days=lead))}到货。"
                f"本报价有效期至{loc.date(valid)}。"
            ]
    else:
        order = f"PO-{rng.randint(10000, 99999)}"
        promised = day + datetime.timedelta(days=rng.randint(3, 20))
        delay = rng.randint(2, 21)
        reason = rng.choice(DELAY_REASONS)
        credit = rng.choice([2, 3, 5])
        if en:
            subject = f"Delay of order {order}"
            body = [
                f"We regret to inform you that order {order} ({product[0]}) will not ship on "
                f"{loc.date(promised)} as promised, because of {reason[0]}.",
                f"The new delivery date is {loc.date(promised + datetime.timedelta(days=delay))}, "
                f"{delay} days later than planned.",
                f"To make up for the delay we will credit {credit}% of the order value on your next invoice.",
            ]
        else:
            subject = f"订单{order}延期交货通知"
            body = [
                f"很抱歉通知您，由于{reason[1]}，订单{order}（{product[1]}）无法按原定的{loc.date(promised)}发货。",
                f"新的交货日期为{loc.date(promised + datetime.timedelta(days=delay))}，比原计划推迟{delay}天。",
                f"为弥补延误，我司将在下一张发票中抵扣订单金额的{credit}%。",
            ]
    if en:
        lines = [
            f"From: {sender} <{loc.email(sender, supplier)}>",
            f"To: {recipient}, {client}",
            f"Date: {loc.date(day)}",
            f"Subject: {subject}",
            "",
            f"Dear {recipient.split(' ')[0]},",
            "",
        ]
        lines += body + ["", rng.choice(["Best regards,", "Kind regards,", "Sincerely,"]), sender, supplier]
    else:
        lines = [
            f"发件人：{sender} <{loc.email(sender, supplier)}>",
            f"收件人：{client} {recipient}",
            f"日期：{loc.date(day)}",
            f"主题：{subject}",
            "",
            f"{recipient}您好：",
            "",
        ]
        lines += body + ["", rng.choice(["此致敬礼！", "顺祝商祺！", "谢谢！"]), sender, supplier]
    return "\n".join(lines)
