"""Test helpers shipped with kvrag: tiny random models and reusable backend suites (need pytest)."""
