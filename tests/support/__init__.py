"""Test helpers shared by the unit and integration suites (fake services, fixtures' building blocks)."""
