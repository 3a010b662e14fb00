"""Behind the TLS proxy, failed sign-ins lock out the user name from the client's address as the
proxy reports it: a stranger cannot lock a named user out for everyone, and cannot escape its own
lockout by writing X-Forwarded-For entries of its own."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

PROXY = "10.0.0.2"  # every connection comes from the proxy
STRANGER, ANN = "203.0.113.9", "198.51.100.7"


def _through_proxy(*, forwarded_for: str) -> Client:
    return Client(REMOTE_ADDR=PROXY, HTTP_X_FORWARDED_FOR=forwarded_for)


@pytest.fixture
def behind_proxy(settings):
    settings.BEHIND_TLS_PROXY = True
    settings.PROXY_COUNT = 1
    settings.AXES_FAILURE_LIMIT = 3
    user = get_user_model().objects.create_user("ann", password="right-password-1", is_staff=True)
    return user


@pytest.mark.django_db
@pytest.mark.parametrize("login_path", ["/dashboard/login/", "/admin/login/"])
def test_a_stranger_behind_the_proxy_cannot_lock_a_user_out_for_everyone(behind_proxy, login_path):
    stranger = _through_proxy(forwarded_for=STRANGER)
    wrong = {"username": "ann", "password": "wrong"}

    failures = [stranger.post(login_path, wrong).status_code for _ in range(3)]
    ann = _through_proxy(forwarded_for=ANN).post(
        login_path, {"username": "ann", "password": "right-password-1"}
    )

    assert failures == [200, 200, 429]
    assert ann.status_code == 302  # ann, from her own address, signs in
    # The stranger stays locked out, whatever it writes to the left of what the proxy appended.
    spoofed = _through_proxy(forwarded_for=f"{ANN}, {STRANGER}")
    assert spoofed.post(login_path, {"username": "ann", "password": "right-password-1"}).status_code == 429
    assert stranger.post(login_path, {"username": "ann", "password": "right-password-1"}).status_code == 429


@pytest.mark.django_db
def test_a_client_behind_the_proxy_is_locked_out_whatever_it_forwards(behind_proxy):
    wrong = {"username": "ann", "password": "wrong"}
    # A stranger that writes a new X-Forwarded-For entry for each try is still one address.
    tries = [_through_proxy(forwarded_for=f"192.0.2.{i}, {STRANGER}") for i in range(3)]

    failures = [client.post("/dashboard/login/", wrong).status_code for client in tries]
    ann = _through_proxy(forwarded_for=ANN).post(
        "/dashboard/login/", {"username": "ann", "password": "right-password-1"}
    )

    assert failures == [200, 200, 429]
    assert ann.status_code == 302
