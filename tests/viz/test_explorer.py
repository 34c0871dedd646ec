"""The HTML explorer in a real browser: headless Chromium, from file://."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.viz.explorer import explorer_html, write_explorer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
TOKENS = ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]
SCREENSHOT_DIR = Path(__file__).resolve().parents[2] / "build" / "screenshots"


def _weights(layers: int = 3, heads: int = 4, n: int = len(TOKENS)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(heads, n, n, generator=g).mul(2).softmax(-1) for _ in range(layers)]


def test_page_is_self_contained() -> None:
    page = explorer_html(_weights(), TOKENS, title="t", subtitle="<b>x</b>")
    assert "http://" not in page and "https://" not in page and "<link" not in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page  # escaped
    tricky = explorer_html(_weights(1, 1, 2), ["</script>", "a"])
    assert tricky.count("</script>") == 2  # the data script and the code script, nothing else


@pytest.mark.parametrize(
    ("attentions", "tokens", "match"),
    [
        ([], TOKENS, "attentions is empty"),
        (_weights(n=5), TOKENS, r"weights are \[H, 5, 5\] but there are 7 query"),
        ([torch.rand(2, 7, 7), torch.rand(3, 7, 7)], TOKENS, "same"),
        ([torch.rand(2, 2, 7, 7)], TOKENS, "one sequence"),
        ([torch.rand(1, 300, 300)], ["x"] * 300, "at most 256"),
    ],
)
def test_bad_inputs(attentions: list[torch.Tensor], tokens: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        explorer_html(attentions, tokens)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: the Makefile installs chromium")
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (make test installs them)"
        )
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="attnlab-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_hover_shows_that_tokens_weights_in_chromium(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    weights = _weights()
    page = write_explorer(
        tmp_path / "explorer.html", weights, TOKENS, title="attnlab explorer test"
    )
    browser.get(page.resolve().as_uri())
    assert browser.title == "attnlab explorer test"

    def hover(panel: str, index: int) -> dict[str, Any]:
        token = browser.find_element(By.CSS_SELECTOR, f"#panel-{panel} [data-query='{index}']")
        ActionChains(browser).move_to_element(token).perform()
        readout = browser.find_element(By.ID, f"readout-{panel}")
        return {
            "query": int(readout.get_attribute("data-query")),
            "weights": json.loads(readout.get_attribute("data-weights")),
            "text": readout.text,
        }

    # panel a starts at layer 0, head 0: hover "flies"
    shown = hover("a", 2)
    assert shown["query"] == 2
    torch.testing.assert_close(
        torch.tensor(shown["weights"]), weights[0][0, 2].round(decimals=3), atol=1e-3, rtol=0
    )
    top = int(weights[0][0, 2].argmax())
    assert "query 2 'flies' attends to" in shown["text"]
    assert shown["text"].splitlines()[1].startswith(TOKENS[top])
    # the key tokens are shaded by weight: the heaviest key is the darkest
    keys = browser.find_elements(By.CSS_SELECTOR, "#panel-a [data-key]")
    alphas = [
        float(k.value_of_css_property("background-color").split(",")[-1].rstrip(")")) for k in keys
    ]
    assert max(range(len(alphas)), key=alphas.__getitem__) == top

    # compare heads: panel b on layer 2, head 3; hovering in b updates both panels
    Select(browser.find_element(By.ID, "layer-b")).select_by_value("2")
    Select(browser.find_element(By.ID, "head-b")).select_by_value("3")
    shown_b = hover("b", 5)
    torch.testing.assert_close(
        torch.tensor(shown_b["weights"]), weights[2][3, 5].round(decimals=3), atol=1e-3, rtol=0
    )
    a_now = browser.find_element(By.ID, "readout-a")
    assert a_now.get_attribute("data-query") == "5"
    # the mean of the heads
    Select(browser.find_element(By.ID, "head-a")).select_by_value("-1")
    mean = hover("a", 1)
    torch.testing.assert_close(
        torch.tensor(mean["weights"]), weights[0].round(decimals=3).mean(0)[1], atol=2e-3, rtol=0
    )
    assert "mean of heads" in mean["text"]
    # the heatmap table has a row per query and a column per key (+ labels)
    rows = browser.find_elements(By.CSS_SELECTOR, "#heat-a tr")
    assert len(rows) == len(TOKENS) + 1
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOT_DIR / "explorer.png"))
