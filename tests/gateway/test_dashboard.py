"""``GET /dashboard``: the page as served (self-contained, locked down by its CSP), and the page
running in headless Chromium against the live gateway: the numbers it shows are exactly the
stats API's, errors show a banner and keep retrying, and a screenshot is saved.

Chromium is Debian's ``chromium`` (``make test`` installs it). Without it the browser tests are
skipped with a loud reason; the served-page tests still run.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import uuid
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from prefixgate.gateway.http import dashboard
from tests.gateway.conftest import ADMIN_KEY, wait_idle

WINDOW = (1440, 1500)  # screenshot size, CSS pixels
# Virtual time the page gets before the DOM is dumped: the first poll at 0, then one every
# 1.5 s, so at least two polls (proof that it keeps polling). Virtual time waits for the
# network, so a slow machine only makes the run longer, never different.
BUDGET_MS = 4000

CHROMIUM = next(
    (path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None
)
MISSING_CHROMIUM = (
    "!!! CHROMIUM IS NOT INSTALLED: the dashboard's browser tests DID NOT RUN. "
    "Install it with `make test` (or `apt-get install chromium`). !!!"
)


@pytest.fixture(scope="module")
def chromium() -> str:
    if CHROMIUM is None:
        print(f"\n{MISSING_CHROMIUM}", file=sys.stderr)
        pytest.skip(MISSING_CHROMIUM)
    return CHROMIUM


# ── a small DOM tree from Chromium's --dump-dom ─────────────────────────────────────────────


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        parts = [c if isinstance(c, str) else c.text for c in self.children]
        return " ".join("".join(parts).split())

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def walk(self):
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.walk()

    def all(self, testid: str) -> list[Element]:
        return [e for e in self.walk() if e.attrs.get("data-testid") == testid]

    def one(self, testid: str) -> Element:
        found = self.all(testid)
        assert len(found) == 1, f"{len(found)} elements with data-testid={testid!r}"
        return found[0]

    def value(self, testid: str) -> str:
        return self.one(testid).attrs["data-value"]


class _TreeBuilder(HTMLParser):
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in self.VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):  # <rect/> in SVG
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse_dom(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


# ── running Chromium ────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class PageRun:
    dom: Element
    raw_dom: str
    console: list[str]  # the page's console messages


def load_page(binary: str, url: str, workdir: Path, screenshot: Path | None = None) -> PageRun:
    """Load ``url`` in headless Chromium, let it run ``BUDGET_MS`` of virtual time, dump the DOM
    (and take a screenshot at the same moment)."""
    workdir.mkdir(parents=True, exist_ok=True)
    args = [
        binary,
        "--headless",
        "--no-sandbox",  # tests run as root in containers
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--enable-logging=stderr",  # the page's console messages, to catch script errors
        f"--user-data-dir={workdir / 'profile'}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        f"--virtual-time-budget={BUDGET_MS}",
        "--dump-dom",
    ]
    if screenshot is not None:
        args.append(f"--screenshot={screenshot}")
    # The timeout only bounds a hung browser; it never decides a pass.
    done = subprocess.run(
        [*args, url], capture_output=True, text=True, timeout=180, cwd=workdir, check=False
    )
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-3000:]}"
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    for line in console:
        # An uncaught exception, a CSP refusal (something the page tried to load or run that
        # the policy forbids) or the page's own console.error/warn ("dashboard: ...").
        assert "Uncaught" not in line and "Refused to" not in line, line
        assert '"dashboard:' not in line, line
    return PageRun(parse_dom(done.stdout), done.stdout, console)


def png_size_and_colours(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct byte values in the decoded scanlines) of a PNG file."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return size[0], size[1], len(set(zlib.decompress(idat)))


# ── shared assertions ───────────────────────────────────────────────────────────────────────


def pct(rate: float) -> str:
    return f"{rate * 100:.1f}%"


def assert_shows(dom: Element, testid: str, value, text: str) -> None:
    """The element shows ``text`` and carries exactly ``value`` (as the API sent it)."""
    element = dom.one(testid)
    shown = element.attrs["data-value"]
    if isinstance(value, float):
        assert float(shown) == value, (testid, shown, value)
    else:
        assert shown == str(value), (testid, shown, value)
    assert element.text == text, (testid, element.text, text)


def assert_hit_rows(dom: Element, kind: str, expected: dict[str, dict]) -> None:
    rows = {row.attrs["data-key"]: row for row in dom.all(f"{kind}-row")}
    assert set(rows) == set(expected), (kind, sorted(rows), sorted(expected))
    for key, hits in expected.items():
        row = rows[key]
        name = row.one(f"{kind}-name")
        # Labels come from clients: shown as text, never parsed as markup.
        assert all(isinstance(child, str) for child in name.children), name
        if key != "__other__":
            assert name.text == " ".join(key.split())
        assert_shows(row, f"{kind}-requests", hits["requests"], f"{hits['requests']:,}")
        assert_shows(row, f"{kind}-query-tokens", hits["query_tokens"], f"{hits['query_tokens']:,}")
        assert_shows(row, f"{kind}-tokens-saved", hits["tokens_saved"], f"{hits['tokens_saved']:,}")
        assert_shows(row, f"{kind}-hit-rate", hits["hit_rate"], pct(hits["hit_rate"]))
        kept = hits["retention_hit_tokens"]
        assert_shows(row, f"{kind}-retention-hits", kept, f"{kept:,}")
    assert_shows(dom, f"{kind}-count", len(expected), str(len(expected)))


def assert_retention(dom: Element, stats: dict) -> None:
    """The retention facts, each tenant's retained pages and the learned TTL rows."""
    for testid, value in (
        ("pages-retained", stats["pages_retained"]),
        ("retained-evicted", stats["retained_evicted"]),
        ("retention-expiries", stats["retention_expiries"]),
        ("retention-hits", stats["global"]["retention_hits"]),
        ("retention-hit-tokens", stats["global"]["retention_hit_tokens"]),
    ):
        assert_shows(dom, testid, value, f"{value:,}")
    for row in dom.all("tenant-row"):
        pages = stats["retained_per_tenant"].get(row.attrs["data-key"], 0)
        assert_shows(row, "tenant-pages-retained", pages, f"{pages:,}")
    policy = stats["retention_policy"]
    assert dom.one("retention-learn").text == ("on" if policy["learn"] else "off")
    expected = {f"{tenant}/{agent}": a for tenant, agents in policy["agents"].items()
                for agent, a in agents.items()}
    rows = {row.attrs["data-key"]: row for row in dom.all("retention-row")}
    assert set(rows) == set(expected)
    for key, a in expected.items():
        assert rows[key].value("retention-pauses") == str(a["pauses"])
        assert float(rows[key].value("retention-ttl")) == a["ttl_s"]
        assert rows[key].one("retention-source").text == a["source"]
    assert ("hidden" in dom.one("retention-empty").classes) == bool(expected)


