"""Verdicts, and every rendering of them: terminal, JSON, HTML, the fuzz and invariance views."""
