"""Who may call, and what they used: the named key store (keys.py, keys.json, hashed) and the usage
ledger per key or app (usage.py). Stores on disk, read by the CLI and the tray without the HTTP layer;
api/key_access.py applies them to a request."""
