"""The built-in prompt corpus: short passages in four kinds (English prose, Chinese prose, code, maths).

Written for ferrylm (no third-party text, nothing downloaded). Prompts are built by drawing these
sentences in random order, so a few dozen per kind give any length. Each kind ends with the task line
that is put after the drawn text, so the request reads like a real one.
"""

EN = [
    "The harbour wakes before the town does, and the first ferry leaves while the streetlights are still on.",
    "Engineers who run large language models in production care less about the peak speed than about the slow tail.",
    "A memory leak rarely announces itself; it shows up as a line that climbs a few megabytes an hour for days.",
    "The river carried timber down from the hills every spring, and the mill worked through the night to keep up.",
    "When a queue grows faster than it drains, every request behind it waits a little longer than the one before.",
    "She kept a notebook of every bridge she crossed, with the date, the weather and the colour of the water.",
    "Good benchmarks state their baseline, their workload and their limits before they state a single number.",
    "The old library had a reading room with tall windows, and in winter the light reached only the first row.",
    "A scheduler that favours short requests keeps the median low but may starve the long ones at the back.",
    "Farmers in the valley rotate their crops so the soil can rest, planting beans where the wheat grew last year.",
    "Latency is what one user feels; throughput is what the operator pays for; goodput is the part of it that counts.",
    "The lighthouse keeper wrote that the fog came in like a slow tide, swallowing the rocks one by one.",
    "A cache helps only when the same thing is asked again, so a benchmark that repeats itself can flatter a server.",
    "On the night train the carriages were quiet, and the conductor walked through them with a small brass lamp.",
    "Every system that runs for months meets the fault its designers did not test: a full disk, a slow link, a hot room.",
    "The recipe called for flour, butter, a pinch of salt and more patience than most people bring to a kitchen.",
    "Measuring the same thing twice and getting two answers is not a failure; it is the first honest result.",
    "The children raced paper boats along the gutter after the storm, cheering whenever one reached the drain.",
]
EN_TASK = "Summarise the text above in three sentences, then say which sentence you found most surprising and why."

ZH = [
    "清晨的码头总是比城里醒得早，第一班渡轮出发时，街灯还亮着。",
    "在生产环境中运行大语言模型的工程师，关心的往往不是峰值速度，而是最慢的那一部分请求。",
    "内存泄漏很少大张旗鼓地出现，它只是一条每小时悄悄上升几兆字节的曲线，持续好几天。",
    "每年春天，河水把山上的木材冲下来，磨坊通宵工作才能跟上。",
    "当队列增长的速度超过它被处理的速度，排在后面的每一个请求都要比前一个多等一会儿。",
    "她有一个笔记本，记下了她走过的每一座桥，还有日期、天气和河水的颜色。",
    "好的基准测试在给出任何数字之前，先说明它的基线、负载和局限。",
    "老图书馆有一间窗户很高的阅览室，冬天的阳光只能照到第一排座位。",
    "偏爱短请求的调度器能让中位数保持很低，却可能让排在后面的长请求一直等下去。",
    "山谷里的农民轮种庄稼，让土地休养生息，去年种麦子的地方今年种豆子。",
    "延迟是一个用户的感受，吞吐量是运营者付钱买的东西，而有效吞吐量才是真正算数的部分。",
    "灯塔看守人写道，雾像缓慢的潮水一样涌来，把礁石一块一块吞没。",
    "缓存只有在同样的问题被再次提出时才有用，所以一个不断重复自己的基准测试可能会美化服务器的表现。",
    "夜班火车的车厢里很安静，列车员提着一盏小铜灯从车厢中走过。",
    "每个运行数月的系统都会遇到设计者没有测试过的故障：磁盘写满、网络变慢、机房过热。",
    "这道菜需要面粉、黄油、一小撮盐，还有比大多数人在厨房里更多的耐心。",
    "把同一件事测量两次却得到两个答案，这不是失败，而是第一个诚实的结果。",
    "暴雨过后，孩子们沿着路边的水沟放纸船，每当一只船漂到下水口，大家就欢呼起来。",
]
ZH_TASK = "请用三句话概括上面的内容，然后说明哪一句最让你意外，以及原因。"

