"""Request bodies an attacker or a careless client sends to /v1/chat/completions.

Each must get a 4xx in the OpenAI error envelope, and none may break
/status. Shared by the hardening tests and
benchmarks/fuzz_random.py.
"""

HOSTILE_BODIES = {
    "deep nesting": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "moderate nesting": b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * 200 + b"]" * 200 + b"}",
    "huge temperature": b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}",
    "huge seed": b'{"messages": [{"role": "user", "content": "x"}], "seed": 9' + b"9" * 400 + b"}",
    "huge max_tokens": b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9' + b"9" * 400 + b"}",
    "NaN temperature": b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    "Infinity top_p": b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
    "-Infinity in logit_bias": b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": -Infinity}}',
    "huge logit_bias": b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 1' + b"0" * 400 + b"}}",
    "float exponent": b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
    "absent messages": b'{"max_tokens": 3}',
    "messages as object": b'{"messages": {"role": "user"}}',
    "null body": b"null",
    "array body": b"[1, 2]",
    "lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
    "lone surrogate in stop": b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "stop": ["\\udfff"]}',
    "lone surrogate in a key": b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "\\ud800": 1}',
    "invalid utf-8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    "tools nested one past the limit": b'{"messages": [{"role": "user", "content": "x"}], "tools": [' +
        b'{"a":' * 64 + b"1" + b"}" * 64 + b"]}",
    "stop of a megabyte": b'{"messages": [{"role": "user", "content": "x"}], "stop": "' + b"s" * 1_000_000 + b'"}',
    "n as a 400-digit number": b'{"messages": [{"role": "user", "content": "x"}], "n": 1' + b"0" * 400 + b"}",
    "role as a number": b'{"messages": [{"role": 1, "content": "x"}]}',
    "content as a number": b'{"messages": [{"role": "user", "content": 1e308}]}',
    "duplicate keys": b'{"messages": [], "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "n": 5}',
}



def acceptable(name: str, status: int) -> bool:
    return 400 <= status < 500
