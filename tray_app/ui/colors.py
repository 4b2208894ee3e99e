"""Colour choices that follow the desktop's palette, as pure functions.

Every colour the UI draws is derived here from a few palette colours (the
window and base backgrounds, the text), so a dark theme gets dark boxes and
status text (red, green, amber, blue) that stays readable: WCAG 2 contrast
of at least 4.5:1 for text and 3:1 for lines and swatches. No Qt here, so it
is tested without a display; tray_app/ui/theme.py hands it the palette.
"""

from __future__ import annotations

from dataclasses import dataclass

RGB = tuple[int, int, int]

TEXT_CONTRAST = 4.5      # WCAG AA for normal text
GRAPHIC_CONTRAST = 3.0   # WCAG AA for lines, swatches and other non-text marks

# The hue of each status, as a light theme shows it; readable() moves it
# towards black or white until it stands out from the background it is on.
STATUS_HUES: dict[str, RGB] = {
    "ok": (0x1F, 0x9D, 0x55),       # green: ready, serving on the GPU
    "error": (0xD6, 0x2C, 0x2C),    # red: down, failed, below the reserve
    "warn": (0xB7, 0x79, 0x1F),     # amber: degraded, reserve and floor lines
    "info": (0x2F, 0x6F, 0xCE),     # blue: starting, the GPU worker's share
}
NEUTRAL_HUE: RGB = (0x93, 0xA3, 0xB8)  # grey-blue: memory used by others

BLACK: RGB = (0, 0, 0)
WHITE: RGB = (255, 255, 255)


def parse_hex(text: str) -> RGB:
    value = text.lstrip("#")
    if len(value) == 3:
        value = "".join(c * 2 for c in value)
    if len(value) != 6:
        raise ValueError(f"not a #rrggbb colour: {text!r}")
    return int(value[0:2], 16), int(value[2:4], 16), int(value[4:6], 16)


def to_hex(color: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*color)


def relative_luminance(color: RGB) -> float:
    """WCAG 2 relative luminance: 0 for black, 1 for white."""

    def linear(channel: int) -> float:
        c = channel / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = color
    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b)


def contrast_ratio(a: RGB, b: RGB) -> float:
    """WCAG 2 contrast ratio, from 1 (same) to 21 (black on white)."""
    la, lb = relative_luminance(a), relative_luminance(b)
    return (max(la, lb) + 0.05) / (min(la, lb) + 0.05)


def is_dark(background: RGB) -> bool:
    """True when white text would stand out more than black text."""
    return contrast_ratio(background, WHITE) > contrast_ratio(background, BLACK)


def mix(a: RGB, b: RGB, amount: float) -> RGB:
    """`amount` of b in a: 0 gives a, 1 gives b."""
    amount = min(max(amount, 0.0), 1.0)
    return tuple(round(x + (y - x) * amount) for x, y in zip(a, b))  # type: ignore[return-value]


def readable(color: RGB, background: RGB, minimum: float = TEXT_CONTRAST) -> RGB:
    """`color`, lightened (on a dark background) or darkened (on a light one)
    just enough to reach `minimum` contrast against `background`."""
    if contrast_ratio(color, background) >= minimum:
        return color
    target = WHITE if is_dark(background) else BLACK
    for step in range(1, 21):
        candidate = mix(color, target, step / 20)
        if contrast_ratio(candidate, background) >= minimum:
            return candidate
    return target


def status_color(status: str, background: RGB, minimum: float = TEXT_CONTRAST) -> RGB:
    """The colour for text (or, with GRAPHIC_CONTRAST, a line) of `status`."""
    return readable(STATUS_HUES[status], background, minimum)


def text_on(fill: RGB) -> RGB:
    """Black or white, whichever reads better on `fill` (numbers inside a bar)."""
    return WHITE if is_dark(fill) else BLACK


