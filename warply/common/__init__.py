"""Helpers every layer may use: loading `module:attr` objects and entry points, CLI value types,
files written for their owner only."""
