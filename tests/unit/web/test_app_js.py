"""The web page's words for route reasons are the service's (base/route_reasons.py)."""

import json
import re
from pathlib import Path

from tray_app.core.base.route_reasons import ROUTE_REASONS

APP_JS = Path(__file__).resolve().parents[3] / "tray_app" / "web" / "app.js"


def page_route_reasons() -> dict[str, str]:
    """The ROUTE_REASONS object literal in app.js: `key: "words"` pairs."""
    literal = re.search(r"const ROUTE_REASONS = \{(.*?)\};", APP_JS.read_text(encoding="utf-8"), re.S).group(1)
    return {key: json.loads(words) for key, words in re.findall(r'(\w+): ("(?:[^"\\]|\\.)*")', literal)}


def test_the_page_says_every_route_reason_in_the_services_words():
    # A reason added to the service but not the page showed as its code with
    # the underscores taken out ("cpu only").
    assert page_route_reasons() == ROUTE_REASONS
