"""Engine integrations: tpcache as the host and storage tiers under an engine's own KV blocks."""
