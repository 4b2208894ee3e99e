from __future__ import annotations

import pytest

from tray_app.core.engine.exits import ExitKind, classify_exit, is_input_crash

SIGABRT, SIGKILL, SIGTERM, SIGSEGV, SIGILL = 6, 9, 15, 11, 4


def lines(text: str) -> list[str]:
    return text.strip("\n").splitlines()


# --- Real log samples ------------------------------------------------------

# CUDA OOM while loading weights.
# https://github.com/ggml-org/llama.cpp/issues/20431
CUDA_OOM_AT_LOAD = lines("""
load_tensors: loading model tensors, this can take a while... (mmap = true, direct_io = false)
ggml_backend_cuda_buffer_type_alloc_buffer: allocating 144817.04 MiB on device 0: cudaMalloc failed: out of memory
alloc_tensor_range: failed to allocate CUDA0 buffer of size 151851674624
llama_model_load: error loading model: unable to allocate CUDA0 buffer
""")

# OOM while reserving compute buffers at context creation; llama-server then exits 1.
# https://github.com/ggml-org/llama.cpp/issues/16725
OOM_AT_CONTEXT_CREATION = lines("""
ggml_backend_cuda_buffer_type_alloc_buffer: allocating 14136.04 MiB on device 0: cudaMalloc failed: out of memory
ggml_gallocr_reserve_n: failed to allocate ROCm0 buffer of size 14822711296
graph_reserve: failed to allocate compute buffers
llama_init_from_model: failed to initialize the context: failed to allocate compute pp buffers
common_init_from_params: failed to create context with model 'models/large/Apertus-70B-Instruct-2509-IQ4_XS.gguf', try reducing --n-gpu-layers if you're running out of VRAM
srv    load_model: failed to load model, 'models/large/Apertus-70B-Instruct-2509-IQ4_XS.gguf'
srv    operator(): operator(): cleaning up before exit...
main: exiting due to model loading error
""")

# OOM in the middle of a request: ggml's CUDA pool fails and GGML_ASSERT aborts.
# https://github.com/ollama/ollama/issues/3237 (llama.cpp's ggml-cuda output)
CUDA_OOM_DURING_COMPUTE = lines("""
encode_image_with_clip: image encoded in  1229.16 ms by CLIP (    2.13 ms per image patch)
CUDA error: out of memory
  current device: 0, in function ggml_cuda_pool_malloc_vmm at C:\\Users\\jeff\\git\\ollama\\llm\\llama.cpp\\ggml-cuda.cu:8658
  cuMemCreate(&handle, reserve_size, &prop, 0)
GGML_ASSERT: C:\\Users\\jmorg\\git\\ollama\\llm\\llama.cpp\\ggml-cuda.cu:256: !"CUDA error"
""")

# Vulkan backend out of device memory, followed by a heap abort.
# https://github.com/ggml-org/llama.cpp/issues/15256
VULKAN_OOM = lines("""
ggml_vulkan: Device memory allocation of size 118497280 failed.
ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory
double free or corruption (out)
""")

# Captured here, 2026-12-01: the vendored llama.cpp's llama-server built with
# -DGGML_VULKAN=ON, on lavapipe (GGML_VK_VISIBLE_DEVICES=0), -ngl 99, with
# GGML_VK_FORCE_MAX_BUFFER_SIZE=1048576 (lavapipe itself never refuses); exit
# code 1. The KV cache is the allocation that fails.
VULKAN_OOM_AT_CONTEXT_CREATION = lines("""
0.00.204.277 W srv  llama_server: security: no API key is set and CORS allows all origins (see https://github.com/ggml-org/llama.cpp/pull/25655)
ggml_vulkan: Device memory allocation of size 188743680 failed.
ggml_vulkan: Requested buffer size exceeds device buffer size limit: ErrorOutOfDeviceMemory
0.00.484.877 E alloc_tensor_range: failed to allocate Vulkan0 buffer of size 188743680
0.00.486.457 E llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache
0.00.486.472 E cmn  common_init_: failed to create context with model '/models/SmolLM2-135M-Instruct.Q4_1.gguf'
0.00.486.504 E srv    load_model: failed to create_context with model '/models/SmolLM2-135M-Instruct.Q4_1.gguf'
0.00.491.306 E srv  llama_server: exiting due to model loading error
""")

