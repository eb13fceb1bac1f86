"""A bounded schemathesis run against the served OpenAPI schema: whatever it sends, no 5xx, and every answer
(success or error body) is what the schema says it is."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import response_schema_conformance, status_code_conformance

EXAMPLES = 60  # per operation: about 10 s in all on the tiny model


def test_generated_requests_never_get_a_server_error(server):
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"}
    failures = []
    for op in operations:

        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case) -> None:
            response = case.call(base_url=server, timeout=60)
            if response.status_code >= 500:
                failures.append((case.operation.path, case.body, response.status_code, response.text[:300]))
                return
            try:
                case.validate_response(response, checks=[response_schema_conformance, status_code_conformance])
            except AssertionError as e:  # schemathesis' failures are AssertionErrors
                failures.append((case.operation.path, case.body, response.status_code, str(e)[:300]))

        check()
    assert not failures, failures[:3]
