"""Generate the bundled sample corpus: Chinese and English business documents.

The corpus exists so that ``mindmoe-train`` with no arguments has something
realistic to learn from on a laptop: documents with recurring structure
(headings, numbered sections, bullet lists, tables written as lines) and
internally consistent numbers (line items that add up to the invoice total,
growth rates that match the two quarters they compare, due dates that follow
from payment terms). A tiny transformer can learn that structure; the slots
(companies, people, products, cities, dates, amounts) vary enough that it
cannot simply memorise the documents.

Only the standard library is used and every random choice comes from one
seeded ``random.Random``, so the output is byte-identical on every run:
``python data/samples/generate.py`` rewrites the files next to this script.
"""

import argparse
import datetime
import json
import random
from pathlib import Path

TRAIN_FILE = "corpus_train.jsonl"
VALID_FILE = "corpus_valid.jsonl"
TRAIN_SEED = 20240611
VALID_SEED = 7919
TRAIN_BYTES = 2_300_000
VALID_BYTES = 125_000

# ---------------------------------------------------------------- slot pools
EN_FIRST = [
    "Alice",
    "Brian",
    "Carmen",
    "David",
    "Elena",
    "Farid",
    "Grace",
    "Hiroshi",
    "Ingrid",
    "James",
    "Karin",
    "Liam",
    "Maria",
    "Nikhil",
    "Olivia",
    "Pedro",
    "Quinn",
    "Rachel",
    "Samuel",
    "Tara",
    "Umar",
    "Vera",
    "William",
    "Xenia",
    "Yusuf",
    "Zoe",
    "Marcus",
    "Helen",
    "Oscar",
    "Priya",
    "Daniel",
    "Sofia",
    "Ethan",
    "Leila",
    "Tom",
    "Nadia",
]
EN_LAST = [
    "Anderson",
    "Brooks",
    "Chen",
    "Dubois",
    "Evans",
    "Fischer",
    "Garcia",
    "Hughes",
    "Ibrahim",
    "Jensen",
    "Kowalski",
    "Lopez",
    "Murphy",
    "Nakamura",
    "Okafor",
    "Patel",
    "Quinteros",
    "Rossi",
    "Schmidt",
    "Taylor",
    "Umeh",
    "Varga",
    "Walsh",
    "Young",
    "Zhang",
    "Moreau",
    "Novak",
    "Silva",
    "Bennett",
    "Kim",
    "Larsen",
    "Romero",
]
ZH_SURNAME = list("王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾萧田董潘袁蔡蒋余于杜叶程")
ZH_GIVEN = list("伟芳娜敏静丽强磊军洋勇艳杰娟涛明超秀霞平刚桂英华玉萍红建文辉力宇浩然欣怡思雨晨阳佳琪子轩博涵梓睿嘉")
EN_PREFIX = [
    "North",
    "Blue",
    "Silver",
    "Harbor",
    "Summit",
    "Cedar",
    "Granite",
    "Pioneer",
    "Maple",
    "Atlas",
    "Beacon",
    "Crescent",
    "Evergreen",
    "Falcon",
    "Golden",
    "Iron",
    "Keystone",
    "Lakeside",
    "Meridian",
    "Oak",
    "Pacific",
    "Redwood",
    "Sterling",
    "Tidewater",
    "Vantage",
    "Westfield",
    "Zenith",
    "Orchid",
    "Copper",
    "Willow",
]
EN_CORE = [
    "ridge",
    "line",
    "point",
    "stone",
    "bridge",
    "field",
    "works",
    "path",
    "gate",
    "peak",
    "wave",
    "light",
    "crest",
    "haven",
]
EN_INDUSTRY = [
    "Logistics",
    "Analytics",
    "Foods",
    "Robotics",
    "Textiles",
    "Software",
    "Medical Supplies",
    "Packaging",
    "Energy",
    "Components",
    "Furniture",
    "Retail",
]
EN_LEGAL = ["Ltd.", "Inc.", "GmbH", "LLC", "Co.", "Group"]
ZH_CITY = [
    "上海",
    "杭州",
    "深圳",
    "成都",
    "武汉",
    "苏州",
    "南京",
    "西安",
    "青岛",
    "厦门",
    "天津",
    "重庆",
    "长沙",
    "合肥",
    "宁波",
    "郑州",
    "济南",
    "福州",
    "大连",
    "昆明",
    "广州",
    "无锡",
]
ZH_CORE = [
    ("华信", "huaxin"),
    ("启明", "qiming"),
    ("恒达", "hengda"),
    ("鼎盛", "dingsheng"),
    ("远航", "yuanhang"),
    ("瑞丰", "ruifeng"),
    ("博纳", "bona"),
    ("金桥", "jinqiao"),
    ("云帆", "yunfan"),
    ("明德", "mingde"),
    ("新元", "xinyuan"),
    ("嘉禾", "jiahe"),
    ("同创", "tongchuang"),
    ("宏图", "hongtu"),
    ("安泰", "antai"),
    ("凯越", "kaiyue"),
    ("海润", "hairun"),
    ("星辰", "xingchen"),
    ("德普", "depu"),
    ("联拓", "liantuo"),
]
ZH_INDUSTRY = ["物流", "科技", "食品", "机器人", "纺织", "软件", "医疗器械", "包装", "能源", "电子元件", "家具", "商贸"]
ZH_LEGAL = ["有限公司", "股份有限公司", "集团有限公司"]
EN_CITY = [
    "Rotterdam",
    "Singapore",
    "Chicago",
    "Manchester",
    "Lyon",
    "Munich",
    "Toronto",
    "Melbourne",
    "Austin",
    "Dublin",
    "Osaka",
    "Barcelona",
    "Denver",
    "Vancouver",
    "Gothenburg",
    "Milan",
    "Seattle",
    "Auckland",
    "Leeds",
    "Porto",
]
# (English name, Chinese name, unit EN, unit ZH, min price, max price in whole currency units,
#  whether it is an electronic device: only those get battery/firmware/connectivity features)
PRODUCTS = [
    ("smart thermostat", "智能温控器", "unit", "台", 45, 160, True),
    ("barcode scanner", "条码扫描枪", "unit", "把", 60, 240, True),
    ("thermal label printer", "热敏标签打印机", "unit", "台", 120, 480, True),
    ("cold-chain temperature sensor", "冷链温度传感器", "unit", "个", 18, 75, True),
    ("ergonomic office chair", "人体工学办公椅", "chair", "把", 90, 420, False),
    ("LED panel light", "LED面板灯", "panel", "盏", 12, 60, False),
    ("industrial 5G router", "工业5G路由器", "unit", "台", 150, 690, True),
    ("water purifier", "净水器", "unit", "台", 80, 350, False),
    ("nitrile safety gloves (box of 100)", "丁腈防护手套（100只装）", "box", "盒", 6, 19, False),
    ("conveyor belt motor", "输送带电机", "motor", "台", 210, 980, False),
    ("solar inverter", "光伏逆变器", "unit", "台", 300, 1500, True),
    ("packing tape (roll)", "封箱胶带", "roll", "卷", 1, 4, False),
    ("laptop docking station", "笔记本扩展坞", "unit", "个", 40, 190, True),
    ("pallet jack", "手动液压搬运车", "unit", "台", 180, 650, False),
    ("stainless steel shelving unit", "不锈钢货架", "set", "组", 70, 300, False),
    ("handheld POS terminal", "手持收银终端", "unit", "台", 110, 400, True),
    ("industrial air compressor", "工业空气压缩机", "unit", "台", 450, 2400, False),
    ("corrugated shipping box", "瓦楞纸箱", "piece", "个", 1, 3, False),
]
# (English name, Chinese name) of software products for release notes.
SOFTWARE = [
    ("Inventory Manager", "库存管理系统"),
    ("Fleet Tracker", "车队追踪平台"),
    ("Invoice Hub", "发票中心"),
    ("Service Desk", "客服工单系统"),
    ("HR Portal", "人事门户"),
    ("Sales Dashboard", "销售看板"),
    ("Warehouse Scanner App", "仓库扫码应用"),
    ("Procurement Suite", "采购协同平台"),
]
DEPARTMENTS = [
    ("Finance", "财务部"),
    ("Sales", "销售部"),
    ("Operations", "运营部"),
    ("Customer Support", "客户服务部"),
    ("Engineering", "研发部"),
    ("Procurement", "采购部"),
    ("Human Resources", "人力资源部"),
    ("Marketing", "市场部"),
    ("Quality Assurance", "质量管理部"),
    ("Legal", "法务部"),
]
TITLES = [
    ("Manager", "经理"),
    ("Director", "总监"),
    ("Specialist", "专员"),
    ("Team Lead", "主管"),
    ("Analyst", "分析师"),
    ("Vice President", "副总裁"),
]
SEGMENTS = [
    ("Hardware", "硬件销售"),
    ("Cloud Services", "云服务"),
    ("Maintenance Contracts", "维保合同"),
    ("Consulting", "咨询服务"),
    ("Online Retail", "线上零售"),
    ("Licensing", "软件授权"),
    ("Logistics Services", "物流服务"),
]
EN_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


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