# Captured here: `python -m llama_cpp.server --model /tmp/not_a_model.gguf` on a
# text file, llama-cpp-python 0.3.36; exit code 1.
LLAMA_CPP_PYTHON_NOT_GGUF = lines("""
gguf_init_from_reader: invalid magic characters: 'this', expected 'GGUF'
llama_model_load: error loading model: llama_model_loader: failed to load model from /tmp/not_a_model.gguf
llama_model_load_from_file_impl: failed to load model
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/server/__main__.py", line 100, in <module>
    main()
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/server/__main__.py", line 86, in main
    app = create_app(
          ^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/server/app.py", line 150, in create_app
    set_llama_proxy(model_settings=model_settings)
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/server/app.py", line 70, in set_llama_proxy
    _llama_proxy = LlamaProxy(models=model_settings)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/server/model.py", line 31, in __init__
    self._current_model = self.load_llama_from_model_settings(
                          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/server/model.py", line 267, in load_llama_from_model_settings
    _model = create_fn(
             ^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/llama.py", line 388, in __init__
    internals.LlamaModel(
  File "/work/main/.venv/lib/python3.11/site-packages/llama_cpp/_internals.py", line 62, in __init__
    raise ValueError(f"Failed to load model from file: {path_model}")
ValueError: Failed to load model from file: /tmp/not_a_model.gguf
""")

# Old GGML-format file given to a GGUF-era llama.cpp.
# https://github.com/ggml-org/llama.cpp/issues/3492
OLD_GGML_FORMAT = lines("""
main: seed  = 1696541774
gguf_init_from_file: invalid magic number 67676a74
error loading model: llama_model_loader: failed to load model from /var/www/html/models/7B/alpaca/ggml-model-q8_0.bin
""")

# Architecture newer than the bundled llama.cpp.
# https://github.com/abetlen/llama-cpp-python/issues/1994
UNKNOWN_ARCHITECTURE = lines("""
llama_model_load: error loading model: error loading model architecture: unknown model architecture: 'llama4'
llama_model_load_from_file_impl: failed to load model
""")

# Harmless fallback warning in a healthy worker's startup log.
# https://github.com/SciSharp/LLamaSharp/issues/337
PINNED_MEMORY_WARNING = "WARNING: failed to allocate 16000.00 MiB of pinned memory: out of memory"

# Recoverable: llama.cpp retries without pipeline parallelism and carries on.
# https://github.com/ggml-org/llama.cpp/pull/16748
RECOVERED_COMPUTE_BUFFER_OOM = lines("""
ggml_backend_cuda_buffer_type_alloc_buffer: allocating 12710.31 MiB on device 0: cudaMalloc failed: out of memory
ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 13327728640
graph_reserve: failed to allocate compute buffers
""")

# Captured here: a second worker on a port already taken; uvicorn exits 3.
PORT_IN_USE = lines("""
INFO:     Started server process [8733]
INFO:     Waiting for application startup.
INFO:     Application startup complete.
ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8155): address already in use
INFO:     Waiting for application shutdown.
INFO:     Application shutdown complete.
""")

# Captured here: a llama.cpp build using AMX instructions the VM does not
# allow dies on its first request; the last thing it logged was the health check.
HEALTHY_LOG_THEN_SIGILL = lines("""
INFO:     Uvicorn running on http://127.0.0.1:8101 (Press CTRL+C to quit)
INFO:     127.0.0.1:39522 - "GET /v1/models HTTP/1.1" 200 OK
""")


# --- Out of memory ---------------------------------------------------------


def test_cuda_oom_at_load_exit_1_blames_the_allocation_not_the_model() -> None:
    report = classify_exit(1, CUDA_OOM_AT_LOAD, stop_requested=False)
    assert report.kind is ExitKind.OUT_OF_MEMORY
    # The first matching line is the root cause, not the vaguer echo after it.
    assert report.evidence == (
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 144817.04 MiB on device 0: "
        "cudaMalloc failed: out of memory"
    )
    assert report.signal_name is None


def test_oom_at_context_creation() -> None:
    report = classify_exit(1, OOM_AT_CONTEXT_CREATION, stop_requested=False)
    assert report.kind is ExitKind.OUT_OF_MEMORY
    assert "cudaMalloc failed" in (report.evidence or "")


def test_oom_during_compute_with_abort() -> None:
    report = classify_exit(-SIGABRT, CUDA_OOM_DURING_COMPUTE, stop_requested=False)
    assert report.kind is ExitKind.OUT_OF_MEMORY
    assert report.signal_name == "SIGABRT"
    assert report.evidence == "CUDA error: out of memory"
    assert report.describe() == "out of memory (SIGABRT): CUDA error: out of memory"


def test_vulkan_oom() -> None:
    report = classify_exit(-SIGABRT, VULKAN_OOM, stop_requested=False)
    assert report.kind is ExitKind.OUT_OF_MEMORY
    assert report.evidence == "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory"


