"""Write the business SFT sample: product-support FAQ and order-status conversations, English and Chinese.

    python data/samples/generate_sft.py                # rewrites business_sft_{train,valid}.jsonl here
    python data/samples/generate_sft.py --out-dir DIR

Everything is invented for mindmoe (company, products, policies, people). The facts are fixed (a
small product knowledge base and a set of store policies), so a fine-tuned model can learn them; the
wording, the products asked about, the orders and the turn structure vary. Order-status answers are
grounded in an order record given in the system message. The validation file uses another seed: the
same knowledge, other orders and other combinations. Standard library only; byte-identical output.
"""

import argparse
import json
import random
from pathlib import Path

TRAIN_FILE, VALID_FILE = "business_sft_train.jsonl", "business_sft_valid.jsonl"
TRAIN_SEED, VALID_SEED = 515, 9091
TRAIN_CONVERSATIONS, VALID_CONVERSATIONS = 420, 60

STORE = {"en": "Qinghe Home", "zh": "清禾家电"}
SUPPORT_SYSTEM = {
    "en": "You are the customer support assistant of Qinghe Home. Answer briefly and accurately.",
    "zh": "你是清禾家电的客服助手，请简洁、准确地回答。",
}
ORDER_SYSTEM = {
    "en": "You are the order-status assistant of Qinghe Home. Use only the order record below.",
    "zh": "你是清禾家电的订单查询助手，只根据下面的订单记录回答。",
}

# name (en, zh) and facts: attribute -> (English answer, Chinese answer)
PRODUCTS = [
    (
        ("AeroPure 300 air purifier", "净风300空气净化器"),
        {
            "warranty": ("The AeroPure 300 has a 2-year warranty.", "净风300空气净化器保修两年。"),
            "maintenance": (
                "Replace the F-300 filter every 6 months; the indicator turns red when it is due.",
                "F-300滤芯每6个月更换一次，指示灯变红时就该换了。",
            ),
            "spec": (
                "It covers rooms up to 40 m² and runs at 28 dB in sleep mode.",
                "适用面积40平方米以内，睡眠模式噪音28分贝。",
            ),
            "problem": (
                "If it smells musty, the filter is saturated: replace the F-300 filter and run it on high "
                "for 30 minutes.",
                "如果有霉味，说明滤芯已饱和：请更换F-300滤芯，并用高档运行30分钟。",
            ),
        },
    ),
    (
        ("BrewMate C2 coffee machine", "咖萃C2咖啡机"),
        {
            "warranty": ("The BrewMate C2 has a 1-year warranty.", "咖萃C2咖啡机保修一年。"),
            "maintenance": (
                "Descale it every 200 cups or every 2 months, whichever comes first.",
                "每冲200杯或每2个月除垢一次，以先到者为准。",
            ),
            "spec": ("The water tank holds 1.2 litres and the pump delivers 15 bar.", "水箱容量1.2升，泵压15巴。"),
            "problem": (
                "Error E3 means the water tank is empty or not seated: refill it and push it down until it clicks.",
                "E3故障表示水箱缺水或未放到位：请加水并把水箱按到底，听到咔哒声即可。",
            ),
        },
    ),
    (
        ("TrailSound X5 earbuds", "行声X5耳机"),
        {
            "warranty": ("The TrailSound X5 earbuds have a 1-year warranty.", "行声X5耳机保修一年。"),
            "maintenance": (
                "Clean the ear tips weekly with a dry cloth and keep the charging contacts dry.",
                "每周用干布清洁耳塞套，并保持充电触点干燥。",
            ),
            "spec": (
                "They play for 8 hours per charge, 32 hours with the case, and are rated IPX5.",
                "单次续航8小时，配合充电盒共32小时，防水等级IPX5。",
            ),
            "problem": (
                "To pair again, put both earbuds in the case, open the lid and hold the button for 5 seconds "
                "until the light blinks white.",
                "重新配对：把两只耳机放回充电盒，打开盒盖，长按按钮5秒，直到指示灯白色闪烁。",
            ),
        },
    ),
    (
        ("HomeHub Mini smart plug", "智联Mini智能插座"),
        {
            "warranty": ("The HomeHub Mini has an 18-month warranty.", "智联Mini智能插座保修18个月。"),
            "maintenance": (
                "It needs no maintenance; keep the firmware updated in the app.",
                "无需保养，请在App中保持固件为最新版本。",
            ),
            "spec": (
                "It handles up to 10 A (2200 W) and connects to 2.4 GHz Wi-Fi only.",
                "最大负载10安（2200瓦），仅支持2.4GHz无线网络。",
            ),
            "problem": (
                "If it will not connect, make sure your router offers 2.4 GHz, then hold the button for 10 "
                "seconds to reset it.",
                "如果无法联网，请确认路由器开启了2.4GHz频段，然后长按按钮10秒重置。",
            ),
        },
    ),
    (
        ("RoboSweep S7 robot vacuum", "扫宝S7扫地机器人"),
        {
            "warranty": (
                "The RoboSweep S7 has a 2-year warranty, 1 year on the battery.",
                "扫宝S7扫地机器人整机保修两年，电池保修一年。",
            ),
            "maintenance": (
                "Empty the bin after each run and replace the side brush every 3 months.",
                "每次清扫后倒空尘盒，边刷每3个月更换一次。",
            ),
            "spec": (
                "It runs for 150 minutes per charge and climbs thresholds up to 2 cm.",
                "充满电可工作150分钟，可越过2厘米高的门槛。",
            ),
            "problem": (
                "Error E7 means a wheel is stuck: remove hair from both wheels and restart it.",
                "E7故障表示轮子被卡住：请清除两侧轮子上的毛发后重新启动。",
            ),
        },
    ),
]

