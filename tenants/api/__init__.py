"""The tenancy part of the /v1 API: the usage ledger (`/v1/usage`). The pieces every /v1 view
shares (base view, errors) are in `core/api`."""
