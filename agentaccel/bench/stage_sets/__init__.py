"""Labelled benchmark sets for stage discovery (`agentaccel bench stages`)."""
