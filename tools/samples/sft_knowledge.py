"""The facts of the business SFT sample: store, products and their facts, policies, phrasings, order fields."""

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
