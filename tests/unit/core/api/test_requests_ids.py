"""X-Request-Id as it enters: only ASCII ids are kept, since the id is
forwarded to peers as a header and a non-ASCII one can't be encoded there."""

from tray_app.core.api.requests import clean_request_id


def test_ascii_ids_are_kept():
    assert clean_request_id(" job-1_a.b:c ") == "job-1_a.b:c"


def test_non_ascii_letters_and_digits_are_not_an_id():
    # str.isalnum() is true for all of these.
    for raw in ("caf\u00e9", "\u0662\u0663", "\u5de5\u4f5c", "x\u00b2"):
        assert clean_request_id(raw) is None


def test_empty_long_and_odd_ids_are_not_an_id():
    assert clean_request_id("") is None and clean_request_id("   ") is None
    assert clean_request_id("a" * 129) is None and clean_request_id("a b") is None
