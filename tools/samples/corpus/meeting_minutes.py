"""Meeting minutes: attendees, agenda topics with a measured figure each, decisions and actions."""

import datetime

from tools.samples.corpus.locales import random_day, role, staff

# (title EN, title ZH, metric EN, metric ZH, unit, low, high, decision EN, decision ZH)
TOPICS = [
    (
        "Budget review",
        "预算执行情况",
        "budget utilisation",
        "预算执行率",
        "%",
        55,
        110,
        "freeze discretionary spending until the next review",
        "暂停非必要开支直至下次评审",
    ),
    (
        "Warehouse relocation",
        "仓库搬迁",
        "relocation progress",
        "搬迁进度",
        "%",
        10,
        95,
        "move the remaining stock over two weekends",
        "分两个周末完成剩余库存搬运",
    ),
    (
        "Hiring plan",
        "招聘计划",
        "open positions filled",
        "岗位到岗率",
        "%",
        20,
        100,
        "prioritise the two support engineer roles",
        "优先招聘两名技术支持工程师",
    ),
    (
        "Customer churn",
        "客户流失",
        "monthly churn rate",
        "月度客户流失率",
        "%",
        1,
        9,
        "call every customer whose contract ends within 60 days",
        "逐一回访合同60天内到期的客户",
    ),
    (
        "Supplier price increase",
        "供应商涨价",
        "average price increase",
        "平均涨价幅度",
        "%",
        2,
        15,
        "request quotes from at least two alternative suppliers",
        "向至少两家备选供应商询价",
    ),
    (
        "Website redesign",
        "官网改版",
        "pages migrated",
        "已迁移页面比例",
        "%",
        5,
        100,
        "launch the new site after the accessibility check",
        "完成无障碍检查后上线新官网",
    ),
    (
        "Security audit",
        "信息安全审计",
        "findings closed",
        "整改完成率",
        "%",
        30,
        100,
        "enforce two-factor login for all staff accounts",
        "所有员工账号启用双因素登录",
    ),
    (
        "Trade show preparation",
        "展会筹备",
        "booth tasks completed",
        "展位准备完成度",
        "%",
        15,
        90,
        "ship the demo units one week before the show",
        "提前一周发运演示样机",
    ),
    (
        "Inventory shortfall",
        "库存短缺",
        "order fill rate",
        "订单满足率",
        "%",
        70,
        99,
        "raise the safety stock of the top twenty items",
        "提高前二十种热销品的安全库存",
    ),
    (
        "Training programme",
        "员工培训",
        "staff trained",
        "培训覆盖率",
        "%",
        20,
        100,
        "add an evening session for the night shift",
        "为夜班员工增加晚间培训场次",
    ),
]


def meeting_minutes(rng, loc):
    company = loc.company()
    day = random_day(rng)
    start = datetime.datetime(day.year, day.month, day.day, rng.randint(8, 16), rng.choice([0, 30]))
    end = start + datetime.timedelta(minutes=rng.choice([30, 45, 60, 90, 120]))
    people = staff(loc, rng, rng.randint(3, 7))
    chair, secretary = people[0], people[-1]
    topics = rng.sample(TOPICS, rng.randint(2, 4))
    room = (
        rng.choice(["Room A", "Room 3B", "the boardroom", "the video bridge"])
        if loc.lang == "en"
        else rng.choice(["第一会议室", "302会议室", "大会议室", "线上会议"])
    )
    next_day = day + datetime.timedelta(days=rng.choice([7, 14, 28]))
    actions = []
    for topic in topics:
        owner = rng.choice(people)[0]
        actions.append((topic, owner, day + datetime.timedelta(days=rng.randint(3, 21))))
    if loc.lang == "en":
        kind = rng.choice(["weekly operations", "monthly management", "project steering", "department"])
        lines = [
            f"Minutes of the {kind} meeting",
            f"{company}",
            f"Date: {loc.date(day)}, {start:%H:%M}-{end:%H:%M}, {room}",
            f"Chair: {role(loc, chair)}",
            f"Minutes taken by: {secretary[0]}",
            "Attendees: " + ", ".join(p[0] for p in people),
            "",
            "Agenda",
        ]
        lines += [f"{i}. {t[0]}" for i, t in enumerate(topics, 1)]
        lines.append("")
        for i, topic in enumerate(topics, 1):
            value, target = rng.randint(topic[5], topic[6]), rng.randint(topic[5], topic[6])
            speaker = rng.choice(people)[0]
            compare = "above" if value > target else "below" if value < target else "exactly on"
            lines += [
                f"Item {i}: {topic[0]}",
                f"{speaker} reported that {topic[2]} was {value}{topic[4]}, {compare} the "
                f"target of {target}{topic[4]}. "
                + rng.choice(
                    [
                        "After discussion the meeting agreed to {d}.",
                        "The group decided to {d}.",
                        "It was agreed to {d}.",
                    ]
                ).format(d=topic[7]),
                "",
            ]
        lines.append("Action items")
        lines += [f"- {owner}: follow up on {t[0].lower()} by {loc.date(due)}" for t, owner, due in actions]
        lines += ["", f"The next meeting is scheduled for {loc.date(next_day)}."]
    else:
        lines = [
            f"{company}{rng.choice(['周例会', '月度经营会', '项目推进会', '部门会议'])}会议纪要",
            f"时间：{loc.date(day)} {start:%H:%M}-{end:%H:%M}",
            f"地点：{room}",
            f"主持人：{role(loc, chair)}",
            f"记录人：{secretary[0]}",
            "参会人员：" + "、".join(p[0] for p in people),
            "",
            "会议议程",
        ]
        lines += [f"{i}. {t[1]}" for i, t in enumerate(topics, 1)]
        lines.append("")
        for i, topic in enumerate(topics, 1):
            value, target = rng.randint(topic[5], topic[6]), rng.randint(topic[5], topic[6])
            speaker = rng.choice(people)[0]
            compare = "高于" if value > target else "低于" if value < target else "持平于"
            lines += [
                f"议题{i}：{topic[1]}",
                f"{speaker}汇报，{topic[3]}为{value}{topic[4]}，{compare}目标值{target}{topic[4]}。"
                + rng.choice(["经讨论，会议决定{d}。", "与会人员一致同意{d}。", "会议要求{d}。"]).format(d=topic[8]),
                "",
            ]
        lines.append("待办事项")
        lines += [f"- {owner}：{loc.date(due)}前跟进{t[1]}" for t, owner, due in actions]
        lines += ["", f"下次会议时间：{loc.date(next_day)}。"]
    return "\n".join(lines)