@dataclass(frozen=True)
class Palette:
    """The palette colours everything else is derived from."""

    window: RGB        # behind the widgets
    window_text: RGB
    base: RGB          # behind text entry, charts and the transcript
    text: RGB
    muted_text: RGB    # the palette's placeholder text


LIGHT = Palette(window=(0xEF, 0xEF, 0xEF), window_text=BLACK, base=WHITE, text=BLACK, muted_text=(0x7B, 0x85, 0x91))


@dataclass(frozen=True)
class Box:
    """A tinted, framed box on the window: its fill, border and text colours."""

    background: RGB
    border: RGB
    text: RGB
    key_text: RGB      # field names, secondary lines
    status_text: RGB   # a warning inside the box


def tinted_box(palette: Palette, status: str) -> Box:
    """A box tinted with a status hue that keeps the theme's lightness: pale
    on a light window, deep on a dark one, never a bright patch on dark."""
    hue = STATUS_HUES[status]
    dark = is_dark(palette.window)
    # Tinted from the base colour (white on a light theme, so the tint stays
    # clear instead of greyish; darker than the window on a dark one).
    background = mix(palette.base, hue, 0.22 if dark else 0.14)
    border = readable(mix(palette.window, hue, 0.65), background, GRAPHIC_CONTRAST)
    text = readable(palette.window_text, background)
    key = readable(mix(text, hue, 0.45), background)
    return Box(background, border, text, key, status_color("error", background))


def muted(palette: Palette, background: RGB | None = None) -> RGB:
    """Secondary text that is still readable on `background` (the window by default)."""
    return readable(palette.muted_text, background or palette.window)


@dataclass(frozen=True)
class BarColors:
    track: RGB                 # the bar's empty background
    outline: RGB
    segments: dict[str, RGB]   # fill per segment key (worker, used, reserve, free)
    labels: dict[str, RGB]     # the number drawn inside each segment
    swatches: dict[str, RGB]   # the legend's squares, on the window background


def bar_colors(palette: Palette) -> BarColors:
    """The headroom bar: saturated shares of memory, and a 'free' segment
    that is a quiet tint of the window, dark on a dark theme."""
    window = palette.window
    dark = is_dark(window)
    segments = {
        "worker": STATUS_HUES["info"],
        "used": mix(window, NEUTRAL_HUE, 0.55 if dark else 0.85),
        "reserve": mix(window, (0xF2, 0xB3, 0x3D), 0.75 if dark else 1.0),
        "free": mix(window, STATUS_HUES["ok"], 0.30 if dark else 0.22),
    }
    labels = {key: text_on(fill) for key, fill in segments.items()}
    swatches = {key: readable(fill if key != "free" else mix(window, STATUS_HUES["ok"], 0.5), window, GRAPHIC_CONTRAST)
                for key, fill in segments.items()}
    track = mix(window, palette.window_text, 0.06)
    outline = readable(mix(window, palette.window_text, 0.35), window, GRAPHIC_CONTRAST)
    return BarColors(track, outline, segments, labels, swatches)


@dataclass(frozen=True)
class ChatColors:
    """The chat transcript's HTML colours, on the transcript's base colour."""

    user_bubble: RGB
    user_text: RGB
    answer_bubble: RGB
    answer_text: RGB
    meta_text: RGB        # route line under an answer
    placeholder: RGB      # the empty transcript's note, the "…" while waiting
    error_text: RGB


def chat_colors(palette: Palette) -> ChatColors:
    base = palette.base
    dark = is_dark(base)
    user_bubble = mix(base, STATUS_HUES["info"], 0.28 if dark else 0.17)
    answer_bubble = mix(base, palette.text, 0.08 if dark else 0.05)
    return ChatColors(
        user_bubble=user_bubble,
        user_text=readable(palette.text, user_bubble),
        answer_bubble=answer_bubble,
        answer_text=readable(palette.text, answer_bubble),
        meta_text=readable(palette.muted_text, answer_bubble),
        placeholder=readable(palette.muted_text, base),
        error_text=status_color("error", answer_bubble),
    )
