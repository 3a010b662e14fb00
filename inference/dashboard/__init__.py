"""Dashboard pages of the inference app (LoRA adapters), in the tenant dashboard's layout."""