CODE = [
    "def moving_average(xs, k):\n    out, total = [], 0.0\n    for i, x in enumerate(xs):\n        total += x\n        if i >= k:\n            total -= xs[i - k]\n        out.append(total / min(i + 1, k))\n    return out\n",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity, self.items = capacity, {}\n\n    def get(self, key):\n        if key not in self.items:\n            return None\n        value = self.items.pop(key)\n        self.items[key] = value\n        return value\n",
    "    def put(self, key, value):\n        self.items.pop(key, None)\n        self.items[key] = value\n        if len(self.items) > self.capacity:\n            self.items.pop(next(iter(self.items)))\n",
    "fn parse_port(s: &str) -> Result<u16, String> {\n    s.trim().parse::<u16>().map_err(|e| format!(\"bad port {s:?}: {e}\"))\n}\n",
    "async def fetch_all(client, urls, limit=8):\n    sem = asyncio.Semaphore(limit)\n\n    async def one(url):\n        async with sem:\n            r = await client.get(url)\n            return url, r.status_code\n\n    return await asyncio.gather(*(one(u) for u in urls))\n",
    "SELECT region, date_trunc('day', created_at) AS day, count(*) AS orders, sum(total) AS revenue\nFROM orders\nWHERE created_at >= now() - interval '30 days'\nGROUP BY region, day\nORDER BY day, revenue DESC;\n",
    "int binary_search(const int *a, int n, int key) {\n    int lo = 0, hi = n - 1;\n    while (lo <= hi) {\n        int mid = lo + (hi - lo) / 2;\n        if (a[mid] == key) return mid;\n        if (a[mid] < key) lo = mid + 1; else hi = mid - 1;\n    }\n    return -1;\n}\n",
    "function debounce(fn, ms) {\n  let timer = null;\n  return (...args) => {\n    clearTimeout(timer);\n    timer = setTimeout(() => fn(...args), ms);\n  };\n}\n",
    "def percentile(values, q):\n    xs = sorted(values)\n    pos = (len(xs) - 1) * q / 100\n    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)\n    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)\n",
    "#!/bin/sh\nset -eu\nfor f in logs/*.log; do\n  gzip -9 \"$f\" && mv \"$f.gz\" archive/\ndone\necho \"archived $(ls archive | wc -l) files\"\n",
    "type Queue[T any] struct {\n\titems []T\n}\n\nfunc (q *Queue[T]) Push(v T) { q.items = append(q.items, v) }\n\nfunc (q *Queue[T]) Pop() (T, bool) {\n\tvar zero T\n\tif len(q.items) == 0 {\n\t\treturn zero, false\n\t}\n\tv := q.items[0]\n\tq.items = q.items[1:]\n\treturn v, true\n}\n",
    "@dataclass(frozen=True)\nclass Window:\n    start: float\n    end: float\n\n    def contains(self, t: float) -> bool:\n        return self.start <= t < self.end\n",
]
CODE_TASK = "Review the code above: point out one bug or risk in each snippet and show the corrected lines."

MATH = [
    "A ferry crosses a 12 km strait at 18 km/h and returns at 24 km/h. What is its average speed for the round trip?",
    "Solve for x: 3x^2 - 12x + 9 = 0, and check both roots by substitution.",
    "A server answers 40 requests per second and each takes 0.25 s on average. By Little's law, how many are in flight?",
    "Prove that the sum of the first n odd numbers is n^2, first by induction and then with a picture in words.",
    "A tank leaks 0.3 litres per day. If it holds 250 litres, after how many weeks is it below one half full?",
    "Let f(x) = x e^{-x}. Find the maximum of f on [0, infinity) and the point where it is reached.",
    "Requests arrive as a Poisson process with rate 2 per second. What is the probability of no arrival in one second?",
    "The matrix A = [[2, 1], [1, 2]] has two eigenvalues. Find them and one eigenvector for each.",
    "A price rises 10% and then falls 10%. Is it back where it started? Show the arithmetic.",
    "How many ways can 5 different books be arranged on a shelf if two of them must stay side by side?",
    "Compute the integral of 1 / (1 + x^2) from 0 to 1 and explain why the answer is a quarter of pi.",
    "Fit a line y = a + b t to the points (0, 1.0), (1, 1.9), (2, 3.2), (3, 3.9) by least squares.",
    "A sample of 25 latencies has mean 1.2 s and standard deviation 0.5 s. Give a 95% confidence interval for the mean.",
    "Show that the square root of 2 is irrational.",
]
MATH_TASK = "Solve each problem above step by step and give every final answer on its own line."

KINDS = {"en": (EN, EN_TASK, " "), "zh": (ZH, ZH_TASK, ""), "code": (CODE, CODE_TASK, "\n"),
         "math": (MATH, MATH_TASK, "\n")}
"""kind -> (sentences, task line, separator between drawn sentences)."""
