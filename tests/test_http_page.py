"""The try-it page (--http-page) in a real headless browser: Debian's chromium driven by selenium through
chromedriver (`make browser-deps`; skipped without them). A person types reviews, presses Classify and reads each
one's label and probabilities, the same as the in-process predictor's; with a token, the page sends the one typed.
Writes docs/figures/http-page.png when TS_WRITE_FIGURES=1 (the README shows it)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from http_fixtures import call
from serving_fixtures import REPO_ROOT, running_server

from serving.model.predictor import Predictor

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="chromium and chromedriver missing (make "
                                                                   "browser-deps, as root)")
TOKEN = "page-test-token-0123456789"
FIGURE = REPO_ROOT / "docs" / "figures" / "http-page.png"


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                 "--window-size=900,700"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)  # no download: the paths are given
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _classify(driver, texts: list[str], token: str = "") -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    box = driver.find_element(By.ID, "texts")
    box.clear()
    box.send_keys("\n".join(texts))
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#out tr")
                                    or d.find_element(By.ID, "error").text)


def test_a_person_types_reviews_and_reads_their_labels(tiny_bundle: Path, browser) -> None:
    from selenium.webdriver.common.by import By

    texts = ["Un livre magnifique, je le recommande.", "Ennuyeux du début à la fin.", "Bof."]
    with running_server(tiny_bundle, device="cpu", http_port=0, http_page=True, auth_token=TOKEN) as s:
        browser.get(f"http://127.0.0.1:{s.http_port}/")
        assert browser.title == "sentiment-server"
        _classify(browser, texts)  # no token: the server's refusal, shown
        assert browser.find_element(By.ID, "error").text.startswith("401 UNAUTHENTICATED")
        _classify(browser, texts, TOKEN)
        rows = browser.find_elements(By.CSS_SELECTOR, "#out tr")
        shown = [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in rows]
        models = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
        answered = browser.find_element(By.ID, "answered").text
        if os.environ.get("TS_WRITE_FIGURES"):
            FIGURE.parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(FIGURE))
        console = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    ref = Predictor(tiny_bundle, device="cpu").predict(texts)
    assert [row[0] for row in shown] == texts
    assert [row[1] for row in shown] == [r.label for r in ref]
    assert [row[2].split("\n") for row in shown] == [[f"{name} {p:.3f}" for name, p in zip(
        ("negative", "positive"), r.probabilities, strict=True)] for r in ref]
    assert [row[3] for row in shown] == [str(r.token_count) for r in ref]
    assert models == ["sentiment"] and answered == "Answered by sentiment, version 1."
    assert console == []  # no script refused by the page's Content-Security-Policy, no failed asset


def test_the_page_is_off_by_default_and_loads_nothing_from_elsewhere(tiny_bundle: Path) -> None:
    with running_server(tiny_bundle, device="cpu", http_port=0) as s:
        assert call(s.http_port, "GET", "/").status == 404
    with running_server(tiny_bundle, device="cpu", http_port=0, http_page=True) as s:
        page = call(s.http_port, "GET", "/")
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert b"http://" not in page.body and b"https://" not in page.body and b"//" not in page.body.replace(
        b"http://127.0.0.1", b"")
