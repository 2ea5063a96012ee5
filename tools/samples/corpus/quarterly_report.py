"""Quarterly reports: segment revenue of two quarters, growth rates that match them, an outlook."""

import datetime

from tools.samples.corpus.locales import pct, role, signed
from tools.samples.corpus.pools import DEPARTMENTS, SEGMENTS, TITLES


def quarterly_report(rng, loc):
    company = loc.company()
    year, quarter = rng.randint(2019, 2025), rng.randint(1, 4)
    prev_q, prev_year = (quarter - 1, year) if quarter > 1 else (4, year - 1)
    segments = rng.sample(SEGMENTS, rng.randint(3, 4))
    prev = [rng.randint(300, 9000) * 1000 for _ in segments]
    # Change of -12.0% .. +26.0% per segment, rounded down to whole thousands.
    cur = [p + p * rng.randint(-120, 260) // 1_000_000 * 1000 for p in prev]
    total, prev_total = sum(cur), sum(prev)
    cost = total * rng.randint(62, 93) // 100
    profit = total - cost
    heads = rng.randint(40, 900)
    hires, leavers = rng.randint(0, heads // 8 + 2), rng.randint(0, heads // 10 + 1)
    low = total * rng.randint(98, 104) // 100 // 1000 * 1000
    high = low + total * rng.randint(3, 9) // 100 // 1000 * 1000
    author = (loc.person(), DEPARTMENTS[0], rng.choice(TITLES))  # Finance
    issued = datetime.date(year + (quarter == 4), quarter * 3 % 12 + 1, rng.randint(5, 25))
    growth = pct(total - prev_total, prev_total)
    m = loc.money
    if loc.lang == "en":
        trend = "up" if growth >= 0 else "down"
        lines = [
            f"{company} - Quarterly Business Report, Q{quarter} {year}",
            f"Prepared by: {role(loc, author)}",
            f"Issued: {loc.date(issued)}",
            "",
            "1. Summary",
            f"Total revenue for Q{quarter} {year} was {m(total * 100)}, {trend} "
            f"{abs(growth):.1f}% from {m(prev_total * 100)} in Q{prev_q} {prev_year}. "
            + rng.choice(
                [
                    "Operating profit reached {p}, a margin of {r:.1f}%.",
                    "The quarter closed with an operating profit of {p} ({r:.1f}% of revenue).",
                    "After operating costs of {c}, operating profit was {p}, or {r:.1f}% of revenue.",
                ]
            ).format(p=m(profit * 100), r=pct(profit, total), c=m(cost * 100)),
            "",
            "2. Revenue by segment",
        ]
        lines += [
            f"- {seg[0]}: {m(c * 100)} (Q{prev_q}: {m(p * 100)}, {signed(pct(c - p, p))})"
            for seg, c, p in zip(segments, cur, prev, strict=True)
        ]
        lines += [
            f"- Total: {m(total * 100)}",
            "",
            "3. Costs and profit",
            f"Operating costs were {m(cost * 100)}. Operating profit was {m(profit * 100)}.",
            "",
            "4. People",
            f"We started the quarter with {heads} employees, hired {hires} and saw {leavers} "
            f"depart, ending at {heads + hires - leavers}.",
            "",
            "5. Outlook",
            rng.choice(
                [
                    "For the next quarter we expect revenue between {lo} and {hi}.",
                    "Management guides next-quarter revenue to a range of {lo} to {hi}.",
                    "Our forecast for next quarter is revenue of {lo} to {hi}.",
                ]
            ).format(lo=m(low * 100), hi=m(high * 100))
            + " "
            + rng.choice(
                [
                    "The main risk remains freight costs.",
                    "Demand in " + loc.city() + " is the key uncertainty.",
                    "Hiring in engineering will continue at a slower pace.",
                    "We will keep inventory levels below 45 days of sales.",
                ]
            ),
        ]
    else:
        trend = "增长" if growth >= 0 else "下降"
        lines = [
            f"{company}{year}年第{quarter}季度经营报告",
            f"编制人：{role(loc, author)}",
            f"发布日期：{loc.date(issued)}",
            "",
            "一、总体情况",
            f"本季度公司实现营业收入{m(total * 100)}，较{prev_year}年第{prev_q}季度的"
            f"{m(prev_total * 100)}{trend}{abs(growth):.1f}%。"
            + rng.choice(
                [
                    "营业利润为{p}，利润率{r:.1f}%。",
                    "扣除营业成本{c}后，营业利润为{p}，占收入的{r:.1f}%。",
                    "本季度实现营业利润{p}，营业利润率为{r:.1f}%。",
                ]
            ).format(p=m(profit * 100), r=pct(profit, total), c=m(cost * 100)),
            "",
            "二、分业务收入",
        ]
        lines += [
            f"- {seg[1]}：{m(c * 100)}（上季度{m(p * 100)}，环比{signed(pct(c - p, p))}）"
            for seg, c, p in zip(segments, cur, prev, strict=True)
        ]
        lines += [
            f"- 合计：{m(total * 100)}",
            "",
            "三、成本与利润",
            f"营业成本{m(cost * 100)}，营业利润{m(profit * 100)}。",
            "",
            "四、人员情况",
            f"季度初员工{heads}人，本季度新入职{hires}人，离职{leavers}人，季度末共{heads + hires - leavers}人。",
            "",
            "五、下季度展望",
            rng.choice(["预计下季度营业收入在{lo}至{hi}之间。", "管理层预计下季度收入区间为{lo}到{hi}。"]).format(
                lo=m(low * 100), hi=m(high * 100)
            )
            + rng.choice(
                [
                    "主要风险仍是运费上涨。",
                    f"{loc.city()}市场需求存在不确定性。",
                    "研发团队招聘将适当放缓。",
                    "库存周转天数将控制在45天以内。",
                ]
            ),
        ]
    return "\n".join(lines)
