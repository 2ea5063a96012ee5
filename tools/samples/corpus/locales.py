"""English and Chinese surface forms (people, companies, dates, amounts) and the helpers every document uses."""

import datetime

from tools.samples.corpus.pools import (
    DEPARTMENTS,
    EN_CITY,
    EN_CORE,
    EN_FIRST,
    EN_INDUSTRY,
    EN_LAST,
    EN_LEGAL,
    EN_MONTHS,
    EN_PREFIX,
    TITLES,
    ZH_CITY,
    ZH_CORE,
    ZH_GIVEN,
    ZH_INDUSTRY,
    ZH_LEGAL,
    ZH_SURNAME,
)


def pct(part, whole):
    """Percentage with one decimal, computed from the numbers printed in the document."""
    return round(100.0 * part / whole, 1)


def signed(value):
    return f"+{value:.1f}%" if value >= 0 else f"{value:.1f}%"


class English:
    """Surface forms of names, dates and amounts in English documents."""

    lang = "en"

    def __init__(self, rng):
        self.rng = rng
        self.date_style = rng.randrange(3)
        self.currency = rng.choice(["$", "€", "£", "USD "])

    def person(self):
        return f"{self.rng.choice(EN_FIRST)} {self.rng.choice(EN_LAST)}"

    def company(self):
        name = self.rng.choice(EN_PREFIX) + self.rng.choice(EN_CORE)
        return f"{name} {self.rng.choice(EN_INDUSTRY)} {self.rng.choice(EN_LEGAL)}"

    def email(self, person, company):
        first, last = person.lower().split(" ")
        return f"{first}.{last}@{company.split(' ')[0].lower()}.com"

    def city(self):
        return self.rng.choice(EN_CITY)

    def date(self, day):
        if self.date_style == 0:
            return f"{EN_MONTHS[day.month - 1]} {day.day}, {day.year}"
        if self.date_style == 1:
            return f"{day.day} {EN_MONTHS[day.month - 1]} {day.year}"
        return day.isoformat()

    def money(self, cents):
        sign = "-" if cents < 0 else ""
        return f"{sign}{self.currency}{abs(cents) // 100:,}.{abs(cents) % 100:02d}"


class Chinese:
    """Surface forms of names, dates and amounts in Chinese documents."""

    lang = "zh"

    def __init__(self, rng):
        self.rng = rng
        self.currency_style = rng.randrange(3)

    def person(self):
        given = "".join(self.rng.choice(ZH_GIVEN) for _ in range(self.rng.choice([1, 2])))
        return self.rng.choice(ZH_SURNAME) + given

    def company(self):
        rng = self.rng
        return rng.choice(ZH_CITY) + rng.choice(ZH_CORE)[0] + rng.choice(ZH_INDUSTRY) + rng.choice(ZH_LEGAL)

    def email(self, person, company):
        # Every city and brand is two characters, so the brand sits at [2:4].
        domain = dict(ZH_CORE)[company[2:4]]
        return f"{self.rng.choice(['service', 'sales', 'hr', 'finance', 'support'])}@{domain}.com.cn"

    def city(self):
        return self.rng.choice(ZH_CITY)

    def date(self, day):
        return f"{day.year}年{day.month}月{day.day}日"

    def money(self, cents):
        sign = "-" if cents < 0 else ""
        amount = f"{abs(cents) // 100:,}.{abs(cents) % 100:02d}"
        return [f"{sign}¥{amount}", f"{sign}{amount}元", f"{sign}人民币{amount}元"][self.currency_style]


def random_day(rng, first_year=2019, last_year=2025):
    start = datetime.date(first_year, 1, 1)
    span = (datetime.date(last_year, 12, 31) - start).days
    return start + datetime.timedelta(days=rng.randrange(span))


def staff(loc, rng, count):
    """``count`` distinct people, each with a department and a title."""
    people = []
    while len(people) < count:
        name = loc.person()
        if name not in [p[0] for p in people]:
            people.append((name, rng.choice(DEPARTMENTS), rng.choice(TITLES)))
    return people


def role(loc, person):
    name, (dept_en, dept_zh), (title_en, title_zh) = person
    return f"{name}, {dept_en} {title_en}" if loc.lang == "en" else f"{name}（{dept_zh}{title_zh}）"
