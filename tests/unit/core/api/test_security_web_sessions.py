"""The web page's login sessions (security.WebSessions): pure bookkeeping."""

from tray_app.core.api.security import WebSessions, cookie_value


def test_a_session_knows_its_csrf_token_until_it_expires():
    sessions = WebSessions(lifetime_s=60)
    token, csrf = sessions.create(now=1000.0)
    assert token != csrf and len(token) >= 40
    assert sessions.csrf_for(token, now=1059.0) == csrf
    assert sessions.csrf_for(token, now=1060.0) is None
    assert sessions.csrf_for(token, now=1000.0) is None  # gone, not just expired
    assert sessions.csrf_for("guessed", now=1000.0) is None and sessions.csrf_for(None, now=1000.0) is None


def test_logins_past_the_limit_push_out_the_oldest_and_logout_ends_one():
    sessions = WebSessions(lifetime_s=60, limit=2)
    first, second, third = (sessions.create(now=1000.0 + i)[0] for i in range(3))
    assert sessions.csrf_for(first, now=1003.0) is None
    assert sessions.csrf_for(second, now=1003.0) and sessions.csrf_for(third, now=1003.0)
    sessions.end(third)
    assert sessions.csrf_for(third, now=1003.0) is None


def test_cookie_value_reads_one_cookie_by_its_exact_name():
    header = "other=1; tray_app_session_x=no; tray_app_session=abc=; tray_app_csrf=xyz"
    assert cookie_value(header, "tray_app_session") == "abc="
    assert cookie_value(header, "tray_app_csrf") == "xyz"
    assert cookie_value(header, "missing") is None and cookie_value(None, "tray_app_csrf") is None


def test_one_keys_logins_end_only_its_own_sessions():
    """A key logging in again and again used to log out every page: now it
    ends its own oldest, and past the table's limit the key holding the most
    gives way."""
    sessions = WebSessions(lifetime_s=600, limit=6, per_key=3)
    admin = sessions.create(now=1000.0, key_identity="admin-hash")[0]
    flood = [sessions.create(now=1001.0 + i, key_identity="guest-hash")[0] for i in range(64)]
    assert sessions.csrf_for(admin, now=1100.0) is not None
    assert [sessions.csrf_for(t, now=1100.0) is not None for t in flood[-4:]] == [False, True, True, True]
    other = [sessions.create(now=1200.0 + i, key_identity=f"key-{i}")[0] for i in range(3)]
    assert all(sessions.csrf_for(t, now=1300.0) for t in [admin, *other])
    assert sessions.key_identity(admin) == "admin-hash"
