"""Helpers every layer may use: loading `module:attr` objects and entry points, CLI value types."""
