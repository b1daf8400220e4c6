"""Corral operator: reconciles LLMDeployment resources into running, autoscaled engine fleets."""
