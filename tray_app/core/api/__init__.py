"""The HTTP face: the app and its routes, security, OpenAPI, metrics, idempotency, protocol shapes."""
