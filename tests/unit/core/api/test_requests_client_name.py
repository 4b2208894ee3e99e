"""How a request's sender is named for the tray and /status."""

import pytest

from tray_app.core.api.requests import MAX_CLIENT_NAME, client_name


@pytest.mark.parametrize("header, agent, expected", [
    ("Open WebUI", "python-requests/2.31", "Open WebUI"),
    (None, "OpenAI/Python 1.54.0", "OpenAI/Python"),
    ("", "curl/8.5.0", "curl/8.5.0"),
    ("<b>evil</b>\n", None, "bevil/b"),
    (None, None, None),
    ("\x00\x01", "", None),
    ("x" * 500, None, "x" * MAX_CLIENT_NAME),
])
def test_the_client_is_named_by_header_then_user_agent_in_plain_characters(header, agent, expected):
    assert client_name(header, agent) == expected