QUESTIONS = {
    "warranty": {
        "en": [
            "How long is the warranty on the {p}?",
            "What warranty comes with the {p}?",
            "Is the {p} still under warranty after a year?",
            "warranty period for the {p}?",
        ],
        "zh": ["{p}保修多久？", "请问{p}的保修期是多长时间？", "{p}买了一年还在保修期内吗？"],
    },
    "maintenance": {
        "en": [
            "How do I maintain the {p}?",
            "How often does the {p} need servicing?",
            "Any maintenance tips for my {p}?",
        ],
        "zh": ["{p}需要怎么保养？", "{p}多久需要维护一次？", "我的{p}平时要注意什么保养？"],
    },
    "spec": {
        "en": [
            "What are the main specs of the {p}?",
            "Tell me the key numbers for the {p}.",
            "How does the {p} perform?",
        ],
        "zh": ["{p}的主要参数是什么？", "介绍一下{p}的性能参数。", "{p}的规格是怎样的？"],
    },
    "problem": {
        "en": [
            "My {p} has a problem, what should I do?",
            "Something is wrong with my {p}. Help?",
            "I cannot get my {p} to work properly.",
        ],
        "zh": ["我的{p}出问题了，怎么办？", "{p}好像坏了，帮我看看。", "{p}用不了了，怎么处理？"],
    },
}

POLICIES = [
    (
        {
            "en": ["Can I return something I bought?", "What is your return policy?", "How do returns work?"],
            "zh": ["买的东西可以退吗？", "你们的退货政策是什么？", "怎么办理退货？"],
        },
        {
            "en": "You can return any item within 30 days of delivery with the receipt; the refund reaches your "
            "account 3 to 5 business days after we receive the item.",
            "zh": "收货后30天内凭购物凭证可以退货，我们收到退货后3到5个工作日内退款到账。",
        },
    ),
    (
        {
            "en": ["Is shipping free?", "How much does delivery cost?", "Do you charge for shipping?"],
            "zh": ["包邮吗？", "运费怎么算？", "配送要收费吗？"],
        },
        {
            "en": "Shipping is free on orders over 199 yuan; smaller orders pay a flat 12 yuan.",
            "zh": "订单满199元包邮，不满199元收取12元运费。",
        },
    ),
    (
        {
            "en": ["What are your service hours?", "When can I reach customer service?"],
            "zh": ["客服什么时间在线？", "几点可以联系人工客服？"],
        },
        {
            "en": "Human agents are available every day from 9:00 to 21:00; this assistant answers around the clock.",
            "zh": "人工客服每天9:00至21:00在线，本助手全天24小时为您服务。",
        },
    ),
]

GREETINGS = {"en": ["Hi.", "Hello!", "Hi there,", "Good morning.", ""], "zh": ["你好。", "您好！", "在吗？", ""]}
THANKS = {"en": ["Thanks!", "Great, thank you.", "OK, got it."], "zh": ["好的，谢谢！", "明白了，谢谢。", "收到。"]}
WELCOME = {
    "en": ["You're welcome. Anything else I can help with?", "Glad to help!"],
    "zh": ["不客气，还有其他可以帮您的吗？", "很高兴为您服务！"],
}

