"""Corral gateway: one OpenAI-compatible endpoint in front of many engine replicas."""
