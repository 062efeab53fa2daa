"""Headless Chromium through the Debian ``chromium-driver``, started as the tests and benchmarks need it.

Usage::

    driver = start(shutil.which("chromedriver"))
    driver.get(page.as_uri())
    driver.quit()
"""

from __future__ import annotations

import shutil
from typing import Any

#: Headless, and nothing reaching out to the network (this machine's is closed).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--window-size=1300,1000")  # fmt: skip


def start(driver_path: str) -> Any:
    """A Chromium WebDriver session (the caller quits it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in FLAGS:
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
