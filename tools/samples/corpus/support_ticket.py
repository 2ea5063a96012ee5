"""Support tickets: a timeline whose resolution time matches the SLA of the priority."""

import datetime

from tools.samples.corpus.locales import random_day
from tools.samples.corpus.pools import PRODUCTS

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
