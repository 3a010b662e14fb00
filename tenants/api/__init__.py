"""The tenancy part of the /v1 API and the pieces every /v1 view shares (base view, errors)."""