# ---------------------------------------------------------------- documents
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


# (symptom EN, symptom ZH, cause EN, cause ZH, fix EN, fix ZH)
ISSUES = [
    (
        "the device stops responding after about an hour",
        "设备运行约一小时后无响应",
        "a memory leak in firmware 2.3",
        "2.3版固件存在内存泄漏",
        "installed firmware 2.4 remotely",
        "远程升级至2.4版固件",
    ),
    (
        "readings are several degrees too high",
        "读数比实际温度偏高数度",
        "a calibration file from the wrong batch",
        "校准文件批次错误",
        "uploaded the correct calibration file",
        "重新上传正确的校准文件",
    ),
    (
        "the unit cannot connect to the office network",
        "设备无法连接办公网络",
        "a firewall rule blocking port 8443",
        "防火墙规则拦截了8443端口",
        "opened port 8443 with the customer's IT team",
        "协助客户IT开放8443端口",
    ),
    (
        "printed labels are blank on one side",
        "打印标签一侧空白",
        "a worn print head",
        "打印头磨损",
        "shipped a replacement print head",
        "寄送新的打印头",
    ),
    (
        "the invoice total does not match the order",
        "发票金额与订单不符",
        "a discount that was applied twice",
        "折扣被重复计算",
        "issued a corrected invoice",
        "重新开具正确发票",
    ),
    (
        "the motor makes a loud noise at full speed",
        "电机满速运行时噪音很大",
        "a loose mounting bracket",
        "安装支架松动",
        "sent a technician to tighten the bracket",
        "派工程师上门紧固支架",
    ),
    (
        "users are logged out every few minutes",
        "用户每隔几分钟被强制退出",
        "a session timeout set to 5 minutes after an update",
        "升级后会话超时被设为5分钟",
        "restored the 8-hour session timeout",
        "恢复8小时会话超时设置",
    ),
    (
        "the delivery arrived with two boxes missing",
        "到货时少了两箱",
        "a labelling error at the distribution centre",
        "配送中心贴错标签",
        "dispatched the missing boxes by express",
        "以快递补发缺少的货物",
    ),
]
SLA_HOURS = {"P1": 4, "P2": 8, "P3": 24, "P4": 72}


