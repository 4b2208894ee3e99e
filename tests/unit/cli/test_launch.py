"""`tray-app launch`: what each agent CLI is given, and when the user is warned."""

from __future__ import annotations

from tray_app.cli.launch import AGENTS, agent_setup, context_warning


def test_claude_code_is_pointed_here_by_its_environment():
    env, args = agent_setup("claude", "http://127.0.0.1:8642/", "SmolLM2", "tak_x")
    assert args == []
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8642" and env["ANTHROPIC_AUTH_TOKEN"] == "tak_x"
    # Its background requests name a small model of their own: the same one here.
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "SmolLM2"


def test_codex_gets_a_responses_provider_without_its_config_file_touched():
    env, args = agent_setup("codex", "http://127.0.0.1:8642", "SmolLM2", "tak_x")
    assert env == {"TRAY_APP_API_KEY": "tak_x"}
    assert args == ["-c", 'model_providers.tray={name="tray-app", base_url="http://127.0.0.1:8642/v1", '
                          'wire_api="responses", env_key="TRAY_APP_API_KEY"}',
                    "-c", "model_provider=tray", "-c", 'model="SmolLM2"']


def test_a_short_context_is_warned_about_with_what_the_cli_needs():
    claude = AGENTS["claude"]
    assert "won't fit" in context_warning(claude, "m", 4096)
    assert "cut short" in context_warning(claude, "m", 32768)
    assert context_warning(claude, "m", 131072) is None and context_warning(claude, "m", None) is None
    assert context_warning(AGENTS["codex"], "m", 16384) is None
