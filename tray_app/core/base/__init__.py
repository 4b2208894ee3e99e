"""The leaves every layer may build on, the config included: they import no tray_app module
(files: private directories and atomic writes; policies: the breaker, restart and GPU-reserve
policies; route_reasons: the route reasons in words; http_basics: loopback names, how an API key
is sent, and where an SSE line ends)."""
