"""Product announcements: launch date, features, price, availability, a quote."""

import datetime

from tools.samples.corpus.locales import random_day, role
from tools.samples.corpus.pools import DEPARTMENTS, EN_CITY, PRODUCTS, TITLES, ZH_CITY

# (feature EN, feature ZH, low, high, electronic devices only): "{n}" is a number in [low, high].
FEATURES = [
    ("energy use {n}% lower than the previous model", "能耗比上一代降低{n}%", 8, 40, True),
    ("battery life of up to {n} hours", "电池续航最长{n}小时", 6, 72, True),
    ("{n}-year warranty", "{n}年质保", 1, 5, False),
    ("connects up to {n} devices at once", "最多同时连接{n}台设备", 4, 128, True),
    ("setup in under {n} minutes", "{n}分钟内完成安装", 5, 30, False),
    ("usable down to -{n} °C", "最低使用温度-{n}℃", 10, 40, False),
    ("{n}% recycled material", "使用{n}%再生材料", 20, 90, False),
    ("remote firmware updates every {n} weeks", "每{n}周一次远程固件升级", 2, 12, True),
]

# (quote EN, quote ZH) of the spokesperson in a product announcement
QUOTES = [
    ("Our customers asked for something simpler and more reliable", "客户希望产品更简单、更可靠。"),
    ("This is the product our service team wished it had five years ago", "这是我们的服务团队期待已久的产品。"),
    ("We designed it together with twelve pilot customers", "这款产品是与十二家试点客户共同设计的。"),
    ("Every unit is tested in our own warehouse before it ships", "每一台产品出厂前都在我们自己的仓库里经过测试。"),
]


def product_announcement(rng, loc):
    company = loc.company()
    product = rng.choice(PRODUCTS)
    model = f"{''.join(rng.choice('ABCDEFGHKMNPRSTVX') for _ in range(2))}-{rng.randint(100, 990)}"
    launch = random_day(rng)
    price = rng.randint(product[4] * 100, product[5] * 100) // 100 * 100 - 1
    discount = rng.choice([5, 10, 15, 20])
    preorder = price * (100 - discount) // 100
    spokesperson = (loc.person(), rng.choice([DEPARTMENTS[1], DEPARTMENTS[4], DEPARTMENTS[7]]), rng.choice(TITLES))
    suitable = [f for f in FEATURES if product[6] or not f[4]]
    features = [(f, rng.randint(f[2], f[3])) for f in rng.sample(suitable, rng.randint(3, len(suitable) - 1))]
    cities = rng.sample(EN_CITY if loc.lang == "en" else ZH_CITY, rng.randint(2, 4))
    quote = rng.choice(QUOTES)
    if loc.lang == "en":
        lines = [
            f"{company} announces the {model} {product[0]}",
            loc.date(launch),
            "",
            rng.choice(
                [
                    "{c} today introduced the {m}, a new {p} for small and mid-sized businesses.",
                    "{c} is launching the {m}, its latest {p}.",
                    "Today {c} unveiled the {m} {p}, built for busy warehouses and offices.",
                ]
            ).format(c=company, m=model, p=product[0]),
            "",
            "Key features:",
        ]
        lines += [f"- {f[0].format(n=n)}" for f, n in features]
        lines += [
            "",
            f"The {model} costs {loc.money(price)} per {product[2]}. Customers who pre-order "
            f"before {loc.date(launch + datetime.timedelta(days=30))} pay {loc.money(preorder)}, "
            f"a {discount}% discount.",
            f"It will be available first in {', '.join(cities[:-1])} and {cities[-1]}.",
            "",
            f'"{quote[0]}," said {role(loc, spokesperson)}.',
        ]
    else:
        lines = [
            f"{company}发布{model}{product[1]}",
            loc.date(launch),
            "",
            rng.choice(
                [
                    "{c}今日正式推出{m}{p}，面向中小企业用户。",
                    "{c}宣布上市新一代{p}{m}。",
                    "今天，{c}发布了专为仓库和办公场景设计的{m}{p}。",
                ]
            ).format(c=company, m=model, p=product[1]),
            "",
            "主要特点：",
        ]
        lines += [f"- {f[1].format(n=n)}" for f, n in features]
        lines += [
            "",
            f"{model}售价为每{product[3]}{loc.money(price)}。"
            f"{loc.date(launch + datetime.timedelta(days=30))}前预订可优惠{discount}%，"
            f"预订价为{loc.money(preorder)}。",
            f"产品将首先在{'、'.join(cities)}上市。",
            "",
            f"{role(loc, spokesperson)}表示：“{quote[1]}”",
        ]
    return "\n".join(lines)
