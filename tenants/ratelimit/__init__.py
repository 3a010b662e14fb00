"""Rate limits, concurrency and monthly quota, counted atomically in Redis (see admit.lua)."""
