"""Schemathesis against the router's own OpenAPI schema, on real workers.

Every generated request must get a documented status, no 5xx, and every
error must be in the OpenAI envelope (the schema's Error component)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import BASE_CONFIG, RunningService

pytestmark = [pytest.mark.integration, pytest.mark.long_running]

# Small context caps keep each generated completion short.
FUZZ_CONFIG = BASE_CONFIG.replace("n_ctx = 1024", "n_ctx = 128").replace("n_ctx = 2048", "n_ctx = 128")
FUZZ_SECONDS = int(os.environ.get("TRAY_APP_FUZZ_SECONDS", "45"))


def test_no_server_errors_and_every_error_in_the_envelope(tmp_path):
    cli = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
    assert cli, "schemathesis is a test dependency: pip install -e '.[test]'"
    service = RunningService(tmp_path, FUZZ_CONFIG)
    try:
        service.wait_ready()
        result = subprocess.run(
            [cli, "run", f"{service.url}/openapi.json", "--workers", "1", "--request-timeout", "60",
             "--max-time", str(FUZZ_SECONDS), "--seed", "20261129",
             "--checks", "not_a_server_error,response_schema_conformance,status_code_conformance,"
                         "content_type_conformance"],
            capture_output=True, text=True, timeout=FUZZ_SECONDS + 120, cwd=tmp_path,
        )
    finally:
        service.stop()
    summary = result.stdout[-3000:]
    assert result.returncode == 0, summary
    assert " passed" in summary and "failure" not in summary.split("SUMMARY")[-1], summary