CARRIERS = [("SF Express", "顺丰速运"), ("JD Logistics", "京东物流"), ("ZTO Express", "中通快递")]
CITIES = [("Shanghai", "上海"), ("Hangzhou", "杭州"), ("Chengdu", "成都"), ("Wuhan", "武汉"), ("Xi'an", "西安")]
STATUS_QUESTIONS = {
    "en": [
        "Where is my order {o}?",
        "What's the status of order {o}?",
        "Has order {o} shipped yet?",
        "Can you check order {o} for me?",
    ],
    "zh": ["我的订单{o}到哪了？", "帮我查一下订单{o}的状态。", "订单{o}发货了吗？", "{o}这个订单现在什么情况？"],
}
CHANGE_QUESTIONS = {
    "en": ["Can I still change the delivery address?", "Is it too late to change the address?"],
    "zh": ["还能修改收货地址吗？", "现在改地址还来得及吗？"],
}


def day(rng, month_lo=3, month_hi=11):
    return rng.randint(month_lo, month_hi), rng.randint(1, 28)


def date_text(lang, month, dom):
    return f"2025-{month:02d}-{dom:02d}" if lang == "en" else f"{month}月{dom}日"


def order_record(rng, lang):
    """(record text for the system message, status answer, address-change answer)."""
    number = f"QH{rng.randint(10**7, 10**8 - 1)}"
    product = rng.choice(PRODUCTS)[0][0 if lang == "en" else 1]
    status = rng.choice(["processing", "shipped", "delivered", "delayed", "cancelled"])
    carrier = rng.choice(CARRIERS)[0 if lang == "en" else 1]
    tracking = f"{rng.choice(['SF', 'JD', 'ZT'])}{rng.randint(10**9, 10**10 - 1)}"
    city = rng.choice(CITIES)[0 if lang == "en" else 1]
    month, dom = day(rng)
    when = date_text(lang, month, dom)
    later = date_text(lang, month, min(dom + rng.randint(2, 4), 28))
    en = lang == "en"
    if status == "processing":
        record = (
            f"order {number}; item {product}; status processing; ships by {when}; to {city}"
            if en
            else f"订单{number}；商品{product}；状态：备货中；预计{when}前发货；收货城市{city}"
        )
        answer = (
            f"Order {number} ({product}) is being prepared and will ship by {when}."
            if en
            else f"订单{number}（{product}）正在备货，预计{when}前发货。"
        )
        change = (
            f"Yes. It has not shipped yet, so you can change the address in My Orders before {when}."
            if en
            else f"可以。订单尚未发货，{when}前可在“我的订单”中修改地址。"
        )
    elif status == "shipped":
        record = (
            (
                f"order {number}; item {product}; status shipped; carrier {carrier}; tracking {tracking}; "
                f"expected {later}; to {city}"
            )
            if en
            else f"订单{number}；商品{product}；状态：已发货；承运商{carrier}；运单号{tracking}；"
            f"预计{later}送达；收货城市{city}"
        )
        answer = (
            (
                f"Order {number} has shipped with {carrier}, tracking number {tracking}. It should arrive in "
                f"{city} on {later}."
            )
            if en
            else f"订单{number}已由{carrier}发出，运单号{tracking}，预计{later}送达{city}。"
        )
        change = (
            f"The order has already shipped, so please ask {carrier} to redirect it with tracking number {tracking}."
            if en
            else f"订单已发货，请凭运单号{tracking}联系{carrier}修改派送地址。"
        )
    elif status == "delivered":
        record = (
            f"order {number}; item {product}; status delivered on {when}; signed by the recipient in {city}"
            if en
            else f"订单{number}；商品{product}；状态：已于{when}签收；收货城市{city}"
        )
        answer = (
            f"Order {number} was delivered in {city} on {when} and signed for."
            if en
            else f"订单{number}已于{when}在{city}签收。"
        )
        change = (
            "The order has already been delivered, so the address can no longer be changed."
            if en
            else "订单已经签收，无法再修改地址。"
        )
    elif status == "delayed":
        reason = rng.choice(
            [("heavy rain on the route", "沿途暴雨"), ("a backlog at the sorting centre", "分拣中心积压")]
        )
        record = (
            (
                f"order {number}; item {product}; status delayed ({reason[0]}); carrier {carrier}; new expected "
                f"date {later}"
            )
            if en
            else f"订单{number}；商品{product}；状态：延误（{reason[1]}）；承运商{carrier}；新的预计送达日期{later}"
        )
        answer = (
            (
                f"Sorry, order {number} is delayed because of {reason[0]}. {carrier} now expects to deliver it on "
                f"{later}."
            )
            if en
            else f"抱歉，订单{number}因{reason[1]}延误，{carrier}预计{later}送达。"
        )
        change = (
            f"It is already with {carrier}; please contact them to change the address."
            if en
            else f"包裹已在{carrier}运输途中，请联系承运商修改地址。"
        )
    else:
        record = (
            f"order {number}; item {product}; status cancelled on {when}; refund issued"
            if en
            else f"订单{number}；商品{product}；状态：已于{when}取消；已退款"
        )
        answer = (
            (
                f"Order {number} was cancelled on {when}. The refund has been issued and reaches your account "
                "within 3 to 5 business days."
            )
            if en
            else f"订单{number}已于{when}取消，退款已发起，3到5个工作日内到账。"
        )
        change = (
            "The order was cancelled, so there is nothing to change; you are welcome to place a new one."
            if en
            else "该订单已取消，无需修改地址，欢迎重新下单。"
        )
    return number, record, answer, change


