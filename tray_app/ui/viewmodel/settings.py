"""The settings dialog's fields, bounds and checks (Qt-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class SettingField:
    name: str
    section: str
    key: str
    label: str
    kind: str  # "path" | "int" | "check"
    help: str = ""
    minimum: int | None = None  # narrower than the config's own bounds, where the UI wants it
    maximum: int | None = None
    minimum_text: str = ""      # shown instead of the lowest value, when it means something special


SETTINGS_FIELDS: tuple[SettingField, ...] = (
    # The labels' '&' marks each field's Alt+letter (mnemonic); they are unique in the dialog.
    SettingField("model_path", "model", "path", "&Model (GGUF)", "path",
                 "Served by both workers. Empty = the bundled SmolLM2-135M-Instruct."),
    SettingField("fallback_path", "model", "fallback_path", "CPU &fallback model", "path",
                 "Optional smaller model for the CPU path. Empty = the same file."),
    SettingField("gpu_ctx", "gpu", "n_ctx", "&GPU context (tokens)", "int",
                 "One GPU request's context (each slot has its own); auto = sized from VRAM.",
                 minimum_text="auto"),
    SettingField("cpu_ctx", "cpu", "n_ctx", "C&PU context (tokens)", "int",
                 "One CPU request's context (each slot has its own); auto = sized from RAM.",
                 minimum_text="auto"),
    SettingField("reserve", "gpu", "reserve_mib", "VRAM &reserve (MiB)", "int",
                 "Kept free on the GPU for other apps."),
    SettingField("gpu_layers", "gpu", "n_gpu_layers", "GPU &layers", "int",
                 "Layers offloaded to the GPU; -1 = all.", minimum_text="all (-1)"),
    SettingField("port", "server", "port", "P&ort", "int",
                 "Port of the OpenAI-compatible API.", minimum=1, maximum=65535),
    SettingField("yield", "gpu", "yield_to_other_apps", "Give VRAM to other &apps", "check",
                 "Unload the GPU model when a game or another app needs the memory; the CPU answers meanwhile."),
    SettingField("idle_unload", "gpu", "idle_unload_s", "&Unload when idle (s)", "int",
                 "Unload the GPU model after this long without a request; the next one loads it.",
                 maximum=7 * 24 * 3600, minimum_text="never (0)"),
)


def setting_bounds(field: SettingField) -> tuple[int, int]:
    """The lowest and highest value a number field accepts: the config's own
    bounds (what apply_overrides enforces), narrowed by the field's."""
    from ...core.config import whole_number_bounds

    low, high = whole_number_bounds(field.section, field.key)
    if field.minimum is not None:
        low = max(low, field.minimum)
    if field.maximum is not None:
        high = min(high, field.maximum)
    return low, high


def settings_values(config: Any) -> dict[str, str]:
    """Every field as the text its input starts with ("true"/"false" for a check)."""
    values = {}
    for f in SETTINGS_FIELDS:
        value = getattr(getattr(config, f.section), f.key)
        if f.kind == "check":
            values[f.name] = "true" if value else "false"
        elif f.kind == "int":
            values[f.name] = str(int(value))  # a number of seconds is stored as a float
        else:
            values[f.name] = str(value)
    return values


def validate_settings(config: Any, values: Mapping[str, str],
                      fields: Iterable[SettingField] = SETTINGS_FIELDS) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Check each field; return (overrides for apply_overrides, {field: message}).

    A message is only for its own field, so the dialog can show it next to it.
    Values equal to the current config are still returned in the overrides.
    Model paths are checked by reading the file's header, which can take
    seconds for a stranger's file: call this off the GUI thread.
    """
    from ...core.config import ConfigError, apply_overrides
    from ...core.memory.gguf_info import ModelFileError, read_model_info

    overrides: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for f in fields:
        raw = (values.get(f.name) or "").strip()
        if f.kind == "check":
            value: Any = raw == "true"
        elif f.kind == "int":
            try:
                value = int(raw)
            except ValueError:
                errors[f.name] = f"must be a whole number, got {raw!r}" if raw else "must not be empty"
                continue
            if f.minimum is not None and value < f.minimum or f.maximum is not None and value > f.maximum:
                errors[f.name] = f"must be from {f.minimum} to {f.maximum}, got {value}"
                continue
        else:
            value = raw
            if raw:
                try:
                    read_model_info(raw)
                except ModelFileError as exc:
                    errors[f.name] = str(exc)
                    continue
        try:
            apply_overrides(config, {f.section: {f.key: value}})
        except ConfigError as exc:
            errors[f.name] = str(exc)
            continue
        overrides.setdefault(f.section, {})[f.key] = value
    if not errors:
        try:
            apply_overrides(config, overrides)
        except ConfigError as exc:  # a cross-field rule
            errors["_form"] = str(exc)
    return overrides, errors


def changed_overrides(config: Any, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Only the values that differ from `config`."""
    out: dict[str, dict[str, Any]] = {}
    for section, values in overrides.items():
        for key, value in values.items():
            if getattr(getattr(config, section), key) != value:
                out.setdefault(section, {})[key] = value
    return out
