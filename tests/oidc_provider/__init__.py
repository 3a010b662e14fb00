"""A real OpenID Connect provider for the single sign-on tests: django-oauth-toolkit in a Django
project of its own, run as a separate process (tests/e2e/test_sso_browser.py)."""
