"""Shared test harnesses."""
