"""A schema fuzzer against `forerun serve`'s own /openapi.json: requests that fit the schema and
requests that break it, on every route, never get a 5xx and never leave work behind."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation.modes import GenerationMode
from test_server import KEY, Served

from forerun.api import LLM

EXAMPLES = 100  # per route and mode: bounded (about 15 s here)
SECONDS = 120  # per mode, whatever the examples, shared out between the routes: later ones are skipped
# Each generation route's field for the most tokens to write (the others' is max_tokens).
LIMITS = {"/v1/responses": "max_output_tokens", "/completion": "n_predict", "/infill": "n_predict"}
UNLIMITED = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")  # routes that write nothing


@pytest.fixture(scope="module")
def served(target_tok):
    s = Served(
        LLM(target_tok, speculative_method="ngram", num_speculative_tokens=3), max_num_seqs=4, spec_stats="summary"
    )
    yield s
    s.stop()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_the_fuzzer_makes_gets_a_5xx(served, mode) -> None:
    schema = schemathesis.openapi.from_dict(httpx.get(served.url + "/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
    }
    statuses: dict[int, int] = {}
    stop_at = [0.0]  # the current route's end of time (a list: read inside the test of each route)
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # a GET without parameters cannot be made wrong
        stop_at[0] = time.monotonic() + SECONDS / len(operations)  # each route its share of the time

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            phases=[Phase.generate],
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(case) -> None:
            if time.monotonic() > stop_at[0]:
                return
            limit = LIMITS.get(case.path, "max_tokens")
            if isinstance(case.body, dict) and isinstance(case.body.get(limit, 0), int) and case.path not in UNLIMITED:
                # Bounded work per example: the fuzzer's max_tokens and n (or no max_tokens: to the
                # end of the context) would otherwise run for minutes.
                case.body = {**case.body, limit: 4}
            response = case.call(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text}"

        call()
    # Each mode reaches what it aims at: the engine (positive), the checks (negative).
    assert (200 if mode == GenerationMode.POSITIVE else 400) in statuses, statuses
    served.wait_counts((0, 0), 10, "left running or waiting: ")