def test_vulkan_oom_at_context_creation_as_llama_server_prints_it() -> None:
    report = classify_exit(1, VULKAN_OOM_AT_CONTEXT_CREATION, stop_requested=False)
    assert report.kind is ExitKind.OUT_OF_MEMORY
    assert report.evidence == ("ggml_vulkan: Requested buffer size exceeds device buffer size limit: "
                               "ErrorOutOfDeviceMemory")


def test_pinned_memory_warning_is_not_an_oom() -> None:
    report = classify_exit(-SIGSEGV, [PINNED_MEMORY_WARNING, "llama_context: n_ctx = 4096"], stop_requested=False)
    assert report.kind is ExitKind.CRASH
    assert report.signal_name == "SIGSEGV"


def test_oom_wins_even_when_stop_was_requested_but_the_worker_aborted() -> None:
    report = classify_exit(-SIGABRT, CUDA_OOM_DURING_COMPUTE, stop_requested=True)
    assert report.kind is ExitKind.OUT_OF_MEMORY


# --- Bad model -------------------------------------------------------------


def test_not_a_gguf_file_via_llama_cpp_python() -> None:
    report = classify_exit(1, LLAMA_CPP_PYTHON_NOT_GGUF, stop_requested=False)
    assert report.kind is ExitKind.BAD_MODEL
    assert report.evidence == "gguf_init_from_reader: invalid magic characters: 'this', expected 'GGUF'"
    assert report.describe() == (
        "could not load the model (exit code 1): "
        "gguf_init_from_reader: invalid magic characters: 'this', expected 'GGUF'"
    )


def test_old_ggml_format() -> None:
    report = classify_exit(1, OLD_GGML_FORMAT, stop_requested=False)
    assert report.kind is ExitKind.BAD_MODEL
    assert report.evidence == "gguf_init_from_file: invalid magic number 67676a74"


def test_unknown_architecture() -> None:
    report = classify_exit(1, UNKNOWN_ARCHITECTURE, stop_requested=False)
    assert report.kind is ExitKind.BAD_MODEL
    assert "unknown model architecture: 'llama4'" in (report.evidence or "")


def test_missing_model_path_is_a_bad_model() -> None:
    tail = ["ValueError: Model path does not exist: /models/gone.gguf"]
    assert classify_exit(1, tail, stop_requested=False).kind is ExitKind.BAD_MODEL


# --- Stops -----------------------------------------------------------------


@pytest.mark.parametrize("returncode", [0, -SIGTERM, -SIGKILL])
def test_requested_stop_is_clean(returncode: int) -> None:
    report = classify_exit(returncode, ["INFO:     Shutting down"], stop_requested=True)
    assert report.kind is ExitKind.CLEAN_STOP
    assert report.describe() == "stopped as requested"


def test_requested_stop_ignores_stale_recovered_oom_lines() -> None:
    report = classify_exit(-SIGTERM, RECOVERED_COMPUTE_BUFFER_OOM, stop_requested=True)
    assert report.kind is ExitKind.CLEAN_STOP


def test_requested_stop_with_windows_terminate_code_is_clean() -> None:
    assert classify_exit(1, [], stop_requested=True).kind is ExitKind.CLEAN_STOP


def test_crash_during_a_requested_stop_is_still_a_crash() -> None:
    report = classify_exit(-SIGSEGV, [], stop_requested=True)
    assert report.kind is ExitKind.CRASH


# --- Crashes and errors ----------------------------------------------------


def test_unrequested_sigkill_hints_at_the_oom_killer() -> None:
    report = classify_exit(-SIGKILL, [], stop_requested=False)
    assert report.kind is ExitKind.CRASH
    assert report.signal_name == "SIGKILL"
    assert "out-of-memory killer" in report.describe()


def test_sigill_with_healthy_log_is_a_crash_without_evidence() -> None:
    report = classify_exit(-SIGILL, HEALTHY_LOG_THEN_SIGILL, stop_requested=False)
    assert report.kind is ExitKind.CRASH
    assert report.evidence is None
    assert report.describe() == "crashed (SIGILL)"


def test_port_in_use_is_an_error_with_the_uvicorn_line() -> None:
    report = classify_exit(3, PORT_IN_USE, stop_requested=False)
    assert report.kind is ExitKind.ERROR
    assert report.evidence is not None and report.evidence.endswith("address already in use")
    assert report.describe().startswith("exited with an error (exit code 3): ERROR:")


def test_exit_0_without_a_stop_request_is_an_error() -> None:
    report = classify_exit(0, [], stop_requested=False)
    assert report.kind is ExitKind.ERROR
    assert "exited on its own" in report.describe()


