"""HR policy memos from the HR director: annual leave, travel reimbursement or overtime compensation."""

from tools.samples.corpus.locales import random_day, role
from tools.samples.corpus.pools import DEPARTMENTS, TITLES


def hr_memo(rng, loc):
    company = loc.company()
    director = (loc.person(), DEPARTMENTS[6], TITLES[1])  # Human Resources Director
    effective = random_day(rng)
    policy = rng.randrange(3)
    en = loc.lang == "en"
    if policy == 0:
        base = rng.randint(5, 15)
        steps = sorted(rng.sample(range(1, 11), 3))
        carry, notice = rng.randint(3, 10), rng.choice([3, 5, 7, 14])
        tiers = [
            ("less than 1 year", "不满1年", base),
            ("1 to 4 years", "1至4年", base + steps[0]),
            ("5 to 9 years", "5至9年", base + steps[1]),
            ("10 years or more", "10年及以上", base + steps[2]),
        ]
        subject = "Annual leave entitlement" if en else "年休假制度"
        body = [(f"- {t[0]} of service: {t[2]} days" if en else f"- 工龄{t[1]}：{t[2]}天") for t in tiers]
        body += (
            [
                f"Up to {carry} unused days may be carried over to the next year.",
                f"Leave must be requested at least {notice} working days in advance.",
            ]
            if en
            else [f"当年未休假期最多可结转{carry}天至下一年度。", f"请至少提前{notice}个工作日提交休假申请。"]
        )
    elif policy == 1:
        rates = sorted((rng.randint(20, 90) * 5 for _ in range(3)), reverse=True)
        hotel = rates[0] * rng.randint(3, 6)
        days, claim = rng.randint(2, 6), rng.choice([15, 30, 45])
        subject = "Travel reimbursement" if en else "差旅费报销标准"
        m = loc.money
        body = (
            [
                f"- Tier 1 cities: {m(rates[0] * 100)} per day",
                f"- Tier 2 cities: {m(rates[1] * 100)} per day",
                f"- Other locations: {m(rates[2] * 100)} per day",
                f"Hotel costs are reimbursed up to {m(hotel * 100)} per night.",
                f"Example: a {days}-day trip to a tier 1 city earns a per-diem of {m(days * rates[0] * 100)}.",
                f"Claims must be submitted within {claim} days of returning.",
            ]
            if en
            else [
                f"- 一线城市：每天{m(rates[0] * 100)}",
                f"- 二线城市：每天{m(rates[1] * 100)}",
                f"- 其他地区：每天{m(rates[2] * 100)}",
                f"住宿费每晚报销上限为{m(hotel * 100)}。",
                f"例如：赴一线城市出差{days}天，可领取补贴{m(days * rates[0] * 100)}。",
                f"请在出差返回后{claim}天内提交报销单据。",
            ]
        )
    else:
        wage = rng.randint(20, 90)
        weekday, weekend = rng.randint(2, 12), rng.randint(0, 8)
        pay = wage * weekday * 3 // 2 + wage * weekend * 2
        cap = rng.choice([24, 36, 40])
        subject = "Overtime compensation" if en else "加班管理办法"
        m = loc.money
        body = (
            [
                "- Weekday overtime is paid at 150% of the hourly rate.",
                "- Weekend overtime is paid at 200%; public holidays at 300%.",
                f"- Overtime may not exceed {cap} hours per month without approval.",
                f"Example: at {m(wage * 100)} per hour, {weekday} weekday hours and {weekend} weekend hours "
                f"are paid {m(pay * 100)}.",
            ]
            if en
            else [
                "- 工作日加班按小时工资的150%支付。",
                "- 休息日加班按200%支付，法定节假日按300%支付。",
                f"- 未经审批，每月加班不得超过{cap}小时。",
                f"例如：小时工资{m(wage * 100)}，工作日加班{weekday}小时、休息日加班{weekend}小时，"
                f"应付加班费{m(pay * 100)}。",
            ]
        )
    contact = loc.email(director[0], company)
    if en:
        lines = (
            [
                f"MEMO - {company}",
                "To: All employees",
                f"From: {role(loc, director)}",
                f"Subject: {subject}",
                f"Effective: {loc.date(effective)}",
                "",
                rng.choice(
                    [
                        "This memo replaces all earlier guidance on this topic.",
                        "Following feedback from the staff survey, the policy has been updated as follows.",
                        "Please read the updated rules below carefully.",
                    ]
                ),
                "",
            ]
            + body
            + ["", f"Questions can be sent to {contact}."]
        )
    else:
        lines = (
            [
                f"{company}内部通知",
                "致：全体员工",
                f"发文：{role(loc, director)}",
                f"主题：关于调整{subject}的通知",
                f"生效日期：{loc.date(effective)}",
                "",
                rng.choice(
                    [
                        "本通知发布后，此前相关规定同时废止。",
                        "根据员工调研反馈，现将有关规定调整如下。",
                        "请各位同事认真阅读以下规定。",
                    ]
                ),
                "",
            ]
            + body
            + ["", f"如有疑问，请联系{contact}。"]
        )
    return "\n".join(lines)
