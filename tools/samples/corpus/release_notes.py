"""Software release notes: features, fixes, a performance figure, upgrade notes."""

from tools.samples.corpus.locales import random_day
from tools.samples.corpus.pools import SOFTWARE

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