def system_prompt() -> str:
    """~170 tokens of a realistic agent system prompt; a fresh nonce so no earlier test
    warmed its pages."""
    nonce = uuid.uuid4().hex[:10]
    tools = " ".join(
        f"Tool {name}: {what} Arguments are JSON; report errors verbatim."
        for name, what in (
            ("search_code", "finds symbols and text in the repository."),
            ("read_file", "returns a file's lines with numbers."),
            ("run_tests", "runs pytest on the given paths and returns the summary."),
            ("open_issue", "files a bug with a title, body and labels."),
        )
    )
    return (
        f"[{nonce}] You are a member of a code-review swarm. Work step by step, use the tools "
        f"below, keep answers short and never invent file names. {tools} "
        "When you are done, reply with a one-line verdict and the files you touched."
    )


def chat(client: httpx.Client, model: str, system: str, task: str, user: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
        "max_tokens": 2,
        "user": user,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ── the page as served ──────────────────────────────────────────────────────────────────────


def test_page_is_self_contained_and_locked_down():
    page = dashboard.build_page()
    dom = parse_dom(page.html)
    scripts = [e for e in dom.walk() if e.tag == "script"]
    styles = [e for e in dom.walk() if e.tag == "style"]
    assert len(scripts) == 1 and len(styles) == 1
    assert "src" not in scripts[0].attrs
    # Nothing is loaded from anywhere: every src/href is inline data.
    for element in dom.walk():
        for attr in ("src", "href"):
            if attr in element.attrs:
                assert element.attrs[attr].startswith("data:"), (element.tag, element.attrs)
    # The policy allows exactly the inlined code, and connections to the page's own origin.
    policy = page.content_security_policy
    js = (dashboard.STATIC_DIR / "dashboard.js").read_text(encoding="utf-8")
    css = (dashboard.STATIC_DIR / "dashboard.css").read_text(encoding="utf-8")
    assert scripts[0].children == [js] and styles[0].children == [css]
    assert f"script-src {dashboard.csp_hash(js)};" in policy
    assert f"style-src {dashboard.csp_hash(css)};" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "unsafe" not in policy


def test_build_page_rejects_broken_static_files(tmp_path):
    for name in ("dashboard.html", "dashboard.css", "dashboard.js"):
        shutil.copy(dashboard.STATIC_DIR / name, tmp_path / name)
    js = (tmp_path / "dashboard.js").read_text()
    (tmp_path / "dashboard.js").write_text(js + "\n// </script><script>alert(1)\n")
    with pytest.raises(ValueError, match="dashboard.js contains '</script'"):
        dashboard.build_page(tmp_path)
    (tmp_path / "dashboard.js").write_text(js)
    html = (tmp_path / "dashboard.html").read_text()
    (tmp_path / "dashboard.html").write_text(html.replace('href="dashboard.css"', 'href="x.css"'))
    with pytest.raises(ValueError, match="exactly once to inline dashboard.css"):
        dashboard.build_page(tmp_path)
    (tmp_path / "dashboard.css").unlink()
    with pytest.raises(FileNotFoundError):
        dashboard.build_page(tmp_path)


@pytest.mark.slow
def test_dashboard_route_serves_the_page(client):
    response = client.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.text == dashboard.PAGE.html
    assert response.headers["content-security-policy"] == dashboard.PAGE.content_security_policy
    assert response.headers["referrer-policy"] == "no-referrer"
    assert client.head("/dashboard").status_code == 200
    assert "/dashboard" not in client.get("/openapi.json").json()["paths"]


# ── the page in a browser ───────────────────────────────────────────────────────────────────


@pytest.mark.slow
def test_dashboard_shows_exactly_the_stats_api(chromium, gateway, client, tmp_path):
    system = system_prompt()
    planner = f"planner-{uuid.uuid4().hex[:6]}"
    # A label with markup in it: the page must show it as text (labels come from clients).
    reviewer = f"<b>reviewer</b>-{uuid.uuid4().hex[:6]}"
    chat(client, gateway.model, system, "Review the patch to the block pool.", planner)
    second = chat(client, gateway.model, system, "Now review the scheduler patch.", reviewer)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # it reused the first

    stats = wait_idle(client)
    screenshot = tmp_path / "dashboard.png"
    run = load_page(chromium, f"{gateway.open_url}/dashboard", tmp_path, screenshot)
    after = client.get("/v1/cache/stats").json()
    assert after == stats, "the gateway was not idle while the page loaded; nothing to compare"

    dom = run.dom
    assert dom.one("status").attrs["data-state"] == "live"
    assert int(dom.value("updates")) >= 2  # it kept polling
    assert "hidden" in dom.one("error-banner").classes

    g = stats["global"]
    assert g["tokens_saved"] > 0
    assert_shows(dom, "global-hit-rate", g["hit_rate"], pct(g["hit_rate"]))
    assert_shows(dom, "global-tokens-saved", g["tokens_saved"], f"{g['tokens_saved']:,}")
    assert_shows(dom, "global-hit-tokens", g["hit_tokens"], f"{g['hit_tokens']:,}")
    assert_shows(dom, "global-query-tokens", g["query_tokens"], f"{g['query_tokens']:,}")
    assert_shows(dom, "global-requests", g["requests"], f"{g['requests']:,}")
    assert_shows(dom, "model", stats["model"], stats["model"])

    for testid, key in (
        ("pages-total", "num_pages"),
        ("pages-used", "pages_used"),
        ("pages-pinned", "pages_pinned"),
        ("pages-cached", "pages_cached_free"),
        ("pages-free", "pages_free"),
        ("page-size", "page_size"),
        ("num-sequences", "num_sequences"),
        ("evictions", "evictions"),
        ("cow-copies", "cow_copies"),
    ):
        assert_shows(dom, testid, stats[key], f"{stats[key]:,}")
    assert stats["pages_cached_free"] > 0  # the two requests left hittable pages behind
    assert_shows(dom, "kv-usage", stats["kv_cache_usage"], pct(stats["kv_cache_usage"]))
    assert_shows(dom, "fragmentation", stats["fragmentation"], pct(stats["fragmentation"]))

    # The pool picture: one cell per page (this pool is small), in state order.
    grid = dom.one("pool-grid").attrs
    assert int(grid["data-pages-per-cell"]) == 1 and int(grid["data-cells"]) == stats["num_pages"]
    assert [int(n) for n in grid["data-cell-counts"].split(",")] == [
        stats["pages_pinned"],
        stats["pages_used"] - stats["pages_pinned"],
        stats["pages_cached_free"],
        stats["pages_free"],
    ]

    engine = stats["engine"]
    for testid, key in (
        ("engine-running", "num_running"),
        ("engine-waiting", "num_waiting"),
        ("engine-max-waiting", "max_waiting"),
        ("engine-prefill", "prefill_tokens_computed"),
        ("engine-decode", "decode_tokens"),
        ("engine-preemptions", "num_preemptions"),
    ):
        assert_shows(dom, testid, engine[key], f"{engine[key]:,}")
    assert_shows(dom, "engine-backend", engine["kernel_backend"], engine["kernel_backend"])
    assert_shows(dom, "engine-device", engine["device"], engine["device"])

    assert {planner, reviewer} <= set(stats["per_agent"])
    assert stats["per_agent"][reviewer]["tokens_saved"] > 0
    assert_hit_rows(dom, "agent", stats["per_agent"])
    assert_hit_rows(dom, "tenant", stats["per_tenant"])
    assert_retention(dom, stats)
    assert "&lt;b&gt;reviewer&lt;/b&gt;" in run.raw_dom  # escaped, not an element

    width, height, colours = png_size_and_colours(screenshot)
    assert (width, height) == WINDOW
    assert colours > 64, "the screenshot is (nearly) blank"
    print(f"\ndashboard screenshot: {screenshot}")


@pytest.mark.slow
def test_dashboard_lists_prefixes_shared_by_live_sequences(chromium, gateway, client, tmp_path):
    """Two streams share a system prompt and stay alive (they ask for far more tokens than
    they read; leaving the ``with`` block disconnects, which aborts them) while the page loads."""
    system = system_prompt()
    nonce = system.split("]")[0] + "]"
    body = {"model": gateway.model, "max_tokens": 1000, "ignore_eos": True, "stream": True}

    def stream(task: str):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        return client.stream("POST", "/v1/chat/completions", json={**body, "messages": messages})

    with stream("Review the cache.") as first, stream("Review the router.") as second:
        # Keep the line iterators alive: a collected one closes its response (a disconnect).
        first_lines, second_lines = first.iter_lines(), second.iter_lines()
        assert next(first_lines).startswith("data: ") and next(second_lines).startswith("data: ")
        run = load_page(chromium, f"{gateway.open_url}/dashboard", tmp_path)
        prefixes = client.get("/v1/cache/stats").json()["top_prefixes"]
    wait_idle(client)

    rows = run.dom.all("prefix-row")
    shown = [
        (
            row.value("prefix-text"),
            int(row.value("prefix-tokens")),
            int(row.value("prefix-sharers")),
        )
        for row in rows
    ]
    assert shown == [(p["text"], p["num_tokens"], p["num_sharers"]) for p in prefixes]
    ours = [row for row in rows if nonce in row.one("prefix-text").text]
    assert ours, shown
    assert int(ours[0].value("prefix-sharers")) >= 2
    assert ours[0].one("prefix-sharers").text == ours[0].value("prefix-sharers")
    assert "hidden" in run.dom.one("prefix-empty").classes


@pytest.mark.slow
def test_dashboard_asks_for_a_key_then_uses_it(chromium, gateway, tmp_path):
    without = load_page(chromium, f"{gateway.auth_url}/dashboard", tmp_path / "no-key")
    dom = without.dom
    banner = dom.one("error-banner")
    assert "hidden" not in banner.classes and banner.attrs["data-kind"] == "auth"
    assert dom.one("error-title").text == "This gateway needs an API key"
    assert dom.one("error-detail").text.startswith("401:")
    assert int(dom.value("error-attempts")) >= 2  # it keeps retrying
    assert dom.one("status").attrs["data-state"] == "auth"
    assert "hidden" not in dom.one("key-form").classes  # the key box opened by itself
    assert dom.one("global-hit-rate").text == "—"

    with_key = load_page(chromium, f"{gateway.auth_url}/dashboard?key={ADMIN_KEY}", tmp_path)
    with httpx.Client(base_url=gateway.auth_url, timeout=60) as admin:
        stats = wait_idle(admin, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    dom = with_key.dom
    assert dom.one("status").attrs["data-state"] == "live"
    assert "hidden" in dom.one("error-banner").classes
    g = stats["global"]
    assert_shows(dom, "global-tokens-saved", g["tokens_saved"], f"{g['tokens_saved']:,}")
    assert_shows(dom, "pages-cached", stats["pages_cached_free"], f"{stats['pages_cached_free']:,}")


@pytest.mark.slow
def test_dashboard_shows_a_banner_when_the_gateway_is_unreachable(chromium, tmp_path):
    """Opened from disk (the HTML loads its CSS and JS as sibling files), the page's relative
    stats URL cannot be fetched: a network failure, as when the gateway is down."""
    screenshot = tmp_path / "down.png"
    url = (dashboard.STATIC_DIR / "dashboard.html").as_uri()
    dom = load_page(chromium, url, tmp_path, screenshot).dom
    banner = dom.one("error-banner")
    assert "hidden" not in banner.classes and banner.attrs["data-kind"] == "network"
    assert dom.one("error-title").text == "Cannot reach the gateway"
    assert int(dom.value("error-attempts")) >= 2  # it keeps retrying
    assert dom.one("status").attrs["data-state"] == "error"
    assert png_size_and_colours(screenshot)[2] > 16