def greeted(rng, lang, text):
    greeting = rng.choice(GREETINGS[lang])
    return f"{greeting} {text}".strip() if lang == "en" else f"{greeting}{text}"


def faq_conversation(rng, lang):
    index = 0 if lang == "en" else 1
    messages = [{"role": "system", "content": SUPPORT_SYSTEM[lang]}] if rng.random() < 0.6 else []
    for turn in range(rng.choice([1, 1, 2, 2, 3])):
        if rng.random() < 0.25:
            questions, answer = rng.choice(POLICIES)
            question, reply = rng.choice(questions[lang]), answer[lang]
        else:
            names, facts = rng.choice(PRODUCTS)
            attribute = rng.choice(sorted(facts))
            question = rng.choice(QUESTIONS[attribute][lang]).format(p=names[index])
            reply = facts[attribute][index]
        messages += [
            {"role": "user", "content": greeted(rng, lang, question) if turn == 0 else question},
            {"role": "assistant", "content": reply},
        ]
    if rng.random() < 0.3:
        messages += [
            {"role": "user", "content": rng.choice(THANKS[lang])},
            {"role": "assistant", "content": rng.choice(WELCOME[lang])},
        ]
    return messages


def order_conversation(rng, lang):
    number, record, answer, change = order_record(rng, lang)
    separator = "\nOrder record: " if lang == "en" else "\n订单记录："
    messages = [
        {"role": "system", "content": ORDER_SYSTEM[lang] + separator + record},
        {"role": "user", "content": greeted(rng, lang, rng.choice(STATUS_QUESTIONS[lang]).format(o=number))},
        {"role": "assistant", "content": answer},
    ]
    if rng.random() < 0.4:
        messages += [
            {"role": "user", "content": rng.choice(CHANGE_QUESTIONS[lang])},
            {"role": "assistant", "content": change},
        ]
    if rng.random() < 0.2:
        messages += [
            {"role": "user", "content": rng.choice(THANKS[lang])},
            {"role": "assistant", "content": rng.choice(WELCOME[lang])},
        ]
    if rng.random() < 0.15:  # some exports use the flat prompt/response form
        return {"prompt": messages[1]["content"], "response": answer, "system": messages[0]["content"]}
    return {"messages": messages}


def conversations(seed, count, exclude=frozenset()):
    """``count`` distinct JSONL lines, none of them in ``exclude`` (short FAQ exchanges repeat by chance)."""
    rng = random.Random(seed)
    lines, seen = [], set(exclude)
    while len(lines) < count:
        lang = "en" if len(lines) % 2 == 0 else "zh"
        row = order_conversation(rng, lang) if rng.random() < 0.5 else {"messages": faq_conversation(rng, lang)}
        line = json.dumps(row, ensure_ascii=False)
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return lines


def write(path: Path, lines) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.write("".join(line + "\n" for line in lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    out_dir = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    train = conversations(TRAIN_SEED, TRAIN_CONVERSATIONS)
    write(out_dir / TRAIN_FILE, train)
    write(out_dir / VALID_FILE, conversations(VALID_SEED, VALID_CONVERSATIONS, exclude=frozenset(train)))


if __name__ == "__main__":
    main()
