"""The model library and the eviction policy as plain values (issue 14)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tray_app.core.config import ConfigError, Config, config_to_toml, parse_config_text
from tray_app.core.residency.eviction import Resident, eviction_shortfall_text, plan_eviction
from tray_app.core.catalog.library import Library, LibraryError, LibraryModel, build_library, gguf_files

# ----- eviction --------------------------------------------------------------------------------


def test_nothing_is_unloaded_when_the_model_fits():
    plan = plan_eviction(1000, 3000, 512, [Resident("a", 800, last_used=1)])
    assert plan is not None and plan.victims == () and plan.shortfall_mib == 0


def test_the_least_recently_used_goes_first():
    residents = [Resident("new", 800, last_used=9), Resident("old", 800, last_used=1)]
    assert plan_eviction(1000, 1000, 512, residents).victims == ("old",)


def test_memory_not_count_a_small_old_model_that_would_not_help_stays():
    # The need is 711 MiB short: "tiny" (662, oldest) alone can't cover it, "gemma" (1287) alone can.
    residents = [Resident("tiny", 662, last_used=1), Resident("gemma", 1287, last_used=2)]
    plan = plan_eviction(806, 351, 256, residents)
    assert plan.victims == ("gemma",) and plan.freed_mib == 1287 and plan.shortfall_mib == 711


def test_several_old_models_go_when_it_takes_all_of_them():
    residents = [Resident(n, 500, last_used=t) for n, t in (("a", 1), ("b", 2), ("c", 3), ("d", 4))]
    plan = plan_eviction(1400, 100, 100, residents)
    assert plan.victims == ("a", "b", "c") and plan.freed_mib == 1500


def test_a_model_with_requests_in_flight_is_never_unloaded():
    residents = [Resident("busy", 4000, last_used=1, in_flight=1), Resident("idle", 300, last_used=2)]
    assert plan_eviction(1000, 500, 256, residents) is None
    assert plan_eviction(500, 500, 256, residents).victims == ("idle",)


def test_memory_another_app_holds_leaves_no_plan_and_says_why():
    # Free memory is what the reading says: a game's 6 GiB is already out of it.
    residents = [Resident("a", 700, last_used=1), Resident("b", 900, last_used=2, in_flight=2)]
    assert plan_eviction(2000, 400, 512, residents) is None
    text = eviction_shortfall_text("big", 2000, 400, 512, residents)
    assert "needs 2000 MiB" in text and "400 MiB is free" in text and "only 700 MiB" in text and "b is busy" in text


def test_an_unloaded_model_frees_nothing_and_ties_are_broken_by_name():
    residents = [Resident("gone", 0, last_used=0), Resident("y", 600, last_used=5), Resident("x", 600, last_used=5)]
    assert plan_eviction(1000, 600, 100, residents).victims == ("x",)


# ----- the library ---------------------------------------------------------------------------


def model(name, path="/m/x.gguf", **kw):
    return LibraryModel(name=name, path=Path(path), **kw)


def test_names_aliases_tags_and_file_names_resolve():
    library = Library([model("smol", "/m/smol.gguf", aliases=("default",), source="default"),
                       model("coder", "/m/qwen-coder.gguf", aliases=("qc",), source="config")])
    assert library.resolve(None).name == "smol" and library.resolve("default").name == "smol"
    assert library.resolve("qc").name == "coder" and library.resolve("coder:latest").name == "coder"
    assert library.resolve("qwen-coder.gguf").name == "coder"
    assert library.resolve("coder:7b") is None and library.resolve("gpt-4") is None


def test_two_models_may_not_share_a_name():
    with pytest.raises(LibraryError) as clash:
        Library([model("a", "/m/a.gguf"), model("b", "/m/b.gguf", aliases=("a",))])
    assert "'a'" in str(clash.value)


def test_the_folder_gives_each_new_file_a_model_and_skips_later_split_parts(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("one.gguf", "sub/two.GGUF", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"GGUF")
    assert [p.name for p in gguf_files(tmp_path)] == ["big-00001-of-00002.gguf", "one.gguf", "two.GGUF"]
    config = parse_config_text(f'[model]\nfolder = "{tmp_path}"\n[[models]]\nname = "first"\npath = '
                               f'"{tmp_path / "one.gguf"}"\ncpu_fallback = "none"\nidle_unload_s = 0\n'
                               f'max_concurrency = 2\n')
    library = build_library(config)
    names = [m.name for m in library]
    # The default model first, then [[models]], then the folder's files that no entry names.
    assert names[1:] == ["first", "big", "two"]
    first = library.resolve("first")
    assert first.cpu_path is None and first.idle_unload_s == 0 and first.slots == 2 and first.source == "config"
    two = library.resolve("two")
    assert two.cpu_path == two.path and two.idle_unload_s == Config().gpu.idle_unload_s and two.source == "folder"


@pytest.mark.parametrize("entry, problem", [
    ('name = "x"', "needs a path"),
    ('path = "/m/x.gguf"', "needs a name"),
    ('name = " x"\npath = "/m/x.gguf"', "needs a name"),
    ('name = "x"\npath = "/m/x.gguf"\nn_ctx = -5', "[models] n_ctx"),
    ('name = "x"\npath = "/m/x.gguf"\nmax_concurrency = 65', "[models] max_concurrency"),
    ('name = "x"\npath = "/m/x.gguf"\ncolour = "red"', "unknown key"),
])
def test_bad_models_entries_are_config_errors(entry, problem):
    with pytest.raises(ConfigError) as bad:
        parse_config_text(f"[[models]]\n{entry}\n")
    assert problem in str(bad.value)


def test_models_entries_survive_a_settings_save():
    config = parse_config_text('[[models]]\nname = "coder"\npath = "/m/c.gguf"\naliases = ["c"]\nn_ctx = 8192\n'
                               '[[models]]\nname = "tiny"\npath = "/m/t.gguf"\ncpu_fallback = "/m/t-cpu.gguf"\n')
    assert parse_config_text(config_to_toml(config)).models == config.models
