"""Rollout engines and the weight-sync protocol that feeds them."""
