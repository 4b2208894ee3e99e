"""What the UI shows, computed from /status snapshots: no Qt in here.

Everything the widgets display (icon state, tooltip, bar segments, banner
lines, the per-answer route line) is a pure function of the JSON the service
returns, so it can be unit-tested with plain dicts. One module per concern;
this package's names are the ones the widgets use (`vm.icon_kind`).
"""

from __future__ import annotations

# The route reasons' words are core's, shared with the note inside a degraded answer.
from ...core.base.route_reasons import route_reason_text  # noqa: F401
from .formatting import (  # noqa: F401
    fmt_mib, fmt_seconds, reason_in_words, humanize_reason, MENU_NAME_CHARS, elide_middle,
)
from .state import (  # noqa: F401
    GPU, CPU, DEGRADED, STARTING, DOWN, ICON_KINDS, STATE_TITLES, BUSY_TITLE, icon_kind, CpuOnly, cpu_only,
    INSTALL_COMMAND, cpu_only_text, GIVEN_STATES, residency_state, residency_text, give_back_label,
    engine_notice, is_busy_overflow,
)
from .memory import (  # noqa: F401
    Segment, Bar, vram_bars, rpc_servers_text, peers_text, MAX_APPS_SHOWN, other_apps_text, ram_floor_mib,
    ram_bar, headroom_text, menu_headroom_text,
)
from .banner import (  # noqa: F401
    MAX_BANNER_ROWS, BannerRequest, Banner, time_left_text, request_line, cpu_requests, interruption_warning,
    cpu_idle, new_request_wait_text, degraded_banner, serving_peers,
)
from .tray import (  # noqa: F401
    IDLE_TITLE, state_title, state_detail, tooltip_text, SHAPE_MISMATCH_TITLE, shape_mismatch_text,
)
from .usage import (  # noqa: F401
    FAULT_WORDS, failover_text, MAX_USAGE_ROWS, UsageRow, UsageView, fmt_count, usage_counts_text, usage_view,
)
from .chat import (  # noqa: F401
    route_line, DONE, SseParser, delta_text, error_message,
)
from .history import (  # noqa: F401
    Sample, History,
)
from .notices import (  # noqa: F401
    ResidencyNotifier, Notice, DegradedNotifier, TimedNote,
)
from .settings import (  # noqa: F401
    SettingField, SETTINGS_FIELDS, setting_bounds, settings_values, validate_settings, changed_overrides,
)
from .models import (  # noqa: F401
    WorkerRow, worker_rows, drafts_text, ModelView, model_views, model_names,
)
# The chat window's queue line says the place as the banner does.
from .banner import _ordinal  # noqa: F401
