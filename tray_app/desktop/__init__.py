"""Desktop integration: the menu entry and start-on-login."""