def support_ticket(rng, loc):
    vendor, customer_company = loc.company(), loc.company()
    customer, agent = loc.person(), loc.person()
    product, issue = rng.choice(PRODUCTS), rng.choice(ISSUES)
    priority = rng.choice(list(SLA_HOURS))
    day = random_day(rng)
    opened = datetime.datetime(day.year, day.month, day.day, rng.randint(7, 19), rng.randint(0, 59))
    acked = opened + datetime.timedelta(minutes=rng.randint(3, 90))
    resolved = acked + datetime.timedelta(minutes=rng.randint(20, SLA_HOURS[priority] * 60 * 3 // 2))
    found = acked + (resolved - acked) * rng.randint(2, 8) // 10
    minutes = int((resolved - opened).total_seconds() // 60)
    met = minutes <= SLA_HOURS[priority] * 60
    ticket = f"TCK-{day.year}-{rng.randint(1, 99999):05d}"
    score = rng.randint(3, 5) if met else rng.randint(1, 4)
    if loc.lang == "en":
        lines = [
            f"Support ticket {ticket} ({priority})",
            f"Vendor: {vendor}",
            f"Customer: {customer}, {customer_company} ({loc.email(customer, customer_company)})",
            f"Product: {product[0]}",
            f"Channel: {rng.choice(['email', 'phone', 'live chat', 'customer portal'])}",
            "",
            "Problem",
            f"The customer reports that {issue[0]}. "
            + rng.choice(
                [
                    "The problem started after a routine restart.",
                    "It affects all units at one site.",
                    "Only one unit is affected.",
                    "The issue is blocking their morning shipments.",
                ]
            ),
            "",
            "Timeline",
            f"- {opened:%Y-%m-%d %H:%M} ticket opened",
            f"- {acked:%Y-%m-%d %H:%M} acknowledged by {agent}",
            f"- {found:%Y-%m-%d %H:%M} root cause identified: {issue[2]}",
            f"- {resolved:%Y-%m-%d %H:%M} resolved: {issue[4]}",
            "",
            "Resolution",
            f"{agent} {issue[4]}. Time to resolution was {minutes // 60} h {minutes % 60} min "
            f"against a {SLA_HOURS[priority]} h target, so the SLA was {'met' if met else 'missed'}.",
            f"Customer satisfaction: {score}/5.",
        ]
    else:
        lines = [
            f"客服工单 {ticket}（优先级{priority}）",
            f"服务商：{vendor}",
            f"客户：{customer}，{customer_company}（{loc.email(customer, customer_company)}）",
            f"产品：{product[1]}",
            f"来源渠道：{rng.choice(['邮件', '电话', '在线客服', '客户门户'])}",
            "",
            "问题描述",
            f"客户反映{issue[1]}。"
            + rng.choice(
                [
                    "问题在例行重启后出现。",
                    "同一站点的所有设备均受影响。",
                    "仅有一台设备受影响。",
                    "该问题影响了客户早班发货。",
                ]
            ),
            "",
            "处理过程",
            f"- {opened:%Y-%m-%d %H:%M} 创建工单",
            f"- {acked:%Y-%m-%d %H:%M} {agent}受理",
            f"- {found:%Y-%m-%d %H:%M} 确认原因：{issue[3]}",
            f"- {resolved:%Y-%m-%d %H:%M} 已解决：{issue[5]}",
            "",
            "处理结果",
            f"{agent}已{issue[5]}。处理用时{minutes // 60}小时{minutes % 60}分钟，"
            f"时限为{SLA_HOURS[priority]}小时，{'符合' if met else '未达到'}服务时限要求。",
            f"客户满意度：{score}/5。",
        ]
    return "\n".join(lines)


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


# (feature EN, feature ZH)
SOFTWARE_FEATURES = [
    ("export reports to Excel and PDF", "支持将报表导出为Excel和PDF"),
    ("single sign-on with the company directory", "支持企业目录单点登录"),
    ("a dark mode for the web client", "网页端新增深色模式"),
    ("bulk import of records from CSV files", "支持从CSV文件批量导入数据"),
    ("an audit log of every change", "新增完整的操作审计日志"),
    ("barcode scanning from the mobile app", "移动端支持扫码录入"),
    ("scheduled e-mail summaries", "支持定时发送邮件摘要"),
    ("role-based access for external partners", "外部合作伙伴可按角色授权访问"),
]
SOFTWARE_FIXES = [
    ("dates shown in the wrong time zone", "日期显示时区错误"),
    ("a crash when a filter matched no rows", "筛选结果为空时程序崩溃"),
    ("duplicate notifications after a restart", "重启后重复发送通知"),
    ("slow loading of large attachments", "大附件加载缓慢"),
    ("totals rounded incorrectly in the summary view", "汇总视图金额四舍五入错误"),
    ("the search box ignoring accented characters", "搜索框无法识别带重音字符"),
    ("an expired session not redirecting to login", "会话过期后未跳转到登录页"),
]


def release_notes(rng, loc):
    company = loc.company()
    name = rng.choice(SOFTWARE)
    major, minor, patch = rng.randint(1, 6), rng.randint(0, 12), rng.randint(1, 9)
    day = random_day(rng)
    features = rng.sample(SOFTWARE_FEATURES, rng.randint(1, 3))
    fixes = [(fix, rng.randint(1000, 9999)) for fix in rng.sample(SOFTWARE_FIXES, rng.randint(2, 4))]
    before = rng.randint(20, 180) / 10
    gain = rng.randint(15, 70)
    after = round(before * (100 - gain) / 100, 1)
    en = loc.lang == "en"
    version, previous = f"{major}.{minor}.{patch}", f"{major}.{minor}.{patch - 1}"
    if en:
        lines = [
            f"{name[0]} {version} release notes",
            f"{company}, released {loc.date(day)}",
            "",
            f"This release follows {previous}. "
            + rng.choice(
                [
                    "Upgrading is recommended for all customers.",
                    "It is a free update for all subscribers.",
                    "Self-hosted customers can upgrade in place.",
                ]
            ),
            "",
            "New",
        ] + [f"- {f[0][0].upper()}{f[0][1:]}" for f in features]
        lines += ["", "Fixed"] + [f"- #{n}: {f[0]}" for f, n in fixes]
        lines += [
            "",
            "Performance",
            f"- Report generation is {gain}% faster: {before:.1f} s before, {after:.1f} s now.",
        ]
        if minor > 0:
            lines += [
                "",
                "Upgrade notes",
                f"Versions older than {major}.{minor - 1}.0 must run the database migration first.",
            ]
    else:
        lines = [
            f"{name[1]} {version} 版本更新说明",
            f"{company}，发布日期：{loc.date(day)}",
            "",
            f"本版本基于{previous}。"
            + rng.choice(["建议所有客户升级。", "所有订阅用户可免费升级。", "私有化部署客户可直接原地升级。"]),
            "",
            "新增功能",
        ] + [f"- {f[1]}" for f in features]
        lines += ["", "问题修复"] + [f"- #{n}：修复{f[1]}的问题" for f, n in fixes]
        lines += ["", "性能优化", f"- 报表生成速度提升{gain}%：由{before:.1f}秒缩短至{after:.1f}秒。"]
        if minor > 0:
            lines += ["", "升级说明", f"低于{major}.{minor - 1}.0的版本需先执行数据库迁移。"]
    return "\n".join(lines)


DOCUMENT_KINDS = [
    quarterly_report,
    meeting_minutes,
    product_announcement,
    support_ticket,
    invoice,
    hr_memo,
    supplier_email,
    release_notes,
]


def documents(seed, target_bytes):
    """Documents alternating English/Chinese until their JSONL encoding reaches ``target_bytes``."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < target_bytes:
        loc = (English if len(lines) % 2 == 0 else Chinese)(rng)
        text = rng.choice(DOCUMENT_KINDS)(rng, loc)
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        lines.append(line)
        size += len(line.encode("utf-8"))
    return lines


def generate(out_dir):
    """Write the train and validation corpora into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, seed, target in [(TRAIN_FILE, TRAIN_SEED, TRAIN_BYTES), (VALID_FILE, VALID_SEED, VALID_BYTES)]:
        path = out_dir / name
        path.write_bytes("".join(documents(seed, target)).encode("utf-8"))
        paths.append(path)
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir",
        default=str(Path(__file__).resolve().parent),
        help="directory for corpus_train.jsonl and corpus_valid.jsonl (default: next to this script)",
    )
    generate(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
