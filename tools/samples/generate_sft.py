"""Write the business SFT sample: product-support FAQ and order-status conversations, English and Chinese.

    python -m tools.samples.generate_sft               # rewrites data/samples/business_sft_{train,valid}.jsonl
    python -m tools.samples.generate_sft --out-dir DIR

Everything is invented for mindmoe (company, products, policies, people). The facts are fixed (a
small product knowledge base and a set of store policies), so a fine-tuned model can learn them; the
wording, the products asked about, the orders and the turn structure vary. Order-status answers are
grounded in an order record given in the system message. The validation file uses another seed: the
same knowledge, other orders and other combinations. Standard library only; byte-identical output. The
knowledge base and phrasings are in ``tools/samples/sft_knowledge.py``.
"""

import argparse
import json
import random
from pathlib import Path

from tools.samples.sft_knowledge import (
    CARRIERS,
    CHANGE_QUESTIONS,
    CITIES,
    GREETINGS,
    ORDER_SYSTEM,
    POLICIES,
    PRODUCTS,
    QUESTIONS,
    STATUS_QUESTIONS,
    SUPPORT_SYSTEM,
    THANKS,
    WELCOME,
)

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "data" / "samples"
TRAIN_FILE, VALID_FILE = "business_sft_train.jsonl", "business_sft_valid.jsonl"
TRAIN_SEED, VALID_SEED = 515, 9091
TRAIN_CONVERSATIONS, VALID_CONVERSATIONS = 420, 60


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
    parser.add_argument("--out-dir", type=Path, default=SAMPLES_DIR)
    out_dir = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    train = conversations(TRAIN_SEED, TRAIN_CONVERSATIONS)
    write(out_dir / TRAIN_FILE, train)
    write(out_dir / VALID_FILE, conversations(VALID_SEED, VALID_CONVERSATIONS, exclude=frozenset(train)))


if __name__ == "__main__":
    main()
