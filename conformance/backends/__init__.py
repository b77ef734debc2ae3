"""Backends shipped with the suite. ``reference`` wraps fp8conf's own passes."""
