"""The tray icons as SVG source (no Qt here).

One filled disc per state with a dark outline, so it stands out on light and
dark panels alike, and a glyph that differs in shape as well as colour:
a bolt (serving on the GPU), a chip (serving on the CPU, on a machine with
no GPU path: calm, as nothing is wrong), "!" (degraded, the CPU is serving
for a GPU that can't), three dots (starting) and a cross (down). `resources/icons/render_icons.py` writes these
to .svg and .png files; the app renders from the files when they are there and
from this text when they are not (an installed wheel has no resources/ dir).
"""

from __future__ import annotations

_OUTLINE = '<circle cx="32" cy="32" r="28.5" fill="{fill}" stroke="#161616" stroke-width="4"/>'
_SHINE = '<path d="M12 28 A20 20 0 0 1 44 12" fill="none" stroke="#ffffff" stroke-opacity="0.28" stroke-width="3" stroke-linecap="round"/>'

_GLYPHS = {
    "gpu": ("#1f9d55", '<path d="M37 8 L16 36 H30 L26 56 L48 27 H34 Z" fill="#ffffff" stroke="#0d4d29" '
                       'stroke-width="1.5" stroke-linejoin="round"/>'),
    # A processor seen from above: a square with three pins on each side.
    "cpu": ("#5b7083", '<rect x="20" y="20" width="24" height="24" rx="3" fill="#ffffff" stroke="#25313c" '
                       'stroke-width="1.5"/><rect x="27" y="27" width="10" height="10" rx="1.5" fill="#5b7083"/>'
                       '<path d="M26 13 V19 M32 13 V19 M38 13 V19 M26 45 V51 M32 45 V51 M38 45 V51 '
                       'M13 26 H19 M13 32 H19 M13 38 H19 M45 26 H51 M45 32 H51 M45 38 H51" '
                       'stroke="#ffffff" stroke-width="3.5" stroke-linecap="round"/>'),
    "degraded": ("#f5a524", '<rect x="27.5" y="12" width="9" height="26" rx="3.5" fill="#1b1b1b"/>'
                            '<circle cx="32" cy="47.5" r="5" fill="#1b1b1b"/>'),
    "starting": ("#3b7ddd", '<circle cx="18" cy="32" r="5.5" fill="#ffffff"/><circle cx="32" cy="32" r="5.5" fill="#ffffff"/>'
                            '<circle cx="46" cy="32" r="5.5" fill="#ffffff"/>'),
    "down": ("#d62c2c", '<path d="M21 21 L43 43 M43 21 L21 43" stroke="#ffffff" stroke-width="8" stroke-linecap="round"/>'),
}

SIZES = (16, 22, 24, 32, 48, 64, 128, 256)


def svg(kind: str) -> str:
    fill, glyph = _GLYPHS[kind]
    return ('<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64" viewBox="0 0 64 64">'
            f'{_OUTLINE.format(fill=fill)}{_SHINE}{glyph}</svg>\n')


def kinds() -> tuple[str, ...]:
    return tuple(_GLYPHS)