def test_unknown_status_without_a_stop_request_is_an_error() -> None:
    report = classify_exit(None, [], stop_requested=False)
    assert report.kind is ExitKind.ERROR
    assert report.describe() == "exited with an error (exit status unknown)"


def test_windows_access_violation_is_a_crash() -> None:
    report = classify_exit(0xC0000005, [], stop_requested=False)
    assert report.kind is ExitKind.CRASH
    assert report.signal_name == "STATUS_ACCESS_VIOLATION"


def test_unnamed_signal_number_still_gets_a_name() -> None:
    report = classify_exit(-200, [], stop_requested=False)
    assert report.kind is ExitKind.CRASH
    assert report.signal_name == "signal 200"


# --- Evidence hygiene ------------------------------------------------------


def test_evidence_is_stripped_of_colour_codes_and_whitespace() -> None:
    tail = ["\x1b[0m  llama_model_load: error loading model: unknown model architecture: 'gemma9'\x1b[0m  "]
    report = classify_exit(1, tail, stop_requested=False)
    assert report.evidence == "llama_model_load: error loading model: unknown model architecture: 'gemma9'"


def test_evidence_is_capped_to_one_readable_line() -> None:
    report = classify_exit(1, ["cudaMalloc failed: out of memory " + "x" * 5000], stop_requested=False)
    assert report.evidence is not None
    assert len(report.evidence) <= 300
    assert "\n" not in report.describe()


# --- Aborts: the input's or the device's ------------------------------------

# Captured here, 2026-12-06: the vendored llama-server, sent
# {"grammar_triggers": [{"type": 9, "value": "x"}]}; gdb's backtrace follows.
ASSERT_ON_REQUEST_FIELD = lines("""
0.01.038.806 I slot get_availabl: id  3 | task -1 | selected slot by LRU, t_last = -1
/tmp/pip-wheel-67nnop6_/llama-cpp-python/vendor/llama.cpp/common/sampling.cpp:254: GGML_ASSERT(false && "unknown trigger type") failed
[New LWP 10569]
#2  0x00007fa1597a17de in ggml_abort () from /venv/lib/python3.11/site-packages/lib/libggml-base.so.0
#4  0x00007fa15956f694 in server_context_impl::launch_slot_with_task(server_slot&, server_task&&) ()
[Inferior 1 (process 10565) detached]
""")

UNCAUGHT_EXCEPTION = lines("""
terminate called after throwing an instance of 'nlohmann::json_abi_v3_11_3::detail::type_error'
  what():  [json.exception.type_error.302] type must be string, but is number
""")

VULKAN_DEVICE_LOST = lines("""
terminate called after throwing an instance of 'vk::DeviceLostError'
  what():  vk::Device::waitForFences: ErrorDeviceLost
""")

CUDA_LAUNCH_FAILURE = lines("""
CUDA error: unspecified launch failure
  current device: 0, in function ggml_backend_cuda_synchronize at ggml-cuda.cu:2628
/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:88: CUDA error
""")


@pytest.mark.parametrize("log, evidence", [
    (ASSERT_ON_REQUEST_FIELD, 'GGML_ASSERT(false && "unknown trigger type") failed'),
    (UNCAUGHT_EXCEPTION, "terminate called after throwing an instance of"),
])
def test_an_abort_on_a_failed_check_is_the_inputs_fault(log, evidence):
    """The request is quarantined, not replayed on the other worker: the same
    check fails there too. The evidence is the failed check, not a backtrace line."""
    report = classify_exit(-SIGABRT, log, stop_requested=False)
    assert report.kind is ExitKind.CRASH and report.signal_name == "SIGABRT"
    assert evidence in (report.evidence or "")
    assert is_input_crash(report)


@pytest.mark.parametrize("log", [VULKAN_DEVICE_LOST, CUDA_LAUNCH_FAILURE, [], HEALTHY_LOG_THEN_SIGILL[:1]])
def test_an_abort_from_the_device_or_from_outside_is_not_the_inputs_fault(log):
    """A lost device, a CUDA error, or a SIGABRT sent from outside (the drill's
    fault) is the GPU's: the request is replayed on the CPU once."""
    report = classify_exit(-SIGABRT, log, stop_requested=False)
    assert report.kind is ExitKind.CRASH
    assert not is_input_crash(report)


def test_an_out_of_memory_abort_is_never_the_inputs_fault():
    assert not is_input_crash(classify_exit(-SIGABRT, CUDA_OOM_DURING_COMPUTE, stop_requested=False))


def test_a_segfault_is_the_inputs_fault():
    assert is_input_crash(classify_exit(-SIGSEGV, [], stop_requested=False))
