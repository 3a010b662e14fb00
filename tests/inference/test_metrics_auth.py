"""/metrics and the details of /ready refuse a bearer that is not ASCII as they refuse any wrong one
(a 401, never a 500)."""

from __future__ import annotations

import pytest
from django.test import Client


@pytest.mark.django_db
@pytest.mark.parametrize("bearer", ["tést-metrics-token", "test-metrics-token\u00ff", "\u00e9" * 64])
def test_a_non_ascii_bearer_is_refused_like_any_wrong_token(operator_headers, bearer):
    client = Client(headers={"Authorization": f"Bearer {bearer}"})

    metrics = client.get("/metrics")
    ready = client.get("/ready")

    assert metrics.status_code == 401
    assert metrics.json()["error"]["code"] == "operator_only"
    assert "pagoda_" not in metrics.content.decode()
    assert ready.status_code in (200, 503) and "checks" not in ready.json()
    # The right token still reads them.
    assert Client(headers=operator_headers).get("/metrics").status_code == 200
